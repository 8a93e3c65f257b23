"""The config file's per-model and per-profile entries (``models:``, ``profiles:``), as
typed pydantic models; :mod:`gmlx.config` reads the file and builds the settings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gmlx.engine import kv_quant as kvq
from gmlx.engine.drafting import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS
from gmlx.engine.profiles import Profile
from gmlx.sampling_fields import SamplingFields, sampling_values


class ProfileConfig(SamplingFields):
    """One ``profiles:`` entry: any sampling field a request may set, an output cap,
    a system prompt, stop strings and chat-template variables.

    Types are checked here; value ranges by the engine's rules when the file loads
    (:func:`load_settings`).
    """

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, ge=1)
    system: str | None = None
    stop: list[str] = Field(default_factory=list)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    def to_profile(self, name: str) -> Profile:
        """This entry as the engine's profile called ``name``."""
        return Profile(
            name=name,
            sampling=sampling_values(self),
            max_tokens=self.max_tokens,
            system=self.system,
            stop=tuple(self.stop),
            chat_template_kwargs=self.chat_template_kwargs,
        )


class KVQuantConfig(BaseModel):
    """A model's ``kv_quant:`` (:mod:`gmlx.engine.kv_quant` says what each key does)."""

    model_config = ConfigDict(extra="forbid")

    scheme: Literal["uniform", "kvarn"] = "uniform"
    bits: int = 8
    group_size: int = kvq.DEFAULT_GROUP_SIZE
    value_bits: int | None = None  # kvarn only (default: bits)
    tail_tokens: int | None = Field(None, ge=0)  # kvarn only
    start: int = Field(0, ge=0)

    @field_validator("bits", "value_bits")
    @classmethod
    def _packable(cls, value: int | None) -> int | None:
        if value is not None and value not in kvq.BITS:
            raise ValueError(f"{value} bits cannot be packed (valid: {', '.join(map(str, kvq.BITS))})")
        return value

    @field_validator("group_size")
    @classmethod
    def _group(cls, value: int) -> int:
        if value not in kvq.GROUP_SIZES:
            raise ValueError(f"{value} is not a group size (valid: {', '.join(map(str, kvq.GROUP_SIZES))})")
        return value

    @field_validator("value_bits", "tail_tokens")
    @classmethod
    def _kvarn_only(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("scheme") == "uniform":
            raise ValueError("only the kvarn scheme has it (uniform quantizes keys and values alike)")
        return value

    def to_kv_quant(self) -> kvq.KVQuant:
        return kvq.KVQuant(**self.model_dump())


class ModelConfig(BaseModel):
    """One ``models:`` entry; a bare string is its source."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(validation_alias=AliasChoices("source", "path"))
    max_kv_size: int | None = Field(None, ge=1)
    profile: str | None = None
    default: bool = False
    pinned: bool = False
    mmproj: str | None = None
    preload: bool = False  # load at start (like a command-line model), but never pin
    idle_timeout: float | None = Field(None, ge=0)  # None: server.idle_timeout; 0: never
    kv_quant: KVQuantConfig | None = None  # None: full-precision KV
    # Speculative decoding: a draft model (a configured id or a source, with the same
    # tokenizer) or prompt lookup, drafting draft_tokens a round (gmlx.engine.speculative).
    draft_model: str | None = None
    prompt_lookup: bool = False
    draft_tokens: int = Field(DEFAULT_DRAFT_TOKENS, ge=1, le=MAX_DRAFT_TOKENS)

    @model_validator(mode="before")
    @classmethod
    def _bare_source(cls, value: Any) -> Any:
        return {"source": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_drafter(self) -> ModelConfig:
        if self.draft_model is not None and self.prompt_lookup:
            raise ValueError("draft_model and prompt_lookup: true exclude each other (pick one drafter)")
        return self
