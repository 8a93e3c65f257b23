"""Settings: the YAML config file, environment overrides and command-line models.

The file has four sections, all optional::

    server:   {host, port, api_key, cors, decode_batch, queue_depth_cap, sse_keepalive_s,
               prompt_cache_bytes, governor, governor_floor_bytes, preflight_mem, overcommit,
               warmup, top_logprobs_k, idle_timeout, models_dir, image_fetch, image_fetch_private,
               image_max_bytes, image_fetch_timeout_s, max_body_bytes, max_messages, max_stop,
               shutdown_timeout_s}
    models:   {id: {source, max_kv_size, profile, default, pinned, mmproj, preload,
              idle_timeout, kv_quant: {scheme, bits, group_size, value_bits, tail_tokens,
              start}, draft_model, prompt_lookup, draft_tokens}}  (or id: source;
              a source is ``demo``, a GGUF file, an MLX folder or ``hf:org/repo[/file]``)
    aliases:  {alias: id or id@profile}
    profiles: {name: {<every sampling field>, max_tokens, system, stop, chat_template_kwargs}}

``server`` values can be overridden by ``GMLX_<KEY>`` environment variables
(``GMLX_PORT``, ``GMLX_API_KEY``, ``GMLX_QUEUE_DEPTH_CAP``, ``GMLX_SSE_KEEPALIVE_S``,
``GMLX_DECODE_BATCH``, ``GMLX_PROMPT_CACHE_BYTES``, ``GMLX_GOVERNOR``, ``GMLX_PREFLIGHT_MEM``,
``GMLX_OVERCOMMIT``, ``GMLX_WARMUP`` ...); ``top_logprobs_k`` by ``TOP_LOGPROBS_K``, the
name the HTTP spec gives it. A profile's sampling fields are the request's
(:mod:`gmlx.sampling_fields`), range-checked by the engine's own rules as the file loads.
Every problem is raised as one :class:`ConfigError` naming the file, the key and the reason;
keys the spec names for what gmlx does not do yet (:data:`NOT_SUPPORTED`) as "not supported yet".

Turning settings into a running registry or app is :mod:`gmlx.compose`'s job.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from gmlx.config_entries import KVQuantConfig, ModelConfig, ProfileConfig
from gmlx.engine.errors import ConfigError, InvalidRequestError, ModelNotFoundError
from gmlx.engine.loading import DEMOS, source_kind
from gmlx.engine.loading.hf_cache import PREFIX as HF_PREFIX
from gmlx.engine.profiles import ProfileBook
from gmlx.engine.types import SamplingParams
from gmlx.paths import config_file
from gmlx.sampling_fields import sampling_values

ENV_PREFIX = "GMLX_"

# Keys the HTTP spec names for what gmlx does not do yet: a config that sets one fails at
# start saying so (not "unknown key"), so a user knows the key is right and the feature absent.
NOT_SUPPORTED: tuple[str, ...] = ("server.hf_cache", "stt", "tts", "embeddings", "rerank")


class ServerSettings(BaseSettings):
    """The ``server:`` section; ``GMLX_<KEY>`` environment variables (``TOP_LOGPROBS_K``
    for ``top_logprobs_k``) win over the file."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    api_key: str | None = None
    cors: Annotated[list[str], NoDecode] = Field(default_factory=list)  # allowed origins
    # None: chosen per model from its capacity table when it loads.
    decode_batch: int | None = Field(None, ge=1, le=512)
    queue_depth_cap: int | None = Field(None, ge=0)  # default: 4 x decode_batch
    sse_keepalive_s: float = Field(15.0, ge=0)  # 0 turns the keep-alive comments off
    # On SIGTERM / Ctrl-C: seconds requests in flight get to finish before they are cut.
    shutdown_timeout_s: float = Field(10.0, ge=0)
    prompt_cache_bytes: int | None = Field(None, ge=0)  # None: the engine's default; 0: off
    governor: bool = True  # GMLX_GOVERNOR=0 turns the memory governor off
    governor_floor_bytes: int | None = Field(None, ge=1)  # None: 5% of memory, 512 MiB..4 GiB
    preflight_mem: bool = True  # GMLX_PREFLIGHT_MEM=0: no memory check before a request
    overcommit: bool = False  # GMLX_OVERCOMMIT=1: no capacity table judges requests
    warmup: bool = True  # GMLX_WARMUP=0: serve a loaded model without first running its batch shapes
    # Seconds a model loaded on demand stays resident with nothing to do (0: forever).
    # Models loaded at start (named on the command line, pinned, preload) never idle
    # out unless their own entry sets an idle_timeout.
    idle_timeout: float = Field(1800.0, ge=0)
    models_dir: str | None = None  # a folder whose GGUF files and MLX folders are served too
    # Image URLs in requests: fetched at all (GMLX_IMAGE_FETCH=0: data: URIs only), from
    # loopback, link-local and private addresses too, up to this size, within this time.
    image_fetch: bool = True
    image_fetch_private: bool = False
    image_max_bytes: int = Field(20 << 20, ge=1)
    image_fetch_timeout_s: float = Field(10.0, gt=0)
    # Request limits: a body over max_body_bytes is refused (413) before it is read whole
    # (it must hold a base64 image of image_max_bytes); more messages (or Responses input
    # items) or stop strings than these are a 400 naming the field.
    max_body_bytes: int = Field(32 << 20, ge=1024)
    max_messages: int = Field(4096, ge=1)
    max_stop: int = Field(16, ge=1)
    # Most alternatives per token that `top_logprobs` may ask for (0: none). The spec
    # names the variable TOP_LOGPROBS_K, without the prefix; GMLX_TOP_LOGPROBS_K works too.
    top_logprobs_k: int = Field(
        0,
        ge=0,
        le=20,
        validation_alias=AliasChoices("top_logprobs_k", "gmlx_top_logprobs_k"),
    )

    @field_validator("cors", mode="before")
    @classmethod
    def _origins(cls, value: Any) -> Any:
        # `cors: true` means any origin; a string may list origins separated by commas.
        if value is True:
            return ["*"]
        if value in (False, None):
            return []
        if isinstance(value, str):
            return [o.strip() for o in value.split(",") if o.strip()]
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's values arrive as init arguments; the environment must beat them.
        return (env_settings, init_settings)


class ConfigFile(BaseModel):
    """The file's model sections (``server:`` is validated as settings, separately)."""

    model_config = ConfigDict(extra="forbid")

    models: dict[str, ModelConfig] = Field(default_factory=dict)
    aliases: dict[str, str] = Field(default_factory=dict)
    profiles: dict[str, ProfileConfig] = Field(default_factory=dict)
    server: dict[str, Any] = Field(default_factory=dict)


class Settings(BaseModel):
    """Everything ``gmlx serve`` runs on, and where it came from."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    server: ServerSettings = Field(default_factory=ServerSettings)
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    aliases: dict[str, str] = Field(default_factory=dict)
    profiles: dict[str, ProfileConfig] = Field(default_factory=dict)
    origin: str = "defaults"  # where the config came from, for the startup log
    source_file: Path | None = None  # the file read, if one was: what a reload re-reads
    preload: list[str] = Field(default_factory=list)  # model ids to load at start

    def startup_models(self) -> list[str]:
        """The ids to load at start: the command-line models, then the pinned and
        preload ones."""
        marked = [mid for mid, m in self.models.items() if m.pinned or m.preload]
        return list(dict.fromkeys([*self.preload, *marked]))

    def profile_book(self) -> ProfileBook:
        """The profiles these settings know: the built-in intents and the file's."""
        return ProfileBook({name: p.to_profile(name) for name, p in self.profiles.items()})

    def with_kv_quant(self, name: str, kv_quant: KVQuantConfig) -> Settings:
        """These settings with the model that ``name`` addresses (an id or alias, with
        or without ``@profile``) quantizing its KV as ``kv_quant`` says."""
        return self._with_entry(name, {"kv_quant": kv_quant}, "KV quantization")

    def with_drafting(self, name: str, draft_model: str | None, prompt_lookup: bool,
                      draft_tokens: int | None = None) -> Settings:
        """These settings with the model that ``name`` addresses drafting as given
        (``gmlx run --draft/--prompt-lookup``). Raises ConfigError for a drafter that
        is no model or two drafters at once."""
        if draft_model is not None and draft_model not in self.models and not _is_source(draft_model):
            raise ConfigError(f"The draft model {draft_model!r} is neither a configured model nor a model path.")
        update: dict[str, Any] = {"draft_model": draft_model, "prompt_lookup": prompt_lookup}
        if draft_tokens is not None:
            update["draft_tokens"] = draft_tokens
        return self._with_entry(name, update, "Drafting")

    def _with_entry(self, name: str, update: dict[str, Any], what: str) -> Settings:
        """These settings with ``update`` applied to the entry of the model ``name``
        addresses, validated as the file's entries are (ConfigError naming ``what``)."""
        model_id = _model_of(self, self.models, name)
        if model_id is None:
            raise ModelNotFoundError(f"{name!r} is not a configured model.", param="model")
        try:
            model = ModelConfig.model_validate({**self.models[model_id].model_dump(exclude_unset=True), **update})
        except ValidationError as e:
            raise ConfigError(f"{what} for {model_id}: {e.errors()[0]['msg'].removeprefix('Value error, ')}.") from e
        return self.model_copy(update={"models": {**self.models, model_id: model}})

    def with_models(self, refs: Iterable[str]) -> tuple[Settings, list[str]]:
        """Add command-line models: each ref that is not already addressable (an id,
        an alias, either with ``@profile``) is a source (``demo``, a GGUF file, an MLX
        folder) served under an id taken from its name.

        As in a request, a ref is split on its last ``@`` only when the suffix names a
        known profile; otherwise the whole ref is the id or the path.

        Returns the new settings and, per ref, the model string that addresses it.
        Raises ModelNotFoundError for ``model@suffix`` where the model exists and the
        suffix is no profile, ModelSourceError for a ref that is neither configured
        nor a model.
        """
        models = dict(self.models)
        book = self.profile_book()
        names: list[str] = []
        for ref in refs:
            known = {*models, *self.aliases}
            head, sep, tail = ref.rpartition("@")
            profiled = bool(sep and head) and tail in book
            if ref in known or (profiled and head in known):
                names.append(ref)
                continue
            source, suffix = ref, ""
            is_path = Path(ref).expanduser().exists()
            if sep and head and not is_path and (head in known or _is_source(head)):
                if not profiled:
                    # Say what is wrong with the ref as typed, not "no such path".
                    raise ModelNotFoundError(
                        f"{ref!r} is not a configured model, an alias or a model path, and "
                        f"{tail!r} after its last @ is not a profile (valid profiles: "
                        f"{', '.join(book.names)}).",
                        param="model",
                    )
                source, suffix = head, f"@{tail}"
            source_kind(source)  # raises ModelSourceError naming the path
            model_id = _id_for(source)
            if model_id in models and models[model_id].source != source:
                model_id = source
            models.setdefault(model_id, ModelConfig(source=source))
            names.append(model_id + suffix)
        preload = [*self.preload, *(n for n in (_model_of(self, models, x) for x in names) if n)]
        settings = self.model_copy(
            update={"models": models, "preload": list(dict.fromkeys(preload))}
        )
        return settings, names


def _is_source(ref: str) -> bool:
    return ref in DEMOS or ref.startswith(HF_PREFIX) or Path(ref).expanduser().exists()


def _id_for(source: str) -> str:
    if source in DEMOS:
        return source
    path = Path(source).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


def _model_of(settings: Settings, models: dict[str, ModelConfig], name: str) -> str | None:
    """The model id a command-line name refers to (through an alias if needed)."""
    for candidate in (name, name.rpartition("@")[0]):
        if candidate in models:
            return candidate
        if candidate in settings.aliases:
            return _model_of(settings, models, settings.aliases[candidate])
    return None


def load_settings(path: Path | str | None = None) -> Settings:
    """Read and validate a config file (default: ``gmlx.paths.config_file()``).

    A missing default file is an empty config; a missing ``--config`` file, bad
    YAML, an unknown key or a bad value raise ConfigError naming file and key.
    """
    explicit = path is not None
    file = Path(path).expanduser() if explicit else config_file()
    if not file.is_file():
        if explicit:
            raise ConfigError(f"Config file {file} does not exist.")
        return Settings(
            server=_server_settings({}, file), origin=f"{file} (not found: empty config)"
        )
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        reason = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"Config file {file} is not valid YAML{where}: {reason}.") from e
    except OSError as e:
        raise ConfigError(f"Config file {file} cannot be read: {e.strerror or e}.") from e
    if not isinstance(raw, dict):
        raise ConfigError(
            f"Config file {file} must hold a mapping of sections, not {type(raw).__name__}."
        )
    _check_not_supported(raw, file)
    try:
        parsed = ConfigFile.model_validate(raw)
    except ValidationError as e:
        raise _config_error(file, e) from e
    settings = Settings(
        server=_server_settings(parsed.server, file),
        models=parsed.models,
        aliases=parsed.aliases,
        profiles=parsed.profiles,
        origin=str(file),
        source_file=file,
    )
    _check_references(settings, file)
    _check_drafters(settings, file)
    _check_sampling(settings, file)
    return settings


def _check_not_supported(raw: dict[str, Any], file: Path) -> None:
    server = raw.get("server")
    for key in NOT_SUPPORTED:
        section, _, sub = key.rpartition(".")
        scope = raw if not section else server if isinstance(server, dict) else {}
        if sub in scope:
            raise ConfigError(
                f"Config file {file} is invalid at {key}: not supported yet "
                "(the spec names it; this gmlx does not implement it)."
            )


def _server_settings(values: dict[str, Any], file: Path) -> ServerSettings:
    try:
        return ServerSettings(**values)
    except ValidationError as e:
        raise _config_error(file, e, prefix="server") from e


def _config_error(file: Path, err: ValidationError, prefix: str = "") -> ConfigError:
    first = err.errors()[0]
    key = ".".join(str(p) for p in (prefix, *first["loc"]) if p != "")
    # A validator's ValueError arrives as "Value error, <reason>": the reason is enough.
    reason = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        reason = "unknown key"
    if prefix == "server" and first["loc"]:
        env = {k.upper() for k in os.environ}
        named = [e for e in _env_names(str(first["loc"][0])) if e in env]
        if named:
            key += f" (set by {named[0]})"
    more = f" (and {len(err.errors()) - 1} more problems)" if len(err.errors()) > 1 else ""
    return ConfigError(f"Config file {file} is invalid at {key}: {reason}{more}.")


def _env_names(key: str) -> list[str]:
    """The environment variables that can set the ``server`` key ``key``."""
    info = ServerSettings.model_fields.get(key)
    if info is not None and isinstance(info.validation_alias, AliasChoices):
        return [str(name).upper() for name in info.validation_alias.choices]
    return [f"{ENV_PREFIX}{key}".upper()]


# Token ids in a profile's logit_bias are checked against each model's vocabulary when a
# request uses the profile; at load time only their sign and the bias values can be.
ANY_VOCAB = 2**31


def _check_sampling(settings: Settings, file: Path) -> None:
    """Every profile's sampling values must pass the engine's own checks, the ones a
    request's values pass: the same rules, the same reasons."""
    if not settings.profiles:
        return
    from gmlx.engine.sampling import validate  # imports MLX: only for a file with profiles

    for name, profile in settings.profiles.items():
        try:
            validate(SamplingParams(**sampling_values(profile)), ANY_VOCAB)
        except InvalidRequestError as e:
            raise ConfigError(
                f"Config file {file} is invalid at profiles.{name}.{e.param}: "
                f"{e.message.rstrip('.')}."
            ) from e


def _check_drafters(settings: Settings, file: Path) -> None:
    """A ``draft_model`` names a configured model or a model source."""
    for mid, model in settings.models.items():
        ref = model.draft_model
        if ref is not None and ref not in settings.models and not _is_source(ref):
            raise ConfigError(
                f"Config file {file} is invalid at models.{mid}.draft_model: {ref!r} is neither "
                "a configured model nor a model path."
            )


def _check_references(settings: Settings, file: Path) -> None:
    """Profiles, aliases and defaults must point at things that exist."""
    book = settings.profile_book()

    def bad(key: str, reason: str) -> ConfigError:
        return ConfigError(f"Config file {file} is invalid at {key}: {reason}.")

    for mid, model in settings.models.items():
        if model.profile is not None and model.profile not in book:
            raise bad(
                f"models.{mid}.profile",
                f"unknown profile {model.profile!r} (valid: {', '.join(book.names)})",
            )
    defaults = [mid for mid, m in settings.models.items() if m.default]
    if len(defaults) > 1:
        raise bad(
            f"models.{defaults[1]}.default",
            f"only one model can be the default, and {defaults[0]} already is",
        )
    for alias, ref in settings.aliases.items():
        if alias in settings.models:
            raise bad(f"aliases.{alias}", "an alias cannot reuse a model id")
        head, sep, tail = ref.rpartition("@")
        if ref in settings.models:
            continue
        if not sep or head not in settings.models:
            raise bad(f"aliases.{alias}", f"{ref!r} does not name a configured model")
        if tail not in book:
            raise bad(
                f"aliases.{alias}", f"unknown profile {tail!r} (valid: {', '.join(book.names)})"
            )
