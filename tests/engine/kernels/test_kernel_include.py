"""A custom kernel's source goes to a file named by its digest and MLX is given an
``#include`` of it (unless ``GMLX_KERNEL_INCLUDE=0``) (MLX's CUDA back-end hashes the
source it holds at every evaluation). The files and the text here are real; the kernel
is recorded where ``mx.fast.cuda_kernel`` would make it (no CUDA back-end on this CPU)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx
import pytest

from gmlx.engine.kernels import cuda_source
from tests.engine.kernels import emulation, test_argmax_cuda
from tests.engine.kernels.emulation import included

HEAD = "using T = __half; constexpr int N = 4;\n"
BODY = "const int i = threadIdx.x;\nif (i < x_shape[0] && i < N) out[i] = x[i];\n"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_inline_when_turned_off(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cuda_source.ENV_INCLUDE, "0")
    assert cuda_source.kernel_source(HEAD + BODY, ["x"]) == HEAD + BODY
    assert not (cache / "kernels" / "sources").exists()


def test_by_default_the_body_is_included_from_its_digests_file(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cuda_source.ENV_INCLUDE, raising=False)
    source = cuda_source.kernel_source(HEAD + BODY, ["x"])
    path = cache / "kernels" / "sources" / f"{hashlib.sha1((HEAD + BODY).encode()).hexdigest()}.cuh"
    assert path.read_text() == HEAD + BODY
    # the file where the source stood; x_shape named again so MLX still gives the kernel x's shape
    assert source == f'#include "{path}"\n// x_shape\n'



def test_a_damaged_file_is_written_again(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cuda_source.ENV_INCLUDE, "1")
    path = cuda_source.source_file(BODY)
    assert path is not None
    path.write_text(BODY[:10])  # (a writer cut off: the file's name no longer matches its text)
    assert cuda_source.source_file(BODY) == path and path.read_text() == BODY
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_inline_where_the_folder_cannot_be_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GMLX_CACHE_DIR", str(blocker / "cache"))  # under a file: no folder can be made
    monkeypatch.setenv(cuda_source.ENV_INCLUDE, "1")
    assert cuda_source.kernel_source(HEAD + BODY, ["x"]) == HEAD + BODY


def test_inline_where_an_include_cannot_name_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path / 'say "cache"'))
    monkeypatch.setenv(cuda_source.ENV_INCLUDE, "1")
    assert cuda_source.kernel_source(HEAD + BODY, ["x"]) == HEAD + BODY


def test_only_inputs_shapes_are_named(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cuda_source.ENV_INCLUDE, "1")
    body = "int a = q_strides[1] + k_ndim + out_shape_like + v_shape[2];\n"
    source = cuda_source.kernel_source(body, ["q", "k"])
    assert source.endswith("// k_ndim q_strides\n")


def test_the_kernels_name_is_the_same_either_way(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict] = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw))
    monkeypatch.setenv(cuda_source.ENV_INCLUDE, "0")
    cuda_source.build("gmlx_t", HEAD, BODY, ["x"])
    monkeypatch.delenv(cuda_source.ENV_INCLUDE)
    cuda_source.build("gmlx_t", HEAD, BODY, ["x"])
    assert made[0]["name"] == made[1]["name"] == cuda_source.kernel_name("gmlx_t", HEAD + BODY)
    assert made[0]["source"] == HEAD + BODY and "#include" in made[1]["source"]


@pytest.mark.skipif(not emulation.AVAILABLE, reason=emulation.WHY_NOT)
def test_a_real_kernel_given_by_default_runs_from_its_file(tmp_path: Path, cache: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The greedy step's argmax kernel as MLX is given it by default (an ``#include`` of its
    file; the folder's conftest keeps the other tests' sources inline): the emulation's
    preprocessor puts the file in, and the kernel picks what ``mx.argmax`` picks."""
    monkeypatch.delenv(cuda_source.ENV_INCLUDE)
    given: list[str] = []
    monkeypatch.setattr(emulation, "included", lambda source: given.append(source) or included(source))
    logits = test_argmax_cuda._rows(1000, mx.float16)
    assert test_argmax_cuda._run(tmp_path, logits) == mx.argmax(logits, axis=-1).tolist()
    assert given and given[0].startswith(f'#include "{cache / "kernels" / "sources"}')
