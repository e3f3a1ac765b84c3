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

The NVFP4 variant (`grouped_matmul_nvfp4_pallas`, Composer 2's per-token forward) takes E2M1 codes, E4M3 scales
per 16 K-elements and one FP32 scale per lhs row (token) and per rhs column (output channel). Per 16-block it
dequantizes codes x block scales in registers to bf16 (exact: at most 5 significant bits), runs a bf16 dot with
FP32 accumulation, and multiplies the accumulator by the row and column FP32 scales once at the end (they are
constant along K).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from c2jax.kernels.mxfp8 import MX_BLOCK
from c2jax.kernels.nvfp4 import NVFP4_BLOCK

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


# ------------------------------------------------------------------------------------------ block-scaled NVFP4
NVFP4_KERNEL_NAME = "grouped_matmul_nvfp4"


def _decode_e2m1(codes):
    """E2M1 codes (sign bit 3, exponent bits 2-1, mantissa bit 0; in uint8) -> float32 values, exactly:
    exponent 0 is the subnormal 0.5 * m, else 2^(e-1) * (1 + m/2)."""
    c = codes.astype(jnp.int32)
    e, m = (c >> 1) & 3, (c & 1).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << jnp.maximum(e - 1, 0)).astype(jnp.float32))
    return jnp.where((c & 8) != 0, -mag, mag)


def _nvfp4_kernel(offsets_ref, lhs_ref, rhs_ref, lhs_bs_ref, rhs_bs_ref, lhs_ts_ref, rhs_ts_ref, out_ref, *,
                  block_m, block_n, num_k_blocks):
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = offsets_ref[g] + i * block_m
    end = offsets_ref[g + 1]
    cols = pl.ds(j * block_n, block_n)

    @pl.when(start < end)
    def _():
        def body(kb, acc):  # one 16-element NVFP4 block of K per step: one E4M3 block scale per row / column
            k0 = pl.multiple_of(kb * NVFP4_BLOCK, NVFP4_BLOCK)
            a = _decode_e2m1(pltr.load(lhs_ref.at[pl.ds(start, block_m), pl.ds(k0, NVFP4_BLOCK)]))
            b = _decode_e2m1(pltr.load(rhs_ref.at[g, pl.ds(k0, NVFP4_BLOCK), cols]))
            sa = pltr.load(lhs_bs_ref.at[pl.ds(start, block_m), pl.ds(kb, 1)])
            sb = pltr.load(rhs_bs_ref.at[g, pl.ds(kb, 1), cols])
            # E2M1 x E4M3 has at most 5 significant bits and lies in [2^-10, 2688]: exact in bfloat16, so the
            # bf16 MMA's products are exact and only the FP32 accumulation rounds
            a, b = (a * sa).astype(jnp.bfloat16), (b * sb).astype(jnp.bfloat16)
            return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, num_k_blocks, body, jnp.zeros((block_m, block_n), jnp.float32))
        # the FP32 per-token (row) and per-output-channel (column) scales are constant along K: applied once
        acc = acc * pltr.load(lhs_ts_ref.at[pl.ds(start, block_m), :]) * pltr.load(rhs_ts_ref.at[g, :, cols])
        rows = start + jnp.arange(block_m)
        pltr.store(out_ref.at[pl.ds(start, block_m), cols], acc.astype(out_ref.dtype), mask=(rows < end)[:, None])


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "interpret", "out_dtype", "num_warps",
                                             "num_stages"))
def _grouped_nvfp4(lhs_codes, lhs_bs, lhs_ts, rhs_codes, rhs_bs, rhs_ts, group_sizes, *, block_m, block_n,
                   interpret, out_dtype, num_warps=4, num_stages=3):
    m, k = lhs_codes.shape
    num_groups, _, n = rhs_codes.shape
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes.astype(jnp.int32))])

    def rows(a):  # lhs operands: padded to whole row tiles plus one tile, so a tile at the last row stays inside
        return jnp.pad(_pad_to(a, 0, block_m), [(0, block_m), (0, 0)])

    lhs_p, lhs_bs_p, lhs_ts_p = rows(lhs_codes), rows(lhs_bs.astype(jnp.float32)), rows(lhs_ts.astype(jnp.float32))
    rhs_p, rhs_bs_p = _pad_to(rhs_codes, 2, block_n), _pad_to(rhs_bs.astype(jnp.float32), 2, block_n)
    rhs_ts_p = _pad_to(rhs_ts.astype(jnp.float32), 2, block_n)
    n_pad = rhs_p.shape[2]
    out = pl.pallas_call(
        functools.partial(_nvfp4_kernel, block_m=block_m, block_n=block_n, num_k_blocks=k // NVFP4_BLOCK),
        out_shape=jax.ShapeDtypeStruct((lhs_p.shape[0], n_pad), out_dtype),
        grid=(num_groups, math.ceil(m / block_m), n_pad // block_n),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=NVFP4_KERNEL_NAME,
    )(offsets, lhs_p, rhs_p, lhs_bs_p, rhs_bs_p, lhs_ts_p, rhs_ts_p)
    valid = jnp.arange(m) < offsets[-1]
    return jnp.where(valid[:, None], out[:m, :n], jnp.zeros((), out_dtype))


_E2M1_STEPS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the positive E2M1 values in code order (code 0: zero)


def e2m1_codes(values: jnp.ndarray) -> jnp.ndarray:
    """float4_e2m1fn values -> their 4-bit codes (sign bit 3), one per uint8: what the NVFP4 kernel loads. Counted
    from the values, not bitcast: XLA:CPU's elemental emitter cannot bitcast 4-bit types (invalid LLVM IR)."""
    v = values.astype(jnp.float32)
    magnitude = sum((jnp.abs(v) >= step).astype(jnp.uint8) for step in _E2M1_STEPS)
    return magnitude + jnp.signbit(v).astype(jnp.uint8) * 8


def grouped_matmul_nvfp4_pallas(lhs_values, lhs_block_scales, lhs_scale, rhs_values, rhs_block_scales, rhs_scale,
                                group_sizes, *, block_m: int = 64, block_n: int = 64, interpret: bool = False,
                                out_dtype=jnp.bfloat16) -> jnp.ndarray:
    """Block-scaled NVFP4 grouped GEMM, both operands quantized along K with per-token FP32 scales
    (`quantize_nvfp4(.., axis=1, scaling="per_token")`): lhs_values [M, K] E2M1, lhs_block_scales [M, K/16] E4M3,
    lhs_scale [M, 1] FP32; rhs_values [G, K, N], rhs_block_scales [G, K/16, N], rhs_scale [G, 1, N].
    out[r, n] = s_r s_n sum_k (q d)_rk (q d)_kn: E2M1 codes and E4M3 block scales dequantized in the kernel to
    exact bf16 products, FP32 accumulation, the two FP32 scales applied to the accumulator. E2M1 travels as one
    4-bit code per byte (packing two per byte, the format's bandwidth saving, is not done)."""
    _check(lhs_values, rhs_values, group_sizes)
    k = lhs_values.shape[1]
    if k % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 grouped GEMM needs K a multiple of {NVFP4_BLOCK}, got {k}")
    m, (g, _, n) = lhs_values.shape[0], rhs_values.shape
    want = ((m, k // NVFP4_BLOCK), (m, 1), (g, k // NVFP4_BLOCK, n), (g, 1, n))
    got = (lhs_block_scales.shape, lhs_scale.shape, rhs_block_scales.shape, rhs_scale.shape)
    if got != want:
        raise ValueError(f"NVFP4 scale shapes {got} do not match values {lhs_values.shape}, {rhs_values.shape} "
                         f"(per-16 block scales along K, one FP32 scale per row / column): want {want}")
    return _grouped_nvfp4(e2m1_codes(lhs_values), lhs_block_scales, lhs_scale, e2m1_codes(rhs_values),
                          rhs_block_scales, rhs_scale, group_sizes, block_m=block_m, block_n=block_n,
                          interpret=interpret, out_dtype=jnp.dtype(out_dtype))
