"""Which model a request means: configured models, their aliases and profiles.

A :class:`ModelBook` holds the configured models (:class:`ModelSpec`) and turns the
``model`` string of a request into a :class:`Target` (which model, which profile),
following the addressing rules: an exact id or alias first, then ``id@profile``
split on the last ``@`` when the suffix names a known profile. A book never changes:
a config reload builds a new one, so a request that addressed through the old book
sees one consistent view.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from gmlx.engine.drafting import DraftSpec
from gmlx.engine.errors import InvalidRequestError, ModelNotFoundError
from gmlx.engine.kv_quant import KVQuant
from gmlx.engine.profiles import ProfileBook


@dataclass(frozen=True)
class ModelSpec:
    """One configured model: where it comes from and how to load and present it."""

    id: str
    source: str  # ``demo``, a GGUF file, an MLX folder, ``hf:org/repo[/file]`` (cache only)
    max_kv_size: int | None = None  # lowers the context window, never raises it
    profile: str | None = None  # the profile used when a request names none
    default: bool = False  # the model an empty ``model`` field means
    pinned: bool = False  # loaded at start, never unloaded for another or when idle
    mmproj: str | None = None  # a vision projector: the model is a VLM
    idle_timeout: float | None = None  # seconds idle before it unloads (None: the
    # registry's default; 0: never)
    preload: bool = False  # loaded at start (it may still idle out and be evicted)
    kv_quant: KVQuant | None = None  # the KV cache's quantization (None: full precision)
    draft: DraftSpec | None = None  # speculative decoding: a draft model or prompt lookup

    @property
    def load_parameters(self) -> tuple[str, int | None, str | None, KVQuant | None, DraftSpec | None]:
        """What the loaded model depends on: a spec that changes only other fields
        (profile, default, pinned, idle timeout) keeps its resident worker."""
        return (self.source, self.max_kv_size, self.mmproj, self.kv_quant, self.draft)


@dataclass(frozen=True)
class Target:
    """What a request addressed: a model and the profile it asked for (None: the model's)."""

    spec: ModelSpec
    profile: str | None = None

    @property
    def profile_name(self) -> str | None:
        """The profile in effect: the requested one, else the model's configured one."""
        return self.profile or self.spec.profile


class ModelBook:
    """Configured models by id, their aliases and the known profiles.

    Args:
        specs: the models, in listing order.
        aliases: alias -> ``id`` or ``id@profile``; raises ValueError when a target
            does not resolve.
        profiles: the known profiles (built-in intents plus user profiles).
    """

    def __init__(
        self,
        specs: Iterable[ModelSpec],
        aliases: Mapping[str, str] | None = None,
        profiles: ProfileBook | None = None,
    ) -> None:
        self.specs: dict[str, ModelSpec] = {s.id: s for s in specs}
        self.profiles = profiles or ProfileBook()
        self.aliases: dict[str, Target] = {}
        for alias, ref in (aliases or {}).items():
            target = self._lookup(ref) or self._split(ref)
            if target is None:
                raise ValueError(f"alias {alias!r} points to {ref!r}, which is not a served model")
            self.aliases[alias] = target

    @property
    def ids(self) -> list[str]:
        return list(self.specs)

    def address(self, model: str | None, profile: str | None = None) -> Target:
        """Resolve a request's ``model`` (and optional ``profile`` field) to a target.

        Raises ModelNotFoundError for an unknown id (``id@suffix`` whose suffix is no
        known profile is an unknown id), UnknownProfileError for an unknown ``profile``
        field, InvalidRequestError for an empty model that is ambiguous.
        """
        name = (model or "").strip()
        target = self._default() if not name else self._lookup(name) or self._split(name)
        if target is None:
            raise self.not_found(name)
        if profile:
            self.profiles.check(profile)
            target = replace(target, profile=profile)
        return target

    def spec(self, model_id: str) -> ModelSpec:
        """The spec of a configured id (ModelNotFoundError when there is none)."""
        spec = self.specs.get(model_id)
        if spec is None:
            raise self.not_found(model_id)
        return spec

    def not_found(self, name: str) -> ModelNotFoundError:
        return ModelNotFoundError(
            f"Model {name!r} is not served here; available models: "
            f"{', '.join(self.ids) or '(none)'}.",
            param="model",
            available_models=self.ids,
        )

    def _lookup(self, name: str) -> Target | None:
        if name in self.specs:
            return Target(self.specs[name])
        return self.aliases.get(name)

    def _split(self, name: str) -> Target | None:
        """``id@profile`` split on the last ``@``, only when the suffix names a known
        profile: otherwise ``name`` is one id (None here, so a 404 names all of it)."""
        head, sep, tail = name.rpartition("@")
        if not sep or not head or tail not in self.profiles:
            return None
        base = self._lookup(head)
        return replace(base, profile=tail) if base is not None else None

    def _default(self) -> Target:
        defaults = [s for s in self.specs.values() if s.default]
        if defaults:
            return Target(defaults[0])
        if len(self.specs) == 1:
            return Target(next(iter(self.specs.values())))
        raise InvalidRequestError(
            "The request names no model and this server has no single default; "
            f"name one of: {', '.join(self.ids) or '(none)'}.",
            param="model",
        )
