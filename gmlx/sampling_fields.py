"""The sampling fields a request body or a profile may set, defined once.

:class:`SamplingFields` is generated from the engine's
:class:`~gmlx.engine.types.SamplingParams`: one optional field per dataclass field, of
the same type, ``None`` meaning "not set here, the layer below decides". Request bodies
(``gmlx.server.schemas``) and YAML profiles (``gmlx.config``) both derive from it, so a
profile can set every field a request can, and a field added to ``SamplingParams`` is
at once a request field and a profile key.

This module checks types only. Value ranges are the engine's
(:func:`gmlx.engine.sampling.validate`): a request's values are checked when the engine
takes the request, a profile's when the config loads.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, create_model, field_validator

from gmlx.engine.types import SamplingParams

# Every SamplingParams field, in its declaration order.
SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingParams))


def _field_type(hint: Any) -> Any:
    """The pydantic type of one SamplingParams field: the same type, optional.

    ``Mapping[K, V]`` becomes ``dict[K, V]``: what JSON and YAML give, and what a
    frozen dataclass stores as happily.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        members = [_field_type(a) for a in args if a is not type(None)]
        return typing.Union[(*members, None)]  # built at run time: no `X | Y` spelling
    if origin is Mapping:
        return dict[args] | None  # type: ignore[misc]
    return hint | None


def _token_ids(value: Any) -> Any:
    """``logit_bias`` keys as token ids: JSON writes them as strings (``{"50256": -100}``),
    YAML may write plain integers; both become ints."""
    if not isinstance(value, Mapping):
        return value  # the type check reports it
    out: dict[int, Any] = {}
    problem = "logit_bias keys must be token ids (integers written as strings)"
    for key, bias in value.items():
        # 1.5 or true would pass int(), and neither is a token id. A ValueError, not a
        # TypeError: pydantic reports only ValueErrors as a field's validation error.
        if isinstance(key, bool) or not isinstance(key, int | str):
            raise ValueError(problem)  # noqa: TRY004
        try:
            out[int(key)] = bias
        except ValueError:
            raise ValueError(problem) from None
    return out


_HINTS = typing.get_type_hints(SamplingParams)

if TYPE_CHECKING:
    # A type checker cannot see generated fields; to it the base is a plain model.
    SamplingFields = BaseModel
else:
    SamplingFields = create_model(
        "SamplingFields",
        __doc__="Every SamplingParams field, optional: the sampling values one layer sets.",
        __module__=__name__,
        __validators__={
            "_logit_bias_token_ids": field_validator("logit_bias", mode="before")(_token_ids)
        },
        **{name: (_field_type(_HINTS[name]), None) for name in SAMPLING_FIELDS},
    )


def sampling_values(fields: BaseModel) -> dict[str, Any]:
    """The sampling values ``fields`` (a :class:`SamplingFields` model) sets, by
    SamplingParams field name; a ``None`` value is not set and is left out."""
    values = {name: getattr(fields, name) for name in SAMPLING_FIELDS}
    return {name: value for name, value in values.items() if value is not None}
