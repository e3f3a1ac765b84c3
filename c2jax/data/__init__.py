"""Data for continued pretraining: sources, held-out split, tokenizers, token-weighted mixture, packing.

Entry points: `build_batches(DataConfig, split)` and `eval_sources(DataConfig)` (pipeline.py),
`load_tokenizer(spec)` (tokenizer.py); `c2jax tokenizer train` (tokenizer_cli.py). See docs/data.md.
Attributes load lazily: Grain imports JAX, which the tokenizer command does not need.
"""

import importlib

_EXPORTS = {
    "DataConfig": "c2jax.data.config", "SourceConfig": "c2jax.data.config", "demo_sources": "c2jax.data.config",
    "FEATURES": "c2jax.data.pipeline", "build_batches": "c2jax.data.pipeline", "eval_sources": "c2jax.data.pipeline",
    "Tokenizer": "c2jax.data.tokenizer", "load_tokenizer": "c2jax.data.tokenizer",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'c2jax.data' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
