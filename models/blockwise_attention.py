"""Exact blockwise attention (FlashAttention-2, Dao 2023) in plain JAX: memory linear in the sequence length,
program size independent of it.

    out = blockwise_attention(q, k, v, scale=..., q_segment_ids=..., kv_segment_ids=...,
                              q_positions=..., kv_positions=..., causal=True)

q: [B, Sq, H, Dqk], k: [B, Sk, H, Dqk], v: [B, Sk, H, Dv] (Dqk may differ from Dv: MLA uses 192 / 128);
out: [B, Sq, H, Dv] in v's dtype. Key j is visible to query i iff

    (not causal or kv_positions[j] <= q_positions[i]) and (no segments or q_segment_ids[i] == kv_segment_ids[j])

Positions default to arange (for Sq != Sk too: a decode-style call where the queries are the last tokens
passes q_positions = arange(Sk - Sq, Sk)). Segment ids are [B, S]; positions are [S] or [B, S]. The mask is
built per [block_q, block_k] tile from these vectors, never as an S x S array.

Forward: for each query block, an online softmax over its key blocks in fp32 (running row max m, running
sum l, unnormalised output acc); saves out and the row log-sum-exp lse = m + log l. Backward (custom VJP,
residuals q, k, v, out, lse and the mask vectors): one pass over key blocks; for each, the query blocks that
see it recompute P = exp(S - lse), then dV += P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)),
dK += dS^T Q, dQ[block] += dS K (dQ accumulated in place in an fp32 [B, H, Sq, Dqk] buffer). Scores are
never stored beyond one tile.

Block skipping, by loop bounds, from data: a [num_q_blocks, num_k_blocks] table says which tiles can hold
a visible pair (conservatively: min key position of the tile <= max query position, and the tiles'
[min, max] segment-id ranges overlap, OR-ed over the batch). For each query block the visible key blocks
are listed first (a stable argsort of the table row) and the inner loop runs over just their count, so the
work is proportional to the visible tiles whatever the positions: with positions None this is exactly the
causal diagonal bound (~(1 + 1/n)/2 of the tiles); monotone positions give the same; packed documents also
skip tiles that lie entirely between different documents. Non-monotone positions or segment ids stay
correct (the tile test only ever over-approximates; the per-element mask is exact) but skip less. The table
is O((S / block)^2) booleans, negligible next to the O(S) activations at any realistic block size.

Everything runs in `lax.fori_loop`s whose bodies handle one tile, so neither the jaxpr/HLO nor the compile
time grows with S. Each sequence is cut into ceil(S / block) equal blocks (so a block may be a little smaller
than asked, and one shorter than the block is a single block of its own length) and padded by less than one
row per block (padded keys masked out, padded query rows dropped), so any Sq, Sk >= 1 works.

Rows that see no key at all (padding whose segment matches nothing) give zeros and zero gradients, never
NaN: masked scores are -inf against a finite initial running max, and such rows store lse = +inf.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

# Block sizes for XLA:CPU. Measured 2026-12-04 on this repo's 2-core CI VM (load average 1.3-2.5, noisy: a
# second run of the same process can be ~1.5x slower), jit fwd+bwd, fp32, B=1, H=8, Dqk=48, Dv=32, causal,
# positions None; the best time observed over 1-4 processes of 5-9 runs each, in ms, block_q:block_k at
# S = 512 / 1024 / 2048 / 4096:
#   128:128  13.7 /  57.5 / 173.6 /   -       256:256 11.6 / 37.5 / 127.5 / 478.6
#   512:512  14.0 /  43.4 / 151.9 / 510.1     256:512       / 42.6 / 136.5 / 502.9
#   1024:128 15.1 /  40.9 / 126.3 / 403.8     512:128  15.3 / 41.2 / 137.0 / 449.2
#   512:256  12.0 /  35.0 / 112.7 / 398.1  <- chosen
# The dense path (models/dense_attention.py, causal_block 128) on the same shapes: 11.1 / 50.1 / 199.2 /
# (not run).
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 256

_M_INIT = -1e30  # finite initial running max: masked (-inf) scores then give exp(-inf - m) = 0, never NaN
_INT_MAX = np.iinfo(np.int32).max
_INT_MIN = np.iinfo(np.int32).min


class _Config(NamedTuple):
    """Static description of one call (hashable: the custom VJP's non-differentiable argument)."""

    scale: float
    causal: bool
    segments: bool  # segment ids given
    key_padding: bool  # Sk was padded: the last key block has invalid keys
    block_q: int
    block_k: int
    num_keys: int  # Sk before padding


class _Meta(NamedTuple):
    """Integer side data of one call: per-token mask vectors (padded) and the block-visibility tables."""

    q_pos: jnp.ndarray  # [B or 1, Sq_pad] int32
    kv_pos: jnp.ndarray  # [B or 1, Sk_pad] int32
    q_seg: jnp.ndarray | None  # [B, Sq_pad] int32
    kv_seg: jnp.ndarray | None  # [B, Sk_pad] int32
    q_order: jnp.ndarray  # [nq, nk]: per query block, the visible key blocks first, ascending
    q_count: jnp.ndarray  # [nq]: how many key blocks query block i visits
    k_order: jnp.ndarray  # [nk, nq]: per key block, the query blocks that see it first, ascending
    k_count: jnp.ndarray  # [nk]


def blockwise_attention(q, k, v, *, scale: float, q_segment_ids=None, kv_segment_ids=None,
                        q_positions=None, kv_positions=None, causal: bool = True,
                        block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K):
    """Exact softmax(q k^T * scale, masked) v, memory O(S), see the module docstring. Differentiable in q, k, v.

    scale is a Python number (static); block_q / block_k are upper bounds on the tile sizes."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, S, H, D], got shapes {q.shape}, {k.shape}, {v.shape}")
    batch, num_q, heads, dqk = q.shape
    num_k = k.shape[1]
    if k.shape != (batch, num_k, heads, dqk) or v.shape[:3] != (batch, num_k, heads):
        raise ValueError(f"shapes do not agree: q {q.shape}, k {k.shape}, v {v.shape}")
    if num_q < 1 or num_k < 1:
        raise ValueError(f"empty sequence: Sq = {num_q}, Sk = {num_k}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("give both q_segment_ids and kv_segment_ids, or neither")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got {block_q}, {block_k}")

    bq, bk = _block_size(num_q, block_q), _block_size(num_k, block_k)
    nq, nk = -(-num_q // bq), -(-num_k // bk)
    pad_q, pad_k = nq * bq - num_q, nk * bk - num_k

    def positions(p, n, pad, name):
        if p is None:
            return jnp.arange(n + pad, dtype=jnp.int32)[None]
        p = jnp.asarray(p, jnp.int32)
        p = p[None] if p.ndim == 1 else p
        if p.ndim != 2 or p.shape[-1] != n or p.shape[0] not in (1, batch):
            raise ValueError(f"{name} must be [{n}] or [B, {n}], got {p.shape}")
        return jnp.pad(p, ((0, 0), (0, pad)))

    def segments(s, n, pad, name):
        s = jnp.asarray(s, jnp.int32)
        if s.shape != (batch, n):
            raise ValueError(f"{name} must be [B, S] = {(batch, n)}, got {s.shape}")
        return jnp.pad(s, ((0, 0), (0, pad)))

    has_seg = q_segment_ids is not None
    q_pos = positions(q_positions, num_q, pad_q, "q_positions")
    kv_pos = positions(kv_positions, num_k, pad_k, "kv_positions")
    q_seg = segments(q_segment_ids, num_q, pad_q, "q_segment_ids") if has_seg else None
    kv_seg = segments(kv_segment_ids, num_k, pad_k, "kv_segment_ids") if has_seg else None
    tables = _block_tables(q_pos, kv_pos, q_seg, kv_seg, num_q, num_k, bq, bk, causal)
    meta = _Meta(q_pos, kv_pos, q_seg, kv_seg, *tables)
    cfg = _Config(float(scale), bool(causal), has_seg, pad_k > 0, bq, bk, num_k)

    # [B, S, H, D] -> [B, H, S_pad, D]: the tile matmuls then have their batch dimensions leading
    def heads_major(x, pad):
        return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    out = _flash(cfg, heads_major(q, pad_q), heads_major(k, pad_k), heads_major(v, pad_k), meta)
    return out.transpose(0, 2, 1, 3)[:, :num_q]


def _block_size(seq: int, block: int) -> int:
    """At most `block`, spread evenly over the ceil(seq / block) blocks so that padding is under one row per
    block: 384 with block 256 -> 2 x 192, not 2 x 256 with 128 padded keys."""
    return -(-seq // -(-seq // block))


def _block_tables(q_pos, kv_pos, q_seg, kv_seg, num_q, num_k, bq, bk, causal):
    """Which [query block, key block] tiles may hold a visible pair (over-approximated, OR over the batch),
    as per-row lists: q_order[i, :q_count[i]] are the key blocks query block i visits (ascending), and
    k_order[j, :k_count[j]] the query blocks that visit key block j."""
    nq, nk = q_pos.shape[1] // bq, kv_pos.shape[1] // bk
    q_valid = (jnp.arange(nq * bq) < num_q)[None]
    k_valid = (jnp.arange(nk * bk) < num_k)[None]

    def block_max(x, valid, blocks, size):
        return jnp.where(valid, x, _INT_MIN).reshape(x.shape[0], blocks, size).max(-1)

    def block_min(x, valid, blocks, size):
        return jnp.where(valid, x, _INT_MAX).reshape(x.shape[0], blocks, size).min(-1)

    visible = jnp.ones((1, nq, nk), bool)
    if causal:
        visible = visible & (block_min(kv_pos, k_valid, nk, bk)[:, None, :]
                             <= block_max(q_pos, q_valid, nq, bq)[:, :, None])
    if q_seg is not None:
        q_lo, q_hi = block_min(q_seg, q_valid, nq, bq), block_max(q_seg, q_valid, nq, bq)
        k_lo, k_hi = block_min(kv_seg, k_valid, nk, bk), block_max(kv_seg, k_valid, nk, bk)
        visible = visible & (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    visible = visible.any(0)
    hidden = (~visible).astype(jnp.int32)
    q_order = jnp.argsort(hidden, axis=1, stable=True).astype(jnp.int32)
    k_order = jnp.argsort(hidden.T, axis=1, stable=True).astype(jnp.int32)
    return q_order, visible.sum(1, dtype=jnp.int32), k_order, visible.sum(0, dtype=jnp.int32)


def _tile(x, index, size, axis):
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


def _tile_mask(cfg: _Config, meta: _Meta, i, j):
    """[B or 1, 1, bq, bk] boolean for query block i, key block j; None when everything is visible."""
    mask = None

    def both(a, b):
        return b if a is None else a & b

    if cfg.causal:
        qp, kp = _tile(meta.q_pos, i, cfg.block_q, 1), _tile(meta.kv_pos, j, cfg.block_k, 1)
        mask = both(mask, kp[:, None, :] <= qp[:, :, None])
    if cfg.segments:
        qs, ks = _tile(meta.q_seg, i, cfg.block_q, 1), _tile(meta.kv_seg, j, cfg.block_k, 1)
        mask = both(mask, qs[:, :, None] == ks[:, None, :])
    if cfg.key_padding:
        valid = j * cfg.block_k + jnp.arange(cfg.block_k) < cfg.num_keys
        mask = both(mask, valid[None, None, :])
    return None if mask is None else mask[:, None]


def _scores(cfg: _Config, meta: _Meta, q_blk, k_blk, i, j):
    """Scaled fp32 scores of one tile, masked entries -inf: [B, H, bq, bk]."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q_blk, k_blk, preferred_element_type=jnp.float32) * cfg.scale
    mask = _tile_mask(cfg, meta, i, j)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: _Config, q, k, v, meta: _Meta):
    return _forward(cfg, q, k, v, meta)[0]


def _forward(cfg: _Config, q, k, v, meta: _Meta):
    """q, k, v heads-major and padded: [B, H, S_pad, D]. Returns out [B, H, Sq_pad, Dv] (v's dtype) and
    lse [B, H, Sq_pad] fp32."""
    batch, heads, sq, _ = q.shape
    dv = v.shape[-1]
    bq, bk = cfg.block_q, cfg.block_k

    def query_block(i, carry):
        out, lse = carry
        q_blk = _tile(q, i, bq, 2)

        def key_block(t, state):
            acc, m, l = state
            j = meta.q_order[i, t]
            s = _scores(cfg, meta, q_blk, _tile(k, j, bk, 2), i, j)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), _tile(v, j, bk, 2),
                            preferred_element_type=jnp.float32)
            return acc * alpha[..., None] + pv, m_new, l * alpha + p.sum(-1)

        init = (jnp.zeros((batch, heads, bq, dv), jnp.float32), jnp.full((batch, heads, bq), _M_INIT, jnp.float32),
                jnp.zeros((batch, heads, bq), jnp.float32))
        acc, m, l = lax.fori_loop(0, meta.q_count[i], key_block, init)
        seen = l > 0
        o = acc / jnp.where(seen, l, 1)[..., None]
        row_lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1)), jnp.inf)
        out = lax.dynamic_update_slice_in_dim(out, o.astype(out.dtype), i * bq, axis=2)
        lse = lax.dynamic_update_slice_in_dim(lse, row_lse, i * bq, axis=2)
        return out, lse

    init = (jnp.zeros((batch, heads, sq, dv), v.dtype), jnp.zeros((batch, heads, sq), jnp.float32))
    out, lse = lax.fori_loop(0, sq // bq, query_block, init)
    return out, lse


# Names of the residuals a remat policy can keep (models/transformer.py, remat_policy "save_attn_kernel"):
# with them saved, rematerialising a layer for its backward does not run this forward again.
KERNEL_RESIDUAL_NAMES = ("attn_kernel_out", "attn_kernel_lse")


def _flash_fwd(cfg: _Config, q, k, v, meta: _Meta):
    out, lse = _forward(cfg, q, k, v, meta)
    out = checkpoint_name(out, KERNEL_RESIDUAL_NAMES[0])
    lse = checkpoint_name(lse, KERNEL_RESIDUAL_NAMES[1])
    return out, (q, k, v, out, lse, meta)


def _flash_bwd(cfg: _Config, res, dout):
    q, k, v, out, lse, meta = res
    bq, bk = cfg.block_q, cfg.block_k
    dout = dout.astype(v.dtype)
    delta = jnp.einsum("bhqd,bhqd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32))

    def key_block(j, carry):
        dq, dk, dv = carry
        k_blk, v_blk = _tile(k, j, bk, 2), _tile(v, j, bk, 2)

        def query_block(t, state):
            dq, dk_blk, dv_blk = state
            i = meta.k_order[j, t]
            q_blk, do_blk = _tile(q, i, bq, 2), _tile(dout, i, bq, 2)
            s = _scores(cfg, meta, q_blk, k_blk, i, j)
            p = jnp.exp(s - _tile(lse, i, bq, 2)[..., None])  # rows that see nothing: lse = inf, p = 0
            dv_blk = dv_blk + jnp.einsum("bhqk,bhqd->bhkd", p.astype(v.dtype), do_blk,
                                         preferred_element_type=jnp.float32)
            dp = jnp.einsum("bhqd,bhkd->bhqk", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = (p * (dp - _tile(delta, i, bq, 2)[..., None])).astype(q.dtype)
            dk_blk = dk_blk + jnp.einsum("bhqk,bhqd->bhkd", ds, q_blk, preferred_element_type=jnp.float32)
            dq_blk = _tile(dq, i, bq, 2) + jnp.einsum("bhqk,bhkd->bhqd", ds, k_blk,
                                                      preferred_element_type=jnp.float32)
            return lax.dynamic_update_slice_in_dim(dq, dq_blk, i * bq, axis=2), dk_blk, dv_blk

        init = (dq, jnp.zeros(k_blk.shape, jnp.float32), jnp.zeros(v_blk.shape, jnp.float32))
        dq, dk_blk, dv_blk = lax.fori_loop(0, meta.k_count[j], query_block, init)
        dk = lax.dynamic_update_slice_in_dim(dk, (dk_blk * cfg.scale).astype(dk.dtype), j * bk, axis=2)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_blk.astype(dv.dtype), j * bk, axis=2)
        return dq, dk, dv

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros_like(k), jnp.zeros_like(v))
    dq, dk, dv = lax.fori_loop(0, k.shape[2] // bk, key_block, init)
    return (dq * cfg.scale).astype(q.dtype), dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)
