"""The MXFP8 recipe, and Composer 2's NVFP4 per-token forward + MXFP8 backward, on expert-sorted rows (the grouped
path of the MoE, moe_impl="grouped"): a quantized grouped linear y[r] = x[src[r]] @ w[group(r)] with a custom VJP,
through the project's low-precision kernels.

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
                                                      blocks the sorted path's [E, C, .] buffers have. The product
                                                      of the dequantized FP32 operands runs the registry's grouped
                                                      weight gradient (kernels/grouped_wgrad.py, as the bf16 grouped
                                                      path's drhs: Pallas Triton on GPUs, the capacity einsum on
                                                      CPU), not the ragged contraction XLA lowers to a G x dense dot

So the quantization is bit for bit the sorted path's (`qlinear.fprop/dgrad/wgrad` on capacity buffers): the same
blocks, scales and codes; what differs is the order of the FP32 sums.

Composer 2's recipe "nvfp4_per_token_fwd+mxfp8_bwd" (NVFP4 forward with per-token FP32 scales, MXFP8 backward):

    fprop  rows quantized to NVFP4 along K with one FP32 scale per token (kernels/nvfp4.py). A token's codes depend
           only on that token, so per-token quantization commutes with the permutation: the T token rows are
           quantized once and their codes, block scales and FP32 scales gathered to the T*k expert-sorted rows
           (src == T: an appended zero row, which quantizes to zero codes, zero block scales, scale 1). That is
           this recipe's fused permute + quantize, and it is cheaper than quantizing the T*k gathered rows (k x
           fewer rows through the quantizer; only 4-bit codes and 8-bit scales are gathered). w is quantized
           along K per expert, one FP32 scale per output channel; the product by the NVFP4 grouped GEMM (op
           grouped_matmul_nvfp4)
    dgrad, wgrad  exactly the MXFP8 recipe's above, then qlinear's straight-through masks of the NVFP4 forward:
           dx = dgrad * m_x, dw = wgrad * m_w (m: the elements the forward did not clip, formats.not_clipped).
           The masks are recomputed in the backward from the high-precision residuals x and w, so the forward
           kernel need not return them; m_x is per token, so it is applied to dx after each token's rows are
           summed (the same as masking each of its rows: the mask is 0 or 1).

Supported (`check_recipe`): "mxfp8" (RCEIL: nothing saturates, masks skipped) and "nvfp4_per_token_fwd+mxfp8_bwd".
Refused: FLOOR ("mxfp8_floor": the fused MX kernel does not return the scaled values its masks need), NVFP4 with a
per-tensor scale (the scale of the whole gathered buffer: not a per-row quantity that commutes with the gather),
DeepSeek FP8.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from c2jax.kernels.grouped_gemm import grouped_matmul_mx, grouped_matmul_nvfp4
from c2jax.kernels.grouped_wgrad import grouped_wgrad
from c2jax.kernels.grouped_wgrad import implementation_for as wgrad_implementation_for
from c2jax.kernels.mxfp8 import MX_BLOCK, fake_quantize_mx, quantize_mx
from c2jax.kernels.nvfp4 import NVFP4Tensor, fake_quantize_nvfp4, quantize_nvfp4
from c2jax.kernels.permute import permute_quantize_mx
from c2jax.kernels.qlinear import QuantSpec, Recipe, apply_mask, get_recipe


@dataclass(frozen=True)
class GroupedQuant:
    """What the quantized grouped linear runs: the recipe and the registry implementations (None: the registry's
    choice for this device, kernels/dispatch.py)."""

    recipe: Recipe
    gemm: str | None = None  # grouped_matmul_mx implementation (and grouped_matmul_nvfp4's for an NVFP4 forward)
    permute: str | None = None  # permute_quantize_mx implementation

    def __post_init__(self):
        check_recipe(self.recipe)


def check_recipe(recipe: str | Recipe) -> Recipe:
    """The recipe, or ValueError saying why the grouped path cannot run it (module docstring)."""
    recipe = get_recipe(recipe)
    mx_ok = lambda s: s.format == "mxfp8" and not s.saturates  # noqa: E731
    nvfp4_ok = recipe.forward.format == "nvfp4" and recipe.forward.scaling == "per_token"
    if not mx_ok(recipe.backward) or not (mx_ok(recipe.forward) or nvfp4_ok):
        raise ValueError(f"the grouped quantized path runs MXFP8 with the RCEIL scale rule backward, and forward "
                         f"either the same (recipe 'mxfp8') or NVFP4 with per-token scales (recipe "
                         f"'nvfp4_per_token_fwd+mxfp8_bwd'); {recipe.name!r} needs other masks or formats")
    return recipe


def nvfp4_forward(recipe: Recipe) -> bool:
    """Whether the recipe's forward is NVFP4 (grouped_matmul_nvfp4; else the MXFP8 grouped_matmul_mx)."""
    return recipe.forward.format == "nvfp4"


def fuses_permute(width: int) -> bool:
    """Whether rows of this width gathered from tokens go through the fused permute + quantize kernel (it takes
    whole 32-element blocks; narrower or ragged widths gather first, then quantize: the same codes)."""
    return width % MX_BLOCK == 0


def _nvfp4_opts(spec: QuantSpec):
    return dict(scaling=spec.scaling, division=spec.division)


def quantize_rows_nvfp4(spec: QuantSpec, x, src=None) -> NVFP4Tensor:
    """NVFP4 codes of the rows x[src] (src == len(x): a zero row; all of x without src), quantized along K per
    token: the T token rows once, then codes, block scales and FP32 scales gathered (module docstring)."""
    q = quantize_nvfp4(x, axis=1, **_nvfp4_opts(spec))
    if src is None:
        return q
    return NVFP4Tensor(*(jnp.concatenate([a, jnp.zeros((1, a.shape[1]), a.dtype)])[src] for a in q[:2]),
                       jnp.concatenate([q.tensor_scale, jnp.ones((1, 1), q.tensor_scale.dtype)])[src])


def _quantize(q: GroupedQuant, a, axis, src=None, backward=False):
    spec = q.recipe.backward if backward else q.recipe.forward
    if spec.format == "nvfp4":  # the forward's lhs (rows, axis 1) or w [G, K, N] (axis 1): both along K
        return quantize_rows_nvfp4(spec, a, src) if a.ndim == 2 else quantize_nvfp4(a, axis=axis, **_nvfp4_opts(spec))
    opts = dict(fmt=spec.element, scale_rule=spec.scale_rule, division=spec.division)
    if src is not None and fuses_permute(a.shape[1]):  # rows gathered from tokens and quantized in one pass
        return permute_quantize_mx(a, src, impl=q.permute, **opts)
    if src is not None:
        a = jnp.concatenate([a, jnp.zeros((1, a.shape[1]), a.dtype)])[src]
    return quantize_mx(a, axis=axis, **opts)


def _fprop(q: GroupedQuant, x, w, group_sizes, src):
    lhs = _quantize(q, x, 1, src)
    gemm = grouped_matmul_nvfp4 if nvfp4_forward(q.recipe) else grouped_matmul_mx
    return gemm(lhs, _quantize(q, w, 1), group_sizes, impl=q.gemm, out_dtype=x.dtype)


def forward_masks(q: GroupedQuant, x, w):
    """The straight-through masks of the forward's quantization (m_x of x's rows [T, K] or [M, K], m_w [G, K, N]),
    or (None, None) where the forward cannot saturate; recomputed from the high-precision operands."""
    spec = q.recipe.forward
    if not spec.saturates:
        return None, None
    return (fake_quantize_nvfp4(x, 1, **_nvfp4_opts(spec))[1], fake_quantize_nvfp4(w, 1, **_nvfp4_opts(spec))[1])


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
    return grouped_wgrad(rows_q, dy_q, sizes, impl=wgrad_implementation_for(q.gemm), preferred_element_type=jnp.float32)


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
    mask_x, mask_w = forward_masks(q, x, w)  # per token: on dx after each token's rows were summed
    return apply_mask(dx, mask_x), apply_mask(dw.astype(w.dtype), mask_w), None, None


grouped_linear.defvjp(_linear_fwd, _linear_bwd)
