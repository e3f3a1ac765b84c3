"""The DeepSeek MLA family: DeepSeek-V3 (`deepseek_v3`; also Moonlight-16B-A3B, whose config.json names
DeepseekV3ForCausalLM), Kimi K2 (`kimi_k2`), Kimi K2.5 (the `kimi_k25` wrapper around a text_config) and
DeepSeek-V2 / V2-Lite (`deepseek_v2`). Weight names are the default layout of models/hf/keys.py.

config.json fields are read with transformers' defaults of that model_type for absent keys. Values c2jax cannot
reproduce raise ConfigError naming the field (hidden_act != silu, attention_bias, dropout, moe_layer_freq != 1,
unknown topk_method, rope types other than default / yarn, quantization other than fp8 e4m3 128x128).
`num_key_value_heads` is ignored (MLA has none; transformers only uses it in its eager path).
`scoring_func="softmax"` is honoured as DeepSeek's reference code does, although transformers' DeepseekV3 always
applies a sigmoid. A `topk_method="greedy"` V3 checkpoint may omit `e_score_correction_bias` (zeros are used).
DeepSeek-V2 routes by softmax with no selection bias; transformers' DeepseekV2 never renormalises the top-k
weights, so its `norm_topk_prob` is read as transformers does (ignored, with a warning when true).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from c2jax.models.config import ConfigError, ModelConfig, dtype_name
from c2jax.models.hf.families.common import build, refuse_unsupported, rope_from_hf, rope_to_hf, warn_unknown
from c2jax.models.hf.fp8 import FP8_BLOCK

MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v2")
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}

# transformers' DeepseekV3Config defaults: the meaning of a field that a config.json leaves out.
_V3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_interleave": True,
    "num_nextn_predict_layers": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
}
# transformers' DeepseekV2Config defaults (num_experts_per_tok has none: a V2 config must set it)
_V2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008, "moe_intermediate_size": 1407,
    "num_hidden_layers": 32, "num_attention_heads": 32, "n_shared_experts": 2, "n_routed_experts": 64,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": None, "topk_group": None, "num_experts_per_tok": None,
    "first_k_dense_replace": 0, "norm_topk_prob": False, "max_position_embeddings": 2048,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_interleave": True,
    "num_nextn_predict_layers": 0, "scoring_func": "softmax", "topk_method": "greedy",
}

# HF field -> ModelConfig field, copied as is.
_DIRECT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
    "routed_scaling_factor", "norm_topk_prob", "scoring_func", "first_k_dense_replace", "rope_interleave",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "initializer_range",
    "num_nextn_predict_layers",
)
# read for validation, or derived by transformers from other fields
_CHECKED = frozenset({
    "hidden_act", "attention_bias", "attention_dropout", "mlp_bias", "moe_layer_freq", "topk_method",
    "quantization_config", "num_mtp_layers", "text_config", "head_dim", "qk_head_dim", "num_key_value_heads",
    "num_experts",
})


def text_config(hf: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The language-model config and the prefix naming its fields in error messages (kimi_k25 wraps one)."""
    if hf.get("model_type") == "kimi_k25":
        text = hf.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError("text_config: a kimi_k25 config needs a text_config mapping")
        inner = text.get("model_type")
        if inner is not None and inner not in ("deepseek_v3", "kimi_k2"):
            raise ConfigError(f"text_config.model_type: {inner!r} is not supported")
        return text, "text_config."
    return hf, ""


def quantization(hf: Mapping[str, Any]) -> dict[str, Any] | None:
    """The validated quantization_config (top level or, for kimi_k25, text_config), or None."""
    text, prefix = text_config(hf)
    found = [(p, q) for p, q in (("", hf.get("quantization_config")), (prefix, text.get("quantization_config")))
             if q is not None]
    if not found:
        return None
    where, q = found[-1]
    name = f"{where}quantization_config"
    if not isinstance(q, Mapping):
        raise ConfigError(f"{name}: expected a mapping, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"{name}.quant_method: only DeepSeek's 'fp8' (e4m3, 128x128 blocks) is supported, "
                          f"got {method!r}")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{name}.fmt: only 'e4m3' is supported, got {fmt!r}")
    block = q.get("weight_block_size")
    if block is None or list(block) != list(FP8_BLOCK):
        raise ConfigError(f"{name}.weight_block_size: only [128, 128] is supported, got {block!r}")
    return dict(q)


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    text, prefix = text_config(hf)
    v2 = hf.get("model_type") == "deepseek_v2"
    defaults = _V2_DEFAULTS if v2 else _V3_DEFAULTS

    def get(name):  # an absent field means transformers' default; null stays null (q_lora_rank)
        return text[name] if name in text else defaults.get(name)

    refuse_unsupported(text, prefix)
    if text.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"{prefix}moe_layer_freq: only 1 is supported, got {text['moe_layer_freq']}")
    n_group, topk_group = int(get("n_group") or 1), int(get("topk_group") or 1)
    topk_method = get("topk_method") or "noaux_tc"
    allowed = ("greedy", "group_limited_greedy") if v2 else ("noaux_tc", "greedy")
    if topk_method not in allowed:
        raise ConfigError(f"{prefix}topk_method: {hf.get('model_type') or 'deepseek_v3'} supports {allowed}, "
                          f"got {topk_method!r}")
    quantization(hf)

    fields = {name: get(name) for name in _DIRECT_FIELDS}
    if v2:
        fields["n_routed_experts"] = text.get("n_routed_experts", text.get("num_experts", defaults["n_routed_experts"]))
        if fields["num_experts_per_tok"] is None:
            raise ConfigError(f"{prefix}num_experts_per_tok: a deepseek_v2 config must set it (no default)")
        if text.get("norm_topk_prob"):
            warnings.warn(f"{prefix}norm_topk_prob is true, but transformers' DeepseekV2 never renormalises the "
                          "top-k weights; c2jax follows transformers", stacklevel=3)
        fields["norm_topk_prob"] = False
        fields["scoring_func"] = "softmax"
    fields |= {"n_group": n_group, "topk_group": topk_group, "topk_method": topk_method,
               # Kimi K2 / K2.5 are DeepSeek-V3 checkpoints and export as such (as transformers loads them)
               "hf_model_type": "deepseek_v2" if v2 else "deepseek_v3"}
    if text.get("num_nextn_predict_layers") is None and text.get("num_mtp_layers") is not None:
        fields["num_nextn_predict_layers"] = text["num_mtp_layers"]
    fields["num_nextn_predict_layers"] = int(fields["num_nextn_predict_layers"] or 0)
    if fields["scoring_func"] not in ("sigmoid", "softmax"):
        raise ConfigError(f"{prefix}scoring_func: only 'sigmoid' and 'softmax' are supported, "
                          f"got {fields['scoring_func']!r}")
    fields["rope_theta"], fields["rope_scaling"] = rope_from_hf(text, prefix, fields["max_position_embeddings"])
    if fields["rope_scaling"] is not None and fields["rope_scaling"].type != "yarn":
        where = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"
        raise ConfigError(f"{prefix}{where}.rope_type: DeepSeek's MLA supports 'default' and 'yarn', got "
                          f"{fields['rope_scaling'].type!r}")
    for name in ("routed_scaling_factor", "rms_norm_eps", "initializer_range"):
        fields[name] = float(fields[name])
    for name in ("norm_topk_prob", "rope_interleave", "tie_word_embeddings"):
        fields[name] = bool(fields[name])
    warn_unknown(text, prefix, set(_DIRECT_FIELDS) | _CHECKED)
    return build(fields, overrides)


def config_to_hf(cfg: ModelConfig, dtype: Any = None) -> dict[str, Any]:
    """A config.json dict of cfg.hf_model_type that transformers (DeepseekV3ForCausalLM / DeepseekV2ForCausalLM)
    and DeepSeek-format consumers read back to the same model."""
    v2 = cfg.hf_model_type == "deepseek_v2"
    if cfg.mlp_bias:
        raise ConfigError(f"{cfg.hf_model_type} has no MLP biases; this config has mlp_bias true (use llama)")
    saved = cfg.param_dtype if dtype is None else dtype_name(dtype)
    out = {
        "architectures": [ARCHITECTURES[cfg.hf_model_type]],
        "model_type": "deepseek_v2" if v2 else "deepseek_v3",
        **{name: getattr(cfg, name) for name in _DIRECT_FIELDS},
        "num_key_value_heads": cfg.num_attention_heads,
        "head_dim": cfg.qk_rope_head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "topk_method": cfg.topk_method,
        "moe_layer_freq": 1,
        **rope_to_hf(cfg),
        "dtype": saved,
        "torch_dtype": saved,
    }
    if v2:  # transformers' DeepseekV2 has neither MTP nor a configurable scoring function
        for name in ("num_nextn_predict_layers", "scoring_func"):
            out.pop(name)
    return out
