"""Request fields every generation route shares: model addressing and sampling.

Request models accept unknown fields (``extra="allow"``). Each route's model lists
the fields it honours in ``HONORED``; any other field a request sets is reported by
:meth:`GenerationBody.ignored`, so the route logs one warning naming them all.

Declared fields are validated strictly (:data:`REQUEST_CONFIG`): a value of the wrong
JSON type, a non-finite number or an output cap below 1 is a 400 that names the field,
before anything reaches a template or the engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any, ClassVar, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gmlx.engine.errors import InvalidRequestError

B = TypeVar("B", bound=BaseModel)

# Strict: "10" is not a number and "true" is not a boolean (the protocols' own servers
# refuse them too), and lax coercion would let a typo through as a different value.
# No inf/NaN: JSON parsers accept 1e309 and NaN, and no sampler can use them.
REQUEST_CONFIG = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

# An output cap: at least one token (0 or less is a client bug, not "no output").
OutputCap = Annotated[int, Field(ge=1)]

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
    "top_n_sigma",
    "typical_p",
    "xtc_probability",
    "xtc_threshold",
    "p_less",
)

COMMON_HONORED: frozenset[str] = frozenset(
    {
        "model",
        "profile",
        "stream",
        "logit_bias",
        "chat_template_kwargs",
        "enable_thinking",
        "thinking_budget",
        "reasoning_effort",
        "reasoning",
        "response_format",
        *SAMPLING_FIELDS,
    }
)


class GenerationBody(BaseModel):
    """Addressing and sampling fields of any generation request."""

    model_config = REQUEST_CONFIG
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
    top_n_sigma: float | None = None
    typical_p: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    p_less: bool | None = None
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None  # reaches the chat template as a variable
    thinking_budget: int | None = Field(default=None, ge=0)  # reasoning tokens before </think>
    reasoning_effort: str | None = None  # OpenAI chat: none/minimal/low/medium/high/xhigh
    reasoning: dict[str, Any] | None = None  # OpenAI Responses: {"effort": ...}
    response_format: dict[str, Any] | None = None  # json_schema / json_object / text

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

    def template_kwargs(self, profile_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The chat-template variables of this request over the profile's: reasoning
        effort mapped to template variables, ``chat_template_kwargs``, ``enable_thinking``."""
        from gmlx.engine.reasoning import template_kwargs

        kwargs = template_kwargs(
            self.enable_thinking,
            self.reasoning_effort,
            self.chat_template_kwargs,
            profile_kwargs,
            reasoning=self.reasoning,
        )
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
