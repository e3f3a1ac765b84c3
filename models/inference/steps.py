"""Jitted engine steps with static shapes: prefill one slot, copy a cached prefix, decode N steps.

Static: slot count and cache length (array shapes), the prompt bucket, the number of cache positions
read (`key_len`, a bucket >= every live length) and the chunk length. The cache argument is donated, so
updates happen in place.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from c2jax.models.config import ModelConfig
from c2jax.models.inference.forward import LayerCache, cache_merge, cache_window, extend, prepare
from c2jax.models.inference.sampling import SamplingParams, sample


class PrefillOutput(NamedTuple):
    cache: tuple[LayerCache, ...]
    first: object  # sampling.Sample for the first generated token of each row, [b]
    first_experts: jnp.ndarray | None  # [b, L_moe, k] experts at each row's last prompt position
    prompt_experts: jnp.ndarray | None  # [b, T_bucket, L_moe, k] experts of every prompt token
    last_logits: jnp.ndarray | None = None  # [b, V] logits at each row's last prompt position (forks use them)


def prefill_rows(cfg: ModelConfig, graphdef: nnx.GraphDef, state, cache, tokens, n_valid, slot, start,
                 sampling: SamplingParams, *, key_len: int, absorbed: bool, prepared=None):
    """Prefill b prompts at once: row i's tokens [b, T_bucket] (first n_valid[i] real) go to positions
    start[i].. of slot[i]; samples each row's next token. A slot index >= the cache's slot count is a padding
    row: its writes are dropped. Returns (PrefillOutput, StepOutput of the forward with logits at each row's
    last prompt position only)."""
    idx = n_valid - 1
    out = extend(cfg, graphdef, state, cache, tokens, slot, start, key_len=key_len, absorbed=absorbed,
                 prepared=prepared, logits_at=idx)
    last = out.logits[:, 0]
    first = sample(last, sampling, start + n_valid)
    experts = out.expert_ids
    first_experts = None if experts is None else jnp.take_along_axis(experts, idx[:, None, None, None], axis=1)[:, 0]
    return PrefillOutput(out.cache, first, first_experts, experts, last), out


@partial(jax.jit, static_argnames=("cfg", "graphdef", "key_len", "absorbed"), donate_argnames=("cache",))
def prefill_slot(cfg: ModelConfig, graphdef: nnx.GraphDef, state, cache, tokens, n_valid, slot, start,
                 sampling: SamplingParams, *, key_len: int, absorbed: bool = False) -> PrefillOutput:
    """prefill_rows, jitted: tokens [b, T_bucket], n_valid / slot / start [b], sampling rows [b]."""
    return prefill_rows(cfg, graphdef, state, cache, tokens, n_valid, slot, start, sampling, key_len=key_len,
                        absorbed=absorbed)[0]


@partial(jax.jit, donate_argnames=("cache",))
def copy_slot(cache, src, dst):
    """Copy slot src's rows of every cache array into slot dst (samples of one prompt share its prefill)."""
    return jax.tree.map(lambda a: a.at[dst].set(a[src]), cache)


@partial(jax.jit, donate_argnames=("cache",))
def copy_row(cache, src_cache, dst_slot):
    """Copy the one-slot cache src_cache into slot dst_slot of cache (prompt caching). Positions past the
    prefix come along too; they are never read before a later token overwrites them."""
    return tuple(type(c)(*(dst.at[dst_slot].set(src[0].astype(dst.dtype)) for dst, src in zip(c, s, strict=True)))
                 for c, s in zip(cache, src_cache, strict=True))


class SlotState(NamedTuple):
    pending: jnp.ndarray  # [B] int32 last sampled token, not yet in the cache
    lengths: jnp.ndarray  # [B] int32 tokens in the cache
    active: jnp.ndarray  # [B] bool
    remaining: jnp.ndarray  # [B] int32 tokens this slot may still generate


class ChunkOutput(NamedTuple):
    tokens: jnp.ndarray  # [N, B]
    logprobs: jnp.ndarray  # [N, B]
    raw_logprobs: jnp.ndarray  # [N, B]
    expert_ids: jnp.ndarray | None  # [N, B, L_moe, k]
    valid: jnp.ndarray  # [N, B] bool: the slot was live and produced this token


@partial(jax.jit, static_argnames=("cfg", "graphdef", "steps", "key_len", "absorbed"),
         donate_argnames=("cache",))
def decode_chunk(cfg: ModelConfig, graphdef: nnx.GraphDef, state, cache, slots: SlotState, stop_ids,
                 sampling: SamplingParams, *, steps: int, key_len: int, absorbed: bool = True):
    """`steps` decode steps over all slots in one lax.scan. stop_ids [B, M] (-1 padded): a slot stops after
    sampling one of them, or when `remaining` reaches 0. Returns (cache, SlotState, ChunkOutput).
    The scan runs over the cache's first key_len positions, sliced out once and written back once
    (forward.cache_window): key_len must cover every live slot's length + steps, as the engine's does."""

    prepared = prepare(graphdef, state)

    def step(carry, _):
        cache, s = carry
        out = extend(cfg, graphdef, state, cache, s.pending[:, None], None, s.lengths, key_len=key_len,
                     absorbed=absorbed, prepared=prepared)
        drawn = sample(out.logits[:, 0], sampling, s.lengths + 1)
        live = s.active
        hit_stop = jnp.any(drawn.tokens[:, None] == stop_ids, axis=-1)
        remaining = s.remaining - live.astype(jnp.int32)
        new = SlotState(jnp.where(live, drawn.tokens, s.pending), s.lengths + live.astype(jnp.int32),
                        live & ~hit_stop & (remaining > 0), remaining)
        experts = None if out.expert_ids is None else out.expert_ids[:, 0]
        return (out.cache, new), ChunkOutput(drawn.tokens, drawn.logprobs, drawn.raw_logprobs, experts, live)

    window = cache_window(cache, key_len)
    (window, slots), outs = jax.lax.scan(step, (window, slots), None, length=steps)
    return cache_merge(cache, window), slots, outs
