"""Multi-head latent attention (MLA, DeepSeek-V2 sec. 2.1) with causal, document-aware masking.

q   = W_qb RMSNorm(W_qa x)                 (or W_q x when q_lora_rank is None)
c   = RMSNorm(W_kva x)[:kv_lora_rank]      latent shared by all heads; cached at decode time
k_r = RoPE(W_kva x)[kv_lora_rank:]         one RoPE key shared by all heads
[k_nope | v] = W_kvb c                     per-head keys and values
score = (q_nope.k_nope + RoPE(q_rope).k_r) * softmax_scale
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import RMSNorm, dense, param
from models.rope import apply_rope

_NEG_INF = -1e30  # finite, so fully masked rows (padding) stay NaN-free


def attention_mask(segment_ids: jnp.ndarray | None, batch: int, seq: int) -> jnp.ndarray:
    """[B, 1, S, S] boolean: causal, and (with packing) only within the same document."""
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))[None, None]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (batch, 1, seq, seq))
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return causal & same


def dot_product_attention(q, k, v, mask, scale):
    """softmax(q k^T * scale + mask) v with fp32 softmax. q,k: [B,S,H,Dqk], v: [B,S,H,Dv]."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask, scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


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

    def __call__(self, x, cos, sin, mask):
        cfg = self.cfg
        q = self.queries(x)
        q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        q_rope = apply_rope(q_rope, cos, sin, cfg.rope_interleave)
        latent, k_rope = self.latents(x, cos, sin)
        kv = jnp.einsum("bsr,rhk->bshk", latent, self.kv_b_proj[...].astype(x.dtype))
        k_nope, v = kv[..., : cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim:]
        heads = cfg.num_attention_heads
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (*k_rope.shape[:2], heads, k_rope.shape[-1]))
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        out = dot_product_attention(q, k, v, mask, cfg.softmax_scale)
        return jnp.einsum("bshv,hvd->bsd", out, self.o_proj[...].astype(x.dtype))
