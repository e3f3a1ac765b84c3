"""DeepSeek-V3 MoE: sigmoid router with a selection-only bias, group-limited top-k, shared experts,
and three dropless dispatch paths over the same parameters.

Dispatch paths (`ModelConfig.moe_impl`):
  sorted  sort assignments by expert, gather them into an [E, C, d] buffer and run one batched einsum.
          C is chosen at run time from a few static buckets (`moe_capacity_factors` x the balanced load,
          then T, the hard bound since a token picks an expert at most once) with `lax.switch`, so no
          token is ever dropped and a balanced batch pays only ~1.25x the useful FLOPs. The default.
  ragged  `jax.lax.ragged_dot` over the sorted rows. Exact grouped GEMM semantics; XLA:CPU lowers it
          to a dense masked matmul (~E x the FLOPs), so it is an oracle on CPU and a candidate on GPU.
  dense   every expert on every token, combined with a [T, E] weight matrix. The simplest oracle.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import MLP, RouterBias, param


class Routing(NamedTuple):
    expert_ids: jnp.ndarray  # [T, k] int32, selected experts (what router replay records)
    weights: jnp.ndarray  # [T, k] float32, combine weights (from unbiased scores)
    counts: jnp.ndarray  # [E] int32, tokens routed to each expert (load-balancing statistic)
    logits: jnp.ndarray  # [T, E] float32 router logits (for z-loss / diagnostics)


def route(cfg: ModelConfig, x: jnp.ndarray, w_router: jnp.ndarray, bias: jnp.ndarray,
          replay_ids: jnp.ndarray | None = None) -> Routing:
    """Top-k routing of DeepSeek-V3 (sec. 2.1.2, "noaux_tc").

    s = sigmoid(x W_r) (or softmax); selection uses s + b, where b is the aux-loss-free balancing bias;
    with n_group > 1 only the topk_group groups with the largest top-2 sums of (s + b) are eligible.
    Weights g = s[selected], renormalised to sum 1 if norm_topk_prob, then times routed_scaling_factor.
    With `replay_ids` (router replay for RL) the selection is taken as given and only g is recomputed
    from the live scores, so gradients still reach the router.
    """
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), w_router.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, -1)
    num_experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if replay_ids is None:
        choice = scores + bias.astype(jnp.float32)
        if cfg.n_group > 1:
            grouped = choice.reshape(-1, cfg.n_group, num_experts // cfg.n_group)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
            _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
            keep = jnp.zeros_like(group_scores, dtype=bool).at[
                jnp.arange(group_scores.shape[0])[:, None], top_groups].set(True)
            keep = jnp.repeat(keep, num_experts // cfg.n_group, axis=-1)
            choice = jnp.where(keep, choice, -jnp.inf)
        _, expert_ids = jax.lax.top_k(jax.lax.stop_gradient(choice), k)
    else:
        if replay_ids.shape != (x.shape[0], k):
            raise ValueError(f"replay_ids shape {replay_ids.shape} != (tokens, top_k) {(x.shape[0], k)}")
        expert_ids = replay_ids
    expert_ids = expert_ids.astype(jnp.int32)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    counts = jnp.zeros((num_experts,), jnp.int32).at[expert_ids.reshape(-1)].add(1)
    return Routing(expert_ids, weights, counts, logits)


def _swiglu_experts(h: jnp.ndarray, gate_up: jnp.ndarray, down: jnp.ndarray) -> jnp.ndarray:
    """[E, C, d] -> [E, C, d] through each expert's SwiGLU."""
    gu = jnp.einsum("ecd,edf->ecf", h, gate_up.astype(h.dtype))
    gate, up = jnp.split(gu, 2, axis=-1)
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, down.astype(h.dtype))


def dispatch_dense(x, routing: Routing, gate_up, down):
    """Oracle: y_t = sum_e G[t, e] * expert_e(x_t), with G zero off the selected experts."""
    num_experts = gate_up.shape[0]
    combine = jnp.zeros((x.shape[0], num_experts), jnp.float32).at[
        jnp.arange(x.shape[0])[:, None], routing.expert_ids].add(routing.weights)
    all_out = _swiglu_experts(jnp.broadcast_to(x, (num_experts, *x.shape)), gate_up, down)
    return jnp.einsum("te,etd->td", combine.astype(x.dtype), all_out)


def _sort_assignments(expert_ids: jnp.ndarray, num_experts: int):
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignment indices grouped by expert
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    starts = jnp.cumsum(counts) - counts
    return flat, order, counts, starts


def dispatch_ragged(x, routing: Routing, gate_up, down):
    """Grouped GEMM over expert-sorted rows with jax.lax.ragged_dot."""
    k = routing.expert_ids.shape[1]
    _, order, counts, _ = _sort_assignments(routing.expert_ids, gate_up.shape[0])
    rows = x[order // k]
    gu = jax.lax.ragged_dot(rows, gate_up.astype(x.dtype), counts)
    gate, up = jnp.split(gu, 2, axis=-1)
    out_sorted = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down.astype(x.dtype), counts)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(x.shape[0], k, -1)
    return jnp.einsum("tkd,tk->td", out, routing.weights.astype(x.dtype))


def capacity_buckets(cfg: ModelConfig, num_tokens: int) -> tuple[int, ...]:
    """Static per-expert capacities tried in order; the last is T, which can never overflow."""
    balanced = num_tokens * cfg.num_experts_per_tok / cfg.n_routed_experts
    caps = []
    for factor in cfg.moe_capacity_factors:
        cap = min(num_tokens, 8 * math.ceil(factor * balanced / 8))
        if not caps or cap > caps[-1]:
            caps.append(cap)
    if caps[-1] < num_tokens:
        caps.append(num_tokens)
    return tuple(caps)


def _dispatch_with_capacity(x, weights, order, starts, counts, slot_of, gate_up, down, capacity):
    num_experts = gate_up.shape[0]
    num_tokens, k = weights.shape
    c = jnp.arange(capacity)
    src = starts[:, None] + c[None, :]  # [E, C] index into the sorted assignments
    valid = c[None, :] < counts[:, None]
    src_token = order[jnp.minimum(src, order.shape[0] - 1)] // k
    buffer = jnp.where(valid[..., None], x[src_token], 0)
    out = _swiglu_experts(buffer, gate_up, down).reshape(num_experts * capacity, -1)
    slots = slot_of[0] * capacity + slot_of[1]  # [T*k] row of each assignment in `out`
    gathered = out[slots].reshape(num_tokens, k, -1)
    return jnp.einsum("tkd,tk->td", gathered, weights.astype(x.dtype))


def dispatch_sorted(cfg: ModelConfig, x, routing: Routing, gate_up, down):
    """Dropless sort + capacity-bucketed batched einsum (see module docstring)."""
    num_experts = gate_up.shape[0]
    flat, order, counts, starts = _sort_assignments(routing.expert_ids, num_experts)
    rank_sorted = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[flat[order]]
    rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)  # position within its expert
    buckets = capacity_buckets(cfg, x.shape[0])
    branches = [
        (lambda cap: lambda *a: _dispatch_with_capacity(*a, gate_up, down, cap))(cap) for cap in buckets
    ]
    index = jnp.searchsorted(jnp.asarray(buckets), jnp.max(counts), side="left")
    operands = (x, routing.weights, order, starts, counts, (flat, rank))
    if len(branches) == 1:
        return branches[0](*operands)
    return jax.lax.switch(jnp.minimum(index, len(branches) - 1), branches, *operands)


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
        flat = x.reshape(batch * seq, d)
        replay = None if replay_ids is None else replay_ids.reshape(batch * seq, -1)
        routing = route(cfg, flat, self.gate[...], self.e_score_correction_bias[...], replay)
        gate_up, down = self.gate_up_proj[...], self.down_proj[...]
        if cfg.moe_impl == "dense":
            y = dispatch_dense(flat, routing, gate_up, down)
        elif cfg.moe_impl == "ragged":
            y = dispatch_ragged(flat, routing, gate_up, down)
        else:
            y = dispatch_sorted(cfg, flat, routing, gate_up, down)
        y = y.reshape(batch, seq, d)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y, routing
