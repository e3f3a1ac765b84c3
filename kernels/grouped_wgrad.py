"""The weight gradient of a grouped GEMM: per group, a contraction over that group's rows.

    grouped_wgrad(lhs [M, K], dout [M, N], group_sizes [G], impl=None) -> [G, K, N]
    out[g] = sum over the rows r of group g of lhs[r]^T dout[r]      (rows sorted by group; rows past
                                                                     sum(group_sizes) are ignored)

It is drhs of out = grouped_matmul(lhs, rhs) (kernels/grouped_gemm.py), the expert weights' gradient in the MoE's
backward. `jax.lax.ragged_dot`'s transpose computes it as a ragged contraction, which XLA lowers to a dense dot
masked per group: G x the FLOPs and a [G, M, .] operand (32x at the `medium` preset's 32 experts). The registry
(kernels/dispatch.py) runs instead:

    pallas_triton   the Pallas Triton kernel below (any NVIDIA GPU; CPU with interpret=True): program (g, a, b)
                    accumulates the [block_k, block_n] tile (a, b) of out[g] over its group's rows, block_m rows at a
                    time, a loop whose trip count is the group's size; rows of the neighbouring groups in a boundary
                    tile are masked to zero; an empty group stores zeros
    xla             capacity-padded batched einsum (every backend; the CPU default): each group's rows gathered into
                    [G, C, K] and [G, C, N] buffers, C picked at run time from a few buckets (as grouped_gemm's XLA
                    fallback), one einsum "gck,gcn->gkn"; nothing is ever dropped
    ragged_dot      the oracle: lax.ragged_dot_general with the rows as a ragged contraction; never auto-chosen

Every implementation accumulates in FP32 and returns `preferred_element_type` (default lhs.dtype).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from c2jax.kernels import dispatch
from c2jax.kernels.grouped_gemm import _pad_row, capacity_buckets
from c2jax.kernels.pallas_grouped import _pad_to

OP = "grouped_wgrad"
KERNEL_NAME = "grouped_wgrad"  # the Pallas kernel's name in its Triton call (how a lowering check finds it)
_RAGGED_CONTRACTION = jax.lax.RaggedDotDimensionNumbers(  # [M, K] x [M, N] -> [G, K, N], M ragged and contracted
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=())


def _check(lhs, dout, group_sizes):
    if lhs.ndim != 2 or dout.ndim != 2 or lhs.shape[0] != dout.shape[0] or group_sizes.ndim != 1:
        raise ValueError(f"expected lhs [M, K], dout [M, N], group_sizes [G], got {lhs.shape}, {dout.shape}, "
                         f"{group_sizes.shape}")


def grouped_wgrad_reference(lhs, dout, group_sizes, preferred_element_type=None):
    """Oracle: the ragged contraction at full FP32 precision."""
    _check(lhs, dout, group_sizes)
    out = jax.lax.ragged_dot_general(lhs, dout, group_sizes.astype(jnp.int32), _RAGGED_CONTRACTION,
                                     precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(preferred_element_type or lhs.dtype)


def grouped_wgrad_xla(lhs, dout, group_sizes, capacity_factors=(1.25, 2.0), preferred_element_type=None):
    """Capacity-padded batched einsum (module docstring)."""
    _check(lhs, dout, group_sizes)
    m, num_groups = lhs.shape[0], group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)

    def at(capacity, lhs, dout):
        c = jnp.arange(capacity, dtype=jnp.int32)
        src = jnp.where(c[None, :] < sizes[:, None], starts[:, None] + c[None, :], m).reshape(-1)
        a = _pad_row(lhs)[src].reshape(num_groups, capacity, -1)
        b = _pad_row(dout)[src].reshape(num_groups, capacity, -1)
        return jnp.einsum("gck,gcn->gkn", a, b, preferred_element_type=jnp.float32).astype(out_dtype)

    buckets = capacity_buckets(m, num_groups, capacity_factors)
    index = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets), jnp.max(sizes), side="left"), len(buckets) - 1)
    return jax.lax.switch(index, [functools.partial(at, cap) for cap in buckets], lhs, dout)


def _kernel(offsets_ref, lhs_ref, dout_ref, out_ref, *, block_m, block_k, block_n):
    g, a, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = offsets_ref[g], offsets_ref[g + 1]

    def body(t, acc):
        r0 = start + t * block_m
        rows = r0 + jnp.arange(block_m)
        x = pltr.load(lhs_ref.at[pl.ds(r0, block_m), pl.ds(a * block_k, block_k)])
        dy = pltr.load(dout_ref.at[pl.ds(r0, block_m), pl.ds(b * block_n, block_n)])
        x = jnp.where((rows < end)[:, None], x, jnp.zeros((), x.dtype))  # the next group's rows add nothing
        return acc + jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    tiles = (end - start + block_m - 1) // block_m
    acc = jax.lax.fori_loop(0, tiles, body, jnp.zeros((block_k, block_n), jnp.float32))
    pltr.store(out_ref.at[g, pl.ds(a * block_k, block_k), pl.ds(b * block_n, block_n)], acc.astype(out_ref.dtype))


@functools.partial(jax.jit, static_argnames=("block_m", "block_k", "block_n", "interpret", "out_dtype",
                                             "num_warps", "num_stages"))
def _wgrad_pallas(lhs, dout, group_sizes, *, block_m, block_k, block_n, interpret, out_dtype, num_warps=4,
                  num_stages=3):
    (m, k), n, num_groups = lhs.shape, dout.shape[1], group_sizes.shape[0]
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes.astype(jnp.int32))])
    offsets = jnp.minimum(offsets, m)  # sizes summing past M (not expected) never read past the padding
    # block_m zero rows at the end: a tile starting at the last row stays inside the buffer
    lhs_p = jnp.pad(_pad_to(lhs, 1, block_k), [(0, block_m), (0, 0)])
    dout_p = jnp.pad(_pad_to(dout, 1, block_n), [(0, block_m), (0, 0)])
    k_pad, n_pad = lhs_p.shape[1], dout_p.shape[1]
    out = pl.pallas_call(
        functools.partial(_kernel, block_m=block_m, block_k=block_k, block_n=block_n),
        out_shape=jax.ShapeDtypeStruct((num_groups, k_pad, n_pad), out_dtype),
        grid=(num_groups, k_pad // block_k, n_pad // block_n),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=KERNEL_NAME,
    )(offsets, lhs_p, dout_p)
    return out[:, :k, :n]


def grouped_wgrad_pallas(lhs, dout, group_sizes, *, block_m: int = 32, block_k: int = 64, block_n: int = 64,
                         interpret: bool = False, preferred_element_type=None):
    """The Pallas Triton kernel (module docstring); FP32 accumulation."""
    _check(lhs, dout, group_sizes)
    if lhs.dtype != dout.dtype:
        raise NotImplementedError(f"pallas_triton grouped wgrad takes operands of one dtype, got {lhs.dtype} and "
                                  f"{dout.dtype}")
    return _wgrad_pallas(lhs, dout, group_sizes, block_m=block_m, block_k=block_k, block_n=block_n,
                         interpret=interpret, out_dtype=jnp.dtype(preferred_element_type or lhs.dtype))


dispatch.register(OP, dispatch.Implementation(
    "pallas_triton", grouped_wgrad_pallas, ("gpu",), interpretable=True,
    description="Pallas Triton grouped weight gradient (a loop over each group's rows)"))
dispatch.register(OP, dispatch.Implementation(
    "xla", grouped_wgrad_xla, ("cpu", "gpu", "tpu"), description="capacity-padded batched einsum over rows"))
dispatch.register(OP, dispatch.Implementation(
    "ragged_dot", grouped_wgrad_reference, ("cpu", "gpu", "tpu"), auto=False,
    description="lax.ragged_dot_general oracle (a dense masked dot: G x the FLOPs)"))


def grouped_wgrad(lhs: jnp.ndarray, dout: jnp.ndarray, group_sizes: jnp.ndarray, *, impl: str | None = None,
                  preferred_element_type=None) -> jnp.ndarray:
    """Per-group lhs^T dout through the registry (module docstring)."""
    _check(lhs, dout, group_sizes)
    return dispatch.call(OP, lhs, dout, group_sizes, impl=impl, preferred_element_type=preferred_element_type)


def implementation_for(name: str | None) -> str | None:
    """The wgrad implementation that goes with the grouped GEMM implementation `name` (e.g. a config's moe_kernel):
    the same name where this op has it, else None (the registry's choice for the device)."""
    return name if name in {i.name for i in dispatch.implementations(OP)} else None

