"""Self-attention with causal, document-aware masking: multi-head latent attention (MLA, DeepSeek-V2 sec. 2.1)
and grouped-query attention (GQA, Ainslie et al. 2023; Llama, Qwen3), chosen by ModelConfig.attention_type
(`make_attention`). Both expose the same pieces: `roped_queries`, `kv_entry` (what a KV cache keeps per token)
and `kv_expand` (per-head keys and values from those entries), so the context-parallel path and the sampler
treat them alike.

MLA:

q   = W_qb RMSNorm(W_qa x)                 (or W_q x when q_lora_rank is None)
c   = RMSNorm(W_kva x)[:kv_lora_rank]      latent shared by all heads; cached at decode time
k_r = RoPE(W_kva x)[kv_lora_rank:]         one RoPE key shared by all heads
[k_nope | v] = W_kvb c                     per-head keys and values
score = (q_nope.k_nope + RoPE(q_rope).k_r) * softmax_scale

GQA:
q = RoPE(norm_q(W_q x + b_q)) [H heads], k = RoPE(norm_k(W_k x + b_k)), v = W_v x + b_v [num_key_value_heads heads
each], with the optional per-head RMSNorms of Qwen3 and the biases of `attention_bias` (also on the output
projection: out = W_o o + b_o; zero-initialised); query head h reads K/V head h // (H / num_key_value_heads).
"""

from __future__ import annotations

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


class AttentionMask(NamedTuple):
    """What self-attention masks by, never an S x S array: causal by index, and with packing (segment_ids
    [B, S]) only within the same document. The backend (models/attention_backends.py) builds per-block masks
    from it (or, for the small-S dense path, the dense mask)."""

    segment_ids: jnp.ndarray | None = None


class _SelfAttention(nnx.Module):
    """What MLA and GQA share: attention over kv_expand(kv_entry(x)) with the platform's backend, the output
    projection, and the exact context-parallel path (which all-gathers only the kv entries)."""

    def __call__(self, x, cos, sin, mask: AttentionMask | ContextParallelMask):
        if isinstance(mask, ContextParallelMask):
            return self._context_parallel(x, cos, sin, mask)
        if not isinstance(mask, AttentionMask):
            raise TypeError(f"mask must be an AttentionMask (segment ids) or a ContextParallelMask, got "
                            f"{type(mask).__name__}: attention never takes an S x S mask")
        cfg = self.cfg
        q = self.roped_queries(x, cos, sin)
        k, v = self.kv_expand(*self.kv_entry(x, cos, sin))
        # the platform's backend (models/attention_backends.py; $C2JAX_ATTENTION overrides): on CPU the dense
        # path up to 512 x 512 scores, exact blockwise attention (memory O(S)) beyond
        out = attention(q, k, v, scale=cfg.softmax_scale, segment_ids=mask.segment_ids)
        return self.project_out(out, x.dtype)

    def project_out(self, out, dtype):
        """The output projection of the per-head attention output [B, S, H, v] -> [B, S, d] (with its bias
        under `attention_bias`): the trainer, the context-parallel path and the sampler all go through it."""
        y = jnp.einsum("bshv,hvd->bsd", out, self.o_proj[...].astype(dtype))
        bias = getattr(self, "o_proj_bias", None)
        return y if bias is None else y + bias[...].astype(dtype)

    def _context_parallel(self, x, cos, sin, cp_mask: ContextParallelMask):
        """Attention under context parallelism (Composer 2 sec. 6), exact.

        x is this rank's two chunks (i and 2CP-1-i, see models/context_parallel.py). Each rank computes
        its queries and its tokens' kv entries; only those are all-gathered over the CP axis (MLA: the
        latents, kv_lora_rank + rope dims per token, not per head, which every rank then up-projects with the
        replicated, small kv_b_proj; GQA: the num_key_value_heads keys and values). Because the layout is
        balanced, a static bound holds on every rank: chunk i < CP needs only the first CP chunks of keys,
        chunk 2CP-1-i needs all, so 3/4 of the full [S/CP, S] score block is computed, the same on every rank."""
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
            k, v = attn.kv_expand(*(gather(a) for a in attn.kv_entry(x, cos, sin)))  # original order
            key_segments = gather(segments) if has_segments else None

            def part(rows, num_keys):
                # causal by original position (the keys are in original order), within documents
                return attention(q[:, rows], k[:, :num_keys], v[:, :num_keys], scale=cfg.softmax_scale,
                                 q_segment_ids=segments[:, rows] if has_segments else None,
                                 kv_segment_ids=key_segments[:, :num_keys] if has_segments else None,
                                 q_positions=q_index[rows], kv_positions=jnp.arange(num_keys, dtype=jnp.int32))

            out = jnp.concatenate([part(slice(0, chunk), cp * chunk), part(slice(chunk, 2 * chunk), seq)], 1)
            return attn.project_out(out, x.dtype)

        tokens = P(tok_batch, cp_axis, None)
        fn = jax.shard_map(local, mesh=mesh, check_vma=False,
                           in_specs=(P(), tokens, tokens, tokens, P(tok_batch, cp_axis) if has_segments else None,
                                     P(cp_axis)),
                           out_specs=tokens)
        return fn(params, x, cos, sin, cp_mask.segment_ids, cp_mask.seq_index)


class MLAttention(_SelfAttention):
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

    # the shared interface: MLA caches the latent and the shared RoPE key, and expands them per head
    def kv_entry(self, x, cos, sin):
        return self.latents(x, cos, sin)

    def kv_expand(self, latent, k_rope):
        return self.expand(latent, k_rope)


class GQAttention(_SelfAttention):
    """Grouped-query attention with optional per-head q/k RMSNorm (Qwen3) and full-width RoPE."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: int | None = None):
        self.cfg = cfg
        d, h, kv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.gqa_head_dim
        self.q_proj = param(rngs, (d, h, dh), ("embed", "heads", "head_dim"), cfg=cfg, stack=stack)
        self.k_proj = param(rngs, (d, kv, dh), ("embed", "kv_heads", "head_dim"), cfg=cfg, stack=stack)
        self.v_proj = param(rngs, (d, kv, dh), ("embed", "kv_heads", "head_dim"), cfg=cfg, stack=stack)
        self.o_proj = param(rngs, (h, dh, d), ("heads", "head_dim", "embed"), cfg=cfg, stack=stack)
        if cfg.attention_bias:  # HF's nn.Linear biases, flattened there ([H * head_dim]); zero at init
            bias = lambda shape, axes: param(rngs, shape, axes, cfg=cfg, stack=stack, init="zeros")  # noqa: E731
            self.q_proj_bias = bias((h, dh), ("heads", "head_dim"))
            self.k_proj_bias = bias((kv, dh), ("kv_heads", "head_dim"))
            self.v_proj_bias = bias((kv, dh), ("kv_heads", "head_dim"))
            self.o_proj_bias = bias((d,), ("embed",))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(dh, cfg, rngs, stack)
            self.k_norm = RMSNorm(dh, cfg, rngs, stack)

    def _project(self, x, name, norm=None):
        """x [B, S, d] through projection `name` (q_proj, k_proj, v_proj), its bias, then the per-head norm."""
        y = jnp.einsum("bsd,dhk->bshk", x, getattr(self, name)[...].astype(x.dtype))
        bias = getattr(self, name + "_bias", None)
        if bias is not None:
            y = y + bias[...].astype(x.dtype)
        return norm(y) if norm is not None else y

    def roped_queries(self, x, cos, sin):
        q = self._project(x, "q_proj", getattr(self, "q_norm", None))
        return apply_rope(q, cos, sin, self.cfg.rope_interleave)

    def kv_entry(self, x, cos, sin):
        """RoPE'd keys and values [B, S, num_key_value_heads, head_dim]: what the KV cache holds (biases
        included, so the sampler's cache needs nothing of its own)."""
        k = self._project(x, "k_proj", getattr(self, "k_norm", None))
        v = self._project(x, "v_proj")
        return apply_rope(k, cos, sin, self.cfg.rope_interleave), v

    def kv_expand(self, k, v):
        # the attention registry reads grouped K/V itself (models/attention_backends.py)
        return k, v


def make_attention(cfg: ModelConfig, rngs: nnx.Rngs, stack: int | None = None) -> _SelfAttention:
    """The attention module ModelConfig.attention_type names."""
    return (GQAttention if cfg.attention_type == "gqa" else MLAttention)(cfg, rngs, stack)
