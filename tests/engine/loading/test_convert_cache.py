"""The converted-weights cache: a GGUF converts once, later loads read the cache."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cli_runner import gmlx
from mlx.utils import tree_flatten

from gmlx.engine.loading import convert_cache, gguf
from gmlx.engine.loading.gguf import load
from gmlx.engine.loading.model import LoadedModel


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache dir, unbounded by the environment."""
    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(convert_cache.ENV_MAX_BYTES, raising=False)
    return tmp_path / "cache" / "converted"


@pytest.fixture
def gguf_copy(tiny_models, tmp_path: Path):
    """``copy(name)``: a private copy of a tiny GGUF, free to touch."""

    def copy(name: str, as_name: str | None = None) -> Path:
        dst = tmp_path / f"{as_name or name}.gguf"
        shutil.copy(tiny_models[name].path, dst)
        return dst

    return copy


def no_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("converted although the cache holds the file")

    monkeypatch.setattr(gguf, "_convert_tensors", refuse)


def assert_same(a: LoadedModel, b: LoadedModel) -> None:
    pa, pb = dict(tree_flatten(a.model.parameters())), dict(tree_flatten(b.model.parameters()))
    assert pa.keys() == pb.keys()
    for name, value in pa.items():
        assert value.dtype == pb[name].dtype and value.shape == pb[name].shape, name
        assert np.array_equal(np.array(value.view(mx.uint8)), np.array(pb[name].view(mx.uint8)))
    assert a.config == b.config
    strip = [n for n in a.notes if not n.startswith("converted weights:")]
    assert strip == [n for n in b.notes if not n.startswith("converted weights:")]


def cache_notes(m: LoadedModel) -> list[str]:
    return [n for n in m.notes if n.startswith("converted weights:")]


@pytest.mark.parametrize("name", ["qwen2-Q4_K", "llama-Q4_0"])
def test_second_load_comes_from_the_cache_bit_for_bit(
    tiny_models, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load(tiny_models[name].path)
    assert cache_notes(first)[0].startswith("converted weights: cached in ")
    no_conversion(monkeypatch)
    second = load(tiny_models[name].path)
    assert cache_notes(second)[0].startswith("converted weights: from cache ")
    assert_same(first, second)
    assert len(convert_cache.entries()) == 1


def test_a_touched_gguf_or_a_new_converter_makes_a_new_entry(
    gguf_copy, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = gguf_copy("llama-Q4_0")
    load(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert "cached in" in cache_notes(load(path))[0]
    with path.open("ab") as f:
        f.write(b"\0" * 64)  # a size change (alignment padding: still a valid GGUF)
    assert "cached in" in cache_notes(load(path))[0]
    monkeypatch.setattr(convert_cache, "converter_version", lambda: "next")
    assert "cached in" in cache_notes(load(path))[0]
    assert len(convert_cache.entries()) == 4


def test_the_float_dtype_is_part_of_the_key(tiny_models, monkeypatch) -> None:
    path = tiny_models["llama-Q4_0"].path
    half = load(path)
    monkeypatch.setattr(gguf, "model_dtype", lambda f: mx.float32)
    full = load(path)
    assert "cached in" in cache_notes(full)[0]
    assert half.model.layers[0].input_layernorm.weight.dtype == mx.float16
    assert full.model.layers[0].input_layernorm.weight.dtype == mx.float32


@pytest.mark.parametrize("damage", ["truncate", "garbage", "no sidecar", "wrong size"])
def test_a_damaged_entry_is_rebuilt_with_one_warning(
    tiny_models, cache_dir: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tiny_models["qwen2-Q4_K"].path
    first = load(path)
    convert_cache.wait_for_writes()  # the entry is written after the load returns
    (data,) = cache_dir.glob("*.safetensors")
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif damage == "garbage":
        data.write_bytes(b"\x07" * data.stat().st_size)
    elif damage == "no sidecar":
        data.with_suffix(".json").unlink()
    else:
        data.write_bytes(data.read_bytes() + b"\0")
    with caplog.at_level(logging.WARNING, logger=convert_cache.__name__):
        rebuilt = load(path)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "rebuilding" in warnings[0].getMessage()
    assert "cached in" in cache_notes(rebuilt)[0]
    assert_same(first, rebuilt)
    caplog.clear()
    again = load(path)
    assert "from cache" in cache_notes(again)[0] and not caplog.records
    assert_same(first, again)


def test_the_byte_bound_evicts_the_least_recently_used(
    gguf_copy, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, c = (gguf_copy("llama-Q4_0", n) for n in "abc")  # entries of one size
    load(a)
    load(b)
    one = max(e.bytes for e in convert_cache.entries())
    monkeypatch.setenv(convert_cache.ENV_MAX_BYTES, str(int(2.5 * one)))
    load(a)  # a is now more recently used than b
    load(c)
    assert {e.source for e in convert_cache.entries()} == {str(a), str(c)}


def test_an_entry_larger_than_the_bound_is_not_written(tiny_models, monkeypatch) -> None:
    monkeypatch.setenv(convert_cache.ENV_MAX_BYTES, "1K")
    m = load(tiny_models["llama-Q4_0"].path)
    assert "not cached" in cache_notes(m)[0] and convert_cache.entries() == []


def test_zero_disables_the_cache(tiny_models, cache_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv(convert_cache.ENV_MAX_BYTES, "0")
    m = load(tiny_models["llama-Q4_0"].path)
    assert cache_notes(m) == [] and not cache_dir.exists()


def test_a_full_disk_skips_writing(tiny_models, monkeypatch) -> None:
    monkeypatch.setattr(
        convert_cache.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 0)
    )
    m = load(tiny_models["llama-Q4_0"].path)
    assert "only 0 bytes free" in cache_notes(m)[0] and convert_cache.entries() == []


def test_two_threads_loading_one_file_share_one_entry(tiny_models, cache_dir: Path) -> None:
    path = tiny_models["qwen2-Q4_K"].path
    results: list[LoadedModel] = []
    threads = [threading.Thread(target=lambda: results.append(load(path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2
    assert_same(results[0], results[1])
    assert sorted(n.split(":")[1][:11] for r in results for n in cache_notes(r)) == [
        " cached in ",
        " from cache",
    ]
    convert_cache.wait_for_writes()
    assert len(list(cache_dir.glob("*.safetensors"))) == 1 and not list(cache_dir.glob("*.tmp-*"))
    assert_same(results[0], load(path))


def test_cli_lists_and_clears(gguf_copy) -> None:
    a, b = gguf_copy("llama-Q4_0"), gguf_copy("qwen2-Q4_K")
    r = gmlx("cache", "list")
    assert r.exit_code == 0 and "no converted" in r.stdout
    load(a)
    load(b)
    # a terminal wide enough for the whole paths: on a narrow one Rich folds a long path
    # over two lines (how long these are depends on pytest's temp folder)
    r = gmlx("cache", "list", env={"COLUMNS": "250"})
    assert r.exit_code == 0 and str(a) in r.stdout and str(b) in r.stdout, r.output
    r = gmlx("cache", "clear", str(a))
    assert r.exit_code == 0 and "removed 1" in r.stdout, r.output
    assert [e.source for e in convert_cache.entries()] == [str(b)]
    r = gmlx("cache", "clear")
    assert r.exit_code == 2 or r.exit_code == 1
    r = gmlx("cache", "clear", "--all")
    assert r.exit_code == 0 and convert_cache.entries() == []


def test_clear_all_removes_the_compiled_kernels_too(gguf_copy) -> None:
    """`gmlx cache clear --all` also empties the folder MLX keeps compiled CUDA kernels
    in (written here by hand: this machine runs MLX on the CPU, which keeps none there)."""
    from gmlx import paths

    kernels = paths.cache_dir() / "kernels" / "mlx-test" / "arch"
    kernels.mkdir(parents=True)
    (kernels / "kernel.ptx").write_bytes(b"x" * 2048)
    load(gguf_copy("llama-Q4_0"))
    r = gmlx("cache", "clear", "--all")
    assert r.exit_code == 0 and "compiled GPU kernels (2.0 KiB)" in r.stdout, r.output
    assert not (paths.cache_dir() / "kernels").exists() and convert_cache.entries() == []


def test_the_first_load_does_not_wait_for_its_entry(tiny_models, cache_dir: Path, monkeypatch) -> None:
    """The entry is written on a thread of its own after the load returns; a second load
    of the file meanwhile waits for it (the key's lock) instead of converting again."""
    path = tiny_models["qwen2-Q4_K"].path
    gate = threading.Event()
    real = mx.save_safetensors
    monkeypatch.setattr(mx, "save_safetensors", lambda *a, **k: (gate.wait(60), real(*a, **k))[1])
    first = load(path)
    assert cache_notes(first)[0].endswith("(written after the load)")
    assert not list(cache_dir.glob("*.json"))  # not written yet
    second: list[LoadedModel] = []
    waiter = threading.Thread(target=lambda: second.append(load(path)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # held by the entry being written
    gate.set()
    waiter.join(60)
    assert cache_notes(second[0])[0].startswith("converted weights: from cache ")
    assert_same(first, second[0])


def test_a_process_that_ends_right_after_a_load_still_writes_the_entry(tiny_models, cache_dir: Path) -> None:
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from gmlx.engine.loading.gguf import load; "
            "m = load(Path(sys.argv[1])); print(m.notes[-1])")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_models["llama-Q4_0"].path)],
                         capture_output=True, text=True, timeout=120, env=os.environ.copy(), check=False)
    assert out.returncode == 0, out.stderr
    assert "written after the load" in out.stdout
    assert [e.source for e in convert_cache.entries()] == [str(tiny_models["llama-Q4_0"].path.resolve())]


def test_a_write_that_fails_leaves_no_entry_and_one_warning(tiny_models, cache_dir: Path, monkeypatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Whatever the writer meets (a full disk, an error out of MLX), the load it follows
    has already returned; the entry is simply not there, with one warning."""
    def fail(*args, **kwargs):
        raise RuntimeError("no room at the inn")

    monkeypatch.setattr(mx, "save_safetensors", fail)
    with caplog.at_level(logging.WARNING, logger=convert_cache.__name__):
        m = load(tiny_models["llama-Q4_0"].path)
        convert_cache.wait_for_writes()
    assert cache_notes(m)[0].endswith("(written after the load)")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no room at the inn" in warnings[0].getMessage()
    assert convert_cache.entries() == [] and not list(cache_dir.glob("*.tmp-*"))
