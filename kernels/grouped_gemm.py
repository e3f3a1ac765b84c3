"""Grouped GEMM over expert-sorted rows: out[r] = lhs[r] @ rhs[group(r)], the MoE expert matmul.

    grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G], impl=None) -> [M, N]

Rows are sorted by group (group_sizes[g] consecutive rows each); rows past sum(group_sizes) give zeros.
Implementations (kernels/dispatch.py picks the first native one; `impl=` or C2JAX_KERNEL_IMPL override):

    mosaic_sm90     JAX's Hopper Mosaic-GPU ragged_dot (wgmma, TMA; H100/H200; elsewhere interpret=True runs it
                    in Pallas' Mosaic GPU interpreter, bf16 with K % 64 == 0 and N % 128 == 0)
    pallas_triton   kernels/pallas_grouped.py (any NVIDIA GPU; CPU with interpret=True)
    jax_triton      kernels/jax_triton_grouped.py (needs jax_triton + a CUDA jaxlib; never auto-chosen)
    xla             sort-free capacity-padded batched einsum below (every backend; the CPU default)
    ragged_dot      jax.lax.ragged_dot, the oracle: XLA lowers it to a dense masked matmul with G x the
                    FLOPs on CPU (and on GPU in jaxlib 0.10), so it is never auto-chosen

The block-scaled form, op `grouped_matmul_mx` (MX_OP), takes MXFP8 operands quantized along K (kernels/mxfp8.py:
E4M3 values, E8M0 scales per 32) and multiplies them with FP32 accumulation:

    grouped_matmul_mx(lhs: MXTensor [M, K], rhs: MXTensor [G, K, N], group_sizes [G], impl=None, out_dtype=bf16)

    pallas_triton   kernels/pallas_grouped.py's block-scaled kernel (any NVIDIA GPU; CPU with interpret=True);
                    needs K % 32 == 0 (refuses otherwise, so the registry falls through)
    xla             the reference: dequantize both operands to FP32, then the capacity-padded einsum below
                    (every backend; the CPU default)
    jax_triton      `tl.dot_scaled` (Blackwell's native block-scaled MMA), needs jax-triton; never auto-chosen

The NVFP4 form, op `grouped_matmul_nvfp4` (NVFP4_OP), takes operands quantized along K with per-token scaling
(kernels/nvfp4.py: E2M1 values, E4M3 scales per 16, one FP32 scale per lhs row and per rhs column; Composer 2's
forward):

    grouped_matmul_nvfp4(lhs: NVFP4Tensor [M, K], rhs: NVFP4Tensor [G, K, N], group_sizes [G], impl=None,
                         out_dtype=bf16)

    pallas_triton   kernels/pallas_grouped.py's NVFP4 kernel (any NVIDIA GPU; CPU with interpret=True): codes and
                    block scales dequantized in the kernel, bf16 dots with FP32 accumulation, the FP32 row and
                    column scales on the accumulator; needs K % 16 == 0 (refuses otherwise)
    xla             the reference: dequantize both operands to FP32, then the capacity-padded einsum below

The XLA fallback gathers each group's rows into a [G, C, K] buffer (C = per-group capacity, empty slots
read an appended zero row), runs one batched einsum and gathers the rows back. C is static, so it is
picked at run time from a few buckets (`capacity_factors` x the balanced load, then M, which always
fits) with `lax.switch`: nothing is ever dropped and balanced groups pay ~1.25x the useful FLOPs.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp

from c2jax.kernels import dispatch
from c2jax.kernels.mxfp8 import MX_BLOCK, MXTensor, dequantize_mx
from c2jax.kernels.nvfp4 import NVFP4_BLOCK, NVFP4Tensor, dequantize_nvfp4
from c2jax.kernels.pallas_grouped import (
    grouped_matmul_mx_pallas,
    grouped_matmul_nvfp4_pallas,
    grouped_matmul_pallas,
)

OP = "grouped_matmul"
MX_OP = "grouped_matmul_mx"
NVFP4_OP = "grouped_matmul_nvfp4"


def _check(lhs, rhs, group_sizes):
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] or group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"expected lhs [M, K], rhs [G, K, N], group_sizes [G], got {lhs.shape}, {rhs.shape}, "
                         f"{group_sizes.shape}")


def grouped_matmul_reference(lhs, rhs, group_sizes, preferred_element_type=None):
    """Oracle: jax.lax.ragged_dot at full FP32 precision."""
    _check(lhs, rhs, group_sizes)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=preferred_element_type)


def capacity_buckets(num_rows: int, num_groups: int, capacity_factors=(1.25, 2.0)) -> tuple[int, ...]:
    balanced = num_rows / num_groups
    caps = []
    for factor in capacity_factors:
        cap = min(num_rows, 8 * math.ceil(factor * balanced / 8))
        if not caps or cap > caps[-1]:
            caps.append(cap)
    if caps[-1] < num_rows:
        caps.append(num_rows)
    return tuple(caps)


def _pad_row(a):
    return jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])


def grouped_matmul_xla(lhs, rhs, group_sizes, capacity_factors=(1.25, 2.0), preferred_element_type=None):
    """Capacity-padded batched einsum (module docstring). Differentiable."""
    _check(lhs, rhs, group_sizes)
    m, _ = lhs.shape
    num_groups, _, n = rhs.shape
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    rows = jnp.arange(m, dtype=jnp.int32)
    row_group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)  # G for rows past the end
    rank = rows - starts[jnp.minimum(row_group, num_groups - 1)]
    buckets = capacity_buckets(m, num_groups, capacity_factors)

    def at(capacity, lhs, rhs):
        c = jnp.arange(capacity, dtype=jnp.int32)
        src = jnp.where(c[None, :] < sizes[:, None], starts[:, None] + c[None, :], m)
        buf = _pad_row(lhs)[src.reshape(-1)].reshape(num_groups, capacity, -1)
        out = jnp.einsum("gck,gkn->gcn", buf, rhs.astype(lhs.dtype), preferred_element_type=out_dtype)
        slot = jnp.where(row_group < num_groups, row_group * capacity + rank, num_groups * capacity)
        return _pad_row(out.reshape(num_groups * capacity, n))[slot]

    index = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets), jnp.max(sizes), side="left"), len(buckets) - 1)
    return jax.lax.switch(index, [lambda a, b, cap=cap: at(cap, a, b) for cap in buckets], lhs, rhs)


def _mosaic_gpu_interpreter():
    """Pallas' Mosaic GPU interpreter (jax 0.10: private, `jax._src.pallas.mosaic_gpu.interpret`): a context under
    which Mosaic GPU kernels traced run on the CPU, simulating shared memory, warpgroups, barriers and TMA. TMA
    zero-fills reads past a buffer's end (the ragged_dot kernel relies on it for the last row block), so
    out-of-bounds reads return zeros here instead of raising."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams, force_gpu_interpret_mode
    except ImportError as e:  # the private module moved: say so instead of failing obscurely
        raise RuntimeError(f"mosaic_sm90 interpret=True needs Pallas' Mosaic GPU interpreter, not found: {e}") from e
    params = InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")
    return force_gpu_interpret_mode(params)


def grouped_matmul_mosaic_sm90(lhs, rhs, group_sizes, preferred_element_type=None, block_m=128, block_n=128,
                               block_k=64, max_concurrent_steps=4, grid_block_n=1, interpret=False):
    """JAX's Hopper ragged_dot (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu): warpgroup MMA with TMA
    loads and a logarithmic ladder of TMA stores for the ragged tail. Hopper GPUs natively; with `interpret`, on
    any backend in Pallas' Mosaic GPU interpreter (slow: ~4 s a call at 64 x 128 x 256, for equality tests)."""
    _check(lhs, rhs, group_sizes)
    k, n = lhs.shape[1], rhs.shape[2]
    if lhs.dtype != jnp.bfloat16 or rhs.dtype != jnp.bfloat16 or preferred_element_type not in (None, jnp.bfloat16):
        raise NotImplementedError("mosaic_sm90 grouped matmul takes bfloat16 operands and output")
    if k % block_k or n % (block_n * grid_block_n):
        raise NotImplementedError(f"mosaic_sm90 needs K % {block_k} == 0 and N % {block_n * grid_block_n} == 0")
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # GPU kernel: only imported when chosen

    with _mosaic_gpu_interpreter() if interpret else contextlib.nullcontext():
        return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes.astype(jnp.int32), block_m=block_m,
                                          block_n=block_n, block_k=block_k,
                                          max_concurrent_steps=max_concurrent_steps, grid_block_n=grid_block_n)


def _jax_triton(lhs, rhs, group_sizes, preferred_element_type=None):
    from c2jax.kernels.jax_triton_grouped import grouped_matmul_jax_triton  # lazily: needs a CUDA jaxlib

    return grouped_matmul_jax_triton(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


dispatch.register(OP, dispatch.Implementation(
    "mosaic_sm90", grouped_matmul_mosaic_sm90, ("gpu",), ("H100", "H200", "H800", "H20"), interpretable=True,
    description="JAX Mosaic-GPU Hopper ragged_dot (wgmma); elsewhere in the Mosaic GPU interpreter"))
dispatch.register(OP, dispatch.Implementation(
    "pallas_triton", grouped_matmul_pallas, ("gpu",), interpretable=True,
    description="Pallas Triton-backend grouped GEMM (kernels/pallas_grouped.py)"))
dispatch.register(OP, dispatch.Implementation(
    "xla", grouped_matmul_xla, ("cpu", "gpu", "tpu"), description="capacity-padded batched einsum"))
dispatch.register(OP, dispatch.Implementation(
    "jax_triton", _jax_triton, ("gpu",), auto=False, description="jax-triton kernel (kernels/jax_triton_grouped.py)"))
dispatch.register(OP, dispatch.Implementation(
    "ragged_dot", grouped_matmul_reference, ("cpu", "gpu", "tpu"), auto=False, description="lax.ragged_dot oracle"))


def grouped_matmul(lhs: jnp.ndarray, rhs: jnp.ndarray, group_sizes: jnp.ndarray, *, impl: str | None = None,
                   preferred_element_type=None) -> jnp.ndarray:
    """Grouped GEMM through the registry (module docstring)."""
    return dispatch.call(OP, lhs, rhs, group_sizes, impl=impl, preferred_element_type=preferred_element_type)


# ------------------------------------------------------------------------------------------ block-scaled MXFP8


def grouped_matmul_mx_xla(lhs: MXTensor, rhs: MXTensor, group_sizes, out_dtype=jnp.bfloat16):
    """Reference: dequantized operands through the capacity-padded einsum, FP32 accumulation. The products of
    dequantized E4M3 values (3-bit mantissas times powers of two) are exact in FP32, and in TF32 too where a GPU's
    default precision uses it, so only the summation order separates this from a block-scaled kernel."""
    out = grouped_matmul_xla(dequantize_mx(lhs, axis=1), dequantize_mx(rhs, axis=1), group_sizes,
                             preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _mx_k_blocks(lhs: MXTensor):
    if lhs.values.shape[1] % MX_BLOCK:
        raise NotImplementedError(f"block-scaled kernels need K a multiple of {MX_BLOCK}, got {lhs.values.shape[1]}")


def _mx_pallas(lhs: MXTensor, rhs: MXTensor, group_sizes, out_dtype=jnp.bfloat16, interpret=False):
    _mx_k_blocks(lhs)
    return grouped_matmul_mx_pallas(lhs.values, lhs.scales, rhs.values, rhs.scales, group_sizes, interpret=interpret,
                                    out_dtype=out_dtype)


def _mx_jax_triton(lhs: MXTensor, rhs: MXTensor, group_sizes, out_dtype=jnp.bfloat16):
    from c2jax.kernels.jax_triton_grouped import grouped_matmul_mx_jax_triton  # lazily: needs a CUDA jaxlib

    _mx_k_blocks(lhs)
    return grouped_matmul_mx_jax_triton(lhs.values, lhs.scales, rhs.values, rhs.scales, group_sizes,
                                        out_dtype=out_dtype)


dispatch.register(MX_OP, dispatch.Implementation(
    "pallas_triton", _mx_pallas, ("gpu",), interpretable=True,
    description="Pallas Triton block-scaled grouped GEMM (FP8 dots, FP32 scale per 32 K; kernels/pallas_grouped.py)"))
dispatch.register(MX_OP, dispatch.Implementation(
    "xla", grouped_matmul_mx_xla, ("cpu", "gpu", "tpu"), description="dequantize + capacity-padded FP32 einsum"))
dispatch.register(MX_OP, dispatch.Implementation(
    "jax_triton", _mx_jax_triton, ("gpu",), auto=False,
    description="jax-triton tl.dot_scaled kernel (kernels/jax_triton_grouped.py)"))


def grouped_matmul_mx(lhs: MXTensor, rhs: MXTensor, group_sizes: jnp.ndarray, *, impl: str | None = None,
                      out_dtype=jnp.bfloat16) -> jnp.ndarray:
    """Block-scaled MXFP8 grouped GEMM through the registry (module docstring): lhs [M, K] and rhs [G, K, N], both
    quantized along K."""
    _check(lhs.values, rhs.values, group_sizes)
    return dispatch.call(MX_OP, lhs, rhs, group_sizes, impl=impl, out_dtype=jnp.dtype(out_dtype))


# ------------------------------------------------------------------------------------------ block-scaled NVFP4


def _check_nvfp4(lhs: NVFP4Tensor, rhs: NVFP4Tensor):
    if lhs.tensor_scale.shape != (lhs.values.shape[0], 1) or rhs.tensor_scale.shape != (
            rhs.values.shape[0], 1, rhs.values.shape[2]):
        raise ValueError(f"grouped_matmul_nvfp4 takes per-token scaling along K (one FP32 scale per lhs row and per "
                         f"rhs column), got tensor scales {lhs.tensor_scale.shape}, {rhs.tensor_scale.shape} for "
                         f"values {lhs.values.shape}, {rhs.values.shape}")


def grouped_matmul_nvfp4_xla(lhs: NVFP4Tensor, rhs: NVFP4Tensor, group_sizes, out_dtype=jnp.bfloat16):
    """Reference: both operands dequantized to FP32 ((q d_b) s, the sorted path's fake quantization bit for bit)
    through the capacity-padded einsum with FP32 accumulation at HIGHEST precision (dequantized NVFP4 values carry
    the FP32 scale's full mantissa, so a GPU's default TF32 would round them)."""
    _check_nvfp4(lhs, rhs)
    with jax.default_matmul_precision("highest"):
        out = grouped_matmul_xla(dequantize_nvfp4(lhs, axis=1), dequantize_nvfp4(rhs, axis=1), group_sizes,
                                 preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _nvfp4_pallas(lhs: NVFP4Tensor, rhs: NVFP4Tensor, group_sizes, out_dtype=jnp.bfloat16, interpret=False):
    _check_nvfp4(lhs, rhs)
    if lhs.values.shape[1] % NVFP4_BLOCK:
        raise NotImplementedError(f"the NVFP4 kernel needs K a multiple of {NVFP4_BLOCK}, got {lhs.values.shape[1]}")
    return grouped_matmul_nvfp4_pallas(lhs.values, lhs.block_scales, lhs.tensor_scale, rhs.values, rhs.block_scales,
                                       rhs.tensor_scale, group_sizes, interpret=interpret, out_dtype=out_dtype)


dispatch.register(NVFP4_OP, dispatch.Implementation(
    "pallas_triton", _nvfp4_pallas, ("gpu",), interpretable=True,
    description="Pallas Triton NVFP4 grouped GEMM (E2M1 x E4M3 per 16 dequantized in registers, bf16 dots, FP32 "
                "accumulation, FP32 row / column scales; kernels/pallas_grouped.py)"))
dispatch.register(NVFP4_OP, dispatch.Implementation(
    "xla", grouped_matmul_nvfp4_xla, ("cpu", "gpu", "tpu"), description="dequantize + capacity-padded FP32 einsum"))


def grouped_matmul_nvfp4(lhs: NVFP4Tensor, rhs: NVFP4Tensor, group_sizes: jnp.ndarray, *, impl: str | None = None,
                         out_dtype=jnp.bfloat16) -> jnp.ndarray:
    """Block-scaled NVFP4 grouped GEMM through the registry (module docstring): lhs [M, K] and rhs [G, K, N], both
    quantized along K with per-token scaling."""
    _check(lhs.values, rhs.values, group_sizes)
    return dispatch.call(NVFP4_OP, lhs, rhs, group_sizes, impl=impl, out_dtype=jnp.dtype(out_dtype))
