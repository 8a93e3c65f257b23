"""The tokenizer kept in the converted-weights cache: a cached load skips the vocabulary
decode and the tokenizer build, and gets a tokenizer identical to a freshly built one."""

from __future__ import annotations

import hashlib
import json
import logging
import marshal
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from gmlx.engine.errors import ModelSourceError
from gmlx.engine.loading import convert_cache, gguf
from gmlx.engine.loading.gguf_file import GGUFFile
from gmlx.engine.loading.gguf_tokenizer import TokenizerSpec, build_spec, build_tokenizer
from gmlx.engine.tokenizer import Tokenizer
from tests.conftest import VOCABS, vocab_path

TEXTS = [
    "Hello world",
    "  two leading spaces\n\nand blank lines\t\ttabs\r\n",
    "Ünïcödé façade naïve — “quotes” 東京 • Zürich 😀 👩‍👩‍👧 🇫🇷 中文，日本語、한국어",
    "numbers 3 33 333 3333 1234567890 3.14159 -42",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "looks special: <|im_ <|im_start <| |> <s> </s> <end>",
    "",
    " ",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there — ça va? 😀"},
    {"role": "assistant", "content": "Fine."},
    {"role": "user", "content": "And <s> now?"},
]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(convert_cache.ENV_MAX_BYTES, raising=False)
    return tmp_path / "cache" / "converted"


def through_cache(path: Path) -> tuple[convert_cache.Converted, GGUFFile]:
    """The cache entry of a vocab-only GGUF (no tensors) read as a load reads it: the
    vocabulary left undecoded unless the tokenizer must be built."""
    f = GGUFFile(path, defer_strings=True)

    def spec() -> TokenizerSpec:
        f.read_deferred()
        return build_spec(path, f.metadata)

    def no_tensors() -> convert_cache.Converted:
        return convert_cache.Converted({}, {}, [])

    return convert_cache.load_or_convert(f, mx.float16, no_tensors, spec), f


def assert_identical(a: Tokenizer, b: Tokenizer) -> None:
    specials = [t for t in (a.bos_token, a.eos_token) if t]
    specials += [a.hf.convert_ids_to_tokens(i) for i in sorted(a.eos_token_ids)]
    texts = [*TEXTS, "".join(specials) + " between " + " ".join(specials) + "end"]
    for text in texts:
        for add in (True, False):
            ids = a.encode(text, add_special_tokens=add)
            assert ids == b.encode(text, add_special_tokens=add), (text, add)
            for skip in (False, True):
                assert a.decode(ids, skip) == b.decode(ids, skip), (text, skip)
    assert a.eos_token_ids == b.eos_token_ids
    assert (a.bos_token, a.bos_token_id, a.eos_token) == (b.bos_token, b.bos_token_id, b.eos_token)
    assert len(a) == len(b) and a.hf.get_vocab() == b.hf.get_vocab()
    added_a = a.hf.backend_tokenizer.get_added_tokens_decoder()
    added_b = b.hf.backend_tokenizer.get_added_tokens_decoder()
    assert {i: (t.content, t.special) for i, t in added_a.items()} == {
        i: (t.content, t.special) for i, t in added_b.items()
    }
    for skip in (False, True):
        assert a.decode(sorted(added_a), skip) == b.decode(sorted(added_a), skip)
    assert a.chat_template == b.chat_template
    assert a.render_chat(CHAT) == b.render_chat(CHAT)
    assert a.encode_chat(CHAT) == b.encode_chat(CHAT)
    assert a.hf.backend_tokenizer.to_str() == b.hf.backend_tokenizer.to_str()


@pytest.mark.parametrize("name", VOCABS)
def test_a_cached_tokenizer_is_the_built_one(name: str, caplog: pytest.LogCaptureFixture) -> None:
    path = vocab_path(name)
    built = build_tokenizer(path, GGUFFile(path).metadata)
    first, f1 = through_cache(path)
    assert "tokenizer.ggml.tokens" in f1.metadata  # the miss decoded and built it
    with caplog.at_level(logging.WARNING, logger=convert_cache.__name__):
        second, f2 = through_cache(path)
    assert "from cache" in second.notes[-1] and not caplog.records
    assert "tokenizer.ggml.tokens" in f2.deferred  # the hit never decoded the vocabulary
    assert second.tokenizer is not None and first.tokenizer is not None
    assert_identical(built, first.tokenizer.tokenizer())
    assert_identical(built, second.tokenizer.tokenizer())


def test_a_cached_model_load_builds_no_tokenizer(
    tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_models["qwen2-Q4_K"].path
    first = gguf.load(path)

    def refuse(*args, **kwargs):
        raise AssertionError("built the tokenizer although the cache holds it")

    monkeypatch.setattr(gguf, "build_spec", refuse)
    monkeypatch.setattr(GGUFFile, "read_deferred", refuse)
    second = gguf.load(path)
    assert any(n.startswith("converted weights: from cache") for n in second.notes)
    assert_identical(first.tokenizer, second.tokenizer)


@pytest.mark.parametrize(
    "damage", ["missing", "truncated", "flipped", "not a tokenizer", "wrong ids", "old sidecar"]
)
def test_a_bad_tokenizer_part_is_rebuilt_with_one_warning(
    tiny_models, cache_dir: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tiny_models["llama-Q4_0"].path
    first = gguf.load(path)
    convert_cache.wait_for_writes()  # the entry is written after the load returns
    (part,) = cache_dir.glob("*.tokenizer")
    sidecar = part.with_suffix(".json")
    info = json.loads(sidecar.read_text())
    if damage == "missing":
        part.unlink()
    elif damage == "truncated":
        part.write_bytes(part.read_bytes()[:-10])
    elif damage == "flipped":  # the same size, one byte changed
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0x20
        part.write_bytes(bytes(data))
    elif damage in ("not a tokenizer", "wrong ids"):  # whole and hashed, but not right
        body = marshal.loads(part.read_bytes())
        if damage == "wrong ids":
            body["added"] = [(i + 1, *rest) for i, *rest in body["added"]]
        else:
            body["format"] = "?"
        data = marshal.dumps(body)
        part.write_bytes(data)
        info["tokenizer"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    else:
        del info["tokenizer"]
    sidecar.write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING, logger=convert_cache.__name__):
        rebuilt = gguf.load(path)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "rebuilding" in warnings[0].getMessage()
    assert any(n.startswith("converted weights: cached in") for n in rebuilt.notes)
    assert_identical(first.tokenizer, rebuilt.tokenizer)
    caplog.clear()
    again = gguf.load(path)
    assert any(n.startswith("converted weights: from cache") for n in again.notes)
    assert not caplog.records
    assert_identical(first.tokenizer, again.tokenizer)


def test_an_entry_counts_and_removes_its_tokenizer(tiny_models, cache_dir: Path) -> None:
    gguf.load(tiny_models["llama-Q4_0"].path)
    (entry,) = convert_cache.entries()
    part = entry.path.with_suffix(".tokenizer")
    assert entry.bytes == entry.path.stat().st_size + part.stat().st_size
    convert_cache.clear()
    assert not part.exists() and not entry.path.exists()


def test_the_wrapper_adopts_the_tokenizer_without_a_copy() -> None:
    spec = build_spec(vocab_path("qwen2"), GGUFFile(vocab_path("qwen2")).metadata)
    backend = spec.backend
    assert spec.tokenizer().hf.backend_tokenizer is backend


def test_deferred_strings_read_back_as_an_eager_parse(tmp_path: Path) -> None:
    path = vocab_path("llama-bpe")
    eager, lazy = GGUFFile(path), GGUFFile(path, defer_strings=True)
    assert set(lazy.deferred) == {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"}
    assert lazy.header() == eager.header() and lazy.data_start == eager.data_start
    lazy.read_deferred()
    assert lazy.deferred == [] and lazy.metadata.keys() == eager.metadata.keys()
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        assert lazy.metadata[key] == eager.metadata[key]
    cut = tmp_path / "cut.gguf"
    shutil.copy(path, cut)
    with cut.open("r+b") as fh:
        fh.truncate(os.path.getsize(path) // 3)  # inside the vocabulary
    with pytest.raises(ModelSourceError, match="not a valid GGUF"):
        GGUFFile(cut, defer_strings=True)


def test_kernel_cache_is_left_alone_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(convert_cache.ENV_KERNEL_CACHE, raising=False)
    if mx.cuda.is_available():
        folder = convert_cache.keep_compiled_kernels()
        assert folder is not None and os.environ[convert_cache.ENV_KERNEL_CACHE] == str(folder)
        assert f"mlx-{mx.__version__}" in folder.parts
    else:
        assert convert_cache.keep_compiled_kernels() is None
        assert convert_cache.ENV_KERNEL_CACHE not in os.environ
    monkeypatch.setenv(convert_cache.ENV_KERNEL_CACHE, "/elsewhere")
    assert convert_cache.keep_compiled_kernels() is None
    assert os.environ[convert_cache.ENV_KERNEL_CACHE] == "/elsewhere"
