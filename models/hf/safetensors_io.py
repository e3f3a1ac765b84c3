"""safetensors I/O (numpy + ml_dtypes; memory-mapped reads).

The reader/writer is our own (a few lines: 8-byte header size, JSON header, raw bytes) so that bfloat16 and
float8 need neither torch nor the safetensors numpy backend; tensors are memory-mapped.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from c2jax.models.hf.errors import CheckpointError

_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}


class _SafetensorsFile:
    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries: dict[str, dict] = header
        self._start = 8 + size
        self._map = np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) > self._start else None

    def dtype(self, key: str) -> np.dtype:
        code = self.entries[key]["dtype"]
        if code not in _ST_DTYPES:
            raise CheckpointError(f"tensor {key!r} in {self.path.name}: unsupported dtype {code}")
        return _ST_DTYPES[code]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key]["shape"])

    def get(self, key: str) -> np.ndarray:
        entry = self.entries[key]
        begin, end = entry["data_offsets"]
        dtype, shape = self.dtype(key), tuple(entry["shape"])
        if end == begin:
            return np.zeros(shape, dtype)
        raw = self._map[self._start + begin : self._start + end]
        return raw.view(dtype).reshape(shape)


def _write_safetensors(
    path: Path,
    tensors: list[tuple[str, Callable[[], np.ndarray], np.dtype, tuple]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write (key, producer, dtype, shape) entries; producers run one at a time while writing."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for key, _, dtype, shape in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[key] = {
            "dtype": _ST_CODES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, produce, dtype, shape in tensors:
            array = np.ascontiguousarray(produce())
            if array.dtype != dtype or tuple(array.shape) != tuple(shape):
                raise AssertionError(f"{key}: produced {array.dtype}{array.shape}, planned {dtype}{shape}")
            f.write(array.tobytes())
