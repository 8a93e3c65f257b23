"""OpenAI shapes <-> engine values: messages in, completion objects and chunks out."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.types import Event, FinishReason, Usage
from gmlx.server.generation import Job, Result
from gmlx.server.openai.schemas import ChatMessage

if TYPE_CHECKING:
    from gmlx.engine.tools import ToolCall

log = logging.getLogger("gmlx.server")

TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})


def finish_reason(reason: FinishReason) -> str:
    """OpenAI's finish_reason for an engine finish (``stop``, ``length``, ``cancelled``)."""
    return reason.value


def text_of(content: Any, param: str = "messages") -> str:
    """The text of message content given as a string or a list of typed parts.

    Raises InvalidRequestError for image parts (no vision support yet), for parts
    of unknown types and for content of any other shape (Responses input items are
    not schema-typed, so their content arrives here as whatever the client sent).
    """
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"Message content must be a string or a list of parts, not {_json_type(content)}.",
            param=param,
        )
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict):
            raise InvalidRequestError(
                f"A content part must be an object, not {_json_type(part)}.", param=param
            )
        kind = part.get("type")
        if kind in TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(
                    f"A {kind} part needs its text as a string, not {_json_type(text)}.",
                    param=param,
                )
            texts.append(text)
        elif kind in IMAGE_PARTS:
            raise InvalidRequestError(
                "Image input needs a vision model (one configured with mmproj:), "
                "and gmlx does not serve vision models yet.",
                param=param,
            )
        else:
            raise InvalidRequestError(f"Unsupported content part type {kind!r}.", param=param)
    return "".join(texts)


def _json_type(value: Any) -> str:
    """The JSON name of a value's type, for error messages."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI chat messages as the plain dicts chat templates expect."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {k: v for k, v in (m.model_extra or {}).items() if v is not None}
        msg["role"] = "system" if m.role == "developer" else m.role
        msg["content"] = text_of(m.content)
        out.append(msg)
    return out


def usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def top_logprobs_cap() -> int:
    """``TOP_LOGPROBS_K`` from the server's environment: 0 to 20, default 0."""
    raw = os.environ.get("TOP_LOGPROBS_K", "0")
    try:
        return min(20, max(0, int(raw)))
    except ValueError:
        log.warning("TOP_LOGPROBS_K=%r is not a number; alternatives stay off", raw)
        return 0


def tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A chat ``tool_calls`` entry; streamed deltas add their ``index``."""
    entry: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return entry if index is None else {"index": index, **entry}


def logprob_content(job: Job, events: Iterable[Event]) -> list[dict[str, Any]]:
    """``logprobs.content`` entries, one per generated token.

    An entry's ``token`` is the text that token released (a character split over
    several tokens is released by its last one), so the entries join to the output
    text exactly; ``bytes`` are that text's UTF-8 bytes.
    """
    tok = job.tokenizer

    def alt(token_id: int, logprob: float) -> dict[str, Any]:
        text = tok.decode([token_id]) if tok is not None else str(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [
        {
            "token": ev.text,
            "logprob": ev.logprob,
            "bytes": list(ev.text.encode()),
            "top_logprobs": [alt(i, lp) for i, lp in ev.top_logprobs],
        }
        for ev in events
        if ev.logprob is not None
    ]


def chat_completion(job: Job, result: Result, logprobs: bool = False) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = [tool_call(c) for c in result.tool_calls]
        message["content"] = result.text or None
    return {
        "id": f"chatcmpl-{job.id}",
        "object": "chat.completion",
        "created": job.created,
        "model": job.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": {"content": logprob_content(job, result.tokens)} if logprobs else None,
                "finish_reason": finish_reason(result.finish_reason),
            }
        ],
        "usage": usage(result.usage),
        "system_fingerprint": None,
    }


def chat_chunk(
    job: Job,
    delta: dict[str, Any] | None,
    finish: FinishReason | None = None,
    *,
    include_usage: bool = False,
    final_usage: Usage | None = None,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; with ``final_usage`` it is the usage-only chunk."""
    chunk: dict[str, Any] = {
        "id": f"chatcmpl-{job.id}",
        "object": "chat.completion.chunk",
        "created": job.created,
        "model": job.model,
        "system_fingerprint": None,
        "choices": []
        if delta is None
        else [
            {
                "index": 0,
                "delta": delta,
                "logprobs": {"content": logprobs} if logprobs is not None else None,
                "finish_reason": finish_reason(finish) if finish else None,
            }
        ],
    }
    if include_usage:
        chunk["usage"] = usage(final_usage) if final_usage else None
    return chunk


def completion(
    job: Job, text: str, finish: FinishReason | None, u: Usage | None = None
) -> dict[str, Any]:
    """A ``text_completion`` object; streamed chunks use it too, one text delta each."""
    body: dict[str, Any] = {
        "id": f"cmpl-{job.id}",
        "object": "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason(finish) if finish else None,
            }
        ],
    }
    if u is not None:
        body["usage"] = usage(u)
    return body


def check_completion_prompt(
    prompt: str | list[Any],
    n: int | None,
    echo: bool | None,
    suffix: str | None,
    best_of: int | None,
) -> str:
    """The single string prompt ``/v1/completions`` serves; anything else is a 400."""
    if not isinstance(prompt, str):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        else:
            raise InvalidRequestError(
                "prompt must be one string: lists of prompts and token arrays are not supported.",
                param="prompt",
            )
    rejections = [
        (n is not None and n != 1, "n", "n must be 1: the server returns one choice"),
        (bool(echo), "echo", "echo is not supported"),
        (bool(suffix), "suffix", "suffix is not supported"),
        (best_of is not None and best_of != 1, "best_of", "best_of must be 1"),
    ]
    for bad, param, message in rejections:
        if bad:
            raise InvalidRequestError(f"{message}.", param=param)
    return prompt
