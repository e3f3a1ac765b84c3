"""Dense attention with a hand-written backward: softmax(q k^T * scale + mask) v from an S x S boolean mask.

The "dense" backend of models/attention_backends.py (the small-S oracle of the tests, and the CPU path of "auto"
up to 512 x 512 scores); `attention_mask` builds the causal, document-aware mask it takes for self-attention.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so fully masked rows (padding) stay NaN-free
# Query rows per causal block. Measured fwd+bwd of one small-preset attention layer (S = 512) on XLA:CPU:
# one block 147 ms, 256 -> 134 ms, 128 -> 117 ms, 64 -> 120 ms.
CAUSAL_BLOCK = 128


def attention_mask(segment_ids: jnp.ndarray | None, batch: int, seq: int) -> jnp.ndarray:
    """[B, 1, S, S] boolean: causal, and (with packing) only within the same document. The dense form of
    AttentionMask (models/attention.py), for `dot_product_attention` (the small-S oracle)."""
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
    bias = jnp.where(mask, jnp.float32(0), jnp.float32(NEG_INF))
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
