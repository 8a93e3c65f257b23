"""``models.py --direct`` writes a Q4_K_M GGUF straight from random blocks (no F16 file, no
llama.cpp build): the tensor types llama-quantize's Q4_K_M gives a llama, weights centred
on 0 with the spread of the F16 draws, and a file gmlx loads and runs to finite logits.
Real files: gguf's reader and dequantizer, gmlx's own GGUF loader, real MLX."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from benchmarks.gpu import models, q4_k_m_direct

SMALL = {"hidden": 256, "layers": 8, "ffn": 512, "heads": 4, "kv_heads": 2,
         "rope_theta": 500000.0, "tied": False, "context": 512}


def _vocab() -> Path:
    found = next((Path(v) for v in models.DEFAULT_VOCABS if v and Path(v).is_file()), None)
    if found is None:
        pytest.skip("the llama-bpe vocabulary GGUF is not here (../shared/fixtures/vocab/)")
    return found


@pytest.fixture(scope="module")
def direct_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("direct")
    q4_k_m_direct.write_q4_k_m_direct("small", SMALL, out, _vocab(), seed=3)
    return out / "q4_k_m.gguf"


def test_more_bits_layers_are_llama_cpps() -> None:
    # use_more_bits over 32 layers: the first and last 4, and every third from layer 6
    assert [i for i in range(32) if q4_k_m_direct.more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27,
                                                                 28, 29, 30, 31]


def test_tensor_types_follow_q4_k_m(direct_file: Path) -> None:
    types = {t.name: t.tensor_type.name for t in GGUFReader(direct_file).tensors}
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert types["blk.0.attn_norm.weight"] == "F32"
    # 8 layers: more bits in layers 0, 7 (first and last eighth) and 3 ((3 - 1) % 3 == 2)
    six = sorted(int(n.split(".")[1]) for n, k in types.items() if n.endswith("attn_v.weight") and k == "Q6_K")
    assert six == [0, 3, 6, 7]
    assert {types[f"blk.{i}.ffn_down.weight"] for i in (0, 3, 6, 7)} == {"Q6_K"}
    assert {types[f"blk.{i}.ffn_down.weight"] for i in (1, 2, 4, 5)} == {"Q4_K"}
    assert {types[f"blk.{i}.attn_q.weight"] for i in range(8)} == {"Q4_K"}


def test_weights_are_centred_with_the_draws_spread(direct_file: Path) -> None:
    reader = GGUFReader(direct_file)
    for t in reader.tensors:
        if t.tensor_type in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
            w = dequantize(np.asarray(t.data), t.tensor_type)
            assert w.shape == (int(t.shape[1]), int(t.shape[0])) and np.isfinite(w).all()
            assert abs(float(w.mean())) < 0.002, t.name
            assert 0.015 < float(w.std()) < 0.025, (t.name, float(w.std()))


def test_gmlx_loads_it_and_runs_finite_logits(direct_file: Path) -> None:
    from gmlx.engine.loading import load_model

    loaded = load_model(direct_file, model_id="direct")
    assert loaded.config["num_hidden_layers"] == 8
    ids = mx.array([loaded.tokenizer.encode("Hello world")])
    logits = loaded.model(ids)
    mx.eval(logits)
    assert logits.shape[-1] == loaded.config["vocab_size"] and bool(mx.isfinite(logits).all())
    assert float(logits.std()) > 0  # not a constant: the weights reach the output


def test_a_row_not_of_whole_blocks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="multiple of 256"):
        q4_k_m_direct.write_q4_k_m_direct("tiny", models.SHAPES["tiny"], tmp_path, _vocab(), seed=0)
