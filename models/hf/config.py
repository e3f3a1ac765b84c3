"""config.json <-> ModelConfig, by model family (models/hf/families/: one module per family)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from c2jax.models.config import ConfigError, ModelConfig
from c2jax.models.hf.families import SUPPORTED_MODEL_TYPES, family
from c2jax.models.hf.families.deepseek import text_config


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """`ModelConfig` from a config.json dict of any supported model_type (SUPPORTED_MODEL_TYPES).

    Values c2jax cannot reproduce raise `ConfigError` naming the field; an unsupported model_type is refused with
    the list of supported ones. `overrides` replace ModelConfig fields afterwards (execution settings such as
    dtype, moe_impl, scan_layers, or model fields)."""
    if not isinstance(hf, Mapping):
        raise ConfigError(f"config.json: expected an object, got {type(hf).__name__}")
    return family(hf.get("model_type")).config_from_hf(hf, **overrides)


def config_to_hf(cfg: ModelConfig, dtype: Any = None) -> dict[str, Any]:
    """The config.json dict of cfg.hf_model_type that transformers reads back to the same model. Execution-only
    fields (moe_impl, remat, ...) are not written."""
    return family(cfg.hf_model_type).config_to_hf(cfg, dtype)


__all__ = ["SUPPORTED_MODEL_TYPES", "config_from_hf", "config_to_hf", "text_config"]
