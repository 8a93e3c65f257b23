"""The memory model: what a model, a request and a fan-out need, in bytes.

Everything above the "probes" line is a pure function of a :class:`Geometry` and
numbers, so it can be checked by hand. The probes at the bottom read the facts off
a loaded model and the machine.

The model:
    need(request) = prefill transient (one chunk) + KV for the tokens it will hold
    KV(tokens)    = sum over layers of bytes_per_token x tokens kept by that layer,
                    rounded up to the cache's allocation step (256 tokens)
    transient     = attention scores of one chunk against the context (when the
                    backend materializes them) + the chunk's logits + its MLP
                    activations
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gmlx.engine.kv_quant import KVQuant
    from gmlx.engine.loading import LoadedModel

KV_STEP = 256  # mlx-lm's KVCache grows in steps of this many tokens
WIDTHS = (1, 2, 4, 8, 16, 32, 64)
DEPTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache: bytes per token (K and V together), the sliding window it
    keeps (None: everything), and any fixed-size state (recurrent layers)."""

    bytes_per_token: int
    window: int | None = None
    fixed_bytes: int = 0


@dataclass(frozen=True)
class Geometry:
    """What the memory model needs to know about a model."""

    weight_bytes: int
    layers: tuple[LayerKV, ...]
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    n_heads: int
    dtype_bytes: int
    context_length: int
    fused_attention: bool = False  # the backend's attention never materializes scores
    # the largest weight a prefill chunk dequantizes for a dense product (CUDA's tuned
    # paths, ``fast_linear``), alive while that product runs
    dense_scratch_bytes: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one more token costs at long context (windowed layers excluded)."""
        return sum(layer.bytes_per_token for layer in self.layers if layer.window is None)


def with_drafter(target: Geometry, draft: Geometry) -> Geometry:
    """A speculative model's geometry: the target's, plus its draft model's weights and
    KV layers (the drafter keeps every stream's tokens in a cache of its own, so one more
    token costs both). The prefill terms stay the target's: the drafter prefills after
    it, with a smaller transient, and the largest dequantized weight is the larger one."""
    return replace(
        target,
        weight_bytes=target.weight_bytes + draft.weight_bytes,
        layers=target.layers + draft.layers,
        dense_scratch_bytes=max(target.dense_scratch_bytes, draft.dense_scratch_bytes),
    )


def _round_up(tokens: int, step: int = KV_STEP) -> int:
    return -(-max(0, tokens) // step) * step


def kv_bytes(geom: Geometry, tokens: int) -> int:
    """KV bytes one sequence of ``tokens`` holds."""
    total = 0
    for layer in geom.layers:
        kept = tokens if layer.window is None else min(tokens, layer.window)
        total += layer.bytes_per_token * _round_up(kept) + layer.fixed_bytes
    return total


def prefill_transient(geom: Geometry, chunk: int, context: int) -> int:
    """Peak scratch memory while prefilling the ``chunk`` tokens that end at ``context``.

    Prefill chunks never materialize their logits (only the caches are evaluated), so
    the terms are the attention scores (absent when the backend fuses attention) and
    the layer activations; the factors were fitted to ``mx.get_peak_memory()`` on the
    CPU backend, rounding up. On CUDA, plus the largest weight a chunk's dense products
    dequantize (counted for every chunk size: a small over-estimate for short chunks).
    """
    chunk = max(1, min(chunk, context))
    b = geom.dtype_bytes
    scores = 0 if geom.fused_attention else geom.n_heads * chunk * context * b * 11 // 10
    activations = chunk * (2 * geom.intermediate_size + 4 * geom.hidden_size) * b * 5 // 2
    logits = geom.vocab_size * 4 * 2  # the last token's logits and log-probabilities
    return scores + activations + logits + geom.dense_scratch_bytes


def worst_prefill_transient(geom: Geometry, prompt_tokens: int, chunk: int, warm_tokens: int = 0) -> int:
    """The largest transient over the chunks a prompt is prefilled in."""
    cold = max(1, prompt_tokens - warm_tokens)
    # The transient grows with both the chunk and the context it ends at, so the
    # worst chunk is the last full one or the final partial one.
    full = cold // chunk
    worst = prefill_transient(geom, chunk, warm_tokens + full * chunk) if full else 0
    if rest := cold - full * chunk:
        worst = max(worst, prefill_transient(geom, rest, prompt_tokens))
    return worst


@dataclass(frozen=True)
class RequestNeed:
    prompt_tokens: int
    warm_tokens: int
    max_tokens: int | None
    kv_bytes: int
    transient_bytes: int

    @property
    def need_bytes(self) -> int:
        return self.kv_bytes + self.transient_bytes


def request_need(
    geom: Geometry, prompt_tokens: int, *, max_tokens: int | None, chunk: int, warm_tokens: int = 0
) -> RequestNeed:
    """Bytes a request needs: its KV (prompt, plus max_tokens when pinned) and the
    prefill transient of its cold part."""
    tokens = prompt_tokens + (max_tokens or 0)
    return RequestNeed(
        prompt_tokens=prompt_tokens,
        warm_tokens=warm_tokens,
        max_tokens=max_tokens,
        kv_bytes=kv_bytes(geom, tokens),
        transient_bytes=worst_prefill_transient(geom, prompt_tokens, chunk, warm_tokens),
    )


def fits(geom: Geometry, width: int, depth: int, budget: int, chunk: int) -> bool:
    """Whether ``width`` sequences of ``depth`` tokens fit ``budget`` bytes, with one of
    them prefilling a chunk at a time."""
    if depth > geom.context_length:
        return False
    return width * kv_bytes(geom, depth) + prefill_transient(geom, chunk, depth) <= budget


def max_context(geom: Geometry, width: int, budget: int, chunk: int) -> int:
    """The longest context each of ``width`` streams can reach (0 when none fits)."""
    lo, hi = 0, geom.context_length
    while lo < hi:  # largest depth that fits; fits() is monotone in depth
        mid = (lo + hi + 1) // 2
        if fits(geom, width, mid, budget, chunk):
            lo = mid
        else:
            hi = mid - 1
    return lo


def max_width(geom: Geometry, depth: int, budget: int, chunk: int, limit: int = 4096) -> int:
    """How many streams of ``depth`` tokens fit (0 when none)."""
    if depth > geom.context_length:
        return 0
    per = kv_bytes(geom, depth)
    room = budget - prefill_transient(geom, chunk, depth)
    if room < per:
        return 0
    return min(limit, room // per if per else limit)


@dataclass(frozen=True)
class CapacityTable:
    """The boot capacity table: max context by width and max width by depth."""

    budget_bytes: int
    weight_bytes: int
    kv_bytes_per_token: int
    chunk: int
    max_ctx: dict[int, int] = field(default_factory=dict)
    max_width_at_depth: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "prefill_chunk": self.chunk,
            "max_ctx": {str(w): c for w, c in self.max_ctx.items()},
            "max_width_at_depth": {str(d): w for d, w in self.max_width_at_depth.items()},
        }

    def width_at(self, width: int) -> int | None:
        """The smallest tabulated width >= ``width`` (None: wider than the table)."""
        return min((w for w in self.max_ctx if w >= width), default=None)

    def max_ctx_at(self, width: int) -> int | None:
        """Read conservatively: the entry of the smallest tabulated width >= ``width``."""
        tabulated = self.width_at(width)
        return self.max_ctx[tabulated] if tabulated is not None else None


def capacity_table(
    geom: Geometry,
    budget: int,
    chunk: int,
    widths: Iterable[int] = WIDTHS,
    depths: Iterable[int] = DEPTHS,
) -> CapacityTable:
    return CapacityTable(
        budget_bytes=budget,
        weight_bytes=geom.weight_bytes,
        kv_bytes_per_token=geom.kv_bytes_per_token,
        chunk=chunk,
        max_ctx={w: max_context(geom, w, budget, chunk) for w in widths},
        max_width_at_depth={d: max_width(geom, d, budget, chunk) for d in depths if d <= geom.context_length},
    )


def plan(table: CapacityTable, width: int, depth: int) -> tuple[bool, str | None]:
    """Whether ``width`` streams of ``depth`` tokens fit the table, and if not why."""
    ctx = table.max_ctx_at(width)
    if ctx is None:
        return False, f"width {width} is wider than the table ({max(table.max_ctx)})"
    if depth > ctx:
        return False, f"depth {depth} exceeds max context {ctx} at width {width}"
    return True, None


def default_decode_batch(table: CapacityTable, context: int, cap: int = 32) -> int:
    """A decode width that keeps every stream able to reach ``context`` tokens."""
    widths = [w for w, c in sorted(table.max_ctx.items()) if c >= min(context, 4096)]
    return max(1, min(cap, max(widths, default=1)))


# -- probes (read facts off a model and the machine) ------------------------------------


def probe_geometry(loaded: LoadedModel, kv_quant: KVQuant | None = None) -> Geometry:
    """Measure a model's cache layout by running one token through fresh caches (its
    KV layers quantized by ``kv_quant``: codes, scales and biases per token, and the
    full-precision tail and start as fixed bytes)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

    from gmlx.engine import kv_quant as kvq
    from gmlx.engine.kernels.fast_linear import dense_scratch_bytes
    from gmlx.engine.kv_cache import QuantKVCache
    from gmlx.engine.kv_layers import make_cache

    model = loaded.model
    caches = make_cache(loaded, kv_quant)
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    layers = []
    for c in caches:
        if isinstance(c, QuantKVCache):
            per = sum(a.nbytes for a in (*c.kq, *c.vq)) // c.kq[0].shape[2]  # type: ignore[misc]
            heads, k_dim, v_dim = c.kq[0].shape[1], c.head_dims[0], c.head_dims[1]  # type: ignore[index]
            fixed = kvq.layer_fixed_bytes(c.kvq, heads, k_dim, v_dim, c.dtype_bytes)
            layers.append(LayerKV(per, fixed_bytes=fixed))
        elif isinstance(c, RotatingKVCache):
            per = (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
            layers.append(LayerKV(per, window=c.max_size))
        elif isinstance(c, QuantizedKVCache):
            per = sum(a.nbytes for a in (*c.keys, *c.values)) // c.keys[0].shape[2]
            layers.append(LayerKV(per))
        elif isinstance(c, KVCache):
            per = (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
            layers.append(LayerKV(per))
        elif isinstance(c, ArraysCache):
            layers.append(LayerKV(0, fixed_bytes=c.nbytes))
        else:  # unknown cache type: assume a full KV cache of its current size per token
            layers.append(LayerKV(max(1, c.nbytes // max(1, c.size()))))
    params = tree_flatten(model.parameters())
    cfg = loaded.config
    text_cfg = cfg.get("text_config", cfg)
    float_dtypes = [v.dtype for _, v in params if v.dtype in (mx.float16, mx.bfloat16, mx.float32)]
    dtype_bytes = max(set(float_dtypes), key=float_dtypes.count).size if float_dtypes else 2
    return Geometry(
        weight_bytes=weight_bytes(model),
        layers=tuple(layers),
        hidden_size=int(text_cfg.get("hidden_size", 0)),
        intermediate_size=int(text_cfg.get("intermediate_size", 0) or 4 * text_cfg.get("hidden_size", 0)),
        vocab_size=int(text_cfg.get("vocab_size", len(loaded.tokenizer))),
        n_heads=int(text_cfg.get("num_attention_heads", 1)),
        dtype_bytes=dtype_bytes,
        context_length=loaded.context_length,
        fused_attention=backend() != "cpu",
        dense_scratch_bytes=dense_scratch_bytes(model),
    )


def weight_bytes(model: Any) -> int:
    """Bytes of a model's parameters as loaded (quantized weights, scales and biases)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def backend() -> str:
    """``metal``, ``cuda`` or ``cpu``: where MLX runs by default."""
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def free_bytes(reserve_bytes: int = 0) -> int:
    """The free working set: memory new KV and transients may use now.

    Unified memory (Metal, CPU): the OS's available memory plus MLX's reusable
    buffer cache. CUDA: the device's free memory as MLX sees it. A memory limit set
    in MLX caps either. ``reserve_bytes`` is kept back for everything else.
    """
    import mlx.core as mx
    import psutil

    cached = mx.get_cache_memory()
    if backend() == "cuda":
        # The device's own free memory (what the driver can still hand out) plus
        # MLX's reusable buffer cache; seen on an H200: keys free_memory, total_memory.
        info = mx.device_info()
        if "free_memory" in info:
            free = int(info["free_memory"]) + cached
        else:
            total = int(info.get("total_memory") or info.get("memory_size") or 0)
            free = total - mx.get_active_memory() if total else psutil.virtual_memory().available
    else:
        free = psutil.virtual_memory().available + cached
    limit = _memory_limit()
    if limit:
        free = min(free, limit - mx.get_active_memory())
    return max(0, int(free) - reserve_bytes)


_LIMIT: dict[str, int] = {}


def set_memory_limit(limit_bytes: int | None) -> int:
    """Cap MLX's memory (all backends) and remember the cap for the free working set;
    ``None`` forgets the cap. Returns MLX's previous limit, to restore it with."""
    import mlx.core as mx

    if limit_bytes is None:
        _LIMIT.pop("bytes", None)
        return mx.get_memory_limit() if hasattr(mx, "get_memory_limit") else 0
    previous = mx.set_memory_limit(limit_bytes)
    _LIMIT["bytes"] = limit_bytes
    return previous


def _memory_limit() -> int | None:
    return _LIMIT.get("bytes")


def gib(n: float) -> int:
    return int(n * 1024**3)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def quantized_geometry(geom: Geometry, config: dict[str, Any], kvq: KVQuant) -> Geometry:
    """``geom`` as it would be with ``kvq``: every full KV layer priced at the quantized
    width (what ``gmlx plan --kv-bits`` compares against)."""
    from dataclasses import replace

    from gmlx.engine.kv_quant import head_geometry, layer_bytes_per_token, layer_fixed_bytes

    heads = head_geometry(config)
    if heads is None or heads[1] % kvq.group_size:
        return geom
    kv_heads, dim = heads
    b = geom.dtype_bytes
    full = 2 * kv_heads * dim * b
    layers = tuple(
        LayerKV(layer_bytes_per_token(kvq, kv_heads, dim, dim, b),
                fixed_bytes=layer_fixed_bytes(kvq, kv_heads, dim, dim, b))
        if layer.window is None and not layer.fixed_bytes and layer.bytes_per_token == full else layer
        for layer in geom.layers
    )
    return replace(geom, layers=layers)
