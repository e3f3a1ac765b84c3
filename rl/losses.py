"""Policy-gradient surrogate losses and their exact aggregation (pure jnp functions on [B, S] arrays).

Notation: logp = log pi_theta(o_t | ctx) (differentiable), mu = the sampler's behaviour logprob, A = the
token's advantage, m = loss mask, sg = stop_gradient. The ratio r = exp(logp - log pi_old), where pi_old
is mu (`ratio_reference="behavior"`) or the learner's own detached logprob ("proximal", r == 1 in value).

Masked slots are replaced by zeros before any arithmetic, so NaN/inf there never reaches a value or a
gradient (a `where` after the fact would still leak NaN through the chain rule).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from c2jax.rl.config import LossConfig


class TokenLoss(NamedTuple):
    loss: jnp.ndarray  # [B, S] per-token loss, 0 where masked
    clipped: jnp.ndarray  # [B, S] bool: the token's ratio (or IS weight) was clipped / masked out
    ratio: jnp.ndarray  # [B, S] r in value (sequence ratio for GSPO), 1 where masked
    is_weight: jnp.ndarray  # [B, S] the TIS/MIS weight w applied, 1 where masked or disabled


def segment_mean(values: jnp.ndarray, mask: jnp.ndarray, sequence_ids: jnp.ndarray, num_sequences: int):
    """Per-sequence masked mean (1/|o_i|) sum_{t in o_i} v_t, gathered back to tokens [B, S]; also the
    per-sequence token counts [N]. sequence_ids [B, S] in [0, N) on loss tokens."""
    seg = jnp.where(mask, sequence_ids, num_sequences).reshape(-1)
    sums = jax.ops.segment_sum(jnp.where(mask, values, 0.0).reshape(-1), seg, num_segments=num_sequences + 1)
    counts = jax.ops.segment_sum(mask.reshape(-1).astype(jnp.float32), seg, num_segments=num_sequences + 1)
    means = sums / jnp.maximum(counts, 1.0)
    return jnp.take(means, seg).reshape(values.shape), counts[:num_sequences]


def importance_weight(logp_sg: jnp.ndarray, behavior_logp: jnp.ndarray, cfg: LossConfig):
    """Trainer/sampler correction w = pi_prox / mu = exp(sg(logp) - mu) (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"):
      TIS: w <- min(w, cap)                        (truncated importance sampling)
      MIS: w <- w * 1[is_low <= w <= cap]          (masked IS; icepop-style, tokens outside the band drop)
    Returns (w, dropped) with w detached."""
    w = jnp.exp(jax.lax.stop_gradient(logp_sg) - behavior_logp)
    if cfg.importance_correction == "none":
        return jnp.ones_like(w), jnp.zeros(w.shape, bool)
    if cfg.importance_correction == "tis":
        return jnp.minimum(w, cfg.is_cap), w > cfg.is_cap
    keep = (w >= cfg.is_low) & (w <= cfg.is_cap)
    return jnp.where(keep, w, 0.0), ~keep


def policy_token_loss(logp, behavior_logp, advantages, mask, sequence_ids, num_sequences: int,
                      cfg: LossConfig) -> TokenLoss:
    """Per-token surrogate l_t (the loss is the aggregate of l_t; its gradient is the policy gradient).

    reinforce (Williams 1992; Dr. GRPO):  l = -w A logp
    ppo (Schulman et al. 2017 eq. 7):      l = -w min(r A, clip(r, 1 - eps_lo, 1 + eps_hi) A)
        dual clip (Ye et al. 2020 eq. 5):  for A < 0, l <- min(l, -c A)
        DAPO clip-higher (Yu et al. 2025): eps_hi > eps_lo (0.28 vs 0.2)
    gspo (Zheng et al. 2025 eqs. 5-7, GSPO-token form):
        log s_t = sg(log s_i) + logp_t - sg(logp_t),  log s_i = (1/|o_i|) sum_t (logp_t - log pi_old_t)
        l = -w min(s A, clip(s, 1 - eps, 1 + eps) A),  eps = gspo_clip
    cispo (MiniMax-M1, 2025 eq. 4):        l = -w sg(clip(r, 1 - eps_lo, 1 + eps_hi)) A logp
    w is the TIS/MIS weight (1 when disabled).
    """
    mask = mask.astype(bool)
    logp = jnp.where(mask, logp, 0.0)
    behavior_logp = jnp.where(mask, behavior_logp, 0.0)
    adv = jnp.where(mask, advantages, 0.0)
    old = behavior_logp if cfg.ratio_reference == "behavior" else jax.lax.stop_gradient(logp)
    w, dropped = importance_weight(logp, behavior_logp, cfg)
    log_ratio = logp - old
    kind = cfg.policy_loss
    if kind == "reinforce":
        ratio = jnp.exp(jax.lax.stop_gradient(log_ratio))
        loss, clipped = -adv * logp, jnp.zeros(mask.shape, bool)
    elif kind == "ppo":
        ratio = jnp.exp(log_ratio)
        lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
        unclipped, clipped_obj = ratio * adv, jnp.clip(ratio, lo, hi) * adv
        loss = -jnp.minimum(unclipped, clipped_obj)
        clipped = clipped_obj < unclipped  # the clipped branch is the active one: no gradient
        if cfg.dual_clip is not None:
            bound = -cfg.dual_clip * adv
            dual = (adv < 0) & (loss > bound)
            loss = jnp.where(dual, bound, loss)
            clipped = clipped | dual
    elif kind == "gspo":
        seq_log_ratio, _ = segment_mean(jax.lax.stop_gradient(log_ratio), mask, sequence_ids, num_sequences)
        ratio = jnp.exp(seq_log_ratio + logp - jax.lax.stop_gradient(logp))
        eps = cfg.gspo_clip
        unclipped, clipped_obj = ratio * adv, jnp.clip(ratio, 1.0 - eps, 1.0 + eps) * adv
        loss = -jnp.minimum(unclipped, clipped_obj)
        clipped = clipped_obj < unclipped
    elif kind == "cispo":
        ratio = jnp.exp(jax.lax.stop_gradient(log_ratio))
        lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
        loss = -jnp.clip(ratio, lo, hi) * adv * logp
        clipped = (ratio < lo) | (ratio > hi)
    else:
        raise ValueError(f"unknown policy loss {kind!r}")
    loss = jnp.where(mask, w * loss, 0.0)
    return TokenLoss(loss, mask & (clipped | dropped), jnp.where(mask, jax.lax.stop_gradient(ratio), 1.0),
                     jnp.where(mask, w, 1.0))


def aggregation_weights(mask, sequence_ids, num_sequences: int, mode: str, constant: float = 1.0):
    """Token weights c_t and denominator D such that loss = sum_t c_t l_t / D, for the whole batch.

    token_mean (DAPO):            c_t = m_t,          D = sum_t m_t
    seq_mean_token_sum:           c_t = m_t,          D = number of sequences with a loss token
    seq_mean_token_mean (GRPO):   c_t = m_t / |o_i|,  D = number of sequences with a loss token
    constant (Dr. GRPO):          c_t = m_t,          D = constant (e.g. G x max generation length)

    Computed once over the full batch (masks only, no parameters), so a micro-batch contributes
    sum_{t in mb} c_t l_t / D and the accumulated gradient equals the full-batch one exactly.
    """
    mask = mask.astype(bool)
    m = mask.astype(jnp.float32)
    seg = jnp.where(mask, sequence_ids, num_sequences).reshape(-1)
    counts = jax.ops.segment_sum(m.reshape(-1), seg, num_segments=num_sequences + 1)[:num_sequences]
    num_nonempty = jnp.sum(counts > 0).astype(jnp.float32)
    if mode == "token_mean":
        return m, jnp.maximum(m.sum(), 1.0)
    if mode == "seq_mean_token_sum":
        return m, jnp.maximum(num_nonempty, 1.0)
    if mode == "seq_mean_token_mean":
        per_token = jnp.take(jnp.concatenate([counts, jnp.ones((1,))]), seg).reshape(mask.shape)
        return m / jnp.maximum(per_token, 1.0), jnp.maximum(num_nonempty, 1.0)
    if mode == "constant":
        return m, jnp.asarray(constant, jnp.float32)
    raise ValueError(f"unknown aggregation {mode!r}")


def aggregate(token_loss: jnp.ndarray, weights: jnp.ndarray):
    """The numerator sum_t c_t l_t of the aggregate; divide by D from `aggregation_weights` after summing
    numerators over micro-batches and data-parallel shards."""
    return jnp.sum(jnp.where(weights > 0, weights * token_loss, 0.0))
