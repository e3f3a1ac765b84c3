"""OCP Microscaling (MX v1.0) block quantization: 32 consecutive elements along one axis share one
E8M0 scale X = 2^(bits - 127); elements are q = RNE(clip(x / X, -max, max)) in E4M3 or E5M2 (MXFP8),
or E2M1 (MXFP4). In a GEMM the block axis must be the contraction axis.

Scale rule. The default is RCEIL (NVIDIA's MXFP8 recipe, cuBLAS/cuDNN, `jax.nn`'s mxfp8, torchao RCEIL,
Blackwell `cvt.rp.satfinite.ue8m0x2.f32`):

    X = 2^ceil(log2(amax / max_elem)),  exponent clamped to [-127, 127]

so amax / X lands in (max/2, max] and nothing is ever clipped. OCP's FLOOR rule,
X = 2^(floor(log2 amax) - emax_elem), puts amax / X in [2^emax, 2^(emax+1)) = [256, 512) for E4M3, so
values above 448 saturate: 1.1% of Gaussian elements in our measurement, and the reason pretraining can
diverge under FLOOR (arXiv 2506.08027). FLOOR is kept as `scale_rule="floor"` for ablations.

ceil(log2 d) is taken from the FP32 bits of d = amax / max_elem (biased exponent, +1 if any mantissa bit
is set), so no transcendental rounding is involved. Special blocks: all zeros -> scale bits 0x00
(2^-127) and zero elements; any NaN or inf in the block -> scale bits 0xFF (NaN) and NaN elements
(E4M3/E5M2). XLA:CPU flushes FP32 subnormals, so blocks whose amax is below ~5e-36 (d subnormal) are
not bit-exact with an IEEE reference there.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from c2jax.kernels.blocking import from_blocks, scales_to_axis, scales_to_last, to_blocks
from c2jax.kernels.formats import (
    E8M0_NAN,
    ElementFormat,
    block_amax,
    check_division,
    clip_cast,
    divide,
    divide_pow2,
    e8m0_bits,
    e8m0_from_bits,
    element_format,
    f32_exponent_fields,
    not_clipped,
    pow2_from_biased,
)

MX_BLOCK = 32
SCALE_RULES = ("rceil", "floor")


class MXTensor(NamedTuple):
    values: jnp.ndarray  # operand shape, element dtype
    scales: jnp.ndarray  # operand shape with the block axis of length ceil(K / block), float8_e8m0fnu


def mx_scale_bits(amax: jnp.ndarray, fmt: ElementFormat, scale_rule: str = "rceil", *,
                  barrier: bool = True) -> jnp.ndarray:
    """Biased E8M0 exponent (int32 in [0, 255]) of the shared scale of blocks with the given amax.
    `barrier=False` inside Pallas kernels (formats.divide)."""
    if scale_rule == "rceil":
        exponent, mantissa = f32_exponent_fields(divide(amax, fmt.max_value, "ieee", barrier=barrier))
        # normal d: ceil(log2 d) + 127 = biased exponent, +1 unless d is a power of two.
        # subnormal d (< 2^-126): ceil(log2 d) is -126 if d > 2^-127, else clamped to -127.
        biased = jnp.where(exponent > 0, exponent + (mantissa != 0), (mantissa > 0x400000).astype(jnp.int32))
    elif scale_rule == "floor":
        exponent, _ = f32_exponent_fields(amax)
        biased = jnp.where(exponent > 0, exponent - fmt.emax, 0)
    else:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    biased = jnp.clip(biased, 0, 254)
    return jnp.where(jnp.isfinite(amax), biased, E8M0_NAN)


def _quantize_blocks(x, axis, fmt, block, scale_rule, division):
    """Block view of x, biased scale bits [..., nb] and the scaled (pre-clip) values [..., nb, block]."""
    check_division(division)
    xb = to_blocks(x.astype(jnp.float32), axis, block)
    amax = block_amax(xb)
    biased = mx_scale_bits(amax, fmt, scale_rule)
    scaled = divide_pow2(xb, biased[..., None], division)
    return biased, scaled


def quantize_mx(x: jnp.ndarray, axis: int = -1, fmt: str | ElementFormat = "e4m3", block: int = MX_BLOCK,
                scale_rule: str = "rceil", division: str = "ieee") -> MXTensor:
    """MX-quantize x along `axis` (blocks of `block` consecutive elements; see module docstring)."""
    fmt = element_format(fmt)
    biased, scaled = _quantize_blocks(x, axis, fmt, block, scale_rule, division)
    values = from_blocks(clip_cast(scaled, fmt), axis, x.shape[axis])
    return MXTensor(values, scales_to_axis(e8m0_from_bits(biased), axis))


def dequantize_mx(q: MXTensor, axis: int = -1, block: int = MX_BLOCK) -> jnp.ndarray:
    """x ~= q_i * X, in float32."""
    length = q.values.shape[axis]
    vb = to_blocks(q.values.astype(jnp.float32), axis, block)
    scale = pow2_from_biased(e8m0_bits(scales_to_last(q.scales, axis)))
    return from_blocks(vb * scale[..., None], axis, length)


def fake_quantize_mx(x, axis=-1, fmt="e4m3", block=MX_BLOCK, scale_rule="rceil", division="ieee"):
    """(dequantize(quantize(x)), mask of elements that were not clipped), both in x's layout."""
    fmt = element_format(fmt)
    biased, scaled = _quantize_blocks(x, axis, fmt, block, scale_rule, division)
    deq = clip_cast(scaled, fmt).astype(jnp.float32) * pow2_from_biased(biased)[..., None]
    length = x.shape[axis]
    return from_blocks(deq, axis, length), from_blocks(not_clipped(scaled, fmt), axis, length)
