"""The MXFP8 recipe on expert-sorted rows (the grouped path of the MoE, moe_impl="grouped"): a quantized grouped
linear y[r] = x[src[r]] @ w[group(r)] with a custom VJP, through the project's low-precision kernels.

The recipe is qlinear's (kernels/qlinear.py), each GEMM quantizing its operands along its own contraction axis
from the high-precision tensors:

    fprop  y  = Q(rows, along K) . Q(w, along K)      rows quantized by the fused permute + MXFP8 quantize kernel
                                                      (kernels/permute.py, op permute_quantize_mx) when they are
                                                      gathered from tokens (`src`), by quantize_mx otherwise; the
                                                      product by the block-scaled grouped GEMM (op grouped_matmul_mx)
    dgrad  dx = Q(dy, along N) . Q(w^T, along N)      the same block-scaled grouped GEMM over the same groups; with
                                                      `src`, each token's rows summed back (scatter-add)
    wgrad  dw = Q(rows, along M)^T . Q(dy, along M)   per group, blocks of 32 rows starting at the group's first row
                                                      (zero-padded at its end), so no block spans two experts: the
                                                      blocks the sorted path's [E, C, .] buffers have. No grouped
                                                      kernel contracts over ragged rows, so wgrad runs on the
                                                      reference path: dequantized FP32 operands through
                                                      lax.ragged_dot_general (ragged contraction), as the bf16
                                                      grouped path's drhs does (XLA lowers it to a masked dense dot)

So the quantization is bit for bit the sorted path's (`qlinear.fprop/dgrad/wgrad` on capacity buffers): the same
blocks, scales and codes; what differs is the order of the FP32 sums. Supported: recipes whose forward and backward
are MXFP8 that cannot saturate (RCEIL: "mxfp8"), so the straight-through masks are all ones and skipped; FLOOR
("mxfp8_floor") and NVFP4 saturate, and the fused kernel does not return the scaled values the masks need.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from c2jax.kernels.grouped_gemm import grouped_matmul_mx
from c2jax.kernels.mxfp8 import MX_BLOCK, fake_quantize_mx, quantize_mx
from c2jax.kernels.permute import permute_quantize_mx
from c2jax.kernels.qlinear import Recipe, get_recipe

_WGRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(  # [M, K] x [M, N] -> [G, K, N], M ragged (contracted per group)
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=())


@dataclass(frozen=True)
class GroupedQuant:
    """What the quantized grouped linear runs: the recipe and the registry implementations (None: the registry's
    choice for this device, kernels/dispatch.py)."""

    recipe: Recipe
    gemm: str | None = None  # grouped_matmul_mx implementation
    permute: str | None = None  # permute_quantize_mx implementation

    def __post_init__(self):
        check_recipe(self.recipe)


def check_recipe(recipe: str | Recipe) -> Recipe:
    """The recipe, or ValueError saying why the grouped path cannot run it (module docstring)."""
    recipe = get_recipe(recipe)
    specs = (recipe.forward, recipe.backward)
    if any(s.format != "mxfp8" or s.saturates for s in specs):
        raise ValueError(f"the grouped quantized path runs MXFP8 with the RCEIL scale rule forward and backward "
                         f"(recipe 'mxfp8'); {recipe.name!r} needs straight-through masks or another format")
    return recipe


def fuses_permute(width: int) -> bool:
    """Whether rows of this width gathered from tokens go through the fused permute + quantize kernel (it takes
    whole 32-element blocks; narrower or ragged widths gather first, then quantize: the same codes)."""
    return width % MX_BLOCK == 0


def _quantize(q: GroupedQuant, a, axis, src=None, backward=False):
    spec = q.recipe.backward if backward else q.recipe.forward
    opts = dict(fmt=spec.element, scale_rule=spec.scale_rule, division=spec.division)
    if src is not None and fuses_permute(a.shape[1]):  # rows gathered from tokens and quantized in one pass
        return permute_quantize_mx(a, src, impl=q.permute, **opts)
    if src is not None:
        a = jnp.concatenate([a, jnp.zeros((1, a.shape[1]), a.dtype)])[src]
    return quantize_mx(a, axis=axis, **opts)


def _fprop(q: GroupedQuant, x, w, group_sizes, src):
    lhs = _quantize(q, x, 1, src)
    return grouped_matmul_mx(lhs, _quantize(q, w, 1), group_sizes, impl=q.gemm, out_dtype=x.dtype)


def _dgrad(q: GroupedQuant, dy, w, group_sizes):
    lhs, rhs = _quantize(q, dy, 1, backward=True), _quantize(q, jnp.swapaxes(w, 1, 2), 1, backward=True)
    return grouped_matmul_mx(lhs, rhs, group_sizes, impl=q.gemm, out_dtype=dy.dtype)


def group_aligned(a, group_sizes, block: int = MX_BLOCK):
    """a [M, C] (rows sorted by group) -> (a' [M', C], sizes' [G]): each group's rows start at a multiple of
    `block` with zero rows up to the next one, so blocks of `block` rows along M never span two groups; rows past
    sum(group_sizes) are dropped. M' = M + G (block - 1) rounded up to `block`: static, whatever the sizes."""
    m, groups = a.shape[0], group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    padded = -(-sizes // block) * block
    ends = jnp.cumsum(sizes)
    rows = jnp.arange(m, dtype=jnp.int32)
    group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)  # G past the last group
    g = jnp.minimum(group, groups - 1)
    dest = (jnp.cumsum(padded) - padded)[g] + rows - (ends - sizes)[g]
    m_pad = -(-(m + groups * (block - 1)) // block) * block
    dest = jnp.where(group < groups, dest, m_pad)  # out of bounds: dropped
    return jnp.zeros((m_pad, a.shape[1]), a.dtype).at[dest].set(a, mode="drop"), padded


def _wgrad(q: GroupedQuant, rows, dy, group_sizes):
    """Per group rows^T dy from operands quantized along M in group-aligned blocks (module docstring)."""
    spec = q.recipe.backward
    opts = dict(fmt=spec.element, scale_rule=spec.scale_rule, division=spec.division)
    rows_a, sizes = group_aligned(rows, group_sizes)
    dy_a, _ = group_aligned(dy, group_sizes)
    rows_q, _ = fake_quantize_mx(rows_a, 0, **opts)
    dy_q, _ = fake_quantize_mx(dy_a, 0, **opts)
    return jax.lax.ragged_dot_general(rows_q, dy_q, sizes, _WGRAD_DIMS, preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def grouped_linear(q: GroupedQuant, x, w, group_sizes, src=None):
    """rows @ w[group] per row under `q`'s recipe (module docstring): rows = x[src] (src == len(x): a zero row)
    when `src` is given, else x itself. x [T, K] (or [M, K]), w [G, K, N], group_sizes [G], src [M] -> [M, N] in
    x.dtype; rows past sum(group_sizes) give zeros."""
    return _fprop(q, x, w, group_sizes, src)


def _linear_fwd(q, x, w, group_sizes, src):
    return _fprop(q, x, w, group_sizes, src), (x, w, group_sizes, src)


def _linear_bwd(q, res, dy):
    x, w, group_sizes, src = res
    dy = dy.astype(x.dtype)
    drows = _dgrad(q, dy, w, group_sizes)
    if src is None:
        rows, dx = x, drows
    else:  # the rows were gathered: gather them again (high precision) and sum each token's gradients
        padded = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
        rows = padded[src]
        dx = jnp.zeros_like(padded).at[src].add(drows)[:-1]
    dw = _wgrad(q, rows, dy, group_sizes)
    return dx, dw.astype(w.dtype), None, None


grouped_linear.defvjp(_linear_fwd, _linear_bwd)
