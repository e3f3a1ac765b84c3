"""Checkpoint reading: the tensors of a (possibly sharded) safetensors checkpoint directory by DeepSeek
text-model key (the `kimi_k25` wrapper's `language_model.` prefixes removed, vision tensors skipped), FP8
weights dequantized on read."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np

from c2jax.models.hf.errors import CheckpointError, CheckpointWarning
from c2jax.models.hf.fp8 import FP8_BLOCK, dequantize_fp8_block
from c2jax.models.hf.safetensors_io import SafetensorsFile, count_non_finite

_FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
_SKIP_PREFIXES = (
    "vision_tower.",
    "mm_projector.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.mm_projector.",
    "model.multi_modal_projector.",
)


def _normalize_key(key: str, wrapper: bool) -> str | None:
    """Map a checkpoint key onto the DeepSeek text-model namespace; None: not part of the text model."""
    if re.search(r"\.rotary_emb\.inv_freq$", key):
        return None  # a buffer some old checkpoints saved
    if wrapper:
        if key.startswith(_SKIP_PREFIXES):
            return None
        for old, new in (
            ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."),
        ):
            if key.startswith(old):
                return new + key[len(old) :]
    return key


class SafetensorsCheckpoint:
    """All tensors of a (possibly sharded) safetensors checkpoint, by normalized key; tracks what was read."""

    def __init__(self, path: Path, wrapper: bool):
        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a "
                                      f"'weight_map' of tensor -> file): {type(e).__name__}: {e}") from None
            missing = [n for n in names if not isinstance(n, str) or not (path / n).is_file()]
            if missing:
                raise CheckpointError(f"{index} names shard file(s) not in {path}: {missing[:5]}")
        elif (path / "model.safetensors").exists():
            names = ["model.safetensors"]
        else:
            raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")
        self.files: dict[str, tuple[SafetensorsFile, str]] = {}
        for name in names:
            file = SafetensorsFile(path / name)
            for raw in file.entries:
                key = _normalize_key(raw, wrapper)
                if key is None:
                    continue
                if key in self.files:
                    raise CheckpointError(f"tensor {key!r} appears twice ({raw!r} in {name})")
                self.files[key] = (file, raw)
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def keys(self) -> set[str]:
        return set(self.files)

    def shape(self, key: str) -> tuple[int, ...]:
        file, raw = self.files[key]
        return file.shape(raw)

    def read(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor (dequantized if it is FP8 with a scale), after checking it exists with this shape."""
        if key not in self.files:
            raise CheckpointError(f"missing tensor {key!r} (expected shape {tuple(shape)})")
        file, raw = self.files[key]
        if file.shape(raw) != tuple(shape):
            raise CheckpointError(f"tensor {key!r} has shape {file.shape(raw)}, expected {tuple(shape)}")
        array = file.get(raw)
        self.used.add(key)
        scale_key = key + "_scale_inv"
        if scale_key in self.files:
            if array.dtype != np.dtype(ml_dtypes.float8_e4m3fn) or array.ndim != 2:
                raise CheckpointError(
                    f"tensor {key!r} has a {scale_key!r} but is {array.dtype}{array.shape}, "
                    "expected a 2-D float8_e4m3fn weight"
                )
            scale_file, scale_raw = self.files[scale_key]
            expected = tuple(math.ceil(d / b) for d, b in zip(shape, FP8_BLOCK, strict=True))
            if scale_file.shape(scale_raw) != expected:
                raise CheckpointError(
                    f"tensor {scale_key!r} has shape {scale_file.shape(scale_raw)}, expected "
                    f"{expected} (128x128 blocks of {tuple(shape)})"
                )
            self.used.add(scale_key)
            return self._warn_non_finite(key, dequantize_fp8_block(array, scale_file.get(scale_raw)))
        if array.dtype in _FP8_DTYPES:
            raise CheckpointError(f"tensor {key!r} is {array.dtype} but has no {scale_key!r}")
        return self._warn_non_finite(key, array)

    def _warn_non_finite(self, key: str, array: np.ndarray) -> np.ndarray:
        """Non-finite weights load (a checkpoint of a diverged run is still worth inspecting), loudly."""
        bad = count_non_finite(array)
        if bad:
            file, raw = self.files[key]
            warnings.warn(f"{file.path}: tensor {raw!r} holds {bad} non-finite value(s) (NaN/inf) of "
                          f"{array.size}", CheckpointWarning, stacklevel=4)
        return array
