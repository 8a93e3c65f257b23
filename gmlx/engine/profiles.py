"""Profiles: named presets of sampling values, an output cap and a system prompt.

A request's effective settings stack in this order, later layers winning:

1. the engine defaults (:class:`~gmlx.engine.types.SamplingParams`),
2. the model family's base (the values its publisher recommends),
3. one profile: the one the request names, else the model's configured one,
4. the fields the request sets explicitly.

Built-in *intents* (``coding``, ``chat``, ``creative``, ...) are profiles whose
values depend on the model family, so ``model@coding`` means "this model, tuned for
code" whatever the model is. A user profile of the same name replaces the intent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from gmlx.engine.errors import UnknownProfileError
from gmlx.engine.types import SamplingParams

SAMPLING_KEYS: frozenset[str] = frozenset(f.name for f in fields(SamplingParams))


@dataclass(frozen=True)
class Profile:
    """A preset; ``None`` and empty values leave the layer below unchanged."""

    name: str
    sampling: Mapping[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    max_tokens: int | None = None
    system: str | None = None
    stop: tuple[str, ...] = ()
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.sampling) - SAMPLING_KEYS
        if unknown:
            raise ValueError(f"unknown sampling keys in profile {self.name}: {sorted(unknown)}")
        object.__setattr__(self, "sampling", MappingProxyType(dict(self.sampling)))
        object.__setattr__(
            self, "chat_template_kwargs", MappingProxyType(dict(self.chat_template_kwargs))
        )

    def over(self, base: Profile) -> Profile:
        """This profile stacked on ``base``: every value this one sets wins."""
        return Profile(
            name=self.name,
            sampling={**base.sampling, **self.sampling},
            max_tokens=self.max_tokens if self.max_tokens is not None else base.max_tokens,
            system=self.system if self.system is not None else base.system,
            stop=self.stop or base.stop,
            chat_template_kwargs={**base.chat_template_kwargs, **self.chat_template_kwargs},
        )

    def sampling_params(self, explicit: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine sampling for this profile, with ``explicit`` request values on top."""
        values = {**self.sampling, **{k: v for k, v in (explicit or {}).items() if v is not None}}
        return SamplingParams(**values)


# Model families, matched on the start of mlx-lm's ``model_type``: the longest prefix wins.
FAMILY_PREFIXES: dict[str, str] = {
    "qwen3": "qwen3",
    "qwen": "qwen",
    "llama": "llama",
    "mistral": "mistral",
    "ministral": "mistral",
    "mixtral": "mistral",
    "gemma": "gemma",
    "phi": "phi",
    "deepseek": "deepseek",
    "glm": "glm",
    "gpt_oss": "gpt-oss",
}


def model_family(model_type: str | None) -> str:
    """The family a model's ``model_type`` belongs to, or ``default``."""
    kind = (model_type or "").lower()
    matches = [p for p in FAMILY_PREFIXES if kind.startswith(p)]
    return FAMILY_PREFIXES[max(matches, key=len)] if matches else "default"


# Family bases: each publisher's recommended sampling for general use.
FAMILY_BASE: dict[str, dict[str, Any]] = {
    "default": {"temperature": 0.7, "top_p": 0.95},
    "qwen": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
    "qwen3": {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
    "llama": {"temperature": 0.6, "top_p": 0.9},
    "mistral": {"temperature": 0.3, "top_p": 0.95},
    "gemma": {"temperature": 1.0, "top_p": 0.95, "top_k": 64},
    "phi": {"temperature": 0.7, "top_p": 0.95},
    "deepseek": {"temperature": 0.6, "top_p": 0.95},
    "glm": {"temperature": 0.6, "top_p": 0.95},
    "gpt-oss": {"temperature": 1.0, "top_p": 1.0},
}

# Built-in intents: per family, the values that differ from the family base.
INTENTS: dict[str, dict[str, dict[str, Any]]] = {
    "coding": {
        "default": {"temperature": 0.2, "top_p": 0.95},
        "qwen": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
        "qwen3": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
        "mistral": {"temperature": 0.15},
        "gemma": {"temperature": 0.3, "top_k": 64},
    },
    "chat": {
        "default": {},
        "qwen3": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
    },
    "creative": {
        "default": {"temperature": 1.0, "top_p": 0.95, "min_p": 0.05},
        "gemma": {"temperature": 1.1, "top_p": 0.95, "top_k": 64},
        "mistral": {"temperature": 0.8, "top_p": 0.95},
    },
    "precise": {
        "default": {"temperature": 0.1, "top_p": 0.9},
    },
    "deterministic": {
        "default": {"temperature": 0.0},
    },
    "reasoning": {
        "default": {"temperature": 0.6, "top_p": 0.95},
        "qwen3": {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
        "gpt-oss": {"temperature": 1.0, "top_p": 1.0},
    },
}

BUILTIN_INTENTS: tuple[str, ...] = tuple(INTENTS)


def family_base(family: str) -> Profile:
    """The base layer for a family (the ``default`` family for unknown ones)."""
    return Profile(name=f"{family}-base", sampling=FAMILY_BASE.get(family, FAMILY_BASE["default"]))


def intent(name: str, family: str) -> Profile:
    """A built-in intent resolved for ``family``."""
    table = INTENTS[name]
    return Profile(name=name, sampling=table.get(family, table["default"]))


class ProfileBook:
    """The profiles a server (or ``gmlx run``) knows: user profiles over built-in intents."""

    def __init__(self, user: Mapping[str, Profile] | None = None) -> None:
        self.user: dict[str, Profile] = dict(user or {})

    @property
    def names(self) -> list[str]:
        """Every valid profile name, sorted."""
        return sorted({*BUILTIN_INTENTS, *self.user})

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.user or name in INTENTS)

    def check(self, name: str) -> None:
        """Raise UnknownProfileError (listing the valid names) unless ``name`` is known."""
        if name not in self:
            raise UnknownProfileError(
                f"Unknown profile {name!r}; valid profiles: {', '.join(self.names)}.",
                param="profile",
                valid_profiles=self.names,
            )

    def resolve(self, name: str | None, model_type: str | None) -> Profile:
        """The effective profile for a model: the family base with ``name`` on top."""
        family = model_family(model_type)
        base = family_base(family)
        if name is None:
            return base
        self.check(name)
        chosen = self.user.get(name) or intent(name, family)
        return chosen.over(base)
