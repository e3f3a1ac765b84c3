"""Fused quantize + permute for expert dispatch: gather token rows into expert order and MXFP8-quantize
them (row-wise, blocks of 32 along d) in the same pass, so the bf16 rows are read once and only FP8
values plus E8M0 scales are written (DeepSeek-V3 dispatches in FP8 for the same reason; Composer 2
quantizes tokens to MXFP8 before dispatch).

    permute_quantize_mx(x [T, d], src [R]) == quantize_mx(x_padded[src], axis=-1)

where x_padded is x with one zero row appended: src == T marks an empty buffer slot (capacity padding),
which yields zero codes and scale bits 0x00, exactly what quantizing a zero row gives.

Implementations (kernels/dispatch.py, op "permute_quantize_mx"): `xla` (gather then quantize under one
jit; XLA fuses the gather into the quantize loop) and `pallas_triton` (one program per output row that
loads its source row block by block; GPU, or CPU with interpret=True).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from c2jax.kernels import dispatch
from c2jax.kernels.formats import block_amax, clip_cast, divide_pow2, e8m0_from_bits, element_format
from c2jax.kernels.mxfp8 import MX_BLOCK, MXTensor, mx_scale_bits, quantize_mx

OP = "permute_quantize_mx"


def _check(x, src):
    if x.ndim != 2 or src.ndim != 1:
        raise ValueError(f"expected x [T, d] and src [R], got {x.shape} and {src.shape}")
    if x.shape[1] % MX_BLOCK:
        raise ValueError(f"permute_quantize_mx needs d a multiple of {MX_BLOCK}, got {x.shape[1]}")


def _padded(x):
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])


@functools.partial(jax.jit, static_argnames=("fmt", "scale_rule", "division"))
def permute_quantize_mx_xla(x, src, fmt="e4m3", scale_rule="rceil", division="ieee") -> MXTensor:
    _check(x, src)
    return quantize_mx(_padded(x)[src], axis=-1, fmt=fmt, scale_rule=scale_rule, division=division)


def _kernel(src_ref, x_ref, values_ref, bits_ref, *, num_blocks, fmt, scale_rule, division):
    r = pl.program_id(0)
    s = src_ref[r]

    def body(b, carry):
        k0 = pl.multiple_of(b * MX_BLOCK, MX_BLOCK)
        block = pltr.load(x_ref.at[pl.ds(s, 1), pl.ds(k0, MX_BLOCK)]).astype(jnp.float32)
        biased = mx_scale_bits(block_amax(block, axis=1)[:, None], fmt, scale_rule, barrier=False)  # [1, 1]
        pltr.store(values_ref.at[pl.ds(r, 1), pl.ds(k0, MX_BLOCK)],
                   clip_cast(divide_pow2(block, biased, division, barrier=False), fmt))
        pltr.store(bits_ref.at[pl.ds(r, 1), pl.ds(b, 1)], biased.astype(jnp.uint8))
        return carry

    jax.lax.fori_loop(0, num_blocks, body, 0)


@functools.partial(jax.jit, static_argnames=("fmt", "scale_rule", "division", "interpret"))
def permute_quantize_mx_pallas(x, src, fmt="e4m3", scale_rule="rceil", division="ieee",
                               interpret=False) -> MXTensor:
    _check(x, src)
    fmt_ = element_format(fmt)
    rows, d = src.shape[0], x.shape[1]
    values, bits = pl.pallas_call(
        functools.partial(_kernel, num_blocks=d // MX_BLOCK, fmt=fmt_, scale_rule=scale_rule, division=division),
        out_shape=(jax.ShapeDtypeStruct((rows, d), fmt_.dtype),
                   jax.ShapeDtypeStruct((rows, d // MX_BLOCK), jnp.uint8)),
        grid=(rows,),
        compiler_params=pltr.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="permute_quantize_mx",
    )(src.astype(jnp.int32), _padded(x))
    return MXTensor(values, e8m0_from_bits(bits))


dispatch.register(OP, dispatch.Implementation(
    "pallas_triton", permute_quantize_mx_pallas, ("gpu",), interpretable=True,
    description="Pallas Triton row-gather + MX quantize"))
dispatch.register(OP, dispatch.Implementation(
    "xla", permute_quantize_mx_xla, ("cpu", "gpu", "tpu"), description="gather + quantize, fused by XLA"))


def permute_quantize_mx(x, src, fmt="e4m3", scale_rule="rceil", division="ieee", impl=None) -> MXTensor:
    """MXFP8 codes and E8M0 scales of x_padded[src] (module docstring), through the registry."""
    return dispatch.call(OP, x, src, fmt=fmt, scale_rule=scale_rule, division=division, impl=impl)
