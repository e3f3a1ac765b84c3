"""Reshape an axis into scale blocks and back. Quantizers work on [..., n_blocks, block] views of the
operand with the quantized (contraction) axis last; a length that is not a multiple of the block is
zero-padded, which leaves every block's amax unchanged (real kernels pad K the same way)."""

from __future__ import annotations

import math

import jax.numpy as jnp


def normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def to_blocks(x: jnp.ndarray, axis: int, block: int) -> jnp.ndarray:
    """[..., K, ...] -> [..., ceil(K / block), block] with `axis` moved last and zero-padded."""
    axis = normalize_axis(axis, x.ndim)
    x = jnp.moveaxis(x, axis, -1)
    length = x.shape[-1]
    padded = block * math.ceil(length / block)
    if padded != length:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - length)])
    return x.reshape(*x.shape[:-1], padded // block, block)


def from_blocks(xb: jnp.ndarray, axis: int, length: int) -> jnp.ndarray:
    """Inverse of `to_blocks` for an array of original rank xb.ndim - 1 and axis length `length`."""
    x = xb.reshape(*xb.shape[:-2], -1)[..., :length]
    return jnp.moveaxis(x, -1, normalize_axis(axis, x.ndim))


def scales_to_axis(scales: jnp.ndarray, axis: int) -> jnp.ndarray:
    """Per-block scales [..., n_blocks] (axis last) back to the operand's axis order."""
    return jnp.moveaxis(scales, -1, normalize_axis(axis, scales.ndim))


def scales_to_last(scales: jnp.ndarray, axis: int) -> jnp.ndarray:
    return jnp.moveaxis(scales, normalize_axis(axis, scales.ndim), -1)
