"""Quantized linear and grouped (per-expert) linear with a custom VJP, and the recipes that choose the
formats (Composer 2 sec. 6; DeepSeek-V3 sec. 3.3).

Each of the three GEMMs of a linear y = x w quantizes its two operands along *its own* contraction
axis, from the high-precision tensors (the residuals are x and w, never their quantized forms):

    fprop  y  = Q_f(x, along K) . Q_f(w, along K)           x [.., M, K], w [.., K, N]
    dgrad  dx = Q_b(dy, along N) . Q_b(w, along N)^T
    wgrad  dw = Q_b(x, along M)^T . Q_b(dy, along M)        (M = tokens; for experts, tokens of one
                                                             expert's buffer, so blocks never span two)

Q_f / Q_b are the recipe's forward and backward specs; products are FP32 dots of dequantized values.
Straight-through estimator: dx and dw pass through Q_f unchanged except where the forward saturated,
dx = dgrad * m_x, dw = wgrad * m_w, with m = |v / scale| < overflow (`c2jax.kernels.formats.not_clipped`:
zero where clipping changed the code). Under RCEIL MXFP8 and DeepSeek FP8 nothing saturates and the
masks are skipped; NVFP4 saturates where a block scale rounded down (or underflowed) in E4M3, and OCP's
FLOOR rule saturates the top of every block.

Recipes (`RECIPES`, selected by `ModelConfig.moe_quant`):
    bf16                             no quantization: the model's compute dtype (the default)
    mxfp8                            MXFP8 E4M3 RCEIL in fprop, dgrad and wgrad
    nvfp4_per_token_fwd+mxfp8_bwd    Composer 2: NVFP4 with per-token FP32 scales forward, MXFP8 backward
    nvfp4_per_tensor_fwd+mxfp8_bwd   the NVFP4 spec's per-tensor scale forward (ablation)
    mxfp8_floor                      MXFP8 with OCP's FLOOR scale rule (ablation)
    fp8_deepseek                     E4M3, 1x128 activation tiles, 128x128 weight blocks, FP32 scales
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from c2jax.kernels.formats import check_division
from c2jax.kernels.fp8_deepseek import fake_quantize_fp8_blocks, fake_quantize_fp8_tiles
from c2jax.kernels.mxfp8 import SCALE_RULES, fake_quantize_mx
from c2jax.kernels.nvfp4 import SCALINGS, fake_quantize_nvfp4

FORMATS = ("none", "mxfp8", "nvfp4", "fp8_deepseek")


@dataclass(frozen=True)
class QuantSpec:
    """How one GEMM's operands are quantized."""

    format: str = "none"
    element: str = "e4m3"  # mxfp8 elements (e4m3 or e5m2)
    scale_rule: str = "rceil"  # mxfp8
    scaling: str = "per_token"  # nvfp4
    division: str = "ieee"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"QuantSpec.format must be one of {FORMATS}, got {self.format!r}")
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"QuantSpec.scale_rule must be one of {SCALE_RULES}, got {self.scale_rule!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"QuantSpec.scaling must be one of {SCALINGS}, got {self.scaling!r}")
        check_division(self.division)

    @property
    def saturates(self) -> bool:
        """Whether finite inputs can be clipped (otherwise the STE mask is all ones and skipped)."""
        return self.format == "nvfp4" or (self.format == "mxfp8" and self.scale_rule == "floor")


@dataclass(frozen=True)
class Recipe:
    name: str
    forward: QuantSpec
    backward: QuantSpec

    @property
    def quantized(self) -> bool:
        return self.forward.format != "none" or self.backward.format != "none"

    def with_division(self, division: str) -> Recipe:
        """The same recipe with every quantizer dividing as `division` says (the report's ablation)."""
        return dataclasses.replace(self, forward=dataclasses.replace(self.forward, division=division),
                                   backward=dataclasses.replace(self.backward, division=division))


_MXFP8 = QuantSpec("mxfp8")
RECIPES = {
    "bf16": Recipe("bf16", QuantSpec(), QuantSpec()),
    "mxfp8": Recipe("mxfp8", _MXFP8, _MXFP8),
    "nvfp4_per_token_fwd+mxfp8_bwd": Recipe("nvfp4_per_token_fwd+mxfp8_bwd", QuantSpec("nvfp4"), _MXFP8),
    "nvfp4_per_tensor_fwd+mxfp8_bwd": Recipe("nvfp4_per_tensor_fwd+mxfp8_bwd",
                                             QuantSpec("nvfp4", scaling="per_tensor"), _MXFP8),
    "mxfp8_floor": Recipe("mxfp8_floor", QuantSpec("mxfp8", scale_rule="floor"),
                          QuantSpec("mxfp8", scale_rule="floor")),
    "fp8_deepseek": Recipe("fp8_deepseek", QuantSpec("fp8_deepseek"), QuantSpec("fp8_deepseek")),
}


def get_recipe(name: str | Recipe, division: str = "ieee") -> Recipe:
    if isinstance(name, Recipe):
        return name
    try:
        recipe = RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown quantization recipe {name!r}; known: {sorted(RECIPES)}") from None
    return recipe if division == "ieee" else recipe.with_division(division)


def fake_quantize(x: jnp.ndarray, axis: int, spec: QuantSpec, weight_axes: tuple[int, int] | None = None):
    """(dequantize(quantize(x)) in float32, STE mask or None) with blocks along `axis`. `weight_axes`
    marks a weight operand: DeepSeek FP8 then uses 128x128 blocks over those two axes."""
    if spec.format == "none":
        return x, None
    if spec.format == "mxfp8":
        deq, mask = fake_quantize_mx(x, axis, spec.element, scale_rule=spec.scale_rule, division=spec.division)
    elif spec.format == "nvfp4":
        deq, mask = fake_quantize_nvfp4(x, axis, spec.scaling, spec.division)
    elif weight_axes is not None:
        deq, mask = fake_quantize_fp8_blocks(x, weight_axes, division=spec.division)
    else:
        deq, mask = fake_quantize_fp8_tiles(x, axis, division=spec.division)
    return deq, (mask if spec.saturates else None)


_FP32 = dict(preferred_element_type=jnp.float32)


def _check_operands(x, w):
    if x.ndim != w.ndim or x.shape[:-2] != w.shape[:-2] or x.shape[-1] != w.shape[-2]:
        raise ValueError(f"expected x [..., M, K] and w [..., K, N] with equal batch dims, got {x.shape}, {w.shape}")


def fprop(x: jnp.ndarray, w: jnp.ndarray, recipe: Recipe):
    """y = Q_f(x) Q_f(w), contraction K; returns (y in x.dtype, STE mask of x or None, of w or None)."""
    _check_operands(x, w)
    spec = recipe.forward
    if spec.format == "none":
        return jnp.einsum("...mk,...kn->...mn", x, w), None, None
    xq, mask_x = fake_quantize(x, -1, spec)
    wq, mask_w = fake_quantize(w, -2, spec, weight_axes=(-2, -1))
    return jnp.einsum("...mk,...kn->...mn", xq, wq, **_FP32).astype(x.dtype), mask_x, mask_w


def dgrad(dy: jnp.ndarray, w: jnp.ndarray, recipe: Recipe) -> jnp.ndarray:
    """dx = Q_b(dy) Q_b(w)^T, contraction N (no STE mask applied here)."""
    spec = recipe.backward
    if spec.format == "none":
        return jnp.einsum("...mn,...kn->...mk", dy, w)
    dyq, _ = fake_quantize(dy, -1, spec)
    wq, _ = fake_quantize(w, -1, spec, weight_axes=(-2, -1))
    return jnp.einsum("...mn,...kn->...mk", dyq, wq, **_FP32).astype(dy.dtype)


def wgrad(x: jnp.ndarray, dy: jnp.ndarray, recipe: Recipe) -> jnp.ndarray:
    """dw = Q_b(x)^T Q_b(dy), contraction M (tokens; no STE mask applied here)."""
    spec = recipe.backward
    if spec.format == "none":
        return jnp.einsum("...mk,...mn->...kn", x, dy)
    xq, _ = fake_quantize(x, -2, spec)
    dyq, _ = fake_quantize(dy, -2, spec)
    return jnp.einsum("...mk,...mn->...kn", xq, dyq, **_FP32).astype(dy.dtype)


def apply_mask(grad, mask):
    return grad if mask is None else jnp.where(mask, grad, jnp.zeros((), grad.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def quantized_bmm(x: jnp.ndarray, w: jnp.ndarray, recipe: Recipe) -> jnp.ndarray:
    """x [..., M, K] @ w [..., K, N] (same leading batch dims, e.g. experts) with `recipe`'s
    quantized fprop / dgrad / wgrad (module docstring)."""
    return fprop(x, w, recipe)[0]


def _bmm_fwd(x, w, recipe):
    y, mask_x, mask_w = fprop(x, w, recipe)
    return y, (x, w, mask_x, mask_w)


def _bmm_bwd(recipe, res, dy):
    x, w, mask_x, mask_w = res
    dx = apply_mask(dgrad(dy, w, recipe), mask_x).astype(x.dtype)
    dw = apply_mask(wgrad(x, dy.astype(x.dtype), recipe), mask_w).astype(w.dtype)
    return dx, dw


quantized_bmm.defvjp(_bmm_fwd, _bmm_bwd)


def quantized_linear(x: jnp.ndarray, w: jnp.ndarray, recipe: str | Recipe = "mxfp8") -> jnp.ndarray:
    """x [..., K] @ w [K, N]; the leading axes of x are flattened into the token axis M."""
    recipe = get_recipe(recipe)
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"quantized_linear expects x [..., K] and w [K, N], got {x.shape}, {w.shape}")
    y = quantized_bmm(x.reshape(-1, x.shape[-1]), w, recipe)
    return y.reshape(*x.shape[:-1], w.shape[1])


def quantized_grouped_linear(x: jnp.ndarray, w: jnp.ndarray, recipe: str | Recipe = "mxfp8") -> jnp.ndarray:
    """Per-expert buffers x [E, C, K] @ w [E, K, N] (the capacity-padded grouped GEMM)."""
    recipe = get_recipe(recipe)
    if x.ndim != 3 or w.ndim != 3:
        raise ValueError(f"quantized_grouped_linear expects x [E, C, K] and w [E, K, N], got {x.shape}, {w.shape}")
    return quantized_bmm(x, w, recipe)
