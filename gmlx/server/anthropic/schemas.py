"""Anthropic Messages request bodies (``/v1/messages`` and its ``count_tokens``)."""

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


class AnthropicMessage(BaseModel):
    """One turn; content is a string or a list of typed blocks. A ``system`` turn
    (string or text blocks) is instructions given at that point of the conversation:
    Claude Code sends one (the top-level ``system`` is the usual place)."""

    model_config = REQUEST_CONFIG

    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class MessagesRequest(GenerationBody):
    HONORED: ClassVar[frozenset[str]] = COMMON_HONORED | {
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "tools",
        "tool_choice",
        "output_config",
        "thinking",
    }
    MESSAGE_FIELDS: ClassVar[tuple[str, ...]] = ("messages",)
    STOP_FIELDS: ClassVar[tuple[str, ...]] = ("stop_sequences",)

    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: OutputCap | None = None  # required by Anthropic; optional here
    stop_sequences: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", ...}}
    thinking: dict[str, Any] | None = None  # {"type": "enabled", "budget_tokens": N} | disabled


class CountTokensRequest(MessagesRequest):
    """The same body without generation; ``max_tokens`` is irrelevant."""


# Route parameters: the body parsed as JSON whatever the Content-Type.
MessagesBody = Annotated[MessagesRequest, Depends(json_body(MessagesRequest))]
CountTokensBody = Annotated[CountTokensRequest, Depends(json_body(CountTokensRequest))]
