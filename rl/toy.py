"""A single-turn toy RL task for tiny models, shared by the learner's end-to-end test and ablations:
prompts of random tokens, reward = fraction of the generated tokens equal to a target token.

The sampler runs a full forward per token (sequences are a few tokens long), so it needs no KV cache;
the real sampler is models/inference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from c2jax.rl.batch import RLBatch, replay_from_model


def make_full_forward_sampler(graphdef: nnx.GraphDef, prompt_len: int, gen: int):
    """sample(params, model_state, prompts [n, prompt_len], key) -> (ids [n, prompt_len + gen], behaviour
    logprob of each sampled token (0 on the prompt), experts of every input position [L, n, T, k]).
    Temperature-1 ancestral sampling."""

    @jax.jit
    def sample(params, model_state, prompts, key):
        model = nnx.merge(graphdef, params, model_state)
        n, total = prompts.shape[0], prompt_len + gen
        ids = jnp.zeros((n, total), jnp.int32).at[:, :prompt_len].set(prompts)

        def body(t, carry):
            ids, logps, key = carry
            logits = jax.lax.dynamic_index_in_dim(model(ids, return_mtp=False).logits, t - 1, 1, False)
            key, sub = jax.random.split(key)
            tok = jax.random.categorical(sub, logits)
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], -1)[:, 0]
            return ids.at[:, t].set(tok), logps.at[:, t].set(logp), key

        ids, logps, _ = jax.lax.fori_loop(prompt_len, total, body, (ids, jnp.zeros((n, total)), key))
        return ids, logps, model(ids, return_mtp=False).expert_ids

    return sample


def single_turn_batch(ids, logps, experts, advantages, prompt_len: int, version: int,
                      group_rewards=None) -> RLBatch:
    """One row per sampled sequence: loss on the generated tokens (position t predicts token t + 1), each
    row's advantage on its loss tokens, behaviour logprobs aligned with the targets, replay ids."""
    ids, logps = np.asarray(ids), np.asarray(logps)
    n, total = ids.shape
    loss_mask = np.zeros((n, total), bool)
    loss_mask[:, prompt_len - 1:total - 1] = True
    return RLBatch(
        input_ids=ids, targets=np.concatenate([ids[:, 1:], np.zeros((n, 1), ids.dtype)], 1), loss_mask=loss_mask,
        positions=np.broadcast_to(np.arange(total), (n, total)).astype(np.int32),
        segment_ids=np.ones((n, total), np.int32),
        sequence_ids=np.broadcast_to(np.arange(n)[:, None], (n, total)).astype(np.int32),
        advantages=np.where(loss_mask, np.asarray(advantages)[:, None], 0.0).astype(np.float32),
        behavior_logprobs=np.concatenate([logps[:, 1:], np.zeros((n, 1))], 1).astype(np.float32),
        policy_versions=np.full((n, total), version, np.int32), replay_ids=replay_from_model(experts),
        group_rewards=group_rewards)
