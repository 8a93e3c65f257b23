"""One-token attention over a batch cache in place, for CUDA: the step's new key and value
written into the cache's own arrays and attended over in one launch a layer
(:func:`attend_cached`), where mlx-lm's cache takes two slice updates, two views and the
attention, each an operation the host hands to MLX (on a GPU one stream's step is bound
by that host time; the whole-step trace this makes possible, :mod:`whole_step`, is the
served default on CUDA since 2026-12-05).

A block a (stream, key-value head, split): its warps take the split's keys in turn, a
key a warp, each lane a few dimensions of the key and of its values in one wide load
each, and every lane holds its dimensions of the query of each head of the group, so the
keys and values are read once for the group (grouped-query models: an 8B's 32 query heads
share 8 key-value heads; or once for each part of it, the head split below). Each warp keeps its own running maximum, total and values per
head, without a barrier; the warps' shares meet in shared memory at the end. The keys so
far are shared evenly between a head's splits (:func:`splits`, toward two blocks an SM),
whose shares the combine kernel of :mod:`attention_cuda` sums. The step's own key and
value are read from their arrays, and one block of each key-value head writes them into
the cache (no block reads that position from the cache, so none waits for the write).

Why this form: the one before it (the routed kernel's: a block a query head, a thread a
key's score, then the block's maximum and total at every tile of 256 keys) took 16-19 us
a call at 37-300 keys on an H200 (ncu: 32 blocks, 1.5% of the SMs' throughput, warps
waiting on their loads; MLX's one-query kernel 7 us) and 53 us at 8,000 keys (MLX 35),
reading each key-value head's keys once for each of its query heads: a conversation of
7,800 tokens decoded at 0.83x llama-server where a short one ran at 1.05-1.10x. This one
took 11-12 us at 37-130 keys on the H100 and 51 us at 8,000 (MLX 4 and 37) in a queue of
independent calls; each key still costs every lane five shuffles and two ``exp2f`` a
head of the group. (Those timings, like every one before 12-06, queued calls that do not
depend on each other, which run at once on the GPU and flatter a form of few blocks; in a
chain, as a step's layers run, the H200 took 16-23 us at 37-130 keys, MLX 7-10, and the
whole form of one stream 290 us at 8,000 keys against the split form's 65.)

A second form takes a key a lane (:data:`LAYOUTS`): each lane scores one key against the
group's queries held in shared memory, a tile of 32 keys takes one shuffle reduction a
head for its maximum and one ``exp2f`` a lane, and the warp adds the tile's values a key
at a time with the weights read from shared memory. Which form runs, whole and split
apart, and from what cache length a split pays, the load measures on its GPU for each
attention shape (:func:`cached_attention_load.tune_split`, in a chain of calls); the lane form only where it
also agreed with MLX at the load's check (on the H100 and H200 it agreed everywhere and
took both forms of the 8B's shape: whole 54 against 102 us at 1,024 keys in a chain).

A key-value head's query heads may also be shared between blocks (the head split,
:func:`hsplits`): each block then holds ``GROUP`` of the group's ``GROUP * HSPLIT``, so
one stream's whole form launches key-value heads x ``HSPLIT`` blocks (the 8B's: 32, a
query head a block), each key costing a block's lanes 1/``HSPLIT`` of the dot products,
shuffles and ``exp2f``, and each key and value is read by ``HSPLIT`` blocks (from L2 at
a short cache). Why: at one stream over 37-1,024 keys the whole form's 8 blocks took
16-23 us a call in a chain on the H200 where MLX's one-query kernel took 7-10; each warp
walks its keys one after another, a key costing four heads' dot products, five shuffles
and two ``exp2f`` each, while 124 of the 132 SMs sit idle; and a split (a second launch)
pays only from ~1,024 keys. Measured since (H100, 12-06, in a chain, bf16, 1 / 2 / 4
blocks a key-value head of the 8B, one stream): that is not what a short cache costs:
38 keys 20.0 / 19.7 / 21.3 us a key a warp, 25.3 / 24.4 / 25.3 a key a lane; 256 keys
33.1 / 32.6 / 33.6 and 25.4 / 25.5 / 26.3; it pays from ~1,000 (warp 92.1 / 87.4 /
84.9, lane 51.0 / 45.8 / 45.8; 2,100: lane 94.7 / 82.9 / 81.3), and more for the 1.5B's
groups of 6 (lane at 2,100 keys, 1 / 2 / 3 / 6 blocks: 98.5 / 84.7 / 78.1 / 72.8). At 8
streams it lost at every short cache (the 8B at 38 keys: 26.0 / 33.6 / 33.8), so only a
single stream takes it unasked. With ``GMLX_HEAD_SPLIT=1`` the load times the whole form
at each head split at :data:`HSPLIT_CAPACITY` positions and takes the fastest, then times
the split threshold with it (:func:`cached_attention_load.tune_split`); the split form keeps one block a
key-value head. Off by default: the one lease that served it (H100, 12-06, with the
other 12-06 additions) served one stream slower than ever, the cause not yet isolated.

One stream's whole form may also go wide (:data:`WIDE`, :func:`wide_threads` says why): a
query head a block of 32 warps (16 for heads of 256), each warp a key at a time, as MLX's
one-query kernel lays its blocks out, with the in-place write. The load checks it
against MLX and times it against the whole form chosen so far at 256 and 1,024 positions
(:func:`cached_attention_load.tune_split`), and one stream takes it only where it won at
both. With ``GMLX_ATTENTION_WIDE_SHAPES=1`` the load first times it at several launch
shapes (fewer warps a block, more keys in flight a warp: :func:`wide_shapes`) and keeps
the fastest; on an H100 none beat its own shape (12-07), so that is off by default.

Unless ``GMLX_ROPE_ATTENTION=0`` (:func:`folded_rope`) the kernel also takes the layer's
rope: handed the step's queries and key as the projections made them, each stream's
position and the rope's inverse frequencies, it rotates them as it reads them (the key
also as it writes it into the cache), in float32, rounded as MLX's rope rounds: two of
MLX's operations a layer fewer (64 of an 8B's ~370 a step), in a step whose host hands
MLX each operation and whose GPU runs each as a launch of its own. The load checks each
folded rope against the layer's own and MLX's attention
(:func:`cached_attention_load.check_folds`). With ``GMLX_ROPE_LANES=1`` a key-a-warp form
(wide or not) has each lane rotate its own dimensions in registers, not the block
through shared memory behind a barrier (:func:`rope_lanes_enabled`; on the H100, 12-07,
the rope through shared memory cost the wide form ~4 us a call); off until a GPU times it.

Used only where built (CUDA), where the step allows it (:func:`supports_cached`) and
``GMLX_CACHE_ATTENTION`` is not ``0`` (:func:`cached_enabled`). Its CUDA sources are
:mod:`cached_attention_source`'s. The tests run them
on the CPU (each block as host threads, shuffles and barriers emulated) against MLX's
attention, and compile it for sm_90 with nvcc as MLX wraps it.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from gmlx.engine.kernels import attention_cuda, cuda_source
from gmlx.engine.kernels.cached_attention_source import FINISH_ONE, FINISH_SPLIT, body, unroll
from gmlx.engine.kernels.cuda_source import build, cuda_type

TARGET_BLOCKS = 264  # about two blocks an SM on the H100 and H200 (132 SMs)
MIN_KEYS = 32  # the fewest positions of the capacity a split is made for
SHARED_BYTES = 48 * 1024  # a block's static shared memory at most
LAYOUTS = ("warp", "lane")  # a key a warp, a key a lane (cached_attention_source.body)
# One stream's whole form, where the load measured it faster (:func:`wide_threads`): a key a
# warp, a query head a block (the head split whole), many warps a block
WIDE = "wide"
FOLD_ENV = "GMLX_ROPE_ATTENTION"
ROPES = ("half", "pairs")  # a folded rope's pairs: (i, i + D/2), traditional (2i, 2i + 1)
# Positions of the capacity from which a split pays, where the load has not measured it
# (:func:`cached_attention_load.tune_splits`): on the H200 (12-06, timed in a chain of calls, as a step's layers
# run) one stream of an 8B (8 blocks) split won from 1,024-2,048 positions (2,048: 45.5
# against 86.1 us whole; 8,192: 69.5 against 309) and a 1.5B's (2 blocks) from 1,024; 8
# streams of an 8B at 8,000 keys split 195 against 328 whole, 32 streams at 2,100 (256
# blocks, a wave of the SMs filled) lost 138 against 127.
SPLIT_KEYS = 1024
_split_keys: dict[tuple, int] = {}  # the load's measure (cached_attention_load.tune_splits): capacity, per (heads, kv heads, head size, dtype)
_layouts: dict[tuple, tuple[str, str]] = {}  # likewise: the whole form's layout and the split form's
_hsplits: dict[tuple, tuple[int, int]] = {}  # likewise: the whole form's blocks a key-value head and the split form's
_lane_agrees: dict[tuple, bool] = {}  # whether the lane form agreed with MLX at the load's check (cached_attention_load)
_wide_agrees: dict[tuple, bool] = {}  # likewise the wide form
_wide: dict[tuple, bool] = {}  # the load's measure: whether one stream's whole form takes WIDE
# likewise, with GMLX_ATTENTION_WIDE_SHAPES=1: the wide form's (warps a block, keys in flight a warp)
_wide_shapes: dict[tuple, tuple[int, int]] = {}
WIDE_SHAPES_ENV = "GMLX_ATTENTION_WIDE_SHAPES"
ROPE_LANES_ENV = "GMLX_ROPE_LANES"


def cached_enabled() -> bool:
    """Whether one-token steps over a batch cache take :func:`attend_cached`: on CUDA with
    ``GMLX_CACHE_ATTENTION`` not ``0`` (on by default since the whole step it makes
    possible measured faster served, 12-05)."""
    return os.environ.get("GMLX_CACHE_ATTENTION", "1") != "0" and cuda_source.available()


def wide_enabled() -> bool:
    """Whether the load checks and times the wide form (:data:`WIDE`) for one stream's
    whole form (``GMLX_ATTENTION_WIDE=0``: never, for a comparison with it)."""
    return os.environ.get("GMLX_ATTENTION_WIDE", "1") != "0"


def fold_enabled() -> bool:
    """Whether layers whose attention writes the cache in place also take their rope in it
    (by default; ``GMLX_ROPE_ATTENTION=0``: never). It takes two of MLX's ropes a layer
    from the step, and where a one-stream step is paced by its host handing over each
    kernel, each kernel fewer is host time saved (12-06 evening, H100: with the q-k-v
    product and the norm folded into it, one stream served 279-282 tok/s against 230-238)."""
    return os.environ.get(FOLD_ENV, "1") != "0"


def head_dim(attention: Any) -> int | None:
    """An attention layer's head size: its own ``head_dim``, else its query projection's
    outputs over its heads (qwen2's layers keep no ``head_dim``: before this, their
    in-place attention was never compiled, checked or timed at the load, and their
    steps never traced whole), else None."""
    d = getattr(attention, "head_dim", None)
    if d is None and "q_proj" in attention and hasattr(attention, "n_heads"):
        d = attention.q_proj.weight.shape[0] // attention.n_heads
    return d


def folded_rope(attention: Any) -> tuple[Any, str] | None:
    """``(inverse frequencies, pairs)`` for one of :mod:`one_token`'s attention layers whose
    rope the in-place kernel can take (:func:`rope_cuda.rotation_applies`' ropes over the
    whole head, no per-head norm before it: qwen3's keep theirs; the rotated queries' room
    in the kernel's shared memory, :func:`fits`), else None."""
    import mlx.core as mx

    from gmlx.engine.kernels import rope_cuda

    group = attention.n_heads // attention.n_kv_heads
    if ("q_norm" in attention or not rope_cuda.rotation_applies(attention)
            or not all(fits(group, head_dim(attention) or 0, layout, rope=True) for layout in LAYOUTS)):
        return None
    inv, traditional = rope_cuda.inverse_frequencies(attention.rope, attention.rope.dims)
    mx.eval(inv)  # once here, not in the first step's graph
    return inv, ROPES[1] if traditional else ROPES[0]


def supports_cached(q: Any, k_new: Any, v_new: Any, keys: Any, values: Any, mask: Any, length: int) -> bool:
    """Whether a one-token step's attention may take :func:`attend_cached`: what
    :func:`attention_cuda.supports` asks of the queries and the cache's arrays, the step's new keys and
    values one position each, and no mask but the batch's padding (none, or a boolean
    one over all ``length`` keys so far, the step's own included: a shorter one is a
    window the kernel would not apply)."""
    import mlx.core as mx

    if q.ndim != 4 or keys.ndim != 4 or q.shape[2] != 1:
        return False
    b, heads, _, d = q.shape
    shape = (b, keys.shape[1], 1, d)
    return (q.dtype in (mx.float16, mx.bfloat16) and d in attention_cuda.HEAD_DIMS and keys.shape[0] == b
            and keys.shape[3] == d and values.shape == keys.shape and heads % keys.shape[1] == 0
            and fits(heads // keys.shape[1], d)
            and all(a.dtype == q.dtype for a in (k_new, v_new, keys, values))
            and k_new.shape == shape and v_new.shape == shape
            and (mask is None or (isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim == 4
                                  and mask.shape == (b, 1, 1, length))))


@cache
def _kernel(dtype: Any, head_dim: int, scale: float, group: int, split: bool = False, layout: str = "warp",
            hsplit: int = 1, rope: str = "", in_flight: int = 0, dense: bool = False, warps: int = 0,
            rope_lanes: bool = False) -> Any:
    """The kernel whole (a block a stream's key-value head) or ``split`` (a block its
    share of the keys, for the combine), a key a warp or a key a lane (``layout``), each
    block ``group // hsplit`` of the key-value head's ``group`` query heads (the head
    split, :func:`hsplits`), the step's query and key rotated in it where ``rope`` names
    the pairs (:data:`ROPES`; two more inputs, each stream's position and the inverse
    frequencies), ``in_flight`` keys' loads in flight a warp (0: the layout's own,
    :func:`cached_attention_source.unroll`), built for ``dense`` rows alone or for any
    strides: four kernels a head split, rope, unroll and build per float type, head size,
    scale and group, whatever the cache's length. ``layout`` :data:`WIDE`: a key a warp in
    blocks of :func:`wide_threads`, or of ``warps`` warps where given (``hsplit`` then the
    whole group: a query head a block). ``rope_lanes``: a key a warp (or wide) with the
    rope, each lane rotating its own dimensions (:data:`cached_attention_rope.STEP_ROPE_LANES`)."""
    head = (attention_cuda.kernel_head(dtype, head_dim, scale, block_threads(layout, head_dim, warps))
            + f"constexpr int GROUP = {group // hsplit}; constexpr int HSPLIT = {hsplit}; "
            + f"constexpr int UNROLL = {unroll(layout, head_dim, in_flight)}; "
            + f"constexpr bool DENSE = {'true' if dense else 'false'};\n"
            + (f"constexpr bool TRAD = {'true' if rope == 'pairs' else 'false'};\n" if rope else "")
            + (FINISH_SPLIT if split else FINISH_ONE))
    name = (f"gmlx_attend_cached_{cuda_type(dtype).strip('_')}_{head_dim}_g{group}"
            f"{f'_h{hsplit}' if hsplit > 1 else ''}{f'_{layout}' if layout != 'warp' else ''}{'_split' if split else ''}"
            f"{f'_rope_{rope}' if rope else ''}{f'_u{in_flight}' if in_flight else ''}{'_dense' if dense else ''}"
            f"{f'_w{warps}' if warps else ''}{'_rl' if rope_lanes else ''}")
    return build(name, head, body("warp" if layout == WIDE else layout, bool(rope), rope_lanes),
                 ["q", "k_new", "v_new", "k", "v", "padding", "position", *(("rope_off", "rope_inv") if rope else ())],
                 outputs=("pacc", "pm", "pl") if split else ("out",), ensure_row_contiguous=False)


def compact() -> tuple[int, bool]:
    """The kernel's build (``(keys in flight, dense rows alone)``): by default ``(0,
    True)``, each layout's own unroll, built for dense rows alone (gmlx's caches: each
    row's dimensions adjacent, rows 16-byte aligned; a strided cache gets NaN and nothing
    written, and the load's check against MLX, run on the caches the server makes, would
    fail and keep MLX's attention). ``GMLX_ATTENTION_DENSE=0`` also builds the strided
    path; ``GMLX_ATTENTION_IN_FLIGHT=N`` sets the keys a warp has in flight (a key a lane:
    rows of values). Why dense by default: on the H100 (12-06 midday, chained, the 8B's
    heads, one stream) the dense builds took 18.7 against 22.8 us a key a lane at 38 keys
    and 44.4 against 51.6 at 1,000, a key a warp 73.3 against 94.1 at 1,000 (and the same
    at 38); fewer keys in flight was slower but a key a warp at 38 keys, so that stays
    each layout's own."""
    return (int(os.environ.get("GMLX_ATTENTION_IN_FLIGHT", "0") or 0),
            os.environ.get("GMLX_ATTENTION_DENSE", "1") != "0")


def wide_threads(d: int) -> int:
    """The wide form's block (:data:`WIDE`): 32 warps for heads of up to 128, 16 for heads
    of 256, each warp a key in flight (nvcc 13 for sm_90: 56 registers a thread for heads
    of 128, within the 64 a block of 1,024 threads leaves; 78 for heads of 256).

    Why: one stream's whole form is a block a key-value head, 8 blocks of 8 warps for an
    8B, each warp walking its keys for the group's four query heads; ncu on the H100
    (12-06 midday, 38 keys) found each block ~17,000 cycles long on 8 of the 132 SMs, a
    warp issuing an instruction every 10.5 cycles, 0.9% of the SMs' throughput: a latency
    chain. MLX's one-query kernel, a block of 32 warps a query head (each key read once a
    query head), took 13.4 us a call in a chain at 38 keys and 26.8 at 1,000, against the
    in-place kernel's 18.7 and 44.4 (dense, a key a lane). This form is that shape with
    the in-place write: a query head a block, its warps each a key at a time, so a short
    cache's keys are one or two a warp and a long one's spread over 32 blocks x 32 warps."""
    return 1024 if d <= 128 else 512


def rope_lanes_enabled() -> bool:
    """Whether a key-a-warp form (wide or not) with the rope folded in has each lane rotate
    its own dimensions, in registers, not the block through shared memory behind a barrier
    (``GMLX_ROPE_LANES=1``; :data:`cached_attention_rope.STEP_ROPE_LANES` says why). The
    same arithmetic; off until a GPU times it (``gmlx-ropelanes``)."""
    return os.environ.get(ROPE_LANES_ENV, "0") == "1"


def wide_shapes_enabled() -> bool:
    """Whether the load times the wide form at several launch shapes (:func:`wide_shapes`)
    and keeps the fastest (``GMLX_ATTENTION_WIDE_SHAPES=1``; else its one shape,
    :func:`wide_threads` with a key in flight a warp)."""
    return os.environ.get(WIDE_SHAPES_ENV, "0") == "1"


def wide_shapes(d: int) -> tuple[tuple[int, int], ...]:
    """The wide form's launch shapes the load times with :func:`wide_shapes_enabled`:
    ``(warps a block, keys in flight a warp)``, its one shape first. Each within a
    block's 65,536 registers (nvcc 13, sm_90, the rope folded in, float16 and bfloat16:
    heads of 128 take 56 registers a thread at 32 warps and 1-2 keys in flight, 71-72 at
    16 warps and 4, 108-109 at 8; heads of 256 61-64 at 16 warps and 1, 88-89 at 2, 119
    at 8 warps and 4).

    Why: at one stream over a short cache the wide form is latency, not bytes (12.3-12.5
    us a layer on the H100 at ~130-260 positions for ~0.5 MB of keys and values): each
    of its 32 warps walks its keys one load at a time, so 256 positions are eight
    round trips to memory a warp. Fewer warps a block with more keys in flight each
    would have the same keys in two or three. Measured (H100, 12-07, the 8B's heads, one
    stream, chained): they do not pay. At 1,000 keys its own shape took 25.1 us against
    29.1-58.4 (the fewer the warps, the slower); at 38 keys all were within the clock's
    noise. More warps beat more loads in flight a warp, so it stays off by default."""
    if d <= 128:
        return (wide_threads(d) // 32, 1), (32, 2), (16, 4), (16, 8), (8, 8)
    return (wide_threads(d) // 32, 1), (16, 2), (8, 4)


def block_threads(layout: str, d: int, warps: int = 0) -> int:
    """A block's threads in ``layout``: ``warps`` warps in the wide form where given, else
    :func:`wide_threads` there, else the one-query kernels' own."""
    if layout == WIDE:
        return 32 * warps or wide_threads(d)
    return attention_cuda.THREADS


def fits(group: int, d: int, layout: str = "warp", rope: bool = False) -> bool:
    """Whether the kernel in ``layout`` is built for ``group`` query heads a key-value
    head of size ``d``: its shared memory (the warps' shares of every head's output,
    maximum and total; a key a lane, also the group's queries, a tile's weights a warp
    and the step's key and value; with the ``rope`` folded in, the rotated queries and
    key) within :data:`SHARED_BYTES`."""
    warps = block_threads(layout, d) // 32
    group = 1 if layout == WIDE else group  # (a query head a block)
    floats = warps * group * d + 2 * warps * group + (group * d + warps * 32 * group + d if layout == "lane" else 0)
    floats += group * d + d // 2 if rope else 0  # (halves of the key: d / 2 floats' room)
    return 4 * floats <= SHARED_BYTES  # (the lane form's key and value of the step: 2 x d halves, d floats)


def _head_split() -> bool:
    """Whether the load times and takes a head split (``GMLX_HEAD_SPLIT=1``; else one
    block a key-value head: on the H100 it moved a call by under 5% at short caches, and
    the one lease that served it served one stream slower, with other changes beside it)."""
    return os.environ.get("GMLX_HEAD_SPLIT", "0") == "1"


def hsplits(group: int) -> tuple[int, ...]:
    """The head splits a key-value head of ``group`` query heads may take: the blocks it
    is shared between, each an equal part of the group (the divisors of ``group``)."""
    return tuple(h for h in range(1, group + 1) if group % h == 0)


def splits(blocks: int, capacity: int, split_keys: int = SPLIT_KEYS) -> int:
    """Blocks each of ``blocks`` (streams x key-value heads x blocks a key-value head,
    :func:`hsplits`) is split into over a cache of ``capacity`` positions: one (the whole
    form, one launch) under ``split_keys`` positions, or where the batch's blocks already
    fill a wave of the GPU (over half ``TARGET_BLOCKS``: :func:`attend_cached` asks with
    the whole form's blocks, then counts the split form's own toward the target, where
    they differ); else toward ``TARGET_BLOCKS`` in all, a split for every
    ``MIN_KEYS`` positions at most. ``split_keys=0`` forces the split wherever the target
    leaves room (the load's check and timing). The keys so far are shared evenly between
    the splits (in the kernel, from the write position), so a short cache in a large
    capacity still gives every block some. A block streams a head's keys at a few tens
    of GB/s, so one block a head over a long cache leaves most of the GPU idle (8 blocks
    at one stream of an 8B: ~310 us a layer at 7,800 positions on the H100), but a split
    costs a second launch and its shares' round trip, which a short cache, or a wide
    batch whose blocks already fill the GPU, does not earn back (:data:`SPLIT_KEYS`)."""
    blocks = max(blocks, 1)
    if capacity < split_keys or (split_keys and 2 * blocks > TARGET_BLOCKS):
        return 1
    return max(1, min(-(-TARGET_BLOCKS // blocks), capacity // MIN_KEYS))


def _shape(q: Any, keys: Any) -> tuple:
    return q.shape[1], keys.shape[1], q.shape[3], str(q.dtype)


def attend_cached(q: Any, k_new: Any, v_new: Any, keys: Any, values: Any, padding: Any, position: Any,
                  scale: float, n: int | None = None, layout: str | None = None, hsplit: int | None = None,
                  rope: tuple[Any, Any, str] | None = None, in_flight: int | None = None,
                  dense: bool | None = None, warps: int | None = None, rope_lanes: bool | None = None) -> Any:
    """A one-token step's attention over a batch cache in one launch: ``k_new`` and
    ``v_new`` (``(B, Hkv, 1, D)``) written **in place** into the cache's ``keys`` and
    ``values`` (``(B, Hkv, capacity, D)``) at ``position`` (an ``int32`` array of one: the
    cache's write position, the same for every stream), and ``softmax(q k^T * scale) v``
    over each stream's keys from its ``padding`` (``(B,)``) to that position ->
    ``(B, 1, H * D)``, shaped for the output projection. Over a long cache the keys are
    split over several blocks a key-value head (:func:`splits`, from the load's measure
    for this shape where it took one) and a second launch combines their shares;
    ``n`` sets the splits instead (1: whole). A key a warp, or a key a lane where the
    load measured that form faster for this shape (whole and split apart), and one
    stream's whole form :data:`WIDE` where the load measured that faster; ``layout``
    sets it instead. Each key-value head's query heads in one block, or shared between
    ``hsplit`` blocks (:func:`hsplits`; None: at one stream as the load measured for this
    shape and form, else one). With ``rope`` (each stream's position, an ``int32``
    ``(B,)``; the inverse frequencies, float32 ``(D/2,)``; the pairs, one of
    :data:`ROPES`), ``q`` and ``k_new`` are the projections unrotated and the kernel
    rotates them (:func:`folded_rope`), the cache taking the rotated key. ``in_flight``
    (the kernel's keys in flight a warp; 0: its layout's own) and ``dense`` (a build for
    dense rows alone) where None, as :func:`compact` says; the wide form in the launch
    shape the load took for it (:func:`wide_shapes`), else ``warps`` warps a block
    where given, else :func:`wide_threads`; ``rope_lanes`` (a key a warp, the rope
    folded in: each lane rotating its own dimensions) where None as
    :func:`rope_lanes_enabled` says.

    Where mlx-lm's cache takes four operations and a view each for the same (two slice
    updates, two views of the keys so far, the attention, its reshape): each operation
    handed to MLX costs the host several microseconds, and a one-stream step on a GPU is
    bound by the host. MLX does not see the write: the caller keeps the cache's arrays
    its own and the positions up to the write unchanged (:meth:`prompt_cache.
    _AlignedBatchKVCache.write_and_attend`)."""
    b, heads, _, d = q.shape
    kv_heads = keys.shape[1]
    shape = _shape(q, keys)
    # the load's head split at one stream alone, where it timed it: 8 streams lost at every short cache
    chosen = (hsplit, hsplit) if hsplit else _hsplits.get(shape, (1, 1)) if b == 1 and _head_split() else (1, 1)
    if n is None:  # whole where the whole form's blocks fill a wave; split, toward the target in the split form's
        n = splits(b * kv_heads * chosen[0], keys.shape[2], _split_keys.get(shape, SPLIT_KEYS))
        n = splits(b * kv_heads * chosen[1], keys.shape[2], 0) if n > 1 else 1
    if layout is None:  # one stream's whole form wide where the load measured it faster
        layout = WIDE if b == 1 and n == 1 and _wide.get(shape) else _layouts.get(shape, ("warp", "warp"))[n > 1]
    if layout == WIDE and n > 1:
        raise ValueError("the wide form of the in-place attention is whole only")
    hsplit = heads // kv_heads if layout == WIDE else chosen[n > 1]
    if (heads // kv_heads) % hsplit:
        raise ValueError(f"a head split of {hsplit} for {heads // kv_heads} query heads a key-value head")
    pairs = rope[2] if rope else ""
    default_in_flight, default_dense = compact()
    if layout == WIDE and warps is None and (taken := _wide_shapes.get(shape)) and wide_shapes_enabled():
        warps, in_flight = taken[0], taken[1] if in_flight is None else in_flight
    in_flight = default_in_flight if in_flight is None else in_flight
    dense = default_dense if dense is None else dense
    shaped = {"warps": warps} if layout == WIDE and warps else {}
    lanes = rope_lanes_enabled() if rope_lanes is None else rope_lanes
    options = shaped | ({"rope_lanes": True} if pairs and layout != "lane" and lanes else {})
    return attention_cuda.in_blocks(lambda split: _kernel(q.dtype, d, float(scale), heads // kv_heads, split, layout,
                                                          hsplit, pairs, in_flight, dense, **options),
                                    [q, k_new, v_new, keys, values, padding, position, *(rope[:2] if rope else ())],
                                    q, n, b * kv_heads * hsplit, (b, 1, heads * d),
                                    block_threads(layout, d, shaped.get("warps", 0)))
