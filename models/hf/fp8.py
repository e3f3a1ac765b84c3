"""FP8 (DeepSeek-V3 release format): float8_e4m3fn weights, float32 `weight_scale_inv` per 128x128 block."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from c2jax.models.hf.errors import CheckpointError

FP8_BLOCK = (128, 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def dequantize_fp8_block(
    q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = FP8_BLOCK
) -> np.ndarray:
    """W[i, j] = float(q[i, j]) * scale_inv[i // bm, j // bn]; scale_inv has ceil(m/bm) x ceil(n/bn) entries
    (the last block row/column may be partial)."""
    m, n = q.shape
    bm, bn = block
    expected = (math.ceil(m / bm), math.ceil(n / bn))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not cover a {q.shape} weight "
            f"in {bm}x{bn} blocks (expected {expected})"
        )
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), bm, axis=0), bn, axis=1)[:m, :n]
    return q.astype(np.float32) * scale


def quantize_fp8_block(w: np.ndarray, block: tuple[int, int] = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(q float8_e4m3fn, scale_inv float32) with per-block scale amax / 448 (round to nearest even)."""
    w = np.asarray(w, np.float32)
    m, n = w.shape
    bm, bn = block
    gm, gn = math.ceil(m / bm), math.ceil(n / bn)
    padded = np.zeros((gm * bm, gn * bn), np.float32)
    padded[:m, :n] = w
    amax = np.abs(padded.reshape(gm, bm, gn, bn)).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale_inv, bm, axis=0), bn, axis=1)[:m, :n]
    q = np.clip(w / full, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale_inv
