"""Llama (`llama`: Llama 2 / 3 / 3.1 / 3.2 and the many models that reuse LlamaForCausalLM): dense GQA, rotate-half
RoPE with optional Llama-3 (or YaRN) frequency scaling, no q/k norms, SwiGLU MLP. Weight names: models/hf/keys.py's
GQA attention keys and the dense `mlp.{gate,up,down}_proj`. Biased projections: `attention_bias` (q/k/v/o_proj) and
`mlp_bias` (gate/up/down_proj), as transformers' LlamaAttention / LlamaMLP."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from c2jax.models.config import ConfigError, ModelConfig, dtype_name
from c2jax.models.hf.families.common import GQA_FIELDS, build, gqa_fields, gqa_to_hf, warn_unknown

MODEL_TYPES = ("llama",)
ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# transformers' LlamaConfig defaults
_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "initializer_range": 0.02}
_CHECKED = frozenset({"hidden_act", "attention_bias", "attention_dropout", "mlp_bias"})


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    fields = gqa_fields(hf, "", _DEFAULTS, biases=("attention_bias", "mlp_bias")) | {"qk_norm": False,
                                                                                   "hf_model_type": "llama"}
    warn_unknown(hf, "", set(GQA_FIELDS) | _CHECKED)
    return build(fields, overrides)


def config_to_hf(cfg: ModelConfig, dtype: Any = None) -> dict[str, Any]:
    if cfg.qk_norm:
        raise ConfigError("llama has no q/k norms; this config has qk_norm true (use qwen3)")
    if cfg.num_moe_layers:
        raise ConfigError(f"llama is dense; this config has {cfg.num_moe_layers} MoE layers")
    return gqa_to_hf(cfg, "llama", "LlamaForCausalLM", cfg.param_dtype if dtype is None else dtype_name(dtype)) \
        | {"mlp_bias": cfg.mlp_bias}
