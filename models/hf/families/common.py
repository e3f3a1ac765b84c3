"""What every family's config.json mapping shares: RoPE parameters (transformers 5.x semantics, both the v5
`rope_parameters` dict and the older `rope_scaling` + `rope_theta`), the bookkeeping fields nobody maps, the
checks of features c2jax does not implement, and turning the mapped fields into a ModelConfig."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from c2jax.models.config import ConfigError, ModelConfig, RopeScaling

# config.json fields with no meaning for the forward pass, in every family
BOOKKEEPING = frozenset({
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "_name_or_path", "name_or_path", "return_dict", "output_hidden_states",
    "output_attentions", "id2label", "label2id", "problem_type", "tokenizer_class", "_attn_implementation",
    "attn_implementation", "chunk_size_feed_forward", "is_encoder_decoder", "model_type",
    # training-only or parallelism knobs of the reference implementations
    "pretraining_tp", "router_aux_loss_coef", "output_router_logits", "aux_loss_alpha", "seq_aux", "ep_size",
    "initializer_range",
})

ROPE_KEYS = frozenset({
    "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
    "mscale", "mscale_all_dim", "attention_factor", "truncate", "partial_rotary_factor", "low_freq_factor",
    "high_freq_factor",
})
ROPE_FIELDS = frozenset({"rope_theta", "rope_scaling", "rope_parameters", "original_max_position_embeddings"})


def refuse_unsupported(text: Mapping[str, Any], prefix: str, biases: Iterable[str] = ()) -> None:
    """ConfigError for what no c2jax family implements: activations other than SiLU, biased projections
    (`attention_bias`, `mlp_bias`) other than the family's `biases`, dropout."""
    if text.get("hidden_act", "silu") not in (None, "silu"):
        raise ConfigError(f"{prefix}hidden_act: only 'silu' is supported, got {text['hidden_act']!r}")
    for name in ("attention_bias", "mlp_bias"):
        if text.get(name) and name not in biases:
            raise ConfigError(f"{prefix}{name}: biased projections are not supported for this family")
    if text.get("attention_dropout"):
        raise ConfigError(f"{prefix}attention_dropout: only 0.0 is supported, got {text['attention_dropout']}")


def rope_from_hf(text: Mapping[str, Any], prefix: str, max_positions: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, RopeScaling or None): default, linear, yarn and llama3 rope types; rope_scaling wins over
    rope_parameters, as in transformers."""
    if text.get("rope_scaling"):
        params, name = dict(text["rope_scaling"]), f"{prefix}rope_scaling"
    else:
        params, name = dict(text.get("rope_parameters") or {}), f"{prefix}rope_parameters"
    unknown = set(params) - ROPE_KEYS
    if unknown:
        warnings.warn(f"{name}: ignoring unknown keys {sorted(unknown)}", stacklevel=3)
    theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{name}.partial_rotary_factor: only 1.0 is supported, got {params['partial_rotary_factor']}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    # transformers: a top-level original_max_position_embeddings wins; else the dict's; else max positions
    original = text.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    original = int(original if original is not None else max_positions)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if params.get(key) is None:
                raise ConfigError(f"{name}.{key}: llama3 RoPE scaling needs it")
        return theta, RopeScaling(type="llama3", factor=factor, original_max_position_embeddings=original,
                                  low_freq_factor=float(params["low_freq_factor"]),
                                  high_freq_factor=float(params["high_freq_factor"]))
    if rope_type == "linear":
        if params.get("factor") is None:
            raise ConfigError(f"{name}.factor: linear RoPE scaling needs it")
        return theta, RopeScaling(type="linear", factor=factor, original_max_position_embeddings=original)
    if rope_type != "yarn":
        raise ConfigError(f"{name}.rope_type: only 'default', 'linear', 'yarn' and 'llama3' are supported, got "
                          f"{rope_type!r}")
    attention_factor = params.get("attention_factor")
    return theta, RopeScaling(
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


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """rope_theta, rope_scaling and rope_parameters of a config.json, read back to the same RoPE by
    transformers 5.x and by older readers of rope_scaling."""
    rs = cfg.rope_scaling
    if rs is None:
        return {"rope_theta": cfg.rope_theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    if rs.type == "linear":
        scaling = {"type": "linear", "rope_type": "linear", "factor": rs.factor}
    elif rs.type == "llama3":
        scaling = {"rope_type": "llama3", "factor": rs.factor,
                   "original_max_position_embeddings": rs.original_max_position_embeddings,
                   "low_freq_factor": rs.low_freq_factor, "high_freq_factor": rs.high_freq_factor}
    else:
        scaling = {"type": "yarn", "rope_type": "yarn", "factor": rs.factor,
                   "original_max_position_embeddings": rs.original_max_position_embeddings,
                   "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow}
        if cfg.attention_type == "mla" or rs.mscale or rs.mscale_all_dim:
            scaling |= {"mscale": rs.mscale, "mscale_all_dim": rs.mscale_all_dim}
        if not rs.truncate:
            scaling["truncate"] = False
        if rs.attention_factor is not None:
            scaling["attention_factor"] = rs.attention_factor
    parameters = {k: v for k, v in scaling.items() if k != "type"} | {"rope_theta": cfg.rope_theta}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters}


def warn_unknown(text: Mapping[str, Any], prefix: str, known: Iterable[str]) -> None:
    unknown = set(text) - set(known) - BOOKKEEPING - ROPE_FIELDS
    if unknown:
        warnings.warn(f"config.json: ignoring unknown fields {sorted(prefix + k for k in unknown)}", stacklevel=3)


def build(fields: dict[str, Any], overrides: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig(**fields) with `overrides` (ModelConfig fields) applied on top; an unknown override is a
    ConfigError."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    bad = set(overrides) - known
    if bad:
        raise ConfigError(f"unknown ModelConfig override(s) {sorted(bad)}")
    return ModelConfig(**(fields | dict(overrides)))


def dense_prefix(num_layers: int, dense: Iterable[int], prefix: str, how: str) -> int:
    """first_k_dense_replace for the set of dense layers `dense`: c2jax stacks the dense layers before the MoE
    layers, so the set must be 0..k-1 (ConfigError naming the layout otherwise)."""
    dense = sorted(set(dense))
    if dense != list(range(len(dense))):
        moe = [i for i in range(num_layers) if i not in dense]
        raise ConfigError(f"{prefix}{how}: dense layers {dense} interleave with MoE layers {moe}; c2jax runs the "
                          "dense layers as one stack before the MoE layers (first_k_dense_replace), so only a "
                          "dense prefix is supported")
    return len(dense)


# the config.json fields of a GQA family that map one to one (HF name -> ModelConfig name)
GQA_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads", "head_dim": "head_dim",
    "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings", "initializer_range": "initializer_range",
}


def gqa_fields(text: Mapping[str, Any], prefix: str, defaults: Mapping[str, Any],
               biases: Iterable[str] = ("attention_bias",)) -> dict[str, Any]:
    """ModelConfig fields of a GQA decoder (Llama, Qwen3, Qwen3-MoE) from its config.json, absent keys meaning
    transformers' `defaults`; every layer dense until the caller says otherwise. `biases`: the bias flags the
    family's transformers class reads (all GQA families: attention_bias on q/k/v/o_proj; Llama also mlp_bias),
    mapped to the ModelConfig fields of the same names."""
    refuse_unsupported(text, prefix, biases)
    if text.get("use_sliding_window"):
        raise ConfigError(f"{prefix}use_sliding_window: sliding-window attention is not supported")
    layer_types = text.get("layer_types")
    if layer_types and set(layer_types) != {"full_attention"}:
        raise ConfigError(f"{prefix}layer_types: only 'full_attention' layers are supported, got "
                          f"{sorted(set(layer_types))}")

    def get(name):
        value = text.get(name)
        return defaults.get(name) if value is None else value

    fields = {ours: get(theirs) for theirs, ours in GQA_FIELDS.items()}
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    for name in ("rms_norm_eps", "initializer_range"):
        fields[name] = float(fields[name])
    fields["tie_word_embeddings"] = bool(fields["tie_word_embeddings"])
    for name in biases:
        fields[name] = bool(text.get(name) or False)
    fields["rope_theta"], fields["rope_scaling"] = rope_from_hf(text, prefix, fields["max_position_embeddings"])
    return fields | {"attention_type": "gqa", "rope_interleave": False, "num_nextn_predict_layers": 0,
                     "first_k_dense_replace": fields["num_hidden_layers"], "n_shared_experts": 0}


def gqa_to_hf(cfg: ModelConfig, model_type: str, architecture: str, saved_dtype: str) -> dict[str, Any]:
    """The config.json fields a GQA family shares; ConfigError for what its model_type cannot express."""
    if cfg.attention_type != "gqa":
        raise ConfigError(f"hf_model_type {model_type!r} is a GQA family; this config has attention_type "
                          f"{cfg.attention_type!r}")
    if cfg.num_nextn_predict_layers:
        raise ConfigError(f"{model_type} has no multi-token-prediction modules (num_nextn_predict_layers = "
                          f"{cfg.num_nextn_predict_layers})")
    if cfg.rope_interleave:
        raise ConfigError(f"{model_type} rotates halves (rope_interleave false), this config interleaves")
    out = {"architectures": [architecture], "model_type": model_type,
           **{theirs: getattr(cfg, ours) for theirs, ours in GQA_FIELDS.items()},
           "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.gqa_head_dim,
           "hidden_act": "silu", "attention_bias": cfg.attention_bias, "attention_dropout": 0.0, **rope_to_hf(cfg),
           "dtype": saved_dtype, "torch_dtype": saved_dtype}
    return out
