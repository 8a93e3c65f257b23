"""Request fields every generation route shares: model addressing and sampling.

Request models accept unknown fields (``extra="allow"``). Each route's model lists
the fields it honours in ``HONORED``; any other field a request sets is reported by
:meth:`GenerationBody.ignored`, so the route logs one warning naming them all.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from gmlx.engine.errors import InvalidRequestError

B = TypeVar("B", bound=BaseModel)

SAMPLING_FIELDS: tuple[str, ...] = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
    "seed",
)

COMMON_HONORED: frozenset[str] = frozenset(
    {
        "model",
        "profile",
        "stream",
        "logit_bias",
        "chat_template_kwargs",
        "enable_thinking",
        *SAMPLING_FIELDS,
    }
)


class GenerationBody(BaseModel):
    """Addressing and sampling fields of any generation request."""

    model_config = ConfigDict(extra="allow")
    HONORED: ClassVar[frozenset[str]] = COMMON_HONORED

    model: str = ""
    profile: str | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int | None = None
    presence_penalty: float | None = None
    presence_context_size: int | None = None
    frequency_penalty: float | None = None
    frequency_context_size: int | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None  # reaches the chat template as a variable

    def sampling(self) -> dict[str, Any]:
        """The sampling values this request sets explicitly (they override the profile)."""
        values: dict[str, Any] = {
            name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None
        }
        if self.logit_bias:
            try:
                values["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise InvalidRequestError(
                    "logit_bias keys must be token ids (integers written as strings).",
                    param="logit_bias",
                ) from None
        return values

    def template_kwargs(self) -> dict[str, Any]:
        """Extra chat-template variables this request sets."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        # `required` and named tool choices are the template's to implement; `none` and
        # `auto` are enforced by the routes (tools stripped, or left to the model).
        choice = getattr(self, "tool_choice", None)
        kind = choice.get("type") if isinstance(choice, dict) else choice
        if choice is not None and kind not in ("auto", "none"):
            kwargs["tool_choice"] = choice
        return kwargs

    def ignored(self) -> list[str]:
        """Fields set to a value that this route does not honour, sorted."""
        extra = self.model_extra or {}
        set_fields = {f for f in self.model_fields_set if getattr(self, f, None) is not None}
        set_fields |= {k for k, v in extra.items() if v is not None}
        return sorted(set_fields - self.HONORED)


def json_body(model: type[B]) -> Callable[[Request], Awaitable[B]]:
    """A dependency that validates the body as JSON whatever its Content-Type says
    (``curl -d`` sends form encoding), raising InvalidRequestError (400) on failure.
    """

    async def parse(request: Request) -> B:
        raw = await request.body()
        try:
            return model.model_validate_json(raw or b"{}")
        except ValidationError as e:
            from gmlx.server.errors import validation_error

            raise validation_error(e) from None

    return parse
