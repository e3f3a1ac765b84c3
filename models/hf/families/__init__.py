"""Model families Hugging Face checkpoints come in, one module each: its config.json <-> ModelConfig mapping, its
transformers defaults and what it refuses. Weight names are models/hf/keys.py's (the families share them but for
the attention keys, which follow ModelConfig.attention_type, and the router bias, ModelConfig.has_router_bias).

  deepseek.py  deepseek_v3 (DeepSeek-V3, Moonlight-16B-A3B), kimi_k2, kimi_k25 (wrapper), deepseek_v2 (V2, V2-Lite)
  qwen3.py     qwen3_moe (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B), qwen3 (dense)
  llama.py     llama

To add a family: a module with MODEL_TYPES, ARCHITECTURES, config_from_hf(hf, **overrides) and
config_to_hf(cfg, dtype), listed in FAMILIES below and in ModelConfig's HF_MODEL_TYPES (docs/models.md).
"""

from __future__ import annotations

from types import ModuleType

from c2jax.models.config import ConfigError
from c2jax.models.hf.families import deepseek, llama, qwen3

FAMILIES: tuple[ModuleType, ...] = (deepseek, qwen3, llama)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES for t in f.MODEL_TYPES)


def family(model_type: str | None) -> ModuleType:
    """The module that maps config.json files of `model_type` (None: DeepSeek-V3, as before model_type existed);
    ConfigError listing the supported ones otherwise."""
    model_type = "deepseek_v3" if model_type is None else model_type
    for module in FAMILIES:
        if model_type in module.MODEL_TYPES:
            return module
    raise ConfigError(f"model_type: {model_type!r} is not supported; supported model_types: "
                      f"{', '.join(SUPPORTED_MODEL_TYPES)}")
