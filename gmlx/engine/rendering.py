"""Typed messages as chat templates take them, and the conversation rendered and tokenized.

The engine turns a request's :class:`~gmlx.engine.types.Message` list into the plain
dicts chat templates read (:func:`template_message`), renders and tokenizes them
(:func:`encode_chat`), and, for templates that take a system message only first,
folds late system messages into the turns around them (:func:`fold_late_system`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gmlx.engine.errors import GmlxError, InvalidRequestError
from gmlx.engine.types import ImagePart, Message, ToolCall

if TYPE_CHECKING:
    from gmlx.engine.tokenizer import Tokenizer


def template_message(message: Message, *, with_images: bool = False) -> dict[str, Any]:
    """A message as the plain dict chat templates expect: its text, or, for a model
    that reads images (``with_images``) and a message that has some, its parts
    (``{"type": "image"}`` and ``{"type": "text", "text": ...}``, as vision templates
    take them)."""
    content: Any = message.content
    if with_images and any(isinstance(p, ImagePart) for p in message.parts):
        content = [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                   for p in message.parts]
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    if message.reasoning:
        out["reasoning_content"] = message.reasoning
    if message.tool_calls:
        out["tool_calls"] = [_template_call(c) for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def fold_late_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation with every system message after the first turn folded into an
    adjacent turn, for templates that take a system message only first; None when
    there is none to fold.

    A system message that only system messages precede joins the first one. Any other
    joins the next user turn (before its text), else the previous one (after its
    text), else becomes a user turn itself: the model still reads it, near where it
    was said. Several that join one turn keep their order.
    """
    late = [i for i, m in enumerate(messages) if m["role"] == "system" and i > 0]
    if not late:
        return None
    ahead: dict[int, list[str]] = {}  # turn -> texts that go before its own
    behind: dict[int, list[str]] = {}  # turn -> texts that go after its own
    users = [j for j, m in enumerate(messages) if m["role"] == "user"]
    out: list[dict[str, Any] | None] = [dict(m) for m in messages]
    for i in late:
        text = messages[i]["content"]
        if all(m["role"] == "system" for m in messages[:i]):
            behind.setdefault(0, []).append(text)
        elif later := [j for j in users if j > i]:
            ahead.setdefault(later[0], []).append(text)
        elif users:
            behind.setdefault(users[-1], []).append(text)
        else:
            out[i] = {"role": "user", "content": text}
            continue
        out[i] = None
    for j, m in enumerate(out):
        if m is not None and (j in ahead or j in behind):
            if isinstance(m["content"], list):  # a turn with images: the texts join as parts
                m["content"] = [*({"type": "text", "text": t + "\n\n"} for t in ahead.get(j, ())),
                                *m["content"],
                                *({"type": "text", "text": "\n\n" + t} for t in behind.get(j, ()))]
                continue
            texts = [*ahead.get(j, ()), m["content"], *behind.get(j, ())]
            m["content"] = "\n\n".join(t for t in texts if t)
    return [m for m in out if m is not None]


def encode_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None, kwargs: Mapping[str, Any]) -> list[int]:
    """The conversation rendered and tokenized; InvalidRequestError when the template
    refuses it."""
    try:
        return tokenizer.encode_chat(messages, tools=tools, **kwargs)
    except GmlxError:
        raise
    except Exception as e:  # jinja raises many types; all mean the messages do not fit
        raise InvalidRequestError(
            f"The model's chat template cannot render these messages: {e}.", param="messages"
        ) from e


def _template_call(call: ToolCall) -> Mapping[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
