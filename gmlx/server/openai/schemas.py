"""OpenAI request bodies: chat completions, completions and Responses.

Only the fields gmlx reads are declared; everything else is accepted as an extra
field and reported as ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from fastapi import Depends
from pydantic import BaseModel, Field

from gmlx.server.schemas import (
    COMMON_HONORED,
    REQUEST_CONFIG,
    GenerationBody,
    OutputCap,
    json_body,
)


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG

    include_usage: bool = False


class ChatMessage(BaseModel):
    """One message; content is a string or a list of typed parts."""

    model_config = REQUEST_CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(GenerationBody):
    HONORED: ClassVar[frozenset[str]] = COMMON_HONORED | {
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "stream_options",
        "tools",
        "tool_choice",
        "logprobs",
        "top_logprobs",
        "timings_per_token",
    }
    MESSAGE_FIELDS: ClassVar[tuple[str, ...]] = ("messages",)
    STOP_FIELDS: ClassVar[tuple[str, ...]] = ("stop",)

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: OutputCap | None = None
    max_completion_tokens: OutputCap | None = None  # wins over max_tokens and the profile
    stop: str | list[str] | None = None
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    timings_per_token: bool | None = None

    @property
    def output_cap(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(GenerationBody):
    HONORED: ClassVar[frozenset[str]] = COMMON_HONORED | {
        "prompt",
        "max_tokens",
        "stop",
        "stream_options",
        # Checked and rejected unless they ask for what the route does anyway.
        "n",
        "echo",
        "suffix",
        "best_of",
    }
    STOP_FIELDS: ClassVar[tuple[str, ...]] = ("stop",)

    prompt: str | list[Any]
    max_tokens: OutputCap | None = None
    stop: str | list[str] | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ResponsesRequest(GenerationBody):
    HONORED: ClassVar[frozenset[str]] = COMMON_HONORED | {
        "input",
        "instructions",
        "max_output_tokens",
        "tools",
        "tool_choice",
        "text",
    }
    MESSAGE_FIELDS: ClassVar[tuple[str, ...]] = ("input",)

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: OutputCap | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "json_schema", ...}}


def stop_list(stop: str | list[str] | None) -> list[str] | None:
    """OpenAI's ``stop`` as a list (it may be one string)."""
    if stop is None:
        return None
    return [stop] if isinstance(stop, str) else list(stop)


# Route parameters: the body parsed as JSON whatever the Content-Type.
ChatBody = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]
CompletionBody = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]
ResponsesBody = Annotated[ResponsesRequest, Depends(json_body(ResponsesRequest))]
