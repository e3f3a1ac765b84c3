"""NVFP4 (arXiv 2509.25149) and Composer 2's per-token variant (report sec. 6).

Two-level scaling of E2M1 elements along one axis (the GEMM contraction axis), 16-element blocks:

    s_enc = 6 * 448 / amax_g            FP32 encode scale of the group g (1 if amax_g == 0)
    s_dec = 1 / s_enc                   FP32 decode scale, stored
    d_b   = E4M3_RNE(amax_b / 6 * s_enc)  block decode scale, <= 448 by construction
    q_i   = E2M1_RNE(clip(x_i / (fp32(d_b) * s_dec), -6, 6))
    x_i  ~= (q_i * d_b) * s_dec

`scaling` chooses the group g behind amax_g:
  "per_tensor"  the whole operand (the NVFP4 spec). One token's quantization then depends on every
                other token in the batch: a large outlier elsewhere shrinks s_enc and pushes small blocks
                to d_b = 0. Composer 2 found it made RL diverge and leak information across sequences.
  "per_token"   every row along `axis` separately (Composer 2): a token's codes depend only on that token.
                For a weight quantized along its input axis this is one scale per output channel.

We divide by the *rounded* block scale fp32(d_b) * s_dec, which is what the block-scaled MMA decodes
(ThunderKittens' reference divides by the unrounded one). A block whose d_b rounds to 0 (amax_b below
2^-9 / 448 of amax_g) is all zeros. `division` applies to the per-element division x_i / eff_b, the hot
loop a kernel would approximate; the scale arithmetic is always IEEE. Inputs must be finite: E2M1 has
no NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from c2jax.kernels.blocking import from_blocks, normalize_axis, scales_to_axis, scales_to_last, to_blocks
from c2jax.kernels.formats import E2M1, E4M3, check_division, clip_cast, divide, not_clipped

NVFP4_BLOCK = 16
SCALINGS = ("per_tensor", "per_token")
_ENCODE_RANGE = E2M1.max_value * E4M3.max_value  # 6 * 448


class NVFP4Tensor(NamedTuple):
    values: jnp.ndarray  # operand shape, float4_e2m1fn
    block_scales: jnp.ndarray  # operand shape with the block axis of length ceil(K / 16), float8_e4m3fn
    tensor_scale: jnp.ndarray  # FP32 s_dec: shape () per tensor, operand shape with axis length 1 per token


def _group_amax(xb: jnp.ndarray, scaling: str) -> jnp.ndarray:
    """amax_g broadcastable against the per-block amax [..., nb]."""
    if scaling == "per_tensor":
        return jnp.max(jnp.abs(xb))
    if scaling == "per_token":
        return jnp.max(jnp.abs(xb), axis=(-2, -1))[..., None]
    raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")


def _quantize_blocks(x, axis, scaling, division, block):
    check_division(division)
    xb = to_blocks(x.astype(jnp.float32), axis, block)
    amax_g = _group_amax(xb, scaling)
    s_enc = jnp.where(amax_g > 0, divide(_ENCODE_RANGE, amax_g, "ieee"), jnp.float32(1.0))
    s_enc = jnp.minimum(s_enc, jnp.finfo(jnp.float32).max)  # amax_g tiny: keep s_dec > 0
    s_dec = divide(1.0, s_enc, "ieee")
    amax_b = jnp.max(jnp.abs(xb), axis=-1)
    d_b = clip_cast(divide(amax_b, E2M1.max_value, "ieee") * s_enc, E4M3)
    eff = d_b.astype(jnp.float32) * s_dec
    scaled = jnp.where(eff[..., None] > 0, divide(xb, eff[..., None], division), 0.0)
    return scaled, d_b, s_dec


def quantize_nvfp4(x: jnp.ndarray, axis: int = -1, scaling: str = "per_token", division: str = "ieee",
                   block: int = NVFP4_BLOCK) -> NVFP4Tensor:
    """NVFP4-quantize x along `axis` (see module docstring for the equations and `scaling`)."""
    scaled, d_b, s_dec = _quantize_blocks(x, axis, scaling, division, block)
    values = from_blocks(clip_cast(scaled, E2M1), axis, x.shape[axis])
    if scaling == "per_token":
        s_dec = jnp.moveaxis(s_dec, -1, normalize_axis(axis, x.ndim))
    return NVFP4Tensor(values, scales_to_axis(d_b, axis), s_dec)


def dequantize_nvfp4(q: NVFP4Tensor, axis: int = -1, block: int = NVFP4_BLOCK) -> jnp.ndarray:
    """x ~= (q_i * d_b) * s_dec, in float32."""
    length = q.values.shape[axis]
    vb = to_blocks(q.values.astype(jnp.float32), axis, block)
    d_b = scales_to_last(q.block_scales, axis).astype(jnp.float32)
    s_dec = q.tensor_scale if q.tensor_scale.ndim == 0 else scales_to_last(q.tensor_scale, axis)
    deq = vb * d_b[..., None] * (s_dec if q.tensor_scale.ndim == 0 else s_dec[..., None])
    return from_blocks(deq, axis, length)


def fake_quantize_nvfp4(x, axis=-1, scaling="per_token", division="ieee", block=NVFP4_BLOCK):
    """(dequantize(quantize(x)), mask of elements that were not clipped), both in x's layout."""
    scaled, d_b, s_dec = _quantize_blocks(x, axis, scaling, division, block)
    s_dec = s_dec if s_dec.ndim == 0 else s_dec[..., None]
    deq = clip_cast(scaled, E2M1).astype(jnp.float32) * d_b.astype(jnp.float32)[..., None] * s_dec
    length = x.shape[axis]
    return from_blocks(deq, axis, length), from_blocks(not_clipped(scaled, E2M1), axis, length)
