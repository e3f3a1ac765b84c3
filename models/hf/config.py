"""config.json <-> ModelConfig.

config.json fields are read with transformers' DeepseekV3Config defaults for absent keys. Values c2jax cannot
reproduce raise ConfigError naming the field (hidden_act != silu, attention_bias, dropout, moe_layer_freq != 1,
topk_method other than noaux_tc / group-free greedy, rope types other than default / yarn, quantization other
than fp8 e4m3 128x128). `num_key_value_heads` is ignored (MLA has none; transformers only uses it in its eager
GQA path). `scoring_func="softmax"` is honoured as DeepSeek's reference code does, although transformers'
DeepseekV3 always applies a sigmoid. A `topk_method="greedy"` checkpoint may omit `e_score_correction_bias`
(zeros are used).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from c2jax.models.config import ConfigError, ModelConfig, RopeScaling, dtype_name
from c2jax.models.hf.fp8 import FP8_BLOCK

# transformers' DeepseekV3Config defaults: the meaning of a field that a config.json leaves out.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "num_nextn_predict_layers": 1,
    "scoring_func": "sigmoid",
}

# HF field -> ModelConfig field, copied as is.
_DIRECT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "scoring_func",
    "first_k_dense_replace",
    "rope_interleave",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "initializer_range",
    "num_nextn_predict_layers",
)

# Fields read for validation only, or that carry no meaning for the forward pass.
_CHECKED_OR_IGNORED = {
    # validated below
    "hidden_act",
    "attention_bias",
    "attention_dropout",
    "moe_layer_freq",
    "topk_method",
    "quantization_config",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "num_mtp_layers",
    "model_type",
    "text_config",
    # derived by transformers from other fields (head_dim := qk_rope_head_dim, qk_head_dim := nope + rope)
    "head_dim",
    "qk_head_dim",
    # MLA has no separate KV heads; transformers only uses this in its eager GQA path
    "num_key_value_heads",
    # training-only or parallelism knobs of the reference implementations
    "aux_loss_alpha",
    "seq_aux",
    "ep_size",
    "pretraining_tp",
    "router_aux_loss_coef",
    "output_router_logits",
    # bookkeeping
    "architectures",
    "auto_map",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "_name_or_path",
    "name_or_path",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
    "_attn_implementation",
    "attn_implementation",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
}

_TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
_ROPE_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
    "partial_rotary_factor",
}


def text_config(hf: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The language-model config and the prefix naming its fields in error messages."""
    model_type = hf.get("model_type")
    if model_type == "kimi_k25":
        text = hf.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError("text_config: a kimi_k25 config needs a text_config mapping")
        return text, "text_config."
    if model_type is not None and model_type not in _TEXT_MODEL_TYPES:
        raise ConfigError(
            f"model_type: {model_type!r} is not supported (expected one of {_TEXT_MODEL_TYPES} or 'kimi_k25')"
        )
    return hf, ""


def _quantization(hf: Mapping[str, Any]) -> dict[str, Any] | None:
    """The validated quantization_config (top level or, for kimi_k25, text_config), or None."""
    text, prefix = text_config(hf)
    found = [
        (p, q)
        for p, q in (("", hf.get("quantization_config")), (prefix, text.get("quantization_config")))
        if q is not None
    ]
    if not found:
        return None
    where, q = found[-1]
    name = f"{where}quantization_config"
    if not isinstance(q, Mapping):
        raise ConfigError(f"{name}: expected a mapping, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(
            f"{name}.quant_method: only DeepSeek's 'fp8' (e4m3, 128x128 blocks) is supported, got {method!r}"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{name}.fmt: only 'e4m3' is supported, got {fmt!r}")
    block = q.get("weight_block_size")
    if block is None or list(block) != list(FP8_BLOCK):
        raise ConfigError(f"{name}.weight_block_size: only [128, 128] is supported, got {block!r}")
    return dict(q)


def _rope_from_hf(
    text: Mapping[str, Any], prefix: str, max_positions: int
) -> tuple[float, RopeScaling | None]:
    """(rope_theta, RopeScaling or None) with transformers 5.x semantics; accepts the v5 `rope_parameters`
    dict and the older `rope_scaling` + `rope_theta` pair (rope_scaling wins, as in transformers)."""
    if text.get("rope_scaling"):
        params, name = dict(text["rope_scaling"]), f"{prefix}rope_scaling"
    else:
        params, name = dict(text.get("rope_parameters") or {}), f"{prefix}rope_parameters"
    unknown = set(params) - _ROPE_KEYS
    if unknown:
        warnings.warn(f"{name}: ignoring unknown keys {sorted(unknown)}", stacklevel=3)
    theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"{name}.partial_rotary_factor: only 1.0 is supported, got {params['partial_rotary_factor']}"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ConfigError(f"{name}.rope_type: only 'default' and 'yarn' are supported, got {rope_type!r}")
    # transformers: a top-level original_max_position_embeddings wins; else the dict's; else max positions
    original = text.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    original = int(original if original is not None else max_positions)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    attention_factor = params.get("attention_factor")
    scaling = RopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),  # transformers: `get(...) or 32`
        beta_slow=float(params.get("beta_slow") or 1.0),
        # absent/None mscale means "not set" in transformers (attention factor = mscale(factor)); our rule
        # treats 0.0 the same way, so None maps to 0.0
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )
    return theta, scaling


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """`ModelConfig` from a `deepseek_v3`, `kimi_k2` or `kimi_k25` (wrapper) config.json dict.

    Values c2jax cannot reproduce raise `ConfigError` naming the field. `overrides` replace ModelConfig
    fields afterwards (execution settings such as dtype, moe_impl, scan_layers, or model fields).
    """
    text, prefix = text_config(hf)
    if prefix:
        inner_type = text.get("model_type")
        if inner_type is not None and inner_type not in _TEXT_MODEL_TYPES:
            raise ConfigError(f"text_config.model_type: {inner_type!r} is not supported")

    def get(name):  # an absent field means transformers' default; null stays null (q_lora_rank)
        return text[name] if name in text else _HF_DEFAULTS.get(name)

    if get("hidden_act") not in (None, "silu"):
        raise ConfigError(f"{prefix}hidden_act: only 'silu' is supported, got {text['hidden_act']!r}")
    if text.get("attention_bias"):
        raise ConfigError(f"{prefix}attention_bias: biased attention projections are not supported")
    if text.get("attention_dropout"):
        raise ConfigError(
            f"{prefix}attention_dropout: only 0.0 is supported, got {text['attention_dropout']}"
        )
    if text.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"{prefix}moe_layer_freq: only 1 is supported, got {text['moe_layer_freq']}")
    n_group = int(get("n_group") or 1)
    topk_group = int(get("topk_group") or 1)
    topk_method = text.get("topk_method") or "noaux_tc"
    if topk_method == "greedy":
        if topk_group != n_group:
            raise ConfigError(
                f"{prefix}topk_method: 'greedy' ignores groups, which c2jax reproduces only with "
                f"topk_group == n_group (got n_group={n_group}, topk_group={topk_group})"
            )
    elif topk_method != "noaux_tc":
        raise ConfigError(
            f"{prefix}topk_method: only 'noaux_tc' and 'greedy' are supported, got {topk_method!r}"
        )
    _quantization(hf)

    fields = {name: get(name) for name in _DIRECT_FIELDS}
    fields["n_group"], fields["topk_group"] = n_group, topk_group
    if text.get("num_nextn_predict_layers") is None and text.get("num_mtp_layers") is not None:
        fields["num_nextn_predict_layers"] = text["num_mtp_layers"]
    fields["num_nextn_predict_layers"] = int(fields["num_nextn_predict_layers"] or 0)
    if fields["scoring_func"] not in ("sigmoid", "softmax"):
        raise ConfigError(
            f"{prefix}scoring_func: only 'sigmoid' and 'softmax' are supported, "
            f"got {fields['scoring_func']!r}"
        )
    fields["rope_theta"], fields["rope_scaling"] = _rope_from_hf(
        text, prefix, fields["max_position_embeddings"]
    )
    for name in ("routed_scaling_factor", "rms_norm_eps", "initializer_range"):
        fields[name] = float(fields[name])
    for name in ("norm_topk_prob", "rope_interleave", "tie_word_embeddings"):
        fields[name] = bool(fields[name])

    unknown = set(text) - set(_DIRECT_FIELDS) - _CHECKED_OR_IGNORED
    if unknown:
        warnings.warn(
            f"config.json: ignoring unknown fields {sorted(prefix + k for k in unknown)}", stacklevel=2
        )

    known = {f.name for f in dataclasses.fields(ModelConfig)}
    bad = set(overrides) - known
    if bad:
        raise ConfigError(f"unknown ModelConfig override(s) {sorted(bad)}")
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(cfg: ModelConfig, dtype: Any = None) -> dict[str, Any]:
    """A `deepseek_v3` config.json dict that transformers (DeepseekV3ForCausalLM) and DeepSeek-format
    consumers read back to the same model. Execution-only fields (moe_impl, remat, ...) are not written."""
    rs = cfg.rope_scaling
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    rope_scaling = None
    if rs is not None:
        rope_scaling = {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast,
            "beta_slow": rs.beta_slow,
            "mscale": rs.mscale,
            "mscale_all_dim": rs.mscale_all_dim,
        }
        if not rs.truncate:
            rope_scaling["truncate"] = False
        if rs.attention_factor is not None:
            rope_scaling["attention_factor"] = rs.attention_factor
        rope_parameters = {k: v for k, v in rope_scaling.items() if k != "type"} | {
            "rope_theta": cfg.rope_theta
        }
    out = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **{name: getattr(cfg, name) for name in _DIRECT_FIELDS},
        "num_key_value_heads": cfg.num_attention_heads,
        "head_dim": cfg.qk_rope_head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "dtype": cfg.param_dtype if dtype is None else dtype_name(dtype),
        "torch_dtype": cfg.param_dtype if dtype is None else dtype_name(dtype),
    }
    return out
