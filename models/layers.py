"""Parameter helpers, RMSNorm and the SwiGLU MLP.

Every parameter carries `logical_axes` metadata (one name per dimension) so the sharding layer can map
it to a mesh without touching model code. Layers built for `lax.scan` get a leading 'layers' axis.
Logical axis names used throughout:
  layers, vocab, embed, q_lora, kv_lora, heads, head_dim, mlp, experts, expert_mlp, norm
Activations: batch, seq, embed, heads, kv_lora, vocab, experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig


class RouterBias(nnx.Variable):
    """Selection-only expert bias (DeepSeek-V3 aux-loss-free balancing): model state, never trained.

    A distinct Variable type keeps it out of `nnx.Param` filters, so optimizers built with `wrt=nnx.Param`
    never see it: no gradient step and no weight decay can touch it.
    """


def param(rngs: nnx.Rngs, shape, axes, *, cfg: ModelConfig, stack: int | None = None,
          init: str = "normal", std: float | None = None) -> nnx.Param:
    if len(shape) != len(axes):
        raise ValueError(f"parameter shape {shape} and logical axes {axes} differ in rank")
    if stack is not None:
        shape, axes = (stack, *shape), ("layers", *axes)
    dtype = jnp.dtype(cfg.param_dtype)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        std = cfg.initializer_range if std is None else std
        value = std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """y = w * x / sqrt(mean(x^2) + eps), statistics in float32 (Zhang & Sennrich 2019)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, cfg: ModelConfig, rngs: nnx.Rngs, stack: int | None = None,
                 axis_name: str = "norm"):
        self.eps = cfg.rms_norm_eps
        self.weight = param(rngs, (dim,), (axis_name,), cfg=cfg, stack=stack, init="ones")

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


def dense(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """x @ w in the activation dtype; weights are stored [in, out]."""
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype))


class MLP(nnx.Module):
    """SwiGLU: down(silu(x W_gate) * (x W_up)) (Shazeer 2020)."""

    def __init__(self, cfg: ModelConfig, width: int, rngs: nnx.Rngs, stack: int | None = None):
        d = cfg.hidden_size
        self.gate_proj = param(rngs, (d, width), ("embed", "mlp"), cfg=cfg, stack=stack)
        self.up_proj = param(rngs, (d, width), ("embed", "mlp"), cfg=cfg, stack=stack)
        self.down_proj = param(rngs, (width, d), ("mlp", "embed"), cfg=cfg, stack=stack)

    def __call__(self, x):
        h = jax.nn.silu(dense(x, self.gate_proj[...])) * dense(x, self.up_proj[...])
        return dense(h, self.down_proj[...])
