"""Parameter <-> checkpoint key mapping.

On-disk layout (what `save_pretrained` writes; what DeepSeek-V3, Kimi-K2 and transformers 5.x write):

  model.embed_tokens.weight [V, d]     model.norm.weight [d]     lm_head.weight [V, d] (absent if tied)
  model.layers.{l}.input_layernorm.weight / post_attention_layernorm.weight
  model.layers.{l}.self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa,
      kv_a_layernorm, kv_b_proj, o_proj          torch Linear weights are [out, in]
      {q,k,v,o}_proj.bias [out] under attention_bias (GQA; our {q,k,v,o}_proj_bias, [heads, head_dim] / [d])
  model.layers.{l}.mlp.{gate,up,down}_proj.weight                       l < first_k_dense_replace
      and .bias [out] under mlp_bias (our mlp.{gate,up,down}_proj_bias)
  model.layers.{l}.mlp.gate.weight [E, d], mlp.gate.e_score_correction_bias [E] (float32)
  model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight           per-expert (DeepSeek layout)
  model.layers.{l}.mlp.shared_experts.{gate,up,down}_proj.weight
  model.layers.{L+j}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, embed_tokens} + a full
      MoE decoder layer                                                  MTP module j (L = num_hidden_layers)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from c2jax.models.config import ModelConfig
from c2jax.models.hf.checkpoint import SafetensorsCheckpoint


def _layer_entry(rel: tuple[str, ...], moe: bool) -> tuple[str, Any]:
    """(key relative to `model.layers.{l}.`, kind) for a parameter path inside a DecoderLayer."""
    name = ".".join(rel)
    if moe and name == "mlp.gate_up_proj":
        return "mlp.experts", "experts_gate_up"
    if moe and name == "mlp.down_proj":
        return "mlp.experts", "experts_down"
    if name == "mlp.e_score_correction_bias":
        return "mlp.gate.e_score_correction_bias", "copy"
    if rel[-1] == "weight":  # RMSNorm scales
        return name, "copy"
    if rel[-1].endswith("_proj_bias"):  # attention_bias / mlp_bias: torch Linear biases, flat [out]
        return name[: -len("_bias")] + ".bias", ("bias",)
    return name + ".weight", ("linear", 2 if rel[-1] == "o_proj" else 1)


def leaf_keys(cfg: ModelConfig, path: tuple[str, ...]) -> tuple[list[str] | None, str, Any]:
    """(per-slice key prefixes, or None for an unstacked leaf; relative key; kind) of a state leaf."""
    head, rel = path[0], path[1:]
    if head == "embed_tokens":
        return None, "model.embed_tokens.weight", "copy"
    if head == "norm":
        return None, "model.norm.weight", "copy"
    if head == "lm_head":
        return None, "lm_head.weight", ("linear", 1)
    if head == "dense_layers":
        prefixes = [f"model.layers.{i}." for i in range(cfg.num_dense_layers)]
        return (prefixes, *_layer_entry(rel, moe=False))
    if head == "moe_layers":
        prefixes = [f"model.layers.{cfg.first_k_dense_replace + i}." for i in range(cfg.num_moe_layers)]
        return (prefixes, *_layer_entry(rel, moe=True))
    if head == "mtp":
        prefixes = [f"model.layers.{cfg.num_hidden_layers + j}." for j in range(cfg.num_nextn_predict_layers)]
        if rel[0] == "block":
            return (prefixes, *_layer_entry(rel[1:], moe=True))
        if rel == ("eh_proj",):
            return prefixes, "eh_proj.weight", ("linear", 1)
        if rel == ("norm", "weight"):
            return prefixes, "shared_head.norm.weight", "copy"
        if rel in (("enorm", "weight"), ("hnorm", "weight")):
            return prefixes, ".".join(rel), "copy"
    raise ValueError(f"no checkpoint mapping for model state {'.'.join(path)}")


def _linear_split(shape: tuple[int, ...], n_in: int) -> tuple[int, int]:
    return int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))


def load_slice(
    ckpt: SafetensorsCheckpoint, prefix: str, rel: str, kind: Any, out: np.ndarray, optional_zero: bool
) -> None:
    """Fill `out` (one layer's slice of a leaf, our layout) from the checkpoint."""
    key = prefix + rel
    if kind == "copy":
        if optional_zero and key not in ckpt:
            out[...] = 0
            return
        out[...] = ckpt.read(key, out.shape)
    elif kind[0] == "linear":
        n_in, n_out = _linear_split(out.shape, kind[1])
        out[...] = ckpt.read(key, (n_out, n_in)).T.reshape(out.shape)
    elif kind == ("bias",):
        out[...] = ckpt.read(key, (out.size,)).reshape(out.shape)
    elif kind in ("experts_gate_up", "experts_down"):
        num_experts, rows, cols = out.shape  # gate_up: [E, d, 2f]; down: [E, f, d]
        fused = f"{key}.{'gate_up_proj' if kind == 'experts_gate_up' else 'down_proj'}"
        if fused in ckpt:  # transformers' in-memory layout: [E, 2f, d] / [E, d, f]
            out[...] = ckpt.read(fused, (num_experts, cols, rows)).transpose(0, 2, 1)
            return
        for e in range(num_experts):
            if kind == "experts_gate_up":
                f = cols // 2
                out[e, :, :f] = ckpt.read(f"{key}.{e}.gate_proj.weight", (f, rows)).T
                out[e, :, f:] = ckpt.read(f"{key}.{e}.up_proj.weight", (f, rows)).T
            else:
                out[e] = ckpt.read(f"{key}.{e}.down_proj.weight", (cols, rows)).T
    else:
        raise AssertionError(kind)


def save_slice(prefix: str, rel: str, kind: Any, value: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(key, view) pairs of one layer's slice of a leaf, in the DeepSeek on-disk layout."""
    key = prefix + rel
    if kind == "copy":
        yield key, value
    elif kind[0] == "linear":
        n_in, n_out = _linear_split(value.shape, kind[1])
        yield key, value.reshape(n_in, n_out).T
    elif kind == ("bias",):
        yield key, value.reshape(-1)
    elif kind == "experts_gate_up":
        f = value.shape[2] // 2
        for e in range(value.shape[0]):
            yield f"{key}.{e}.gate_proj.weight", value[e, :, :f].T
            yield f"{key}.{e}.up_proj.weight", value[e, :, f:].T
    elif kind == "experts_down":
        for e in range(value.shape[0]):
            yield f"{key}.{e}.down_proj.weight", value[e].T
    else:
        raise AssertionError(kind)
