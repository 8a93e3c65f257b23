"""OpenAI shapes <-> engine values: messages in, completion objects and chunks out."""

from __future__ import annotations

from typing import Any

from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.types import FinishReason, Usage
from gmlx.server.generation import Job, Result
from gmlx.server.openai.schemas import ChatMessage

TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})


def finish_reason(reason: FinishReason) -> str:
    """OpenAI's finish_reason for an engine finish (``stop``, ``length``, ``cancelled``)."""
    return reason.value


def text_of(content: str | list[dict[str, Any]] | None, param: str = "messages") -> str:
    """The text of message content given as a string or a list of typed parts.

    Raises InvalidRequestError for image parts (no vision support yet) and for
    parts of unknown types.
    """
    if content is None or isinstance(content, str):
        return content or ""
    texts: list[str] = []
    for part in content:
        kind = part.get("type")
        if kind in TEXT_PARTS:
            texts.append(str(part.get("text") or ""))
        elif kind in IMAGE_PARTS:
            raise InvalidRequestError(
                "Image input needs a vision model (one configured with mmproj:), "
                "and gmlx does not serve vision models yet.",
                param=param,
            )
        else:
            raise InvalidRequestError(f"Unsupported content part type {kind!r}.", param=param)
    return "".join(texts)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI chat messages as the plain dicts chat templates expect."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {k: v for k, v in (m.model_extra or {}).items() if v is not None}
        msg["role"] = "system" if m.role == "developer" else m.role
        msg["content"] = text_of(m.content)
        out.append(msg)
    return out


def template_tools(
    tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None
) -> list[dict[str, Any]] | None:
    """The tools the chat template sees: none at all when ``tool_choice`` is ``none``."""
    if not tools or tool_choice == "none":
        return None
    return tools


def usage(u: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }


def chat_completion(job: Job, result: Result) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{job.id}",
        "object": "chat.completion",
        "created": job.created,
        "model": job.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": None,
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
                "logprobs": None,
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
        (n is not None and n > 1, "n", "n > 1 is not supported: the server returns one choice"),
        (bool(echo), "echo", "echo is not supported"),
        (bool(suffix), "suffix", "suffix is not supported"),
        (best_of is not None and best_of > 1, "best_of", "best_of > 1 is not supported"),
    ]
    for bad, param, message in rejections:
        if bad:
            raise InvalidRequestError(f"{message}.", param=param)
    return prompt
