"""Router replay metrics (Composer 2 sec. 5): how often the plausibility filter overrode the sampler's
experts, and how far the trainer's logprobs are from the sampler's.

The filter itself lives in `c2jax.models.moe_routing.route` (`ModelConfig.router_replay_filter_ratio`),
because it must run inside the scanned layer stack; the model returns the experts it actually used, so the
firing rate is measured by comparing those with what was replayed.
"""

from __future__ import annotations

import jax.numpy as jnp


def replay_override_fraction(used_ids: jnp.ndarray, replay_ids: jnp.ndarray, token_mask: jnp.ndarray):
    """Fraction of replayed (token, layer, slot) assignments whose expert the trainer did not use:
    1/(|T| L k) sum_{t in T, l, j} 1[replay[t, l, j] not in used[t, l, :]].
    used_ids, replay_ids [B, S, L, k]; token_mask [B, S] (real tokens)."""
    present = (replay_ids[..., :, None] == used_ids[..., None, :]).any(-1)  # [B, S, L, k]
    mask = jnp.broadcast_to(token_mask[:, :, None, None], present.shape)
    return jnp.sum(jnp.where(mask, ~present, False)) / jnp.maximum(jnp.sum(mask), 1)


def logprob_mismatch(trainer_logp: jnp.ndarray, behavior_logp: jnp.ndarray, mask: jnp.ndarray) -> dict:
    """Trainer/sampler numerics mismatch on the loss tokens, d_t = log pi_trainer - log mu:
    mean |d|, p99 |d| (the statistic the report's plausibility filter reduces), and the k3 estimate of
    KL(mu || pi_trainer) = E_mu[exp(d) - 1 - d] (tokens are samples from mu)."""
    mask = mask.astype(bool)
    d = jnp.where(mask, trainer_logp - behavior_logp, 0.0)
    count = jnp.maximum(mask.sum(), 1)
    abs_d = jnp.abs(d)
    p99 = jnp.nanpercentile(jnp.where(mask, abs_d, jnp.nan), 99.0)
    return {
        "mismatch/abs_mean": abs_d.sum() / count,
        "mismatch/abs_p99": jnp.where(mask.any(), p99, 0.0),
        "mismatch/kl_k3": jnp.sum(jnp.where(mask, jnp.expm1(d) - d, 0.0)) / count,
    }
