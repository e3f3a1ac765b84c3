"""MTP speculative decoding: draft k tokens with the MTP module(s), verify them with the main model in one
pass over k + 1 positions, keep them by the speculative-sampling rejection rule (Leviathan et al. 2023,
Chen et al. 2023), so every emitted token is distributed exactly as the main model's sampler would draw it.

A round for a slot whose cache holds n tokens (the pending token x_n, sampled but not yet in the cache, sits
at position n):

  1. Draft. Step i = 0..k-1 runs MTP module min(i, D - 1) (one module reused when k > D, EAGLE style) at
     position n - 1 + i on (hidden, token): step 0 on (h(n - 1), x_n), exactly what the trainer's module 0
     sees; step i > 0 on (step i - 1's normed output, draft d_i). Its logits q_{i+1} give d_{i+1} ~ q_{i+1}.
  2. Verify. The main model runs [x_n, d_1, ..., d_k] at positions n..n+k in one cached forward: logits
     p_1..p_{k+1} (p_j for the token at position n + j), trunk hidden states, routed expert ids.
  3. Accept. d_j is kept with probability min(1, p_j(d_j) / q_j(d_j)) while every earlier one was kept; at
     the first rejection j the token is drawn from norm(max(0, p_j - q_j)); if all k are kept, a bonus token
     is drawn from p_{k+1}. p and q are the sampler's distributions: temperature-scaled and top-k / top-p
     truncated the same way (`sampling.sampling_logits`); greedy rows use one-hot distributions (the argmax),
     which makes the output exactly plain greedy decoding.
  4. MTP cache upkeep. MTP module 0's cache entry at position t depends only on that position's inputs, the
     trunk's normed hidden state h(t) and the token x_{t+1}; the verify pass just produced them for the
     settled positions n..n+a, so their entries are written (`forward.mtp_write`, no attention). h(n + a) is
     the next round's anchor (`SpecState`).
  5. Rollback is free: the cache length becomes n + (tokens kept); latents written for rejected positions lie
     past it, are masked out, and are overwritten before any query can see them.

Logprobs, raw logprobs and expert ids of an emitted token come from the verify pass's row that produced it,
i.e. from the main model, as the learner needs. Random keys: the residual / bonus / plain draw of the token
at position P uses the plain sampler's key fold_in(key(seed), P) (so k = 0 reproduces plain decoding token
for token), the draft uses fold_in(that, 1), the acceptance uniform fold_in(that, 2).

With k = 0 a round is one plain decode step that also writes the MTP cache entries, so an engine can switch
speculation off (large batches) and on again without losing the MTP cache.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from c2jax.models.config import ModelConfig
from c2jax.models.inference.forward import extend, mtp_step, mtp_write, prepare
from c2jax.models.inference.sampling import (
    SamplingParams,
    draw,
    first_argmax,
    sampling_logits,
    token_keys,
    token_logprobs,
)
from c2jax.models.inference.steps import ChunkOutput, SlotState, prefill_rows

_DRAFT, _ACCEPT = 1, 2  # fold_in tags of a position's key


class SpecState(NamedTuple):
    """The next draft's anchor per slot: the trunk's output after its final norm at the last cached position
    n - 1 (the anchor's token is the slot's pending token x_n)."""
    hidden: jnp.ndarray  # [B, d]


def init_spec_state(cfg: ModelConfig, slots: int) -> SpecState:
    return SpecState(jnp.zeros((slots, cfg.hidden_size), jnp.dtype(cfg.dtype)))


def _rows(params: SamplingParams, reps: int) -> SamplingParams:
    """Sampling params repeated for `reps` consecutive rows per sequence ([b] -> [b * reps])."""
    return SamplingParams(*(jnp.repeat(a, reps) for a in params))


def _probs(logits: jnp.ndarray, params: SamplingParams) -> jnp.ndarray:
    """The sampler's distribution [b, V] for logits [b, V]: one-hot argmax for greedy rows."""
    greedy = (params.temperature <= 0)[:, None]
    soft = jax.nn.softmax(sampling_logits(logits, params), axis=-1)
    hard = jax.nn.one_hot(first_argmax(logits), logits.shape[-1], dtype=soft.dtype)
    return jnp.where(greedy, hard, soft)


class Verdict(NamedTuple):
    tokens: jnp.ndarray  # [b, k+1]: d_1..d_a, then the residual / bonus token, then padding (d's)
    accepted: jnp.ndarray  # [b] int32 a: drafts kept (a + 1 tokens emitted)
    logprobs: jnp.ndarray  # [b, k+1] under softmax(p_logits / T)
    raw_logprobs: jnp.ndarray  # [b, k+1] under softmax(p_logits)


def speculative_accept(p_logits: jnp.ndarray, q_logits: jnp.ndarray, drafts: jnp.ndarray,
                       params: SamplingParams, positions: jnp.ndarray) -> Verdict:
    """The rejection rule. p_logits [b, k+1, V]: the main model's logits for positions P..P+k (P = positions
    [b], the position of d_1); q_logits [b, k, V]: the draft's logits d_1..d_k were drawn from; drafts [b, k].
    Emits a + 1 tokens whose joint distribution is exactly the main model sampler's."""
    b, k1, vocab = p_logits.shape
    k = k1 - 1
    greedy = params.temperature <= 0
    pos = positions[:, None].astype(jnp.int32) + jnp.arange(k1, dtype=jnp.int32)[None]  # [b, k+1]
    p = _probs(p_logits.reshape(b * k1, vocab), _rows(params, k1)).reshape(b, k1, vocab)
    base = token_keys(jnp.repeat(params.seed, k1), pos.reshape(-1))  # [b*(k+1)] plain keys
    if k:
        q = _probs(q_logits.reshape(b * k, vocab), _rows(params, k)).reshape(b, k, vocab)
        p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
        q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        accept_keys = jax.vmap(lambda key: jax.random.fold_in(key, _ACCEPT))(base.reshape(b, k1)[:, :k].reshape(-1))
        u = jax.vmap(jax.random.uniform)(accept_keys).reshape(b, k)
        keep = u * q_d < p_d  # u < p/q, without dividing (q_d > 0: d was drawn from q)
        accepted = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)  # leading kept drafts
        q_pad = jnp.concatenate([q, jnp.zeros((b, 1, vocab), q.dtype)], axis=1)  # row k: bonus, from p itself
    else:
        accepted = jnp.zeros(b, jnp.int32)
        q_pad = jnp.zeros((b, 1, vocab), p.dtype)
    p_a = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [b, V]
    residual = jnp.maximum(p_a - jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0], 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_a)  # p == q: rounding only
    logits_a = jnp.take_along_axis(p_logits, accepted[:, None, None], axis=1)[:, 0]
    final_logits = jnp.where(accepted[:, None] == k, sampling_logits(logits_a, params), jnp.log(residual))
    key_a = jnp.take_along_axis(base.reshape(b, k1), accepted[:, None], axis=1)[:, 0]
    drawn = draw(key_a, final_logits)
    final = jnp.where(greedy, first_argmax(logits_a), drawn).astype(jnp.int32)
    padded = jnp.concatenate([drafts.astype(jnp.int32), jnp.zeros((b, 1), jnp.int32)], axis=1)
    tokens = jnp.where(jnp.arange(k1)[None] == accepted[:, None], final[:, None], padded)
    logprobs, raw = token_logprobs(p_logits.reshape(b * k1, vocab), _rows(params, k1), tokens.reshape(-1))
    return Verdict(tokens, accepted, logprobs.reshape(b, k1), raw.reshape(b, k1))


def draft_tokens(cfg: ModelConfig, prepared, mtp_cache, hidden, token, start, params: SamplingParams, *, k: int,
                 key_len: int, absorbed: bool):
    """k draft tokens for every slot. hidden [B, d], token [B]: the anchor's inputs (trunk's normed h(n-1), x_n);
    start [B] = n - 1. Returns (drafts [B, k], q_logits [B, k, V], mtp_cache)."""
    depth = len(prepared.mtp)
    mtp_cache = list(mtp_cache)
    drafts, qs = [], []
    h, tok = hidden[:, None], token[:, None]
    greedy = params.temperature <= 0
    for i in range(k):
        m = min(i, depth - 1)
        h, logits, mtp_cache[m] = mtp_step(cfg, prepared, m, mtp_cache[m], h, tok, None, start + i,
                                           key_len=key_len, absorbed=absorbed)
        q_logits = logits[:, 0]
        keys = jax.vmap(lambda key: jax.random.fold_in(key, _DRAFT))(token_keys(params.seed, start + i + 2))
        drawn = draw(keys, sampling_logits(q_logits, params))
        tok = jnp.where(greedy, first_argmax(q_logits), drawn).astype(jnp.int32)[:, None]
        drafts.append(tok[:, 0])
        qs.append(q_logits)
    return jnp.stack(drafts, 1), jnp.stack(qs, 1), tuple(mtp_cache)


class SpecChunkOutput(NamedTuple):
    out: ChunkOutput  # arrays [rounds, B, k+1] ([..., L_moe, top_k] for expert ids)
    drafted: jnp.ndarray  # [rounds, B] int32 drafts proposed for live slots
    accepted: jnp.ndarray  # [rounds, B] int32 drafts kept for live slots


@partial(jax.jit, static_argnames=("cfg", "graphdef", "rounds", "k", "key_len", "absorbed"),
         donate_argnames=("cache", "mtp_cache", "spec"))
def spec_decode_chunk(cfg: ModelConfig, graphdef: nnx.GraphDef, state, cache, mtp_cache, slots: SlotState,
                      spec: SpecState, stop_ids, sampling: SamplingParams, *, rounds: int, k: int, key_len: int,
                      absorbed: bool = True):
    """`rounds` speculative rounds (k drafts each; k = 0: plain decode steps) over all slots in one lax.scan.
    Stop ids / budgets as in steps.decode_chunk: a slot stops after emitting a stop id or its last budgeted
    token, and tokens after that in the same round are not emitted. Returns (cache, mtp_cache, SlotState,
    SpecState, SpecChunkOutput)."""
    prepared = prepare(graphdef, state)
    model = prepared.model

    def one_round(carry, _):
        cache, mtp_cache, s, sp = carry
        n = s.lengths
        if k:
            drafts, q_logits, mtp_cache = draft_tokens(cfg, prepared, mtp_cache, sp.hidden, s.pending, n - 1,
                                                       sampling, k=k, key_len=key_len, absorbed=absorbed)
            inputs = jnp.concatenate([s.pending[:, None], drafts], axis=1)
        else:
            drafts = jnp.zeros((n.shape[0], 0), jnp.int32)
            q_logits = jnp.zeros((n.shape[0], 0, cfg.vocab_size), jnp.float32)
            inputs = s.pending[:, None]
        out = extend(cfg, graphdef, state, cache, inputs, None, n, key_len=key_len, absorbed=absorbed,
                     prepared=prepared)
        verdict = speculative_accept(out.logits, q_logits, drafts, sampling, n + 1)
        tokens = verdict.tokens
        live = s.active
        hit = jnp.any(tokens[..., None] == stop_ids[:, None, :], axis=-1)  # [B, k+1]
        idx = jnp.arange(k + 1, dtype=jnp.int32)[None]
        first_stop = jnp.min(jnp.where(hit, idx, k + 1), axis=1)
        emitted = jnp.minimum(jnp.minimum(verdict.accepted + 1, s.remaining), first_stop + 1)
        emitted = jnp.where(live, emitted, 0)
        valid = idx < emitted[:, None]
        last = jnp.take_along_axis(tokens, jnp.maximum(emitted - 1, 0)[:, None], axis=1)[:, 0]
        remaining = s.remaining - emitted
        stopped = jnp.any(hit & valid, axis=1)
        new = SlotState(jnp.where(live, last, s.pending), n + emitted, live & ~stopped & (remaining > 0), remaining)
        # MTP cache entries of the settled positions n..n+emitted-1 (rows past them land at positions >= the new
        # length: masked, and rewritten before any query sees them); the last settled one is the next anchor
        hidden = model.norm(out.hidden).astype(sp.hidden.dtype)  # [B, k+1, d]
        mtp_cache = (mtp_write(cfg, prepared, 0, mtp_cache[0], hidden, tokens, None, n), *mtp_cache[1:])
        anchor = jnp.take_along_axis(hidden, jnp.maximum(emitted - 1, 0)[:, None, None], axis=1)[:, 0]
        new_sp = SpecState(jnp.where(live[:, None], anchor, sp.hidden))
        experts = out.expert_ids  # [B, k+1, L_moe, top_k]
        chunk = ChunkOutput(tokens, verdict.logprobs, verdict.raw_logprobs, experts, valid)
        stats = (jnp.where(live, k, 0).astype(jnp.int32), jnp.where(live, verdict.accepted, 0))
        return (out.cache, mtp_cache, new, new_sp), (chunk, *stats)

    (cache, mtp_cache, slots, spec), (outs, drafted, accepted) = jax.lax.scan(
        one_round, (cache, mtp_cache, slots, spec), None, length=rounds)
    return cache, mtp_cache, slots, spec, SpecChunkOutput(outs, drafted, accepted)


@partial(jax.jit, static_argnames=("cfg", "graphdef", "key_len", "absorbed"),
         donate_argnames=("cache", "mtp_cache", "spec"))
def prefill_slot_spec(cfg: ModelConfig, graphdef: nnx.GraphDef, state, cache, mtp_cache, spec: SpecState, tokens,
                      n_valid, slot, start, sampling: SamplingParams, next_token, *, key_len: int,
                      absorbed: bool = False):
    """steps.prefill_slot (b rows) that also fills each row's MTP module-0 cache entries for its prompt
    positions and makes its last prompt position the next draft's anchor. The token after it is the sampled
    first token, or next_token[i] when >= 0 (re-prefilling a live sequence after a weight swap: its pending
    token). Returns (PrefillOutput, mtp_cache, spec)."""
    prepared = prepare(graphdef, state)
    pre, out = prefill_rows(cfg, graphdef, state, cache, tokens, n_valid, slot, start, sampling, key_len=key_len,
                            absorbed=absorbed, prepared=prepared)
    following = jnp.where(next_token >= 0, next_token, pre.first.tokens).astype(jnp.int32)  # [b]
    hidden = prepared.model.norm(out.hidden)  # [b, T, d]
    t = tokens.shape[1]
    nxt = jnp.roll(tokens, -1, axis=1)
    nxt = jnp.where(jnp.arange(t)[None] == (n_valid - 1)[:, None], following[:, None], nxt)  # token after each
    mtp_cache = (mtp_write(cfg, prepared, 0, mtp_cache[0], hidden, nxt, slot, start), *mtp_cache[1:])
    anchor = jnp.take_along_axis(hidden, (n_valid - 1)[:, None, None], axis=1)[:, 0]
    spec = SpecState(spec.hidden.at[slot].set(anchor.astype(spec.hidden.dtype), mode="drop"))
    return pre, mtp_cache, spec


@partial(jax.jit, static_argnames=("cfg", "graphdef"), donate_argnames=("mtp_cache", "spec"))
def fork_slot_spec(cfg: ModelConfig, graphdef: nnx.GraphDef, state, mtp_cache, spec: SpecState, src, dst, token,
                   position):
    """The MTP side of copying a freshly prefilled prompt from slot src to slot dst: the MTP cache rows and the
    anchor are copied, and the entry at the last prompt position (`position`) is rewritten with dst's own first
    sampled token `token`."""
    mtp_cache = jax.tree.map(lambda a: a.at[dst].set(a[src]), mtp_cache)
    hidden = spec.hidden[src]
    prepared = prepare(graphdef, state)
    first = mtp_write(cfg, prepared, 0, mtp_cache[0], hidden[None, None], token.reshape(1, 1), dst[None],
                      position[None])
    return (first, *mtp_cache[1:]), SpecState(spec.hidden.at[dst].set(hidden))


@partial(jax.jit, donate_argnames=("mtp_cache",))
def copy_mtp_row(mtp_cache, src_cache, dst_slot):
    """Copy a one-slot MTP cache into slot dst_slot (prompt caching)."""
    return tuple(type(c)(*(dst.at[dst_slot].set(src[0].astype(dst.dtype)) for dst, src in zip(c, s, strict=True)))
                 for c, s in zip(mtp_cache, src_cache, strict=True))
