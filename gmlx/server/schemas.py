"""Request fields every generation route shares: model addressing and sampling.

Request models accept unknown fields (``extra="allow"``). Each route's model lists
the fields it honours in ``HONORED``; any other field a request sets is reported by
:meth:`GenerationBody.ignored`, so the route logs one warning naming them all.

Declared fields are validated strictly (:data:`REQUEST_CONFIG`): a value of the wrong
JSON type, a non-finite number or an output cap below 1 is a 400 that names the field,
before anything reaches a template or the engine. So is a list longer than the server's
limit for it (``server.max_messages`` for the fields a model names in
``MESSAGE_FIELDS``, ``server.max_stop`` for ``STOP_FIELDS``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, ClassVar, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gmlx.engine.errors import InvalidRequestError
from gmlx.sampling_fields import SAMPLING_FIELDS, SamplingFields

B = TypeVar("B", bound=BaseModel)

# Strict: "10" is not a number and "true" is not a boolean (the protocols' own servers
# refuse them too), and lax coercion would let a typo through as a different value.
# No inf/NaN: JSON parsers accept 1e309 and NaN, and no sampler can use them.
REQUEST_CONFIG = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

# An output cap: at least one token (0 or less is a client bug, not "no output").
OutputCap = Annotated[int, Field(ge=1)]

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


class GenerationBody(SamplingFields):
    """Addressing and sampling fields of any generation request (the sampling fields
    are :class:`~gmlx.sampling_fields.SamplingFields`, ``logit_bias`` keyed by int)."""

    model_config = REQUEST_CONFIG
    HONORED: ClassVar[frozenset[str]] = COMMON_HONORED
    MESSAGE_FIELDS: ClassVar[tuple[str, ...]] = ()  # lists capped by server.max_messages
    STOP_FIELDS: ClassVar[tuple[str, ...]] = ()  # lists capped by server.max_stop

    model: str = ""
    profile: str | None = None
    stream: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None  # reaches the chat template as a variable
    thinking_budget: int | None = Field(default=None, ge=0)  # reasoning tokens before </think>
    reasoning_effort: str | None = None  # OpenAI chat: none/minimal/low/medium/high/xhigh
    reasoning: dict[str, Any] | None = None  # OpenAI Responses: {"effort": ...}
    response_format: dict[str, Any] | None = None  # json_schema / json_object / text

    def ignored(self) -> list[str]:
        """Fields set to a value that this route does not honour, sorted."""
        extra = self.model_extra or {}
        set_fields = {f for f in self.model_fields_set if getattr(self, f, None) is not None}
        set_fields |= {k for k, v in extra.items() if v is not None}
        return sorted(set_fields - self.HONORED)


def check_limits(body: BaseModel, server: Any) -> None:
    """Refuse a body whose message or stop lists exceed the ``server`` settings' limits
    (InvalidRequestError naming the field)."""
    fields = [
        *((f, server.max_messages, "server.max_messages") for f in getattr(body, "MESSAGE_FIELDS", ())),
        *((f, server.max_stop, "server.max_stop") for f in getattr(body, "STOP_FIELDS", ())),
    ]
    for field, limit, key in fields:
        value = getattr(body, field, None)
        if isinstance(value, list) and len(value) > limit:
            raise InvalidRequestError(
                f"{field} has {len(value)} items; this server takes at most {limit} ({key}).",
                param=field,
            )


def json_body(model: type[B]) -> Callable[[Request], Awaitable[B]]:
    """A dependency that validates the body as JSON whatever its Content-Type says
    (``curl -d`` sends form encoding) and checks the server's list limits, raising
    InvalidRequestError (400) on failure.
    """

    async def parse(request: Request) -> B:
        raw = await request.body()
        try:
            body = model.model_validate_json(raw or b"{}")
        except ValidationError as e:
            from gmlx.server.errors import validation_error

            raise validation_error(e) from None
        check_limits(body, request.app.state.settings.server)
        return body

    return parse


def documented(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body :func:`json_body` reads: the model's JSON
    schema as the request body (references inlined), so the app's OpenAPI document
    describes what the route takes."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any, seen: frozenset[str] = frozenset()) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                name = ref.removeprefix("#/$defs/")
                if name in seen:  # a recursive model: any JSON object stands for the repeat
                    return {"type": "object"}
                return inline(defs[name], seen | {name})
            return {k: inline(v, seen) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v, seen) for v in node]
        return node

    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": inline(schema)}},
        }
    }
