"""MoE routing (DeepSeek-V3, DeepSeek-V2, Qwen3-MoE): a sigmoid or softmax router with a selection-only bias,
group-limited top-k and router replay. `route` turns tokens into a `Routing` (experts, combine weights, load counts,
logits), which the dispatch paths (models/moe_dispatch.py) and expert parallelism (models/expert_parallel.py)
consume.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from c2jax.models.config import ModelConfig


class Routing(NamedTuple):
    expert_ids: jnp.ndarray  # [T, k] int32, selected experts (what router replay records)
    weights: jnp.ndarray  # [T, k] float32, combine weights (from unbiased scores)
    counts: jnp.ndarray  # [E] int32, tokens routed to each expert (load-balancing statistic)
    logits: jnp.ndarray  # [T, E] float32 router logits (for z-loss / diagnostics)


def route(cfg: ModelConfig, x: jnp.ndarray, w_router: jnp.ndarray, bias: jnp.ndarray,
          replay_ids: jnp.ndarray | None = None) -> Routing:
    """Top-k routing of DeepSeek-V3 (sec. 2.1.2, "noaux_tc"), DeepSeek-V2 and Qwen3-MoE.

    s = sigmoid(x W_r) or softmax(x W_r) (cfg.scoring_func); selection uses s + b, where b is the aux-loss-free
    balancing bias (zero and untouched for families without it). cfg.topk_method picks the eligible experts:
    "noaux_tc" (V3) keeps the topk_group groups with the largest top-2 sums of (s + b), "group_limited_greedy"
    (V2) those with the largest single score, "greedy" (V2-Lite, Qwen3-MoE) every expert.
    Weights g = s[selected], renormalised to sum 1 if norm_topk_prob, then times routed_scaling_factor.
    With `replay_ids` (router replay for RL) the selection is taken as given and only g is recomputed
    from the live scores, so gradients still reach the router; with cfg.router_replay_filter_ratio > 0
    implausible replayed experts are first swapped for the trainer's own (`_plausible_replay`), and the
    returned expert_ids are the ones actually used (compare them with replay_ids for the firing rate).
    """
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), w_router.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, -1)
    num_experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    choice = _selection_scores(cfg, scores, bias)
    if replay_ids is None:
        _, expert_ids = jax.lax.top_k(jax.lax.stop_gradient(choice), k)
    else:
        if replay_ids.shape != (x.shape[0], k):
            raise ValueError(f"replay_ids shape {replay_ids.shape} != (tokens, top_k) {(x.shape[0], k)}")
        expert_ids = replay_ids
        if cfg.router_replay_filter_ratio > 0:
            # the trainer's own choice is made under the same group limit as the sampler's
            expert_ids = _plausible_replay(scores, choice, replay_ids.astype(jnp.int32), k,
                                           cfg.router_replay_filter_ratio)
    expert_ids = expert_ids.astype(jnp.int32)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    counts = jnp.zeros((num_experts,), jnp.int32).at[expert_ids.reshape(-1)].add(1)
    return Routing(expert_ids, weights, counts, logits)


def _selection_scores(cfg: ModelConfig, scores: jnp.ndarray, bias: jnp.ndarray) -> jnp.ndarray:
    """[T, E] what the top-k selects by: s + b, -inf outside the eligible groups (cfg.topk_method)."""
    num_experts = cfg.n_routed_experts
    choice = scores + bias.astype(jnp.float32)
    if cfg.n_group > 1 and cfg.topk_method != "greedy":
        grouped = choice.reshape(-1, cfg.n_group, num_experts // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        else:  # group_limited_greedy
            group_scores = grouped.max(-1)
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        keep = jnp.zeros_like(group_scores, dtype=bool).at[
            jnp.arange(group_scores.shape[0])[:, None], top_groups].set(True)
        keep = jnp.repeat(keep, num_experts // cfg.n_group, axis=-1)
        choice = jnp.where(keep, choice, -jnp.inf)
    return choice


def _plausible_replay(scores, choice, replay_ids, k: int, ratio: float) -> jnp.ndarray:
    """Router replay plausibility filter (Composer 2 sec. 5; threshold form of prime-rl PR #2703).

    Keep replayed expert e of token t iff s[t, e] >= ratio * min_{j in topk_t} s[t, j], where topk_t is the
    trainer's own top-k by the selection score s + b within the groups it may choose from (`choice` is -inf
    outside them: without that, a grouped router's own replayed choice could fall below the threshold of an
    ungrouped top-k and be swapped for an expert its groups exclude). Each rejected slot takes, in rank order,
    the best trainer candidate not already among the kept replayed experts, so the k ids stay distinct.
    """
    scores, choice = jax.lax.stop_gradient(scores), jax.lax.stop_gradient(choice)
    _, own = jax.lax.top_k(choice, k)  # [T, k], best first
    threshold = ratio * jnp.take_along_axis(scores, own, axis=-1).min(-1, keepdims=True)
    keep = jnp.take_along_axis(scores, replay_ids, axis=-1) >= threshold
    kept_ids = jnp.where(keep, replay_ids, -1)
    free = ~(own[:, :, None] == kept_ids[:, None, :]).any(-1)  # trainer candidates still available
    drop_rank = jnp.cumsum(~keep, axis=-1) - 1
    free_rank = jnp.cumsum(free, axis=-1) - 1
    match = (~keep)[:, :, None] & free[:, None, :] & (drop_rank[:, :, None] == free_rank[:, None, :])
    backfill = jnp.sum(jnp.where(match, own[:, None, :], 0), axis=-1)
    return jnp.where(keep, replay_ids, backfill)


def load_balancing_loss(cfg: ModelConfig, router_logits: jnp.ndarray, expert_ids: jnp.ndarray,
                        token_mask: jnp.ndarray | None = None) -> jnp.ndarray:
    """The auxiliary load-balancing loss E * sum_e f_e P_e (Switch Transformer eq. 4; Qwen3-MoE, Mixtral and
    DeepSeek-V2's expert-level balance loss), pooled over every MoE layer as transformers' load_balancing_loss_func
    pools them: f_e = top-k assignments to expert e / (layers x tokens), P_e = its mean routing probability.
    router_logits [L, ..., E], expert_ids [L, ..., k] (ModelOutput's), token_mask [...] (1 = a real token; padding
    excluded). Probabilities are the softmax of the logits for softmax routers and the sigmoid scores normalised to
    sum 1 per token for sigmoid ones (DeepSeek-V3's sequence-wise form). The top-k counts carry no gradient; the
    probabilities carry it to the router."""
    num_experts = cfg.n_routed_experts
    logits = router_logits.reshape(router_logits.shape[0], -1, num_experts).astype(jnp.float32)
    ids = expert_ids.reshape(expert_ids.shape[0], -1, expert_ids.shape[-1])
    if cfg.scoring_func == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
        probs = scores / (scores.sum(-1, keepdims=True) + 1e-20)
    mask = jnp.ones(logits.shape[1], jnp.float32) if token_mask is None else token_mask.reshape(-1).astype(jnp.float32)
    rows = jnp.maximum(mask.sum() * logits.shape[0], 1.0)
    onehot = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32).sum(-2)  # [L, T, E] assignments per token
    tokens_per_expert = jax.lax.stop_gradient(jnp.einsum("lte,t->e", onehot, mask)) / rows
    prob_per_expert = jnp.einsum("lte,t->e", probs, mask) / rows
    return num_experts * jnp.sum(tokens_per_expert * prob_per_expert)
