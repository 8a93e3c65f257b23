"""A fast, memory-mapped reader for GGUF files: metadata and tensor views.

``gguf.GGUFReader`` builds a numpy view per metadata string, which takes 10-20 s on a
150k-262k token vocabulary; this reader parses the same layout with ``struct`` over an
``mmap`` (well under a second) and hands out zero-copy numpy views of the tensor data.
The type codes, block sizes and value types come from the ``gguf`` package.

With ``defer_strings`` the long string arrays (a vocabulary and its merges: hundreds of
thousands of strings) are only stepped over, and decoded by :meth:`GGUFFile.read_deferred`
when wanted: a load whose tokenizer comes from the converted-weights cache never needs them.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from gmlx.engine.errors import ModelSourceError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_U64 = struct.Struct("<Q")
_DEFER_MIN = 1024  # string arrays at least this long may be left undecoded (defer_strings)

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY: dict[GGUFValueType, type] = {
    GGUFValueType.UINT8: np.uint8,
    GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32,
    GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32,
    GGUFValueType.BOOL: np.bool_,
    GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
}
_FLOAT_TENSORS: dict[GGMLQuantizationType, type] = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: numpy-order shape, GGML type and absolute data offset."""

    name: str
    shape: tuple[int, ...]  # numpy order: the last axis is GGML's ne[0] (contiguous)
    qtype: GGMLQuantizationType
    offset: int

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape, dtype=np.int64)) // block * size


class GGUFFile:
    """A GGUF file opened for reading: ``metadata`` (dict) and ``tensors`` (by name).

    String arrays become lists of str, numeric arrays numpy arrays. Tensor data is read
    lazily through :meth:`raw`, which returns a view of the memory map (no copy).
    """

    def __init__(self, path: Path, *, defer_strings: bool = False) -> None:
        self.path = path
        self._defer = defer_strings
        self._deferred: dict[str, tuple[int, int]] = {}  # key -> (first string's offset, count)
        try:
            with path.open("rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelSourceError(f"{path} cannot be read: {e}.") from e
        try:
            self._parse()
        except (struct.error, ValueError, UnicodeDecodeError, IndexError) as e:
            raise ModelSourceError(f"{path} is not a valid GGUF file: {e}.") from e

    def _parse(self) -> None:
        mm = self._mm
        if mm[:4] != _MAGIC:
            raise ValueError("the magic bytes are not GGUF")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old (2 or later is supported)")
        self.version = version
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            vtype = GGUFValueType(self._unpack("<I"))
            if not (vtype == GGUFValueType.ARRAY and self._defer and self._skip_strings(key)):
                self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", mm, self._pos)
            self._pos += 8 * n_dims
            qtype = self._unpack("<I")
            offset = self._unpack("<Q")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        align = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // align) * align
        self.data_start = data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset in infos:
            try:
                gtype = GGMLQuantizationType(qtype)
            except ValueError:
                raise ValueError(f"tensor {name} has unknown GGML type {qtype}") from None
            block = GGML_QUANT_SIZES[gtype][0]
            if shape and shape[-1] % block:
                raise ValueError(
                    f"tensor {name} rows of {shape[-1]} are not whole {gtype.name} blocks"
                )
            info = TensorInfo(name, shape, gtype, data_start + offset)
            if info.offset + info.nbytes > len(mm):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = info

    def header(self) -> bytes:
        """The bytes before the tensor data: the header, metadata and tensor table."""
        return bytes(self._mm[: self.data_start])

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        start = self._pos
        self._pos += n
        return self._mm[start : self._pos].decode("utf-8", errors="replace")

    def _strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary: hundreds of thousands), in one tight
        loop: a call per string cost 3.6 us each, most of a cached load's time."""
        mm, pos, length = self._mm, self._pos, _U64.unpack_from
        out: list[str] = [""] * count
        for i in range(count):
            (n,) = length(mm, pos)
            pos += 8
            out[i] = mm[pos : pos + n].decode("utf-8", errors="replace")
            pos += n
        self._pos = pos
        return out

    def _skip_strings(self, key: str) -> bool:
        """Step over the array at the read position if it is a long string array, noting
        where it lies; False (nothing read) for any other array."""
        item, count = struct.unpack_from("<IQ", self._mm, self._pos)
        if item != GGUFValueType.STRING or count < _DEFER_MIN:
            return False
        mm, pos, length = self._mm, self._pos + 12, _U64.unpack_from
        self._deferred[key] = (pos, count)
        for _ in range(count):
            pos += 8 + length(mm, pos)[0]
        if pos > len(mm):
            raise ValueError(f"metadata {key} runs past the end of the file")
        self._pos = pos
        return True

    @property
    def deferred(self) -> list[str]:
        """The metadata keys left undecoded so far (see ``defer_strings``)."""
        return list(self._deferred)

    def read_deferred(self) -> None:
        """Decode the string arrays the constructor stepped over into ``metadata``."""
        for key, (pos, count) in list(self._deferred.items()):
            self._pos = pos
            self.metadata[key] = self._strings(count)
            del self._deferred[key]

    def _value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            item = GGUFValueType(self._unpack("<I"))
            count = self._unpack("<Q")
            if item == GGUFValueType.STRING:
                return self._strings(count)
            if item == GGUFValueType.ARRAY:
                return [self._value(GGUFValueType.ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
            arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=self._pos).copy()
            self._pos += count * dtype.itemsize
            return arr
        return self._unpack(_SCALARS[vtype])

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored data as a read-only view of the file.

        Float and integer tensors come in their dtype and numpy shape; quantized tensors
        as uint8 rows of blocks, shape ``(*shape[:-1], bytes_per_row)``.
        """
        info = self.tensors[name]
        if info.qtype == GGMLQuantizationType.BF16:
            count = int(np.prod(info.shape, dtype=np.int64))
            return np.frombuffer(self._mm, np.uint16, count, info.offset).reshape(info.shape)
        if info.qtype in _FLOAT_TENSORS:
            count = int(np.prod(info.shape, dtype=np.int64))
            dtype = _FLOAT_TENSORS[info.qtype]
            return np.frombuffer(self._mm, dtype, count, info.offset).reshape(info.shape)
        rows = info.shape[:-1]
        row_bytes = info.nbytes // max(1, int(np.prod(rows, dtype=np.int64)))
        return np.frombuffer(self._mm, np.uint8, info.nbytes, info.offset).reshape(
            (*rows, row_bytes)
        )
