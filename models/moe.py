"""The DeepSeek-V3 MoE layer: router (models/moe_routing.py), routed experts through one of the dropless dispatch
paths (models/moe_dispatch.py, `ModelConfig.moe_impl`; "auto": grouped on GPUs, sorted elsewhere), and shared
experts. Under logical rules that shard the experts or the tokens, the routed part runs expert-parallel
(models/expert_parallel.py) on the same path, each rank's experts through it.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from c2jax.models.config import ModelConfig
from c2jax.models.expert_parallel import moe_expert_parallel, token_parallel_mesh
from c2jax.models.layers import MLP, RouterBias, param
from c2jax.models.logical import active_mesh_axes
from c2jax.models.moe_dispatch import (
    dispatch_dense,
    dispatch_grouped,
    dispatch_ragged,
    dispatch_sorted,
    moe_path,
)
from c2jax.models.moe_routing import route


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: int | None = None):
        self.cfg = cfg
        d, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.gate = param(rngs, (d, e), ("embed", "experts"), cfg=cfg, stack=stack)
        bias_shape, bias_axes = ((e,), ("experts",)) if stack is None else ((stack, e), ("layers", "experts"))
        self.e_score_correction_bias = RouterBias(jnp.zeros(bias_shape, jnp.float32), logical_axes=bias_axes)
        # gate and up fused along the output axis ([gate | up]), as HF keeps them in memory
        self.gate_up_proj = param(rngs, (e, d, 2 * f), ("experts", "embed", "expert_mlp"), cfg=cfg, stack=stack)
        self.down_proj = param(rngs, (e, f, d), ("experts", "expert_mlp", "embed"), cfg=cfg, stack=stack)
        self.shared_experts = (
            MLP(cfg, f * cfg.n_shared_experts, rngs, stack) if cfg.n_shared_experts else None
        )

    def __call__(self, x: jnp.ndarray, replay_ids: jnp.ndarray | None = None):
        """x: [B, S, d]. Returns (y [B, S, d], Routing over the B*S tokens)."""
        cfg = self.cfg
        batch, seq, d = x.shape
        gate_up, down = self.gate_up_proj[...], self.down_proj[...]
        impl = moe_path(cfg)  # "auto" resolved for the device the kernels are chosen for
        sharded_tokens = impl in ("sorted", "grouped") and token_parallel_mesh() is not None
        if active_mesh_axes("experts") is not None or sharded_tokens:
            y, routing = moe_expert_parallel(cfg, x, self.gate[...], self.e_score_correction_bias[...],
                                             gate_up, down, replay_ids)
            if self.shared_experts is not None:
                y = y + self.shared_experts(x)
            return y, routing
        flat = x.reshape(batch * seq, d)
        replay = None if replay_ids is None else replay_ids.reshape(batch * seq, -1)
        routing = route(cfg, flat, self.gate[...], self.e_score_correction_bias[...], replay)
        if impl == "dense":
            y = dispatch_dense(flat, routing, gate_up, down)
        elif impl == "ragged":
            y = dispatch_ragged(flat, routing, gate_up, down)
        elif impl == "grouped":
            y = dispatch_grouped(cfg, flat, routing, gate_up, down)
        else:
            y = dispatch_sorted(cfg, flat, routing, gate_up, down)
        y = y.reshape(batch, seq, d)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y, routing
