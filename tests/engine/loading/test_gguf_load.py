"""End to end: tiny GGUF models load into mlx-lm classes and match their reference."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFWriter

from gmlx.engine.errors import ModelSourceError, UnsupportedModelError
from gmlx.engine.loading import load_model
from gmlx.engine.loading.gguf import load

PROMPT = "Hello world, the tiny model is here."


def _logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


NAMES = [
    "llama-F16",
    "llama-Q8_0",
    "llama-Q4_0",
    "qwen2-Q4_K",
    "qwen2-Q6_K",
    "qwen3-Q5_K",
    "gemma3_text-Q8_0",
]


@pytest.mark.parametrize("name", [n for n in NAMES if "Q6_K" not in n])
def test_lossless_types_give_exact_logits_in_float32(
    tiny_models, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With float32 scales and activations the GGUF model *is* the reference model."""
    from gmlx.engine.loading import gguf

    monkeypatch.setattr(gguf, "model_dtype", lambda f: mx.float32)
    tiny = tiny_models[name]
    loaded = load(tiny.path)
    ids = loaded.tokenizer.encode(PROMPT)
    np.testing.assert_allclose(_logits(loaded.model, ids), _logits(tiny.reference, ids), atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_reference(tiny_models, name: str) -> None:
    tiny = tiny_models[name]
    loaded = load(tiny.path)
    assert loaded.kind == "gguf" and loaded.context_length == 2048
    ids = loaded.tokenizer.encode(PROMPT)
    assert len(ids) > 5
    expected = _logits(tiny.reference, ids)
    got = _logits(loaded.model, ids)
    # Loaded as it would be served: float16 scales and activations. The tiny models stay
    # within 5% of the logit scale (measured: <= 3%); requantized Q6_K adds its reported
    # error (random Q6_K blocks are a worst case: sub-block scales differ wildly).
    scale = np.abs(expected).max()
    tolerance = 0.05 if "Q6_K" not in name else 0.1
    assert np.abs(got - expected).max() <= tolerance * scale
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.9


def test_quantized_layers_use_mlx_layout(tiny_models) -> None:
    loaded = load(tiny_models["qwen2-Q4_K"].path)
    layer = loaded.model.model.layers[0]
    assert type(layer.mlp.down_proj).__name__ == "QuantizedLinear"
    assert (layer.mlp.down_proj.bits, layer.mlp.down_proj.group_size) == (4, 32)
    assert loaded.config["quantization"]["bits"] == 4
    assert not any("requantized" in n for n in loaded.notes)


def test_requantized_tensors_are_logged(tiny_models) -> None:
    loaded = load(tiny_models["qwen2-Q6_K"].path)
    notes = [n for n in loaded.notes if n.startswith("requantized")]
    assert notes and "Q6_K -> 6-bit group 32" in notes[0] and "max error" in notes[0]


def test_llama_qk_rows_are_unpermuted(tiny_models) -> None:
    tiny = tiny_models["llama-F16"]
    loaded = load(tiny.path)
    got = np.array(loaded.model.model.layers[1].self_attn.k_proj.weight.astype(mx.float32))
    expected = np.array(tiny.reference.model.layers[1].self_attn.k_proj.weight)
    np.testing.assert_array_equal(got, expected)


def test_gemma3_norms_lose_the_stored_one(tiny_models) -> None:
    tiny = tiny_models["gemma3_text-Q8_0"]
    loaded = load(tiny.path)
    got = np.array(loaded.model.model.norm.weight.astype(mx.float32))
    expected = np.array(tiny.reference.model.norm.weight)
    np.testing.assert_allclose(got, expected, atol=1e-3)


def test_tokenizer_and_template_from_the_file(tiny_models) -> None:
    tok = load(tiny_models["llama-Q8_0"].path).tokenizer
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert [tok.hf.convert_ids_to_tokens(i) for i in ids] == ["Hello", "Ġworld"]
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[0] == tok.token_to_id(
        "<|im_start|>"
    )
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids


def test_load_model_dispatches_to_gguf(tiny_models) -> None:
    loaded = load_model(tiny_models["qwen3-Q5_K"].path, model_id="tiny")
    assert loaded.id == "tiny" and loaded.config["model_type"] == "qwen3"


def _write(path: Path, arch: str, **tensors: np.ndarray) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_names_it(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "m.gguf", "falcon", **{"token_embd.weight": np.zeros((4, 32), np.float32)}
    )
    with pytest.raises(UnsupportedModelError, match="'falcon'.*supported: llama, mistral, qwen2"):
        load(path)


def test_unsupported_tensor_type_names_it(tiny_models, tmp_path: Path) -> None:
    from gmlx.engine.loading import gguf_quant

    path = tiny_models["llama-Q4_0"].path
    supported = gguf_quant.SUPPORTED_TYPES
    try:
        gguf_quant.SUPPORTED_TYPES = tuple(t for t in supported if t.name != "Q4_0")
        with pytest.raises(UnsupportedModelError, match="Q4_0 are not supported"):
            load(path)
    finally:
        gguf_quant.SUPPORTED_TYPES = supported


def test_vocab_only_file_is_not_a_model(tmp_path: Path) -> None:
    path = _write(tmp_path / "v.gguf", "llama")
    with pytest.raises(ModelSourceError, match="token_embd"):
        load(path)


def test_truncated_file_is_a_source_error(tiny_models, tmp_path: Path) -> None:
    data = tiny_models["llama-F16"].path.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelSourceError, match="not a valid GGUF"):
        load(path)


def test_prompt_cache_hits_on_a_sliding_window_model(tmp_path: Path) -> None:
    """gemma3 mixes sliding-window layers (rotating caches, merged as mlx-lm does) with
    global ones (merged by gmlx with room): hits, alone and batched with a miss, give
    what the model gives without a cache. (F16: MLX's CPU prefill of the Q8_0 fixture
    takes seconds per prompt.)"""
    import threading

    from gguf import GGMLQuantizationType

    from gmlx.engine.types import GenerateRequest, SamplingParams
    from gmlx.engine.worker import ModelWorker
    from tests.engine.loading.conftest import write_tiny_model

    tiny = write_tiny_model(tmp_path / "gemma3.gguf", "gemma3_text", GGMLQuantizationType.F16, seed=11)
    loaded = load_model(tiny.path, model_id="tiny-gemma")
    kinds = {type(c).__name__ for c in loaded.model.make_cache()}
    assert kinds == {"RotatingKVCache", "KVCache"}
    vocab = loaded.config["vocab_size"]
    head = [(7 * i) % (vocab - 3) + 3 for i in range(90)]
    prompts = [tuple(head + [5 + k, 6, 7 + k]) for k in range(3)] + [tuple(reversed(head))]
    greedy = SamplingParams(temperature=0.0)

    def run_all(w):
        out = [None] * len(prompts)

        def one(i):
            events = list(w.generate(GenerateRequest(prompts[i], max_tokens=6, sampling=greedy)))
            out[i] = ([t for e in events for t in e.token_ids], events[-1].cache_tier)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out

    cold = ModelWorker(loaded, decode_batch=4, prompt_cache_bytes=0)
    warm = ModelWorker(loaded, decode_batch=4)
    try:
        expected = [tokens for tokens, _ in run_all(cold)]
        list(warm.generate(GenerateRequest(tuple(head + [9]), max_tokens=2, sampling=greedy)))
        got = run_all(warm)
    finally:
        cold.close()
        warm.close()
    assert [tokens for tokens, _ in got] == expected
    assert [tier for _, tier in got][:3] == ["block"] * 3
