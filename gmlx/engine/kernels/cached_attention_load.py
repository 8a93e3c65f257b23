"""The in-place one-token attention at a model's load (:mod:`cached_attention_cuda` is
the kernel, its launch and the policy it follows): every form compiled and checked
against MLX's attention before the model reports ready (:func:`compile_cached`), each
rope folded into it checked likewise (:func:`check_folds`), and, on this GPU, which
layout, head split and split threshold each attention shape takes (:func:`tune_splits`:
what :func:`cached_attention_cuda.attend_cached` then reads)."""

from __future__ import annotations

import logging
from typing import Any

from gmlx.engine.kernels import attention_cuda
from gmlx.engine.kernels import cached_attention_cuda as cac

log = logging.getLogger(__name__)

TUNE_CAPACITIES = (256, 512, 1024, 2048, 4096, 8192, 16384)  # one stream's cache lengths the load times both forms at
# The cache length at which the load times the whole form's head splits: where they pay
# (the H100, 12-06: within 3% of each other at 38-256 keys, 10% apart at 1,000), below the
# split threshold (1,024-2,048 positions), so the whole form still runs there.
HSPLIT_CAPACITY = 1024
# The cache lengths at which the load times one stream's whole form against the wide one
# (cached_attention_cuda.wide_threads): a short conversation's and a longer one's; the wide
# form is taken where it won at both.
WIDE_CAPACITIES = (256, 1024)


def compile_cached(model: Any) -> int:
    """Run :func:`cached_attention_cuda.attend_cached` whole, split and with a head split, in both layouts, for
    every distinct attention shape among ``model``'s layers that write in place
    (one_token's ``_in_place``), so the kernels and the combine are compiled before the model reports
    ready (a cache reaches the split form only once it has grown, inside some later
    request), each call checked against MLX's attention (:func:`_check`). Returns how
    many shapes; raises RuntimeError where a key-a-warp kernel does not compile, launch
    or agree. A key-a-lane kernel that does not is only never used (logged)."""
    shapes = _in_place_shapes(model)
    for shape in _supported(shapes):
        compile_shape(*shape)
    check_folds(model)
    return len(shapes)


def check_folds(model: Any) -> int:
    """Each distinct rope ``model``'s in-place layers fold into the kernel (``_fold``),
    run whole and split in each layout the load may take, against the layer's own rope
    and MLX's attention (:func:`_check`); where one does not compile, launch or agree,
    its layers keep MLX's rope (logged): a wrong kernel must not serve a token. Returns
    how many ropes were checked."""
    import mlx.core as mx

    folds: dict[tuple, list[Any]] = {}
    for _, m in model.named_modules():
        if getattr(m, "_fold", None) is not None and (shape := _shape(m)) is not None:
            inv, pairs = m._fold
            folds.setdefault((*shape[:4], str(shape[4]), pairs, tuple(inv.tolist())), []).append((m, shape))
    for layers in folds.values():
        m, shape = layers[0]
        if shape not in _supported({shape}):
            continue
        key = (*shape[:3], str(shape[4]))
        layouts = ("warp", "lane") if cac._lane_agrees.get(key, False) else ("warp",)
        checks = [(form, layout) for layout in layouts for form in _whole_and_split(shape[1])]
        checks += [(_whole_and_split(shape[1])[0], cac.WIDE)] if cac._wide_agrees.get(key, False) else []
        try:
            for form, layout in checks:
                _check(*shape, *form, layout, rope=(m.rope, *m._fold))
        except Exception as error:  # noqa: BLE001 - a kernel MLX refused, or one that disagreed
            log.warning("cuda: the in-place attention does not take the rope (%d layers keep their own): %s",
                        len(layers), str(error).splitlines()[0][:200])
            for layer, _ in layers:
                object.__setattr__(layer, "_fold", None)
        else:
            log.info("cuda: the in-place attention takes the rope of %d layer(s) (%s pairs)", len(layers), m._fold[1])
    mx.clear_cache()
    return len(folds)


def compile_shape(heads: int, kv_heads: int, d: int, scale: float, dtype: Any) -> None:
    """:func:`compile_cached` for one attention shape: whole, split and whole with the
    largest head split (where the group has more than one head), a key a warp
    (RuntimeError where any does not compile, launch or agree), then a key a lane where it
    fits (:func:`cached_attention_cuda.fits`), and the wide form whole
    (:data:`cached_attention_cuda.WIDE`), whose failures only keep them from being used (logged)."""
    # one block a head, then split, then the group's heads a block each (the load times it)
    forms = _whole_and_split(kv_heads)
    forms += [(cac.MIN_KEYS, 1, h) for h in cac.hsplits(heads // kv_heads)[-1:] if h > 1]
    for form in forms:
        _check(heads, kv_heads, d, scale, dtype, *form)
    key = (heads, kv_heads, d, str(dtype))
    cac._lane_agrees[key] = False
    if cac.fits(heads // kv_heads, d, "lane"):
        try:
            for form in forms:
                _check(heads, kv_heads, d, scale, dtype, *form, "lane")
            cac._lane_agrees[key] = True
        except RuntimeError as error:
            log.warning("cuda: the in-place attention's key-a-lane form is not used: %s",
                        str(error).splitlines()[0][:200])
    cac._wide_agrees[key] = False
    if cac.wide_enabled() and cac.fits(heads // kv_heads, d, cac.WIDE):  # one stream's whole form (tune_split times it)
        try:
            for capacity in (cac.MIN_KEYS, 16 * cac.MIN_KEYS):  # warps with no key, and several keys a warp
                _check(heads, kv_heads, d, scale, dtype, capacity, 1, 1, cac.WIDE)
            cac._wide_agrees[key] = True
        except RuntimeError as error:
            log.warning("cuda: the in-place attention's wide form is not used: %s", str(error).splitlines()[0][:200])


def _whole_and_split(kv_heads: int) -> list[tuple[int, int, int]]:
    """The forms a load checks each build in: ``(capacity, splits, head split)`` whole over a
    short cache, then split over a longer one (two streams of ``kv_heads``)."""
    return [(cac.MIN_KEYS, 1, 1), (16 * cac.MIN_KEYS, cac.splits(2 * kv_heads, 16 * cac.MIN_KEYS, 0), 1)]


def _shape(m: Any) -> tuple | None:
    """A module's attention shape if it writes in place: (query heads, key-value heads,
    head size, scale, dtype), else None."""
    if not getattr(m, "_in_place", False) or not all(hasattr(m, a) for a in ("n_heads", "n_kv_heads", "scale")):
        return None
    if not (d := cac.head_dim(m)):
        return None
    proj = m.o_proj
    dtype = proj.scales.dtype if "scales" in proj else proj.weight.dtype
    return m.n_heads, m.n_kv_heads, d, float(m.scale), dtype


def _in_place_shapes(model: Any) -> set[tuple]:
    """The distinct attention shapes among ``model``'s layers that write in place (:func:`_shape`)."""
    return {shape for _, m in model.named_modules() if (shape := _shape(m)) is not None}


def _supported(shapes: set[tuple]) -> list[tuple]:
    """Those of ``shapes`` the kernel is built for (float16 or bfloat16, a head size of
    :data:`attention_cuda.HEAD_DIMS`, a group that :func:`cached_attention_cuda.fits`), in a fixed order: no
    other reaches it (:func:`supports_cached`)."""
    import mlx.core as mx

    return sorted((s for s in shapes if s[4] in (mx.float16, mx.bfloat16) and s[2] in attention_cuda.HEAD_DIMS
                   and cac.fits(s[0] // s[1], s[2])), key=str)


def tune_splits(model: Any) -> list[str]:
    """Where a split starts to pay for each of ``model``'s in-place attention shapes on this
    GPU (:func:`tune_split`). Where a wide form took a launch shape of its own
    (:func:`_tune_wide_shape`), each rope folded into it is checked again in that shape
    (:func:`check_folds`). Returns one line a shape for the load's log."""
    shapes = _supported(_in_place_shapes(model))
    lines = [tune_split(heads, kv_heads, d, scale, dtype) for heads, kv_heads, d, scale, dtype in shapes]
    if any((heads, kv_heads, d, str(dtype)) in cac._wide_shapes for heads, kv_heads, d, _, dtype in shapes):
        check_folds(model)
    return lines


def tune_split(heads: int, kv_heads: int, d: int, scale: float, dtype: Any) -> str:
    """How one attention shape runs on this GPU, timed on one stream's calls
    (:func:`_call_time`, each pair in the order a, b, b, a, so a drifting clock favours
    neither): where the lane form agreed at the load's check (:func:`compile_cached`),
    which layout the whole form takes (at 1,024 positions) and which the split form (at
    the longest of :data:`TUNE_CAPACITIES`); where the group has more than one query head,
    how many blocks the whole form shares each key-value head's between (each of
    :func:`cached_attention_cuda.hsplits`, at :data:`HSPLIT_CAPACITY` positions, in its layout; the split form
    keeps one); where the wide form agreed, whether one stream's whole form takes it (faster
    at each of :data:`WIDE_CAPACITIES`); then, with those, whole against split at each
    of :data:`TUNE_CAPACITIES`, and the smallest capacity from which the split form won at
    every capacity timed becomes the shape's split threshold (:func:`cached_attention_cuda.splits`; none:
    twice the largest timed). Kept for the process (the decision is the GPU's and the
    shape's, not a model's). Returns what it timed and took, in a line."""
    import mlx.core as mx

    def call(capacity: int) -> tuple:
        keys = mx.random.split(mx.random.key(capacity), 5)
        q = mx.random.normal((1, heads, 1, d), key=keys[0]).astype(dtype)
        k_new, v_new = (mx.random.normal((1, kv_heads, 1, d), key=keys[i]).astype(dtype) for i in (1, 2))
        k, v = (mx.random.normal((1, kv_heads, capacity, d), key=keys[i]).astype(dtype) for i in (3, 4))
        args = (q, k_new, v_new, k, v, mx.zeros((1,), mx.int32), mx.array([capacity - 1], mx.int32), scale)
        mx.eval(*args[:-1])
        return args

    def pair(args: tuple, *forms: tuple) -> list[float]:
        """Each of ``forms``' seconds a call, timed in their order, then back (a, b, b, a)."""
        if len(set(forms)) == 1:  # no split at this length: nothing to compare
            return [_call_time(args, *forms[0])] * len(forms)
        times = dict.fromkeys(forms, 0.0)
        for each in (*forms, *reversed(forms)):
            times[each] += _call_time(args, *each)
        return [times[form] / 2 for form in forms]

    key = (heads, kv_heads, d, str(dtype))
    for chosen_before in (cac._layouts, cac._hsplits, cac._wide, cac._wide_shapes):
        chosen_before.pop(key, None)
    said = []
    if cac._lane_agrees.get(key, False):
        chosen = []
        for capacity in (1024, TUNE_CAPACITIES[-1]):
            n = 1 if capacity == 1024 else cac.splits(kv_heads, capacity, 0)
            warp, lane = pair(call(capacity), (n, "warp", 1), (n, "lane", 1))
            chosen.append("lane" if lane < warp else "warp")
            said.append(f"{'whole' if n == 1 else 'split'} form a key a {chosen[-1]} "
                        f"({capacity:,}: {warp * 1e6:.1f} warp / {lane * 1e6:.1f} lane us)")
        cac._layouts[key] = (chosen[0], chosen[1])
    if cac._head_split() and len(options := cac.hsplits(heads // kv_heads)) > 1:  # the whole form in its layout, its group split or not
        took = pair(call(HSPLIT_CAPACITY), *((1, None, h) for h in options))
        best = options[took.index(min(took))]
        cac._hsplits[key] = (best, 1)
        said.append(f"whole form {best} block{'s' if best > 1 else ''} a key-value head ({HSPLIT_CAPACITY:,}: "
                    + " / ".join(f"{t * 1e6:.1f}" for t in took) + f" us at {' / '.join(map(str, options))})")
    if cac._wide_agrees.get(key, False) and cac.wide_shapes_enabled():  # the wide form's launch shape first
        said.append(_tune_wide_shape(heads, kv_heads, d, scale, dtype, [call(c) for c in WIDE_CAPACITIES]))
    if cac._wide_agrees.get(key, False):  # one stream's whole form as chosen so far, or wide
        took = [pair(call(capacity), (1, None, None), (1, cac.WIDE, None)) for capacity in WIDE_CAPACITIES]
        cac._wide[key] = all(wide < chosen for chosen, wide in took)
        said.append(f"one stream's whole form {'wide' if cac._wide[key] else 'as above'} ("
                    + ", ".join(f"{c:,}: {t[0] * 1e6:.1f} / {t[1] * 1e6:.1f} wide us"
                                for c, t in zip(WIDE_CAPACITIES, took, strict=True)) + ")")
    timed = []
    for capacity in TUNE_CAPACITIES:
        n = cac.splits(kv_heads, capacity, 0)
        whole, split = pair(call(capacity), (1, None, None), (n, None, None))
        timed.append((capacity, whole, split))
    from_ = 2 * TUNE_CAPACITIES[-1]
    for capacity, whole, split in reversed(timed):
        if split >= whole:
            break
        from_ = capacity
    cac._split_keys[key] = from_
    said.append(f"split from {from_:,} positions at one stream ("
                + ", ".join(f"{c:,}: {w * 1e6:.1f} whole / {s * 1e6:.1f} split us" for c, w, s in timed) + ")")
    return f"{heads} heads over {kv_heads}, head size {d}: " + "; ".join(said)


def _tune_wide_shape(heads: int, kv_heads: int, d: int, scale: float, dtype: Any, calls: list[tuple]) -> str:
    """The wide form's launch shape for one attention shape (:func:`cached_attention_cuda.wide_shapes`):
    each shape that launches here and agrees with MLX (:func:`_check`: one whose registers a
    block cannot hold fails its launch) timed over ``calls`` (one stream's, at each of
    :data:`WIDE_CAPACITIES`), in the order a, b, ..., b, a, and the least total kept for
    :func:`cached_attention_cuda.attend_cached` (where it is not the form's own shape).
    Returns what it timed and took, for the load's line."""
    key = (heads, kv_heads, d, str(dtype))
    shapes = [cac.wide_shapes(d)[0]]
    for warps, in_flight in cac.wide_shapes(d)[1:]:
        try:
            for capacity in (cac.MIN_KEYS, 16 * cac.MIN_KEYS):
                _check(heads, kv_heads, d, scale, dtype, capacity, 1, 1, cac.WIDE, warps=warps, in_flight=in_flight)
            shapes.append((warps, in_flight))
        except RuntimeError as error:
            log.warning("cuda: the in-place attention's wide form is not used at %d warps a block, %d keys in flight: "
                        "%s", warps, in_flight, str(error).splitlines()[0][:200])
    totals = dict.fromkeys(shapes, 0.0)
    for shape in (*shapes, *reversed(shapes)):
        totals[shape] += sum(_call_time(args, 1, cac.WIDE, None, warps=shape[0], in_flight=shape[1]) for args in calls)
    best = min(shapes, key=totals.__getitem__)
    if best != shapes[0]:  # (its own shape is the kernel built without these constants)
        cac._wide_shapes[key] = best
    return (f"the wide form {best[0]} warps a block, {best[1]} key(s) in flight ("
            + ", ".join(f"{w}x{u}: {totals[(w, u)] / 2 * 1e6:.1f}" for w, u in shapes)
            + f" us over {' + '.join(f'{c:,}' for c in WIDE_CAPACITIES)} positions)")


def _call_time(args: tuple, n: int, layout: str | None, hsplit: int | None = None, reps: int = 20,
               **shape: int) -> float:
    """Seconds a call of :func:`cached_attention_cuda.attend_cached` over ``args`` with ``n`` splits in
    ``layout`` and ``hsplit`` blocks a key-value head (None: the shape's), ``reps`` calls
    in a chain (each call's queries the last one's output: :func:`timing.chain_time`, as
    a step's layers follow each other; each writes the same position again); ``shape``:
    the wide form's ``warps`` and ``in_flight`` where given."""
    from gmlx.engine.kernels.timing import chain_time

    q, rest = args[0], args[1:]
    return chain_time(lambda x: cac.attend_cached(x, *rest, n=n, layout=layout, hsplit=hsplit, **shape).reshape(q.shape),
                      q, reps) / reps


def _check(heads: int, kv_heads: int, d: int, scale: float, dtype: Any, capacity: int, n: int, hsplit: int = 1,
           layout: str = "warp", rope: tuple | None = None, **shape: int) -> None:
    """One :func:`cached_attention_cuda.attend_cached` call with ``n`` splits and ``hsplit`` blocks a key-value
    head in ``layout`` on random inputs (two streams, the second padded) against MLX's
    attention over the same keys with the step's written at the middle position: RuntimeError where the output is off by more than 0.05 (bf16 rounding of
    these values is ~0.004) or the cache's arrays are not the old ones with that one
    position replaced. With ``rope`` (a layer's rope module, its inverse frequencies and
    pairs), the kernel rotates the queries and key, against that module's rotation. A
    wrong kernel must not serve a token."""
    import mlx.core as mx

    keys = mx.random.split(mx.random.key(capacity + heads + d), 5)
    at = capacity // 2
    q = mx.random.normal((2, heads, 1, d), key=keys[0]).astype(dtype)
    k_new, v_new = (mx.random.normal((2, kv_heads, 1, d), key=keys[i]).astype(dtype) for i in (1, 2))
    k, v = (mx.random.normal((2, kv_heads, capacity, d), key=keys[i]).astype(dtype) for i in (3, 4))
    padding = mx.array([0, 3], dtype=mx.int32)
    err, written = agreement(q, k_new, v_new, k, v, padding, at, scale, n, layout, hsplit, rope, **shape)
    if not (err <= 0.05 and written):
        raise RuntimeError(f"the in-place attention (a key a {layout}, {hsplit} block(s) a key-value head) disagrees "
                           f"with MLX's ({heads} heads over {kv_heads}, head size {d}, {capacity} positions: "
                           f"largest difference {err:.3g}"
                           f"{'' if written else ', the cache not written as it should be'})")


def agreement(q: Any, k_new: Any, v_new: Any, k: Any, v: Any, padding: Any, at: int, scale: float,
              n: int | None = None, layout: str | None = None, hsplit: int | None = None,
              rope: tuple | None = None, **shape: int) -> tuple[float, bool]:
    """One :func:`cached_attention_cuda.attend_cached` call writing at ``at`` (``n`` splits in ``layout``,
    ``hsplit`` blocks a key-value head: as it would be launched where None), against
    MLX's attention over the same keys with the step's written there (each stream's from
    its ``padding``): the largest difference, and whether the cache's arrays are then the
    old ones with that one position replaced, bit for bit. With ``rope`` (a rope module,
    its inverse frequencies and pairs: :func:`folded_rope`), the kernel is handed ``q``
    and ``k_new`` unrotated with each stream's position (``at`` less its padding) and
    rotates them, against the module's rotation; the written key may then differ from
    the module's in its last bits (the angles computed apart), within the same 0.05.
    ``shape``: the wide form's ``warps`` and ``in_flight`` where given."""
    import mlx.core as mx

    folded, raw_q, raw_k = None, q, k_new
    if rope is not None:
        module, inv, pairs = rope
        offset = (at - padding).astype(mx.int32)
        q, k_new = module(q, offset=offset), module(k_new, offset=offset)
        folded = (offset, inv, pairs)
    k_want, v_want = (mx.concatenate([a[..., :at, :], new, a[..., at + 1:, :]], axis=2)
                      for a, new in ((k, k_new), (v, v_new)))
    mask = (mx.arange(at + 1)[None] >= padding[:, None]).reshape(padding.shape[0], 1, 1, at + 1)
    want = mx.fast.scaled_dot_product_attention(q, k_want[..., :at + 1, :], v_want[..., :at + 1, :],
                                                scale=scale, mask=mask)
    mx.eval(q, k_new, v_new, k, v, padding, k_want, v_want, want, raw_q, raw_k)  # all before the kernel writes
    got = cac.attend_cached(raw_q, raw_k, v_new, k, v, padding, mx.array([at], dtype=mx.int32), scale, n=n,
                        layout=layout, hsplit=hsplit, rope=folded, **shape)
    mx.eval(got)
    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32).reshape(got.shape)).max().item()
    if folded is not None:  # the written key within the tolerance, the rest bit for bit
        err = max(err, mx.abs(k[..., at, :].astype(mx.float32) - k_new[..., 0, :].astype(mx.float32)).max().item())
        k, k_want = (mx.concatenate([a[..., :at, :], a[..., at + 1:, :]], axis=2) for a in (k, k_want))
    return err, mx.array_equal(k, k_want).item() and mx.array_equal(v, v_want).item()
