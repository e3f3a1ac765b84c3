"""Qwen3 (`qwen3`, dense) and Qwen3-MoE (`qwen3_moe`: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, the Composer 2 report's
ablation model): GQA with per-head q/k RMSNorm before RoPE (rotate-half pairs, theta 1e6 in the releases), and in
Qwen3-MoE a softmax top-k router (`norm_topk_prob` renormalises the k weights) over routed experts without shared
experts or a selection bias. Weight names: models/hf/keys.py's GQA attention keys (`self_attn.{q,k,v,o}_proj`,
`self_attn.{q,k}_norm`), `mlp.gate` (router) and `mlp.experts.{e}.{gate,up,down}_proj` as DeepSeek's.

Layer layout: layer i is MoE iff num_experts > 0, i is not in `mlp_only_layers` and (i + 1) is a multiple of
`decoder_sparse_step`; c2jax stacks dense layers first, so the dense layers must be a prefix (ConfigError
otherwise). Sliding-window attention (`use_sliding_window`) is refused. `attention_bias` puts biases on q/k/v/o_proj
(before the q/k norms), as transformers' Qwen3Attention / Qwen3MoeAttention; their MLPs and experts have no bias
(`mlp_bias` is not a Qwen3 field: transformers ignores it, and so does c2jax, with a warning).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from c2jax.models.config import ConfigError, ModelConfig, dtype_name
from c2jax.models.hf.families.common import (
    GQA_FIELDS,
    build,
    dense_prefix,
    gqa_fields,
    gqa_to_hf,
    warn_unknown,
)

MODEL_TYPES = ("qwen3_moe", "qwen3")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# transformers' Qwen3Config / Qwen3MoeConfig defaults (head_dim: Qwen3 128, Qwen3-MoE hidden / heads)
_QWEN3_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
                   "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                   "initializer_range": 0.02}
_MOE_DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": None,
                 "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                 "initializer_range": 0.02, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
                 "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False}
_MOE_FIELDS = ("decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok", "num_experts", "norm_topk_prob",
               "mlp_only_layers", "num_local_experts")
_CHECKED = frozenset({"hidden_act", "attention_bias", "attention_dropout", "use_sliding_window", "sliding_window",
                      "max_window_layers", "layer_types", "mlp_bias"})


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    moe = hf.get("model_type") == "qwen3_moe"
    defaults = _MOE_DEFAULTS if moe else _QWEN3_DEFAULTS
    if hf.get("mlp_bias"):
        warnings.warn(f"mlp_bias: {hf.get('model_type')} has no MLP biases (transformers ignores the field); "
                      "ignored", stacklevel=2)
        hf = {k: v for k, v in hf.items() if k != "mlp_bias"}
    fields = gqa_fields(hf, "", defaults) | {"qk_norm": True, "hf_model_type": hf.get("model_type")}
    if moe:
        get = lambda name: defaults[name] if hf.get(name) is None else hf[name]  # noqa: E731
        if hf.get("num_experts") is None and hf.get("num_local_experts") is not None:
            hf = dict(hf, num_experts=hf["num_local_experts"])  # transformers 5.x writes this name
        layers, experts, step = fields["num_hidden_layers"], int(get("num_experts")), int(get("decoder_sparse_step"))
        if step <= 0:
            raise ConfigError(f"decoder_sparse_step must be positive, got {step}")
        only = [int(i) for i in (hf.get("mlp_only_layers") or [])]
        dense = [i for i in range(layers) if experts == 0 or i in only or (i + 1) % step]
        fields["first_k_dense_replace"] = dense_prefix(layers, dense, "", "decoder_sparse_step / mlp_only_layers")
        if experts:
            fields |= {"n_routed_experts": experts, "num_experts_per_tok": int(get("num_experts_per_tok")),
                       "moe_intermediate_size": int(get("moe_intermediate_size")),
                       "norm_topk_prob": bool(get("norm_topk_prob")), "scoring_func": "softmax",
                       "topk_method": "greedy", "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1}
    warn_unknown(hf, "", set(GQA_FIELDS) | _CHECKED | (set(_MOE_FIELDS) if moe else set()))
    return build(fields, overrides)


def config_to_hf(cfg: ModelConfig, dtype: Any = None) -> dict[str, Any]:
    saved = cfg.param_dtype if dtype is None else dtype_name(dtype)
    model_type = cfg.hf_model_type
    if not cfg.qk_norm:
        raise ConfigError(f"{model_type} normalises q and k per head; this config has qk_norm false")
    if cfg.mlp_bias:
        raise ConfigError(f"{model_type} has no MLP biases; this config has mlp_bias true (use llama)")
    out = gqa_to_hf(cfg, model_type, ARCHITECTURES[model_type], saved)
    if model_type == "qwen3":
        if cfg.num_moe_layers:
            raise ConfigError(f"qwen3 is dense; this config has {cfg.num_moe_layers} MoE layers (use qwen3_moe)")
        return out | {"use_sliding_window": False, "sliding_window": None, "layer_types": None}
    if cfg.n_shared_experts or cfg.topk_method != "greedy" or cfg.scoring_func != "softmax" \
            or cfg.routed_scaling_factor != 1.0:
        raise ConfigError("qwen3_moe routes by softmax top-k (greedy, routed_scaling_factor 1) without shared "
                          "experts; this config differs")
    return out | {"num_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                  "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
                  "decoder_sparse_step": 1, "mlp_only_layers": list(range(cfg.first_k_dense_replace)),
                  "use_sliding_window": False, "sliding_window": None}
