"""KV-cache quantization: what a model's ``kv_quant`` asks for, which layers get it,
and what a token of KV then costs.

Two schemes, both applied from the ``start`` offset (a sequence shorter than
``start`` tokens keeps all its KV at full precision; from there on every query reads
quantized keys and values):

    uniform  keys and values at ``bits``, in groups of ``group_size`` along the head
             dimension (mlx-lm's quantized attention runs on the codes directly)
    kvarn    keys at ``bits``, values at ``value_bits``, and each query reads its
             ``tail_tokens`` most recent tokens at full precision

The cache itself (:mod:`gmlx.engine.kv_cache`) runs batched inside mlx-lm's
``BatchGenerator`` and is what the prompt cache stores, so a cached prefix stays
quantized. Only plain KV layers are quantized; sliding-window and recurrent layers
keep mlx-lm's own caches, and a layer whose head dimension ``group_size`` does not
divide stays at full precision: the listing's ``verdict`` says how much took
(``full``, ``partial``, ``dropped``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

SCHEMES = ("uniform", "kvarn")
BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
DEFAULT_TAIL_TOKENS = 128


@dataclass(frozen=True)
class KVQuant:
    """A model's KV quantization (validated: :meth:`check`)."""

    scheme: str = "uniform"
    bits: int = 8
    group_size: int = DEFAULT_GROUP_SIZE
    value_bits: int | None = None  # kvarn: the values' width (None: ``bits``)
    tail_tokens: int | None = None  # kvarn: full-precision recent tokens (None: the default)
    start: int = 0
    # Not a config key: full-precision positions kept beyond the tail, set by the engine
    # for a speculative model (a round's rejected drafts, up to ``draft_tokens + 1``
    # positions, leave the tail whole when they are dropped).
    slack: int = 0

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the first bad field as ``field: reason``."""
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme: {self.scheme!r} is not a scheme (valid: {', '.join(SCHEMES)})")
        for name, value in (("bits", self.bits), ("value_bits", self.value_bits)):
            if value is not None and value not in BITS:
                raise ValueError(f"{name}: {value} bits cannot be packed (valid: {', '.join(map(str, BITS))})")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size: {self.group_size} is not a group size "
                             f"(valid: {', '.join(map(str, GROUP_SIZES))})")
        if self.scheme == "uniform":
            for name in ("value_bits", "tail_tokens"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only the kvarn scheme has it (uniform quantizes "
                                     "keys and values alike)")
        if self.tail_tokens is not None and self.tail_tokens < 0:
            raise ValueError(f"tail_tokens: {self.tail_tokens} is negative")
        if self.start < 0:
            raise ValueError(f"start: {self.start} is negative")

    @property
    def key_bits(self) -> int:
        return self.bits

    @property
    def val_bits(self) -> int:
        return self.bits if self.value_bits is None else self.value_bits

    @property
    def tail(self) -> int:
        """Recent tokens each query reads at full precision."""
        if self.scheme != "kvarn":
            return 0
        return DEFAULT_TAIL_TOKENS if self.tail_tokens is None else self.tail_tokens

    @property
    def trimmable(self) -> bool:
        """Whether a sequence's last positions can be dropped from the cache (a prompt
        cache hit on a shorter prefix, a speculative round's rejected drafts): not when
        full-precision positions are kept (a tail, or everything before ``start``),
        which a shorter sequence would still read and the cache no longer holds."""
        return not self.tail and not self.start

    def for_drafts(self, draft_tokens: int) -> KVQuant | None:
        """This scheme for a speculative model verifying ``draft_tokens`` a round (its
        rejected drafts are dropped per stream), or None where it cannot be: a
        ``start`` offset (a stream the trim takes back before ``start`` would need
        every full-precision position the cache no longer holds)."""
        if self.start:
            return None
        return replace(self, slack=draft_tokens + 1) if self.tail else self


def uniform(bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> KVQuant:
    """The ``uniform`` scheme at ``bits`` (``gmlx run --kv-bits``)."""
    return KVQuant("uniform", bits, group_size)


# -- pricing ----------------------------------------------------------------------------


def quantized_bytes(dim: int, bits: int, group_size: int, dtype_bytes: int) -> int:
    """Bytes one head's ``dim`` values take quantized: the packed codes plus a scale
    and a bias per group, both in the model's float type."""
    return dim * bits // 8 + 2 * (dim // group_size) * dtype_bytes


def layer_bytes_per_token(kvq: KVQuant, kv_heads: int, k_dim: int, v_dim: int, dtype_bytes: int) -> int:
    """Bytes one more token costs a quantized layer (keys and values)."""
    return kv_heads * (quantized_bytes(k_dim, kvq.key_bits, kvq.group_size, dtype_bytes)
                       + quantized_bytes(v_dim, kvq.val_bits, kvq.group_size, dtype_bytes))


def layer_fixed_bytes(kvq: KVQuant, kv_heads: int, k_dim: int, v_dim: int, dtype_bytes: int) -> int:
    """The full-precision KV a quantized layer holds besides its codes: the tail (and,
    for a sequence still shorter than ``start``, up to ``start`` tokens)."""
    return max(kvq.tail + kvq.slack if kvq.tail else 0, kvq.start) * kv_heads * (k_dim + v_dim) * dtype_bytes


def head_geometry(config: dict[str, Any]) -> tuple[int, int] | None:
    """(kv heads, head dimension) of a model's attention, from its config (None: the
    config does not say)."""
    text = config.get("text_config") or config
    heads = text.get("num_attention_heads") or text.get("n_head")
    kv_heads = text.get("num_key_value_heads") or heads
    hidden = text.get("hidden_size") or text.get("n_embd")
    head_dim = text.get("head_dim") or (hidden // heads if hidden and heads else None)
    if not (kv_heads and head_dim):
        return None
    return int(kv_heads), int(head_dim)
