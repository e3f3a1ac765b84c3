"""safetensors I/O (numpy + ml_dtypes; memory-mapped reads).

The reader/writer is our own (8-byte header size, JSON header, raw bytes) so that bfloat16 and float8
need neither torch nor the safetensors numpy backend (which has no bfloat16); tensors are memory-mapped.
The reader trusts nothing in the file: the header length is bounded by the file size (and by the
safetensors library's own 100 MB cap) before anything is allocated, and every tensor's dtype, shape and
byte range is checked against the header and the file, as the safetensors library does, so a truncated,
overwritten or foreign file is a `CheckpointError` naming the file and the problem.
"""

from __future__ import annotations

import json
import math
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
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_CODES = {v: k for k, v in _ST_DTYPES.items() if k != "F8_E8M0"}
_ML_FLOATS = {"bfloat16", "float8_e4m3fn", "float8_e5m2"}  # ml_dtypes floats, numpy kind "V"
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's limit


class SafetensorsFile:
    """One safetensors file, its header validated on open; `get` memory-maps a tensor."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: not a file")
        size = os.path.getsize(self.path)
        if size < 8:
            raise self._error(f"{size} bytes, too short for a safetensors file (8-byte header length first)")
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise self._error(
                    f"header length {header_len} exceeds the {size - 8} bytes after it"
                    + (f" (or the {_MAX_HEADER_BYTES}-byte limit)" if header_len > _MAX_HEADER_BYTES else "")
                    + ": not a safetensors file, or a damaged one"
                )
            raw_header = f.read(header_len)
        try:
            header = json.loads(raw_header)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._error(f"header is not valid JSON ({e}): not a safetensors file, or a damaged one") from None
        if not isinstance(header, dict):
            raise self._error(f"header is a JSON {type(header).__name__}, expected an object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise self._error("__metadata__ is not a JSON object")
        self.metadata = metadata
        self._start = 8 + header_len
        self.entries: dict[str, dict] = {key: self._checked_entry(key, entry, size - self._start)
                                         for key, entry in header.items()}
        self._check_no_overlap()
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > self._start else None

    def _error(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {problem}")

    def _checked_entry(self, key: str, entry: Any, data_bytes: int) -> dict:
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise self._error(f"tensor {key!r}: header entry must hold dtype, shape and data_offsets, "
                              f"got {entry!r:.200}")
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise self._error(f"tensor {key!r}: shape must be a list of non-negative integers, got {shape!r:.200}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
                or offsets[0] > offsets[1]):
            raise self._error(f"tensor {key!r}: data_offsets must be [begin, end] with 0 <= begin <= end, "
                              f"got {offsets!r:.200}")
        begin, end = offsets
        if end > data_bytes:
            raise self._error(f"tensor {key!r}: bytes [{begin}, {end}) run past the end of the data "
                              f"({data_bytes} bytes): the file is truncated or its header damaged")
        if code in _ST_DTYPES:
            expected = math.prod(shape) * _ST_DTYPES[code].itemsize
            if end - begin != expected:
                raise self._error(f"tensor {key!r}: {end - begin} bytes for {code} of shape {tuple(shape)}, "
                                  f"expected {expected}")
        elif not isinstance(code, str):
            raise self._error(f"tensor {key!r}: dtype must be a string, got {code!r:.100}")
        return entry

    def _check_no_overlap(self) -> None:
        spans = sorted((e["data_offsets"][0], e["data_offsets"][1], k) for k, e in self.entries.items())
        for (_, end_a, key_a), (begin_b, end_b, key_b) in zip(spans, spans[1:]):
            if begin_b < end_a and begin_b < end_b:
                raise self._error(f"tensors {key_a!r} and {key_b!r} overlap in the file: a damaged header")

    def dtype(self, key: str) -> np.dtype:
        code = self.entries[key]["dtype"]
        if code not in _ST_DTYPES:
            raise self._error(f"tensor {key!r}: unsupported dtype {code}")
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


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def count_non_finite(array: np.ndarray, chunk: int = 1 << 24) -> int:
    """NaN and inf entries of a floating array (0 for other dtypes), read in chunks so a memory-mapped
    tensor is never materialised whole."""
    if array.dtype.kind != "f" and array.dtype not in (np.dtype(ml_dtypes.bfloat16),) and \
            not array.dtype.name.startswith("float8"):
        return 0
    flat = array.reshape(-1)
    return sum(int(np.count_nonzero(~np.isfinite(flat[i : i + chunk].astype(np.float32))))
               for i in range(0, flat.size, chunk))


def write_safetensors(
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
