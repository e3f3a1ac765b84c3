"""Pallas grouped GEMM for expert-sorted rows, Triton backend (portable to H100/H200/B200; runs on CPU
with interpret=True).

out[r] = lhs[r] @ rhs[g(r)] for the rows r of group g (rows sorted by group, group_sizes[g] each);
rows past sum(group_sizes) are zero, as in `jax.lax.ragged_dot`.

Grid (G, ceil(M / block_m), N / block_n), as in tokamax's Triton ragged_dot: program (g, i, j) handles
rows [offset_g + i*block_m, offset_g + (i+1)*block_m) of group g and returns at once if that start is
past the group's end, so empty groups cost one branch per program. A tile that runs into the next group
computes those rows but stores only its own (row mask). lhs is padded with block_m zero rows so no load
ever leaves the buffer; K and N are zero-padded to the block sizes, which adds nothing to the sums.

The block-scaled variant takes FP8 values with one FP32 scale per 32 K-elements of each lhs row and of
each rhs column (MXFP8 E8M0 scales decoded to FP32 by the wrapper); it accumulates
sum_kb dot(a_kb, b_kb) * sa[:, kb] * sb[kb, :] in FP32: the dequantize-in-register scheme of Hopper.
Blackwell's native block-scaled MMA (tcgen05 with scales in TMEM) is not expressible in Pallas-Triton;
see kernels/jax_triton_grouped.py for the `tl.dot_scaled` kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from c2jax.kernels.mxfp8 import MX_BLOCK

MX_KERNEL_NAME = "grouped_matmul_mx"  # the block-scaled kernel's pallas_call name (the bf16 one: "grouped_matmul")


def _pad_to(a, axis, multiple):
    extra = -a.shape[axis] % multiple
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


def _kernel(offsets_ref, lhs_ref, rhs_ref, *rest, block_m, block_n, block_k, num_k_blocks, scaled):
    if scaled:
        lhs_scale_ref, rhs_scale_ref, out_ref = rest
    else:
        (out_ref,) = rest
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = offsets_ref[g] + i * block_m
    end = offsets_ref[g + 1]

    @pl.when(start < end)
    def _():
        def body(kb, acc):
            k0 = pl.multiple_of(kb * block_k, block_k)
            a = pltr.load(lhs_ref.at[pl.ds(start, block_m), pl.ds(k0, block_k)])
            b = pltr.load(rhs_ref.at[g, pl.ds(k0, block_k), pl.ds(j * block_n, block_n)])
            part = jnp.dot(a, b, preferred_element_type=jnp.float32)
            if scaled:  # block_k == 32: one scale column per step
                sa = pltr.load(lhs_scale_ref.at[pl.ds(start, block_m), pl.ds(kb, 1)])
                sb = pltr.load(rhs_scale_ref.at[g, pl.ds(kb, 1), pl.ds(j * block_n, block_n)])
                part = part * sa * sb
            return acc + part

        acc = jax.lax.fori_loop(0, num_k_blocks, body, jnp.zeros((block_m, block_n), jnp.float32))
        rows = start + jnp.arange(block_m)
        pltr.store(out_ref.at[pl.ds(start, block_m), pl.ds(j * block_n, block_n)], acc.astype(out_ref.dtype),
                   mask=(rows < end)[:, None])


def _check(lhs, rhs, group_sizes):
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] or group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"expected lhs [M, K], rhs [G, K, N], group_sizes [G], got {lhs.shape}, {rhs.shape}, "
                         f"{group_sizes.shape}")


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret", "out_dtype",
                                             "num_warps", "num_stages", "name"))
def _grouped(lhs, rhs, group_sizes, lhs_scales=None, rhs_scales=None, *, block_m, block_n, block_k, interpret,
             out_dtype, num_warps=4, num_stages=3, name="grouped_matmul"):
    m, _ = lhs.shape
    num_groups, _, n = rhs.shape
    scaled = lhs_scales is not None
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes.astype(jnp.int32))])
    lhs_p = _pad_to(_pad_to(lhs, 1, block_k), 0, block_m)
    lhs_p = jnp.pad(lhs_p, [(0, block_m), (0, 0)])  # a tile starting at the last row stays inside
    rhs_p = _pad_to(_pad_to(rhs, 1, block_k), 2, block_n)
    k_pad, n_pad = lhs_p.shape[1], rhs_p.shape[2]
    operands = [offsets, lhs_p, rhs_p]
    if scaled:
        lhs_s = jnp.pad(_pad_to(lhs_scales.astype(jnp.float32), 0, block_m), [(0, block_m), (0, 0)])
        rhs_s = _pad_to(rhs_scales.astype(jnp.float32), 2, block_n)
        operands += [lhs_s, rhs_s]
    out = pl.pallas_call(
        functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                          num_k_blocks=k_pad // block_k, scaled=scaled),
        out_shape=jax.ShapeDtypeStruct((lhs_p.shape[0], n_pad), out_dtype),
        grid=(num_groups, math.ceil(m / block_m), n_pad // block_n),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,  # in the Triton custom call's backend config: how a lowering check tells the kernels apart
    )(*operands)
    # rows past sum(group_sizes) were never stored: zero them as ragged_dot does
    valid = jnp.arange(m) < offsets[-1]
    return jnp.where(valid[:, None], out[:m, :n], jnp.zeros((), out_dtype))


def grouped_matmul_pallas(lhs: jnp.ndarray, rhs: jnp.ndarray, group_sizes: jnp.ndarray, *, block_m: int = 64,
                          block_n: int = 64, block_k: int = 32, interpret: bool = False,
                          preferred_element_type=None) -> jnp.ndarray:
    """lhs [M, K] rows sorted by group, rhs [G, K, N], group_sizes [G] -> [M, N] (FP32 accumulation).
    Forward only (the training path differentiates through its own custom VJP)."""
    _check(lhs, rhs, group_sizes)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    return _grouped(lhs, rhs, group_sizes, block_m=block_m, block_n=block_n, block_k=block_k,
                    interpret=interpret, out_dtype=out_dtype)


def grouped_matmul_mx_pallas(lhs_values, lhs_scales, rhs_values, rhs_scales, group_sizes, *, block_m: int = 64,
                             block_n: int = 64, interpret: bool = False, out_dtype=jnp.bfloat16) -> jnp.ndarray:
    """Block-scaled grouped GEMM: lhs_values [M, K] FP8 with lhs_scales [M, K/32], rhs_values [G, K, N] FP8
    with rhs_scales [G, K/32, N] (E8M0 or FP32; both quantized along K, e.g. `quantize_mx(.., axis=1)`)."""
    _check(lhs_values, rhs_values, group_sizes)
    k = lhs_values.shape[1]
    if k % MX_BLOCK:
        raise ValueError(f"block-scaled grouped GEMM needs K a multiple of {MX_BLOCK}, got {k}")
    if lhs_scales.shape != (lhs_values.shape[0], k // MX_BLOCK) or rhs_scales.shape != (
            rhs_values.shape[0], k // MX_BLOCK, rhs_values.shape[2]):
        raise ValueError(f"scale shapes {lhs_scales.shape}, {rhs_scales.shape} do not match values "
                         f"{lhs_values.shape}, {rhs_values.shape} with blocks of {MX_BLOCK} along K")
    return _grouped(lhs_values, rhs_values, group_sizes, lhs_scales, rhs_scales, block_m=block_m,
                    block_n=block_n, block_k=MX_BLOCK, interpret=interpret, out_dtype=jnp.dtype(out_dtype),
                    name=MX_KERNEL_NAME)
