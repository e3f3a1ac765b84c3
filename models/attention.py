"""Multi-head latent attention (MLA, DeepSeek-V2 sec. 2.1) with causal, document-aware masking.

q   = W_qb RMSNorm(W_qa x)                 (or W_q x when q_lora_rank is None)
c   = RMSNorm(W_kva x)[:kv_lora_rank]      latent shared by all heads; cached at decode time
k_r = RoPE(W_kva x)[kv_lora_rank:]         one RoPE key shared by all heads
[k_nope | v] = W_kvb c                     per-head keys and values
score = (q_nope.k_nope + RoPE(q_rope).k_r) * softmax_scale
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from c2jax.models.attention_backends import attention
from c2jax.models.config import ModelConfig
from c2jax.models.context_parallel import ContextParallelMask, balanced_order, inverse_order
from c2jax.models.layers import RMSNorm, dense, param
from c2jax.models.logical import active_mesh_axes, batch_axes
from c2jax.models.rope import apply_rope

_NEG_INF = -1e30  # finite, so fully masked rows (padding) stay NaN-free
# Query rows per causal block. Measured fwd+bwd of one small-preset attention layer (S = 512) on XLA:CPU:
# one block 147 ms, 256 -> 134 ms, 128 -> 117 ms, 64 -> 120 ms.
_CAUSAL_BLOCK = 128


class AttentionMask(NamedTuple):
    """What self-attention masks by, never an S x S array: causal by index, and with packing (segment_ids
    [B, S]) only within the same document. The backend (models/attention_backends.py) builds per-block masks
    from it (or, for the small-S dense path, the dense mask)."""

    segment_ids: jnp.ndarray | None = None


def attention_mask(segment_ids: jnp.ndarray | None, batch: int, seq: int) -> jnp.ndarray:
    """[B, 1, S, S] boolean: causal, and (with packing) only within the same document. The dense form of
    AttentionMask, for `dot_product_attention` (the small-S oracle)."""
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))[None, None]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (batch, 1, seq, seq))
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return causal & same


def dot_product_attention(q, k, v, mask, scale, causal_block: int | None = None):
    """softmax(q k^T * scale + mask) v with fp32 softmax. q: [B,Sq,H,Dqk], k: [B,Sk,H,Dqk], v: [B,Sk,H,Dv];
    mask: [B or 1, 1, Sq, Sk] boolean (True = attend).

    causal_block: promise that `mask` allows nothing above the diagonal (true of `attention_mask`), so
    query block i (of this many rows) only needs keys [0, (i + 1) * causal_block): ~(1 + 1/n)/2 of the
    scores work for n blocks. The result is the same either way."""
    seq = q.shape[1]
    square = seq == k.shape[1]
    block = causal_block if causal_block and square and seq % causal_block == 0 else seq
    bias = jnp.where(mask, jnp.float32(0), jnp.float32(_NEG_INF))
    return _attention(q, k, v, bias, scale, block)


# Attention has a hand-written backward. Autodiff of the softmax spends two full passes over the
# [B, H, S, S] scores (the select of the mask and the reduction of dprobs * probs); here the mask is an
# additive bias and the softmax backward uses rowsum(dP * P) = rowsum(dO * O), a reduction over the
# [B, S, H, Dv] output instead (FlashAttention, Dao et al. 2022, sec. 3.1). Probabilities are saved.
# Queries are processed in blocks that each see only the causal prefix of the keys.
@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, bias, scale, block):
    return _attention_fwd(q, k, v, bias, scale, block)[0]


def _blocks(seq, block, num_keys):
    """(query slice, number of keys it can see) per query block; one block sees all `num_keys` keys."""
    if block >= seq:
        return [(slice(0, seq), num_keys)]
    return [(slice(i, i + block), i + block) for i in range(0, seq, block)]


def _attention_fwd(q, k, v, bias, scale, block):
    # The scale goes on q, not on the scores: XLA:CPU materialised `scores * scale` as a multiply by a
    # broadcast [B, H, S, S] constant (a 64 MB write and two reads per layer at the small preset).
    q = q * jnp.asarray(scale, q.dtype)
    outs, probs = [], []
    for rows, keys in _blocks(q.shape[1], block, k.shape[1]):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q[:, rows], k[:, :keys],
                            preferred_element_type=jnp.float32) + bias[:, :, rows, :keys]
        p = jax.nn.softmax(scores, axis=-1)
        outs.append(jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v[:, :keys]))
        probs.append(p)
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    return out, (q, k, v, probs, out)


def _attention_bwd(scale, block, res, dout):
    q, k, v, probs, out = res  # q already scaled
    seq, num_keys = q.shape[1], k.shape[1]
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32))
    dq, dk, dv = [], jnp.zeros_like(k), jnp.zeros_like(v)
    for (rows, keys), p in zip(_blocks(seq, block, num_keys), probs, strict=True):
        do = dout[:, rows]
        pad = ((0, 0), (0, num_keys - keys), (0, 0), (0, 0))
        dv = dv + jnp.pad(jnp.einsum("bhqk,bqhd->bkhd", p.astype(v.dtype), do), pad)
        dprobs = jnp.einsum("bqhd,bkhd->bhqk", do, v[:, :keys], preferred_element_type=jnp.float32)
        dscores = (p * (dprobs - delta[:, :, rows, None])).astype(q.dtype)
        dq.append(jnp.einsum("bhqk,bkhd->bqhd", dscores, k[:, :keys]))
        dk = dk + jnp.pad(jnp.einsum("bhqk,bqhd->bkhd", dscores, q[:, rows]), pad)
    dq = (jnp.concatenate(dq, axis=1) if len(dq) > 1 else dq[0]) * jnp.asarray(scale, q.dtype)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: int | None = None):
        self.cfg = cfg
        d, h = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            self.q_proj = param(rngs, (d, h, cfg.qk_head_dim), ("embed", "heads", "head_dim"),
                                cfg=cfg, stack=stack)
        else:
            self.q_a_proj = param(rngs, (d, cfg.q_lora_rank), ("embed", "q_lora"), cfg=cfg, stack=stack)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg, rngs, stack, axis_name="q_lora")
            self.q_b_proj = param(rngs, (cfg.q_lora_rank, h, cfg.qk_head_dim),
                                  ("q_lora", "heads", "head_dim"), cfg=cfg, stack=stack)
        self.kv_a_proj_with_mqa = param(rngs, (d, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                                        ("embed", "kv_lora"), cfg=cfg, stack=stack)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg, rngs, stack, axis_name="kv_lora")
        self.kv_b_proj = param(rngs, (cfg.kv_lora_rank, h, cfg.qk_nope_head_dim + cfg.v_head_dim),
                               ("kv_lora", "heads", "head_dim"), cfg=cfg, stack=stack)
        self.o_proj = param(rngs, (h, cfg.v_head_dim, d), ("heads", "head_dim", "embed"),
                            cfg=cfg, stack=stack)

    def queries(self, x):
        """[B, S, H, qk_head_dim] before RoPE."""
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            w = self.q_proj[...]
            return jnp.einsum("bsd,dhk->bshk", x, w.astype(x.dtype))
        q_latent = self.q_a_layernorm(dense(x, self.q_a_proj[...]))
        return jnp.einsum("bsr,rhk->bshk", q_latent, self.q_b_proj[...].astype(x.dtype))

    def latents(self, x, cos, sin):
        """The per-token cache entry: normalised latent [B,S,kv_lora] and RoPE'd shared key [B,S,rope]."""
        cfg = self.cfg
        kv = dense(x, self.kv_a_proj_with_mqa[...])
        latent = self.kv_a_layernorm(kv[..., : cfg.kv_lora_rank])
        k_rope = apply_rope(kv[..., cfg.kv_lora_rank:], cos, sin, cfg.rope_interleave)
        return latent, k_rope

    def expand(self, latent, k_rope):
        """Per-head keys [B,S,H,qk_head_dim] and values [B,S,H,v_head_dim] from the cache entry."""
        cfg = self.cfg
        kv = jnp.einsum("bsr,rhk->bshk", latent, self.kv_b_proj[...].astype(latent.dtype))
        k_nope, v = kv[..., : cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim:]
        heads = cfg.num_attention_heads
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (*k_rope.shape[:2], heads, k_rope.shape[-1]))
        return jnp.concatenate([k_nope, k_rope], axis=-1), v

    def roped_queries(self, x, cos, sin):
        cfg = self.cfg
        q = self.queries(x)
        q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        return jnp.concatenate([q_nope, apply_rope(q_rope, cos, sin, cfg.rope_interleave)], axis=-1)

    def __call__(self, x, cos, sin, mask: AttentionMask | ContextParallelMask):
        if isinstance(mask, ContextParallelMask):
            return self._context_parallel(x, cos, sin, mask)
        if not isinstance(mask, AttentionMask):
            raise TypeError(f"mask must be an AttentionMask (segment ids) or a ContextParallelMask, got "
                            f"{type(mask).__name__}: attention never takes an S x S mask")
        cfg = self.cfg
        q = self.roped_queries(x, cos, sin)
        k, v = self.expand(*self.latents(x, cos, sin))
        # the platform's backend (models/attention_backends.py; $C2JAX_ATTENTION overrides): on CPU the dense
        # path up to 512 x 512 scores, exact blockwise attention (memory O(S)) beyond
        out = attention(q, k, v, scale=cfg.softmax_scale, segment_ids=mask.segment_ids)
        return jnp.einsum("bshv,hvd->bsd", out, self.o_proj[...].astype(x.dtype))

    def _context_parallel(self, x, cos, sin, cp_mask: ContextParallelMask):
        """MLA under context parallelism (Composer 2 sec. 6), exact.

        x is this rank's two chunks (i and 2CP-1-i, see models/context_parallel.py). Each rank computes
        its queries and its tokens' KV latents; only the latents (kv_lora_rank + rope dims per token, not
        per head) are all-gathered over the CP axis; every rank then up-projects the whole sequence's
        latents with the (replicated, small) kv_b_proj. Because the layout is balanced, a static bound
        holds on every rank: chunk i < CP needs only the first CP chunks of keys, chunk 2CP-1-i needs all,
        so 3/4 of the full [S/CP, S] score block is computed, the same on every rank."""
        cfg = self.cfg
        mesh, cp_axes = active_mesh_axes("seq")
        cp_axis = cp_axes[0] if len(cp_axes) == 1 else cp_axes
        cp = int(np.prod([mesh.shape[a] for a in cp_axes]))
        tok_batch = tuple(a for a in batch_axes() if a not in cp_axes) or None
        seq = x.shape[1]
        chunk = seq // (2 * cp)
        inverse = jnp.asarray(inverse_order(balanced_order(seq, cp)))
        graphdef, params = nnx.split(self)
        has_segments = cp_mask.segment_ids is not None

        def local(params, x, cos, sin, segments, q_index):
            attn = nnx.merge(graphdef, params)
            q = attn.roped_queries(x, cos, sin)
            gather = lambda a: jax.lax.all_gather(a, cp_axis, axis=1, tiled=True)[:, inverse]
            k, v = attn.expand(*(gather(a) for a in attn.latents(x, cos, sin)))  # original order
            key_segments = gather(segments) if has_segments else None

            def part(rows, num_keys):
                # causal by original position (the keys are in original order), within documents
                return attention(q[:, rows], k[:, :num_keys], v[:, :num_keys], scale=cfg.softmax_scale,
                                 q_segment_ids=segments[:, rows] if has_segments else None,
                                 kv_segment_ids=key_segments[:, :num_keys] if has_segments else None,
                                 q_positions=q_index[rows], kv_positions=jnp.arange(num_keys, dtype=jnp.int32))

            out = jnp.concatenate([part(slice(0, chunk), cp * chunk), part(slice(chunk, 2 * chunk), seq)], 1)
            return jnp.einsum("bshv,hvd->bsd", out, attn.o_proj[...].astype(x.dtype))

        tokens = P(tok_batch, cp_axis, None)
        fn = jax.shard_map(local, mesh=mesh, check_vma=False,
                           in_specs=(P(), tokens, tokens, tokens, P(tok_batch, cp_axis) if has_segments else None,
                                     P(cp_axis)),
                           out_specs=tokens)
        return fn(params, x, cos, sin, cp_mask.segment_ids, cp_mask.seq_index)
