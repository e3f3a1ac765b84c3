"""DeepSeek-V3 FP8 (sec. 3.3; DeepGEMM's SM90 format): E4M3 everywhere, FP32 scales from the current
amax, activations per 1x128 tile along the contraction axis, weights per 128x128 block.

    s = amax / 448 (1 if the tile is all zeros),  q = E4M3_RNE(clip(x / s, -448, 448)),  x ~= q * s

128x128 weight blocks are symmetric, so the forward (contract the input axis) and dgrad (contract the
output axis) see the very same quantized weight, which 1x128 tiles would not give. The Hopper kernel
also promotes partial sums to FP32 every 128 K-elements; with dequantized operands and an FP32 dot, as
here, that is implicit. Non-finite inputs give a NaN scale and NaN codes for their tile.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp

from c2jax.kernels.blocking import from_blocks, normalize_axis, scales_to_axis, scales_to_last, to_blocks
from c2jax.kernels.formats import E4M3, block_amax, check_division, clip_cast, divide, not_clipped

TILE = 128


class FP8BlockTensor(NamedTuple):
    values: jnp.ndarray  # operand shape, float8_e4m3fn
    scales: jnp.ndarray  # FP32; tiles: axis length ceil(K/128); blocks: both block axes ceil(./128)


def _scale_from_amax(amax):
    return jnp.where(amax > 0, divide(amax, E4M3.max_value, "ieee"), jnp.float32(1.0))


def _tiles(x, axis, tile, division):
    check_division(division)
    xb = to_blocks(x.astype(jnp.float32), axis, tile)
    scale = _scale_from_amax(block_amax(xb))
    return divide(xb, scale[..., None], division), scale


def quantize_fp8_tiles(x: jnp.ndarray, axis: int = -1, tile: int = TILE, division: str = "ieee") -> FP8BlockTensor:
    """Activation tiles: 1 x `tile` consecutive elements along `axis`."""
    scaled, scale = _tiles(x, axis, tile, division)
    return FP8BlockTensor(from_blocks(clip_cast(scaled, E4M3), axis, x.shape[axis]), scales_to_axis(scale, axis))


def dequantize_fp8_tiles(q: FP8BlockTensor, axis: int = -1, tile: int = TILE) -> jnp.ndarray:
    vb = to_blocks(q.values.astype(jnp.float32), axis, tile)
    return from_blocks(vb * scales_to_last(q.scales, axis)[..., None], axis, q.values.shape[axis])


def fake_quantize_fp8_tiles(x, axis=-1, tile=TILE, division="ieee"):
    scaled, scale = _tiles(x, axis, tile, division)
    deq = clip_cast(scaled, E4M3).astype(jnp.float32) * scale[..., None]
    length = x.shape[axis]
    return from_blocks(deq, axis, length), from_blocks(not_clipped(scaled, E4M3), axis, length)


def _block_view(w, axes, block):
    """w with `axes` = (a, b) moved last, zero-padded, as [..., na, block, nb, block]."""
    a, b = (normalize_axis(ax, w.ndim) for ax in axes)
    if a == b:
        raise ValueError(f"weight block axes must differ, got {axes}")
    w = jnp.moveaxis(w, (a, b), (-2, -1))
    rows, cols = w.shape[-2:]
    pr, pc = block * math.ceil(rows / block), block * math.ceil(cols / block)
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, pr - rows), (0, pc - cols)])
    return w.reshape(*w.shape[:-2], pr // block, block, pc // block, block), (a, b), (rows, cols)


def _unblock(wb, axes, shape2):
    w = wb.reshape(*wb.shape[:-4], wb.shape[-4] * wb.shape[-3], wb.shape[-2] * wb.shape[-1])
    w = w[..., : shape2[0], : shape2[1]]
    return jnp.moveaxis(w, (-2, -1), axes)


def _blocks(w, axes, block, division):
    check_division(division)
    wb, axes, shape2 = _block_view(w.astype(jnp.float32), axes, block)
    scale = _scale_from_amax(block_amax(wb, axis=(-3, -1)))  # [..., na, nb]
    return divide(wb, scale[..., :, None, :, None], division), scale, axes, shape2


def quantize_fp8_blocks(w: jnp.ndarray, axes: tuple[int, int] = (-2, -1), block: int = TILE,
                        division: str = "ieee") -> FP8BlockTensor:
    """Weight blocks: `block` x `block` over `axes`; scales keep the operand's axis order."""
    scaled, scale, axes, shape2 = _blocks(w, axes, block, division)
    return FP8BlockTensor(_unblock(clip_cast(scaled, E4M3), axes, shape2), jnp.moveaxis(scale, (-2, -1), axes))


def dequantize_fp8_blocks(q: FP8BlockTensor, axes: tuple[int, int] = (-2, -1), block: int = TILE) -> jnp.ndarray:
    vb, axes, shape2 = _block_view(q.values.astype(jnp.float32), axes, block)
    scale = jnp.moveaxis(q.scales, axes, (-2, -1))
    return _unblock(vb * scale[..., :, None, :, None], axes, shape2)


def fake_quantize_fp8_blocks(w, axes=(-2, -1), block=TILE, division="ieee"):
    scaled, scale, axes, shape2 = _blocks(w, axes, block, division)
    deq = clip_cast(scaled, E4M3).astype(jnp.float32) * scale[..., :, None, :, None]
    return _unblock(deq, axes, shape2), _unblock(not_clipped(scaled, E4M3), axes, shape2)
