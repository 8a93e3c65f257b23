"""The models a server serves: their ids, aliases, profiles, and the workers of those loaded.

A :class:`Registry` knows every configured model (:class:`ModelSpec`) and turns the
``model`` string of a request into a :class:`Target` (which model, which profile),
following the addressing rules: an exact id or alias first, then ``id@profile``
split on the last ``@`` when the suffix names a known profile. A model loads on
first use (or at start, through :meth:`Registry.preload`) and then runs on its own
:class:`~gmlx.engine.worker.ModelWorker`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gmlx.engine.errors import InvalidRequestError, ModelNotFoundError
from gmlx.engine.profiles import Profile, ProfileBook

if TYPE_CHECKING:
    from gmlx.engine.loading import LoadedModel
    from gmlx.engine.worker import ModelWorker

log = logging.getLogger("gmlx.engine")


@dataclass(frozen=True)
class ModelSpec:
    """One configured model: where it comes from and how to load and present it."""

    id: str
    source: str  # ``demo``, a GGUF file, an MLX folder
    max_kv_size: int | None = None  # lowers the context window, never raises it
    profile: str | None = None  # the profile used when a request names none
    default: bool = False  # the model an empty ``model`` field means
    pinned: bool = False  # loaded at start and kept resident
    mmproj: str | None = None  # a vision projector: the model is a VLM


@dataclass(frozen=True)
class Target:
    """What a request addressed: a model and the profile it asked for (None: the model's)."""

    spec: ModelSpec
    profile: str | None = None

    @property
    def profile_name(self) -> str | None:
        """The profile in effect: the requested one, else the model's configured one."""
        return self.profile or self.spec.profile


@dataclass(frozen=True)
class ModelInfo:
    """One row of the model listing: a model id, or an alias with ``alias_of`` set."""

    id: str
    resident: bool
    pinned: bool
    speculative: bool
    vlm: bool
    profile: str | None
    default: bool
    context_length: int | None
    max_context_at_width_1: int | None = None
    alias_of: str | None = None


class Registry:
    """Configured models by id, their aliases and profiles, and one worker per loaded model.

    Args:
        specs: the models, in listing order.
        aliases: alias -> ``id`` or ``id@profile``; targets must resolve.
        profiles: the known profiles (built-in intents plus user profiles).
        decode_batch: the decode width of every worker.
        queue_cap: most requests waiting per worker (None: the worker's default).
    """

    def __init__(
        self,
        specs: Iterable[ModelSpec],
        *,
        aliases: Mapping[str, str] | None = None,
        profiles: ProfileBook | None = None,
        decode_batch: int = 8,
        queue_cap: int | None = None,
    ) -> None:
        self.specs: dict[str, ModelSpec] = {s.id: s for s in specs}
        self.profiles = profiles or ProfileBook()
        self.decode_batch = decode_batch
        self.queue_cap = queue_cap
        self._workers: dict[str, ModelWorker] = {}
        self._locks: dict[str, threading.Lock] = {i: threading.Lock() for i in self.specs}
        self.aliases: dict[str, Target] = {}
        for alias, ref in (aliases or {}).items():
            target = self._lookup(ref) or self._split(ref)
            if target is None:
                raise ValueError(f"alias {alias!r} points to {ref!r}, which is not a served model")
            self.aliases[alias] = target

    @property
    def ids(self) -> list[str]:
        return list(self.specs)

    # -- addressing -------------------------------------------------------------

    def address(self, model: str | None, profile: str | None = None) -> Target:
        """Resolve a request's ``model`` (and optional ``profile`` field) to a target.

        Raises ModelNotFoundError for an unknown id, UnknownProfileError for an
        unknown profile, InvalidRequestError for an empty model that is ambiguous.
        """
        name = (model or "").strip()
        target = self._default() if not name else self._lookup(name) or self._split(name)
        if target is None:
            raise ModelNotFoundError(
                f"Model {name!r} is not served here; available models: "
                f"{', '.join(self.ids) or '(none)'}.",
                param="model",
                available_models=self.ids,
            )
        if profile:
            self.profiles.check(profile)
            target = replace(target, profile=profile)
        return target

    def _lookup(self, name: str) -> Target | None:
        if name in self.specs:
            return Target(self.specs[name])
        return self.aliases.get(name)

    def _split(self, name: str) -> Target | None:
        """``id@profile`` on the last ``@``; a known model with an unknown suffix is a 400."""
        head, sep, tail = name.rpartition("@")
        if not sep or not head or (base := self._lookup(head)) is None:
            return None
        self.profiles.check(tail)
        return replace(base, profile=tail)

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

    def profile(self, target: Target, loaded: LoadedModel) -> Profile:
        """The effective profile of a target on its loaded model (family base included)."""
        return self.profiles.resolve(target.profile_name, loaded.config.get("model_type"))

    # -- residency --------------------------------------------------------------

    def worker(self, model_id: str) -> ModelWorker:
        """The running worker of a model, loading it first if needed (blocks meanwhile).

        Concurrent callers for the same model wait for one load. Errors are
        ModelSourceError from the loader.
        """
        if (worker := self._workers.get(model_id)) is not None:
            return worker
        with self._locks[model_id]:
            if (worker := self._workers.get(model_id)) is not None:
                return worker
            from gmlx.engine.loading import load_model
            from gmlx.engine.worker import ModelWorker

            spec = self.specs[model_id]
            loaded = load_model(spec.source, model_id=spec.id)
            if spec.max_kv_size:
                loaded.context_length = min(loaded.context_length, spec.max_kv_size)
            for note in loaded.notes:
                log.info("%s: %s", spec.id, note)
            worker = ModelWorker(loaded, decode_batch=self.decode_batch, queue_cap=self.queue_cap)
            self._workers[model_id] = worker
            log.info("loaded %s from %s (context %d)", spec.id, spec.source, loaded.context_length)
            return worker

    def preload(self, model_ids: Iterable[str] | None = None) -> None:
        """Load the named models now (default: the pinned ones)."""
        ids = (
            list(model_ids)
            if model_ids is not None
            else [s.id for s in self.specs.values() if s.pinned]
        )
        for model_id in ids:
            self.worker(model_id)

    def workers(self) -> list[ModelWorker]:
        """The workers of the loaded models."""
        return list(self._workers.values())

    def resident(self, model_id: str) -> bool:
        return model_id in self._workers

    def listing(self) -> list[ModelInfo]:
        """Every model id, then every alias, with their markers."""
        rows = [self._info(spec.id, Target(spec)) for spec in self.specs.values()]
        rows += [self._info(alias, t, alias_of=t.spec.id) for alias, t in self.aliases.items()]
        return rows

    def _info(self, name: str, target: Target, alias_of: str | None = None) -> ModelInfo:
        spec = target.spec
        worker = self._workers.get(spec.id)
        context = worker.loaded.context_length if worker is not None else spec.max_kv_size
        return ModelInfo(
            id=name,
            resident=worker is not None,
            pinned=spec.pinned,
            speculative=False,
            vlm=spec.mmproj is not None,
            profile=target.profile_name,
            default=spec.default and alias_of is None,
            context_length=context,
            alias_of=alias_of,
        )

    def close(self) -> None:
        """Stop every worker (their requests finish as cancelled)."""
        for worker in list(self._workers.values()):
            worker.close()
        self._workers.clear()
