"""Group-relative advantages (pure jnp functions over arrays of sequence rewards).

Rewards come as [num_groups, G]: G rollouts of the same prompt, a fixed group size (Composer 2 sec. 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from c2jax.rl.config import AdvantageConfig


def group_advantages(rewards: jnp.ndarray, cfg: AdvantageConfig | None = None) -> jnp.ndarray:
    """[num_groups, G] rewards -> [num_groups, G] advantages.

    group_mean (Dr. GRPO, Liu et al. 2025 eq. 3):  A_i = R_i - (1/G) sum_j R_j
    rloo (Ahmadian et al. 2024 eq. 6):             A_i = R_i - (1/(G-1)) sum_{j != i} R_j
                                                       = G/(G-1) * (R_i - mean_G)
    none:                                          A_i = R_i
    std_normalize (GRPO, Shao et al. 2024):        A_i <- A_i / (std_G(R) + eps), std with ddof=1.

    std_normalize is off by default: Composer 2 (sec. 4.2, after Dr. GRPO) drops it because in a group
    whose rollouts are all (nearly) equally correct it divides tiny reward differences by a tiny std and
    "massively upweights" them. A group of size 1 gets advantage 0 under both baselines.
    """
    cfg = AdvantageConfig() if cfg is None else cfg
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {rewards.shape}")
    g = rewards.shape[1]
    mean = rewards.mean(-1, keepdims=True)
    if cfg.baseline == "group_mean":
        adv = rewards - mean
    elif cfg.baseline == "rloo":
        adv = (rewards - mean) * (g / (g - 1)) if g > 1 else jnp.zeros_like(rewards)
    elif cfg.baseline == "none":
        adv = rewards
    else:
        raise ValueError(f"unknown baseline {cfg.baseline!r}")
    if cfg.std_normalize:
        std = rewards.std(-1, ddof=1, keepdims=True) if g > 1 else jnp.zeros_like(mean)
        adv = adv / (std + cfg.eps)
    return adv


def zero_variance_fraction(rewards: jnp.ndarray, tol: float = 1e-6) -> jnp.ndarray:
    """Fraction of groups whose G rewards are all equal (max - min <= tol): they carry no gradient under a
    group baseline, so a rising value means wasted rollouts (DAPO's dynamic-sampling signal)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    return jnp.mean((rewards.max(-1) - rewards.min(-1)) <= tol)


def token_advantages(seq_advantages: jnp.ndarray, sequence_ids: jnp.ndarray, loss_mask: jnp.ndarray,
                     length_normalize: bool = False) -> jnp.ndarray:
    """Broadcast per-sequence advantages [N] to tokens [B, S] through `sequence_ids` [B, S] (-1 = none).

    length_normalize (GRPO, Shao et al. 2024 eq. 3, the 1/|o_i| factor): A_{i,t} = A_i / |o_i| with
    |o_i| = the number of loss tokens of sequence i. Off by default: Dr. GRPO (Liu et al. 2025 sec. 3.1)
    shows it rewards long incorrect and short correct responses disproportionately (a length bias).
    Tokens outside the mask get 0.
    """
    n = seq_advantages.shape[0]
    valid = (sequence_ids >= 0) & (sequence_ids < n) & loss_mask.astype(bool)
    idx = jnp.where(valid, sequence_ids, 0)
    adv = jnp.take(seq_advantages.astype(jnp.float32), idx)
    if length_normalize:
        lengths = jax.ops.segment_sum(valid.reshape(-1).astype(jnp.float32), jnp.where(valid, idx, n).reshape(-1),
                                      num_segments=n + 1)[:n]
        adv = adv / jnp.maximum(jnp.take(lengths, idx), 1.0)
    return jnp.where(valid, adv, 0.0)


def chain_rewards(chain_ids: jnp.ndarray, final_rewards: jnp.ndarray) -> jnp.ndarray:
    """Self-summarization (Composer 2 sec. 4.5): a rollout chained through summaries is several segments
    (each its own context); every segment s of chain c gets the chain's final reward, R_s = R_{c(s)}, so a
    summary that lost information is down-weighted with the outcome it caused.

    chain_ids [num_segments] int (index into final_rewards [num_chains]) -> [num_segments] rewards."""
    chain_ids = jnp.asarray(chain_ids)
    final_rewards = jnp.asarray(final_rewards, jnp.float32)
    return jnp.take(final_rewards, chain_ids, mode="fill", fill_value=jnp.nan)
