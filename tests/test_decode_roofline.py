"""The decode roofline accounting of experiments/bench/decode_throughput.py, against an independent count: bytes
from the parameter tree as a whole, FLOPs from the parameter count (every matmul weight is used once per token:
2 FLOPs per weight, the routed experts scaled to the k chosen of E) plus the attention terms over the cache."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from c2jax.models.config import preset
from c2jax.models.inference.forward import unstack
from c2jax.models.transformer import init
from experiments.bench.decode_throughput import decode_flops_per_token, weight_bytes


def _tiny():
    cfg = preset("tiny").replace(num_nextn_predict_layers=0)
    return cfg, init(cfg, seed=0)


def test_weight_bytes_split_covers_every_layer_parameter_and_the_head():
    cfg, model = _tiny()
    _, weights = unstack(*nnx.split(model))
    fixed, per_expert = weight_bytes(weights)
    layer_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(weights.layers))
    assert len(per_expert) == cfg.num_moe_layers
    routed_total = cfg.n_routed_experts * sum(per_expert)
    head = cfg.hidden_size * cfg.vocab_size * np.dtype(cfg.dtype).itemsize
    norm = cfg.hidden_size * np.dtype(cfg.dtype).itemsize
    assert fixed + routed_total == layer_bytes + head + norm
    # one routed expert: gate, up and down projections
    assert per_expert[0] == 3 * cfg.hidden_size * cfg.moe_intermediate_size * np.dtype(cfg.dtype).itemsize


def test_decode_flops_count_each_used_weight_twice_plus_attention_over_the_cache():
    cfg, model = _tiny()
    _, weights = unstack(*nnx.split(model))
    item = np.dtype(cfg.dtype).itemsize
    fixed, per_expert = weight_bytes(weights)
    # matmul weights read per token: everything but norms, the router bias, and the unchosen experts
    small = sum(leaf.nbytes for path, leaf in jax.tree_util.tree_leaves_with_path(weights.layers)
                if leaf.ndim == 1)
    used = (fixed - small - cfg.hidden_size * item) / item  # minus the final norm
    used += cfg.num_experts_per_tok * sum(per_expert) / item
    # absorbed MLA applies kv_b_proj's halves W_uk, W_uv to q and o (once per token, like any weight), and per
    # cached position and head: a score over the latent and the RoPE key, and a weighted sum of latents
    h, r = cfg.num_attention_heads, cfg.kv_lora_rank
    key_len = 96
    attention_over_cache = h * (2 * r + cfg.qk_rope_head_dim) * key_len
    expected = 2 * (used + cfg.num_hidden_layers * attention_over_cache)
    np.testing.assert_allclose(decode_flops_per_token(cfg, key_len), expected, rtol=1e-12)
