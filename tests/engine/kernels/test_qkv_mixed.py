"""The q-k-v product of two layouts with the norm folded in (``qkv_mixed``): its own
source run on the CPU (``emulation``: CUDA cannot run here) against MLX's norm and each
layer's product, as close to a float32 norm and product as MLX's are; and how a load
binds it (``qkv_cuda.fold_norms``), with MLX's operations standing in for the kernel."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from gmlx.engine.kernels import qgemv_q8, qkv_mixed, timing
from gmlx.engine.kernels.timing import agrees, exact_product
from tests.engine.kernels import emulation


def _made(dtype, layout, values_layout, config, sizes, values, eps, k: int = 0) -> dict:
    """What ``qkv_mixed`` hands ``mx.fast.cuda_kernel`` (``k``: the row's width, where a
    part may round x to bytes)."""
    made: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)
        qkv_mixed._kernel.cache_clear()
        try:
            warps, rpw, *rest = config
            qkv_mixed._kernel(dtype, layout, values_layout, warps, rpw, rest[1] if len(rest) > 1 else 1, sizes,
                              values, eps, k)
        finally:
            qkv_mixed._kernel.cache_clear()
    return made[0]


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
@pytest.mark.parametrize(("layout", "values_layout", "sizes", "values", "config", "q8"), [
    ((4, 32), (6, 32), (12, 4), 6, (4, 2), "0"),  # a Q4_K_M's: 4-bit queries and keys, 6-bit values
    ((4, 32), (8, 64), (10, 6), 9, (4, 4, 1, 2), "0"),  # two chunks a lane in flight; the values' part ends mid-block
    ((6, 32), (4, 32), (8, 8), 8, (8, 1), "0"),
    ((4, 32), (6, 32), (12, 4), 6, (4, 2), "all"),  # both parts round x to bytes (GMLX_Q8X=all)
    ((4, 32), (8, 64), (10, 6), 9, (4, 4), "all"),  # the 4-bit part rounds, the 8-bit values sum floats
])
def test_each_part_is_mlx_norm_then_its_layers_product(tmp_path, monkeypatch: pytest.MonkeyPatch, layout,
                                                       values_layout, sizes, values, config, q8: str) -> None:
    """Each part (and with ``GMLX_Q8X=all``, a part that rounds x to bytes, within
    :func:`qgemv_q8.tolerance`; the float sums still within MLX's 0.1%) as close to a
    float32 norm and product as MLX's norm and the layer's product are."""
    dtype, k, eps = mx.float16, 1088, 1e-5
    monkeypatch.setenv(qgemv_q8.ENV, q8)
    mx.random.seed(sum(sizes) + values)
    layers = [mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=g, bits=b)
              for n, (b, g) in ((sizes[0], layout), (sizes[1], layout), (values, values_layout))]
    h = (mx.random.normal((1, k)) * 5 - 1).astype(dtype)
    nw = (mx.random.uniform(shape=(k,)) + 0.5).astype(dtype)
    made = _made(dtype, layout, values_layout, config, sizes, values, eps, k)
    assert made["input_names"][-1] == "nw" and made["output_names"] == ["out", "out2", "out3"]
    assert (made["source"].count("__dp4a") > 0) == (q8 == "all")
    body = emulation.function(made, ["float16", *(["uint32", "float16", "float16"] * 3), "float16"], ["float16"] * 3)
    suffix = ["", "2", "3"]
    names = {"x": "x.data()", "x_shape": "xs", "x_ndim": "2", "w_shape": "ws", "w3_shape": "ws3", "nw": "nw.data()"}
    for sfx in suffix:
        names |= {f"w{sfx}": f"w{sfx}.data()", f"scales{sfx}": f"s{sfx}.data()", f"biases{sfx}": f"b{sfx}.data()",
                  f"out{sfx}": f"out{sfx}.data()"}
    args = ", ".join(names[p] for p in emulation.parameters(body))
    rows = (*sizes, values)
    shapes = ((layout[0], layout[1]), (layout[0], layout[1]), values_layout)
    loads = [f'auto w{x} = load<uint32_t>("w{x}.bin", {n * k // 32 * b}); auto s{x} = load<E>("s{x}.bin", {n * k // g}); '
             f'auto b{x} = load<E>("b{x}.bin", {n * k // g}); std::vector<E> out{x}({n});'
             for x, n, (b, g) in zip(suffix, rows, shapes, strict=True)]
    warps, rpw = config[0], config[1]
    grid = qkv_mixed.blocks(sum(sizes), warps, rpw) + qkv_mixed.blocks(values, warps, rpw)
    main = f"""
int main() {{
    auto x = load<E>("x.bin", {k});
    auto nw = load<E>("nw.bin", {k});
    {" ".join(loads)}
    Shape xs{{1, {k}}}, ws{{{sizes[0]}, {k // 32 * layout[0]}}}, ws3{{{values}, {k // 32 * values_layout[0]}}};
    run_blocks({grid}, {32 * warps}, [&] {{ kernel({args}); }});
    {" ".join(f'save("out{x}.bin", out{x});' for x in suffix)}
}}
"""
    program = emulation.PRELUDE + "using E = __half;\n" + body + main
    (tmp_path / "x.bin").write_bytes(np.array(h.view(mx.uint16)).tobytes())
    (tmp_path / "nw.bin").write_bytes(np.array(nw.view(mx.uint16)).tobytes())
    for sfx, (wq, sc, bi) in zip(suffix, layers, strict=True):
        for name, a in ((f"w{sfx}", wq), (f"s{sfx}", sc.view(mx.uint16)), (f"b{sfx}", bi.view(mx.uint16))):
            (tmp_path / f"{name}.bin").write_bytes(np.array(a).tobytes())
    emulation.compile_and_run(tmp_path, program, [])
    normed = mx.fast.rms_norm(h, nw, eps)
    h32 = h.astype(mx.float32)
    normed32 = h32 * mx.rsqrt(mx.mean(h32 * h32, axis=-1, keepdims=True) + eps) * nw.astype(mx.float32)
    for sfx, n, layer, (bits, group) in zip(suffix, rows, layers, shapes, strict=True):
        got = mx.array(np.frombuffer((tmp_path / f"out{sfx}.bin").read_bytes(), dtype=np.uint16).reshape(1, n)).view(dtype)
        want = mx.quantized_matmul(normed, *layer, transpose=True, group_size=group, bits=bits)
        assert agrees(got, want, exact_product(normed32, *layer, group, bits), qgemv_q8.tolerance(bits)), f"part {sfx or 1}"
        unnormed = mx.quantized_matmul(h, *layer, transpose=True, group_size=group, bits=bits)
        assert not agrees(unnormed, want, exact_product(normed32, *layer, group, bits))  # the norm is not a no-op


def test_staged_shapes_are_refused() -> None:
    layer = type("L", (), {"bits": 4, "group_size": 32, "weight": mx.zeros((8, 32), mx.uint32),
                           "scales": mx.zeros((8, 8)), "biases": mx.zeros((8, 8))})()
    with pytest.raises(ValueError, match="unstaged"):
        qkv_mixed.bound(layer, layer, layer, (8, 2, 1, 1, 1), (mx.ones((256,)), 1e-5))


@pytest.mark.parametrize(("q8", "layout", "values_layout", "config", "k", "rounds"), [
    ("1", (4, 32), (6, 32), (4, 2), 4096, (False, False)),  # the default: one-row 4-bit products round, not these
    ("0", (4, 32), (6, 32), (4, 2), 4096, (False, False)),
    ("all", (4, 32), (6, 32), (4, 2), 4096, (True, True)),
    ("all", (4, 32), (8, 64), (4, 4), 4096, (True, False)),  # 8-bit values never round
    ("all", (4, 32), (6, 32), (4, 4, 1, 2), 4096, (False, False)),  # two chunks a lane in flight
    ("all", (4, 32), (6, 32), (4, 2), 65536, (False, False)),  # a row too wide for a block's shared memory
])
def test_each_part_is_allowed_the_rounded_share_only_where_it_rounds(monkeypatch: pytest.MonkeyPatch, q8: str,
                                                                     layout, values_layout, config, k: int,
                                                                     rounds: tuple[bool, bool]) -> None:
    """``qkv_mixed.tolerance`` allows a part :data:`qgemv_q8.TOLERANCE` exactly where the
    kernel built for it rounds x to bytes (its name says which part does: ``_q1_q0``),
    else MLX's own share, whatever the one-row products of those bits do."""
    monkeypatch.setenv(qgemv_q8.ENV, q8)
    name = _made(mx.float16, layout, values_layout, config, (8, 8), 8, 1e-5, k)["name"]
    built = re.search(r"_q([01])_q([01])_", name)
    assert (tuple(flag == "1" for flag in built.groups()) if built else (False, False)) == rounds, name
    for (bits, _), rounded in zip((layout, values_layout), rounds, strict=True):
        assert qkv_mixed.tolerance(bits, config, k) == (qgemv_q8.TOLERANCE if rounded else timing.TOLERANCE), bits


@pytest.mark.parametrize("q8", ["1", "all"])
def test_a_load_holds_the_mixed_launch_to_what_it_rounds(monkeypatch: pytest.MonkeyPatch, q8: str) -> None:
    """A load's check (``qkv_cuda.fold_norms``) of the one launch of a Q4_K_M's 4-bit
    queries and keys and 6-bit values: its queries 1% of their largest off (what x
    rounded to bytes may add, within :data:`qgemv_q8.TOLERANCE`) are refused where the
    kernel does not round x (``GMLX_Q8X=1``, the default: the layer keeps two launches)
    and taken where it does (``GMLX_Q8X=all``). ``qkv_mixed.bound`` and
    ``qgemv_cuda.bound`` stand in with MLX's norm and products (CUDA cannot run here)."""
    from mlx import nn

    from gmlx.engine.kernels import one_token, qgemv_cuda, qkv_cuda
    from tests.engine.kernels.models import tiny

    monkeypatch.setenv(qgemv_q8.ENV, q8)
    monkeypatch.delenv(qkv_cuda.NORM_ENV, raising=False)
    monkeypatch.delenv(qkv_mixed.ENV, raising=False)
    mixed: list = []

    def products(x, norm, layers):
        n = mx.fast.rms_norm(x, norm[0], norm[1])
        return [mx.quantized_matmul(n, *layer, transpose=True, group_size=g, bits=b) for layer, g, b in layers]

    def bound_mixed(queries, keys, values, config, norm, heads=()):
        def run(x):
            q, k, v = products(x, norm, [((m.weight, m.scales, m.biases), m.group_size, m.bits)
                                         for m in (queries, keys, values)])
            return q + 0.01 * mx.abs(q).max() * (mx.arange(q.shape[-1]) == 0), k, v
        mixed.append(run)
        return run

    def bound(w, scales, biases, group_size, bits, config, more=(), norm=None, **kw):
        def run(x):
            outs = products(x, norm, [(layer, group_size, bits) for layer in ((w, scales, biases), *more)])
            return tuple(outs) if more else outs[0]
        return run

    monkeypatch.setattr(qkv_mixed, "bound", bound_mixed)
    monkeypatch.setattr(qgemv_cuda, "bound", bound)
    model = tiny("llama", 1, dtype=mx.float16, seed=17)
    nn.quantize(model, group_size=32, bits=4)
    v = model.layers[0].self_attn.v_proj
    dense = nn.Linear(v.weight.shape[1] * 32 // v.bits, v.weight.shape[0], bias=False)
    dense.weight = mx.dequantize(v.weight, v.scales, v.biases, group_size=v.group_size, bits=v.bits)
    model.layers[0].self_attn.v_proj = nn.QuantizedLinear.from_linear(dense, group_size=32, bits=6)
    one_token.attach(model, rotation=lambda attention: None)
    assert qkv_cuda.fold_norms(model).endswith("at one stream in 1 of 1 block(s)")
    taken = model.layers[0].self_attn._normed_project[0]
    assert len(mixed) == 1 and (taken is mixed[0]) == (q8 == "all")
