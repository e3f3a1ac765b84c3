"""Cached forward pass of the transformer: pure functions of the NNX state and a KV cache. MLA layers cache latents
(below); GQA layers (ModelConfig.attention_type "gqa") cache their RoPE'd keys and values, num_key_value_heads per
token (`KVCache`, head-major: [slots, heads, S, head_dim]), and decode reads them with a grouped einsum (no
per-query-head copies).

The cache holds, per layer and per slot, what MLA attention needs from past tokens (DeepSeek-V2 sec. 2.1):
  latent [slots, S, kv_lora_rank]      c_s = RMSNorm(W_kva x_s)[:kv_lora_rank]
  k_rope [slots, S, qk_rope_head_dim]  k^R_s = RoPE(W_kva x_s)[kv_lora_rank:], shared by all heads
not the per-head K/V (which would be H * (qk_nope + qk_rope + v_head_dim) numbers per token per layer).

Two attention paths read that cache, equal in exact arithmetic (see docs/inference.md):
  expanded  [k_nope | v] = W_kvb c_s for every cached token, then ordinary attention (the test oracle,
            and the prefill path, where the expansion is amortised over many queries)
  absorbed  q~ = q_nope W_uk, score = (q~ . c_s + q_rope . k^R_s) * scale, o = (sum_s p_s c_s) W_uv:
            decode reads only the latent cache and never forms per-head keys or values.
Every layer piece (norms, q/latent projections, RoPE, router, expert dispatch, MLP, LM head) is the trainer's
own module method, so numerics are the trainer's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from c2jax.models.attention_backends import attention
from c2jax.models.config import ModelConfig
from c2jax.models.layers import dense
from c2jax.models.logical import active_mesh_axes
from c2jax.models.moe_routing import route
from c2jax.models.rope import apply_rope, rope_tables

_NEG_INF = -1e30  # same finite mask value as c2jax.models.dense_attention


class LayerCache(NamedTuple):
    """An MLA layer's cache."""

    latent: jnp.ndarray  # [slots, S, kv_lora_rank]
    k_rope: jnp.ndarray  # [slots, S, qk_rope_head_dim]


class KVCache(NamedTuple):
    """A GQA layer's cache: keys after RoPE (and Qwen3's k norm) and values, head-major: for each slot and K/V head
    the positions are one contiguous [S, head_dim] block, the operand layout of both decode einsums (position-major
    [slots, S, heads, head_dim] made XLA:CPU transpose the keys and values it read at every decode step and layer:
    ~0.13 ms per layer at `small-qwen3-moe`, batch 8, 128 positions, about twice the attention itself)."""

    k: jnp.ndarray  # [slots, num_key_value_heads, S, head_dim]
    v: jnp.ndarray  # [slots, num_key_value_heads, S, head_dim]


SEQ_AXIS = {LayerCache: 1, KVCache: 2}  # each cache type's position axis


def _zeroed_layer_cache(cfg: ModelConfig, slots: int, max_len: int) -> LayerCache | KVCache:
    dtype = jnp.dtype(cfg.dtype)
    if cfg.attention_type == "gqa":
        shape = (slots, cfg.kv_heads, max_len, cfg.gqa_head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    return LayerCache(jnp.zeros((slots, max_len, cfg.kv_lora_rank), dtype),
                      jnp.zeros((slots, max_len, cfg.qk_rope_head_dim), dtype))


def init_cache(cfg: ModelConfig, slots: int, max_len: int) -> tuple[LayerCache | KVCache, ...]:
    """Zeroed cache, one entry per decoder layer (dense layers first, then MoE layers)."""
    return tuple(_zeroed_layer_cache(cfg, slots, max_len) for _ in range(cfg.num_hidden_layers))


def cache_slots(cache) -> int:
    """The number of slots a cache (init_cache's tuple) holds."""
    return cache[0][0].shape[0]


def cache_window(cache, key_len: int):
    """The first key_len positions of every cache array (init_cache's or init_mtp_cache's tuple), a copy.

    A decode chunk reads the same key_len positions at every step; slicing them out of the full cache inside the
    step copied them at every step (XLA:CPU runs a slice feeding a dot as a copy), for every layer. The chunk
    slices its window once, decodes over it (updated in place: it is the scan's carry) and writes it back once
    (`cache_merge`): measured at `small-qwen3-moe`, batch 8, the grouped decode attention over 128 positions took
    0.19 ms per layer with the slice and 0.07 ms without. Costs a window-sized second copy of the cache while the
    chunk runs (none when key_len covers the whole cache). Writes past the window are dropped, as writes past the
    cache end: the caller's key_len must cover every position the chunk writes for its live rows."""
    if cache and key_len >= cache[0][0].shape[SEQ_AXIS[type(cache[0])]]:
        return cache
    return tuple(type(c)(*(jax.lax.slice_in_dim(a, 0, key_len, axis=SEQ_AXIS[type(c)]) for a in c)) for c in cache)


def cache_merge(cache, window):
    """`cache` with `window` (cache_window's result, updated) written back over its first positions; in place
    where the cache is donated."""
    if window is cache:
        return cache
    return tuple(type(c)(*(jax.lax.dynamic_update_slice_in_dim(a, w.astype(a.dtype), 0, axis=SEQ_AXIS[type(c)])
                           for a, w in zip(c, cw, strict=True)))
                 for c, cw in zip(cache, window, strict=True))


def cache_bytes_per_token(cfg: ModelConfig) -> tuple[int, int]:
    """(this model's cache, an expanded per-query-head K/V cache) bytes per token over all layers: MLA's latent vs
    its per-head K/V, GQA's num_key_value_heads K/V vs one K/V head per query head."""
    item = jnp.dtype(cfg.dtype).itemsize
    if cfg.attention_type == "gqa":
        cache = cfg.num_hidden_layers * 2 * cfg.kv_heads * cfg.gqa_head_dim * item
    else:
        cache = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * item
    expanded = cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.value_head_dim) * item
    return cache, expanded


def _layers(model):
    """Per-layer modules in order: (module, is_moe), sliced out of the scanned stacks."""
    out = []
    for stack, num, moe in ((model.dense_layers, model.cfg.num_dense_layers, False),
                            (model.moe_layers, model.cfg.num_moe_layers, True)):
        if stack is None:
            continue
        graphdef, state = nnx.split(stack)
        for i in range(num):
            out.append((nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)), moe))
    return out


def _write(attn, x, cos, sin, cache, slot_idx, positions):
    """Write the cache entries of inputs x [b, T, d] (MLA: latent and shared RoPE key; GQA: keys and values) at
    `positions` [b, T] of rows `slot_idx` [b] (None: row i is slot i). Writes past the cache end are dropped."""
    entry = attn.kv_entry(x, cos, sin)
    rows = (jnp.arange(x.shape[0]) if slot_idx is None else slot_idx)[:, None]
    if isinstance(cache, KVCache):  # [slots, heads, S, D] at [b, T] rows and positions: entries [b, T, heads, D]
        return KVCache(*(c.at[rows, :, positions].set(e.astype(c.dtype), mode="drop")
                         for c, e in zip(cache, entry, strict=True)))
    return type(cache)(*(c.at[rows, positions].set(e.astype(c.dtype), mode="drop")
                         for c, e in zip(cache, entry, strict=True)))


def _attend_gqa(cfg: ModelConfig, attn, x, cos, sin, cache: KVCache, slot_idx, positions, key_len: int,
                absorbed: bool):
    """GQA over the cache for queries at `positions` [b, T]; writes this step's keys and values first. Decode
    (`absorbed`) groups the query heads over their K/V head in one einsum, reading each cached K/V once; prefill
    goes through the attention registry like the trainer."""
    q = attn.roped_queries(x, cos, sin)  # [b, T, H, D]
    cache = _write(attn, x, cos, sin, cache, slot_idx, positions)
    if slot_idx is None:  # a no-op slice when key_len is the whole (windowed) cache
        k, v = cache.k[:, :, :key_len], cache.v[:, :, :key_len]
    else:
        k, v = cache.k[slot_idx, :, :key_len], cache.v[slot_idx, :, :key_len]
    k, v = k.astype(x.dtype), v.astype(x.dtype)  # [b, Hkv, K, D]
    if absorbed:
        b, t, heads, dim = q.shape
        groups = heads // cfg.kv_heads
        qg = q.reshape(b, t, cfg.kv_heads, groups, dim) * jnp.asarray(cfg.softmax_scale, x.dtype)
        # batch (b, j), [g*t, D] x [K, D]^T and [g*t, K] x [K, D]: plain batched GEMMs over the cache as it lies.
        # The output as [b, j, g, t, D], then a transpose (tiny): asking for [b, t, j, g, D] directly made XLA:CPU
        # compute it transposed with a generic dot (measured at `small-qwen3-moe`, batch 8: 0.17 vs 0.06 ms/layer)
        scores = jnp.einsum("btjgd,bjkd->bjgtk", qg, k, preferred_element_type=jnp.float32)
        visible = jnp.arange(key_len)[None, None, :] <= positions[:, :, None]  # [b, T, K]
        scores = scores + jnp.where(visible, jnp.float32(0), jnp.float32(_NEG_INF))[:, None, None]
        p = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("bjgtk,bjkd->bjgtd", p, v)
        out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, heads, dim)
    else:
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # the registry's [b, K, Hkv, D]
        out = attention(q, k, v, scale=cfg.softmax_scale, q_positions=positions, kv_positions=jnp.arange(key_len),
                        causal=True)
    return attn.project_out(out, x.dtype), cache


def _attend(cfg: ModelConfig, attn, x, cos, sin, cache, slot_idx, positions, key_len: int, absorbed: bool):
    """Attention over the cache for queries at `positions` [b, T]; writes this step's entries first."""
    if cfg.attention_type == "gqa":
        return _attend_gqa(cfg, attn, x, cos, sin, cache, slot_idx, positions, key_len, absorbed)
    q = attn.queries(x)
    q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
    q_rope = apply_rope(q_rope, cos, sin, cfg.rope_interleave)
    cache = _write(attn, x, cos, sin, cache, slot_idx, positions)
    if slot_idx is None:  # decode: every slot in order, a slice rather than a gather of the whole cache
        c, kr = cache.latent[:, :key_len], cache.k_rope[:, :key_len]
    else:
        c, kr = cache.latent[slot_idx, :key_len], cache.k_rope[slot_idx, :key_len]
    c, kr = c.astype(x.dtype), kr.astype(x.dtype)  # [b, K, r], [b, K, dr]
    scale = jnp.asarray(cfg.softmax_scale, x.dtype)
    kv_b = attn.kv_b_proj[...].astype(x.dtype)  # [r, H, dn + dv]
    w_uk, w_uv = kv_b[..., : cfg.qk_nope_head_dim], kv_b[..., cfg.qk_nope_head_dim:]
    if absorbed:
        visible = jnp.arange(key_len)[None, None, :] <= positions[:, :, None]  # causal over the cache
        bias = jnp.where(visible, jnp.float32(0), jnp.float32(_NEG_INF))[:, None]  # [b, 1, T, K]
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope * scale, w_uk)
        scores = (jnp.einsum("bthr,bkr->bhtk", q_lat, c, preferred_element_type=jnp.float32)
                  + jnp.einsum("bthe,bke->bhtk", q_rope * scale, kr, preferred_element_type=jnp.float32))
        p = jax.nn.softmax(scores + bias, axis=-1)
        # [b, h, t, r] then a transpose: XLA:CPU runs "bhtk,bkr->bthr" as a slow generic batched dot (t between
        # the batch and the head axes); this layout is a plain batched GEMM (measured: 0.19 vs 1.0 ms at b=32)
        o_lat = jnp.swapaxes(jnp.einsum("bhtk,bkr->bhtr", p.astype(x.dtype), c), 1, 2)
        out = jnp.einsum("bthr,rhv->bthv", o_lat, w_uv)
    else:
        k_nope = jnp.einsum("bkr,rhn->bkhn", c, w_uk)
        v = jnp.einsum("bkr,rhv->bkhv", c, w_uv)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(kr[:, :, None], (*kr.shape[:2], cfg.num_attention_heads,
                                                                         kr.shape[-1]))], axis=-1)
        # prefill: the attention registry (models/attention_backends.py), as the trainer: on CPU dense for
        # short prompts and blockwise (memory O(K), no [b, H, T, K] scores) beyond; cuDNN where it applies.
        # Key j is cache position j, visible to a query at position p iff j <= p (later entries are stale)
        out = attention(jnp.concatenate([q_nope, q_rope], axis=-1), k, v, scale=cfg.softmax_scale,
                        q_positions=positions, kv_positions=jnp.arange(key_len), causal=True)
    return attn.project_out(out, x.dtype), cache


def moe_ffn(cfg: ModelConfig, mlp, x):
    """The MoE layer `mlp` on x [b, T, d] -> (y, Routing): the trainer's router, experts and shared experts.
    With few tokens (3 * b * T * top_k <= experts, i.e. decode at batch 1-2), the selected experts' weights are
    gathered and only they are read, instead of the trainer's dispatch over every expert's weights: decode is
    weight-bandwidth bound. The gather copies what it reads (read, write, read again: ~3x the selected bytes),
    so beyond a third of the experts the dispatch over all of them is cheaper (measured at `small` on CPU: a
    3-token verify took 35 ms per round gathered, 21 ms through the dispatch). Same math (float reassociation
    aside); the trainer's dispatch otherwise, and
    whenever experts are sharded or quantized."""
    b, t, d = x.shape
    n = b * t
    if (3 * n * cfg.num_experts_per_tok > cfg.n_routed_experts or cfg.moe_quant != "bf16"
            or active_mesh_axes("experts") is not None):
        return mlp(x)
    flat = x.reshape(n, d)
    routing = route(cfg, flat, mlp.gate[...], mlp.e_score_correction_bias[...])
    k = cfg.num_experts_per_tok
    # one row per (token, expert) assignment, batch axis first: "ad,adf->af" is a plain batched GEMV over the
    # gathered [n*k, d, 2f] weights; the [n, k]-indexed einsum it replaces made XLA:CPU transpose the gathered
    # weights to [d, k*2f] first (measured at `small`, batch 1: 1.34 vs 0.65 ms per MoE layer)
    chosen = routing.expert_ids.reshape(-1)
    rows = jnp.repeat(flat, k, axis=0)  # [n*k, d]
    gate, up = jnp.split(jnp.einsum("ad,adf->af", rows, mlp.gate_up_proj[...][chosen].astype(x.dtype)), 2, axis=-1)
    out = jnp.einsum("af,afd->ad", jax.nn.silu(gate) * up, mlp.down_proj[...][chosen].astype(x.dtype))
    y = jnp.einsum("nk,nkd->nd", routing.weights.astype(x.dtype), out.reshape(n, k, d)).reshape(b, t, d)
    if mlp.shared_experts is not None:
        y = y + mlp.shared_experts(x)
    return y, routing


class StepOutput(NamedTuple):
    logits: jnp.ndarray  # [b, T, V] float32
    expert_ids: jnp.ndarray | None  # [b, T, L_moe, k] int32 experts chosen for each input token
    cache: tuple[LayerCache, ...]
    hidden: jnp.ndarray | None = None  # [b, T, d] final hidden state before the output norm


def _mtp_modules(model):
    """The MTP modules in depth order, sliced out of their stack (empty without MTP)."""
    if model.mtp is None:
        return []
    graphdef, state = nnx.split(model.mtp)
    return [nnx.merge(graphdef, jax.tree.map(lambda a, j=j: a[j], state))
            for j in range(model.cfg.num_nextn_predict_layers)]


class Prepared(NamedTuple):
    model: nnx.Module
    layers: list  # [(decoder layer module, is_moe)]
    mtp: list  # MTP modules, depth order
    head_vd: jnp.ndarray | None = None  # [V, d] LM head transposed once per weight version (`unstack`)


def head_logits(prepared: Prepared, normed: jnp.ndarray) -> jnp.ndarray:
    """The shared LM head on normed hidden states [..., d] -> float32 logits [..., V]. With `unstack`'s [V, d]
    copy of the head each vocabulary row is one contiguous dot product: measured on 2 CPU cores with the
    weights out of cache, 2.8 vs 5.3 ms at 32 rows, 1.7 vs 2.2 ms at 8, equal at 1, against the trainer's
    [d, V] layout (which the oracle path, `prepare` from a plain state, still uses)."""
    if prepared.head_vd is None:
        return dense(normed, prepared.model.head_weight(), preferred_element_type=jnp.float32)
    flat = normed.reshape(-1, normed.shape[-1])
    out = jnp.einsum("nd,vd->nv", flat, prepared.head_vd.astype(flat.dtype), preferred_element_type=jnp.float32)
    return out.reshape(*normed.shape[:-1], out.shape[-1])


class LayeredDef:
    """Static half of `unstack`: the model's graphdef and each layer's / MTP module's. A static argument of every
    jitted step, so it is hashed on every call: the hash is computed once (hashing the graphdefs took ~3 ms per
    call at `small`, 5% of a batch-1 decode chunk), and the engine passes the same object each time, which
    compares equal by identity."""

    __slots__ = ("model", "layers", "mtp", "_hash")

    def __init__(self, model: nnx.GraphDef, layers: tuple, mtp: nnx.GraphDef | None):
        self.model, self.layers, self.mtp = model, layers, mtp  # layers: ((graphdef, is_moe), ...) in order
        self._hash = hash((model, layers, mtp))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, LayeredDef) and self._hash == other._hash
                                 and (self.model, self.layers, self.mtp) == (other.model, other.layers, other.mtp))


class LayeredState(NamedTuple):
    """Array half of `unstack`: the model state plus every layer's and MTP module's own parameters, and the LM
    head transposed to [V, d] (`head_logits`)."""
    model: nnx.State
    layers: tuple
    mtp: tuple
    head_vd: jnp.ndarray | None = None


def unstack(graphdef: nnx.GraphDef, state: nnx.State) -> tuple[LayeredDef, LayeredState]:
    """Slice the scanned layer stacks into per-layer parameters once, eagerly (per weight version). Passed to
    the jitted steps in place of (graphdef, state), it spares every call a copy of all layer weights out of
    the stacks (measured at `small` on CPU: ~35 ms per call, more than two decode steps). Costs one more copy
    of the layer weights in memory, and one of the LM head (transposed, see `head_logits`; none when tied:
    the embedding table is already [V, d])."""
    model = nnx.merge(graphdef, state)
    layers = [nnx.split(m) for m, _ in _layers(model)]
    mtp = [nnx.split(m) for m in _mtp_modules(model)]
    moe = [is_moe for _, is_moe in _layers(model)]
    defs = LayeredDef(graphdef, tuple((d, m) for (d, _), m in zip(layers, moe, strict=True)),
                      mtp[0][0] if mtp else None)
    head_vd = model.embed_tokens[...] if model.lm_head is None else jnp.asarray(model.lm_head[...]).T.copy()
    return defs, LayeredState(state, tuple(s for _, s in layers), tuple(s for _, s in mtp), head_vd)


def prepare(graphdef, state) -> Prepared:
    """(model, per-layer modules, MTP modules) from (graphdef, state) or from `unstack`'s pair. From a plain
    state the stacked parameters are sliced here: do it once, outside a decode loop."""
    if isinstance(graphdef, LayeredDef):
        return Prepared(nnx.merge(graphdef.model, state.model),
                        [(nnx.merge(d, s), m) for (d, m), s in zip(graphdef.layers, state.layers, strict=True)],
                        [nnx.merge(graphdef.mtp, s) for s in state.mtp], state.head_vd)
    model = nnx.merge(graphdef, state)
    return Prepared(model, _layers(model), _mtp_modules(model))


def init_mtp_cache(cfg: ModelConfig, slots: int, max_len: int) -> tuple[LayerCache | KVCache, ...]:
    """Zeroed cache of the MTP modules' attention, one entry per module."""
    return tuple(_zeroed_layer_cache(cfg, slots, max_len) for _ in range(cfg.num_nextn_predict_layers))


def _mtp_input(model, module, hidden, tokens):
    """eh_proj [enorm(Emb(tokens)); hnorm(hidden)]: the MTP block's input (c2jax.models.transformer._mtp)."""
    e = module.enorm(model.embed(tokens))
    x = jnp.concatenate([e, module.hnorm(hidden.astype(e.dtype))], axis=-1)
    return dense(x, module.eh_proj[...])


def mtp_write(cfg: ModelConfig, prepared: Prepared, depth: int, cache: LayerCache, hidden, tokens, slot_idx,
              start) -> LayerCache:
    """Write MTP module `depth`'s cache entries for rows hidden [b, T, d] (the representation the module is fed:
    the trunk's output after its final norm for depth 0) and tokens [b, T] (the token after each position) at
    positions start[b] + t. An entry depends only on its own position's inputs, so no attention runs."""
    module = prepared.mtp[depth]
    positions = start[:, None].astype(jnp.int32) + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    cos, sin = rope_tables(cfg, positions)
    x = _mtp_input(prepared.model, module, hidden, tokens)
    return _write(module.block.self_attn, module.block.input_layernorm(x), cos, sin, cache, slot_idx, positions)


def mtp_step(cfg: ModelConfig, prepared: Prepared, depth: int, cache: LayerCache, hidden, tokens, slot_idx,
             start, *, key_len: int, absorbed: bool = True):
    """MTP module `depth` on rows hidden [b, T, d], tokens [b, T] at positions start + t, attending over its own
    cache. Returns (its output after its own norm [b, T, d] (the next depth's `hidden`), logits [b, T, V]
    float32 (the shared head on that output), cache)."""
    model, module = prepared.model, prepared.mtp[depth]
    positions = start[:, None].astype(jnp.int32) + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    cos, sin = rope_tables(cfg, positions)
    x = _mtp_input(model, module, hidden, tokens)
    block = module.block
    attn_out, cache = _attend(cfg, block.self_attn, block.input_layernorm(x), cos, sin, cache, slot_idx,
                              positions, key_len, absorbed)
    h = x + attn_out
    ffn, _ = moe_ffn(cfg, block.mlp, block.post_attention_layernorm(h))
    out = module.norm(h + ffn)
    logits = head_logits(prepared, out)
    return out, logits, cache


def extend(cfg: ModelConfig, graphdef: nnx.GraphDef, state: nnx.State, cache: tuple[LayerCache, ...],
           tokens: jnp.ndarray, slot_idx: jnp.ndarray | None, start: jnp.ndarray, *, key_len: int,
           absorbed: bool = True, prepared=None, logits_at: jnp.ndarray | None = None) -> StepOutput:
    """Run `tokens` [b, T] of slots `slot_idx` [b] whose caches hold `start` [b] tokens.

    slot_idx None means row i is slot i (decode over all slots).
    Token t of row i sits at position start[i] + t, attends to cache positions <= its own, and its latent is
    written there (writes past the cache end are dropped). Only the first `key_len` (static) cache positions
    are read, so the caller passes a bound >= max(start + T). Prefill is T = prompt length; decode T = 1.
    `prepared`: the result of prepare(graphdef, state), if the caller already has it.
    `logits_at` [b]: compute logits only at token logits_at[i] of row i (StepOutput.logits [b, 1, V]): a prefill
    samples from its last position only, and the head over every prompt token was ~30% of its FLOPs.
    """
    prepared = prepare(graphdef, state) if prepared is None else prepared
    model, layers = prepared.model, prepared.layers
    b, t = tokens.shape
    positions = start[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None]
    cos, sin = rope_tables(cfg, positions)
    x = model.embed(tokens)
    new_cache, experts = [], []
    for layer, (module, moe) in enumerate(layers):
        attn_out, layer_cache = _attend(cfg, module.self_attn, module.input_layernorm(x), cos, sin,
                                        cache[layer], slot_idx, positions, key_len, absorbed)
        new_cache.append(layer_cache)
        h = x + attn_out
        normed = module.post_attention_layernorm(h)
        if moe:
            ffn, routing = moe_ffn(cfg, module.mlp, normed)
            experts.append(routing.expert_ids.reshape(b, t, -1))
        else:
            ffn = module.mlp(normed)
        x = h + ffn
    expert_ids = jnp.stack(experts, axis=2) if experts else None
    last = x if logits_at is None else jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), axis=1)
    return StepOutput(head_logits(prepared, model.norm(last)), expert_ids, tuple(new_cache), x)
