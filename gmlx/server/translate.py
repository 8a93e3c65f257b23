"""What every protocol's translation shares: the common body fields as engine values,
and function tools checked and made engine :class:`Tool` objects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gmlx.engine.errors import InvalidRequestError
from gmlx.engine.types import Reasoning, Tool
from gmlx.sampling_fields import sampling_values
from gmlx.server.schemas import GenerationBody


def sampling(body: GenerationBody) -> dict[str, Any]:
    """The sampling values the body sets explicitly (they override the profile)."""
    return sampling_values(body)


def common(body: GenerationBody, *, enabled: bool | None = None,
           budget: int | None = None) -> dict[str, Any]:
    """The ``ChatRequest`` fields every generation body carries: the address, the
    sampling overrides, the reasoning controls (``reasoning_effort``, else Responses'
    ``reasoning: {"effort"}``; ``enabled`` and ``budget`` fill in what a protocol
    spells its own way) and the template variables."""
    effort = (body.reasoning or {}).get("effort")
    return {
        "model": body.model,
        "profile": body.profile,
        "sampling": sampling(body),
        "reasoning": Reasoning(
            enabled=body.enable_thinking if body.enable_thinking is not None else enabled,
            effort=body.reasoning_effort if body.reasoning_effort is not None else effort,
            budget=body.thinking_budget if body.thinking_budget is not None else budget,
        ),
        "template_kwargs": dict(body.chat_template_kwargs or {}),
    }


def function_tool(function: Any, where: str, *, schema_key: str = "parameters") -> Tool:
    """A function definition (``name``, ``description``, the parameters schema under
    ``schema_key``, any other fields kept for the template) as an engine Tool.

    Raises InvalidRequestError (param ``tools``) for a definition that is not an
    object, a missing name or a parameters value that is not a schema object: a
    template renders whatever it is handed, so a nameless tool would otherwise only
    surface as a call nobody can match.
    """
    if not isinstance(function, Mapping):
        raise InvalidRequestError(f"{where} must be an object.", param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where} needs a name (a non-empty string).", param="tools")
    params = function.get(schema_key)
    if params is not None and not isinstance(params, Mapping):
        raise InvalidRequestError(
            f"{where} ({name}): parameters must be a JSON schema object.", param="tools"
        )
    description = function.get("description")
    extra = {k: v for k, v in function.items() if k not in ("name", "description", schema_key)}
    return Tool(name, description if isinstance(description, str) else None, params, extra)


def tool_kind(tool: Any, where: str) -> None:
    """Raise InvalidRequestError unless ``tool`` is an object of type ``function``."""
    if not isinstance(tool, Mapping):
        raise InvalidRequestError(f"{where} must be an object.", param="tools")
    kind = tool.get("type", "function")
    if kind != "function":
        raise InvalidRequestError(
            f"{where} has type {kind!r}; only function tools are supported.", param="tools"
        )


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for error messages."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
