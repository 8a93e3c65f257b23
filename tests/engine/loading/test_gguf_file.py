"""The fast GGUF reader agrees with the gguf package's GGUFReader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from gmlx.engine.errors import ModelSourceError
from gmlx.engine.loading.gguf_file import GGUFFile


@pytest.mark.parametrize("name", ["llama-Q4_0", "qwen2-Q4_K"])
def test_matches_gguf_reader(tiny_models, name: str) -> None:
    path = tiny_models[name].path
    ours, reference = GGUFFile(path), GGUFReader(path)
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        got = ours.metadata[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        assert got == pytest.approx(expected) if isinstance(expected, float) else got == expected
    assert set(ours.tensors) == {t.name for t in reference.tensors}
    for t in reference.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(ours.raw(t.name), t.data)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelSourceError, match="not a valid GGUF"):
        GGUFFile(path)
