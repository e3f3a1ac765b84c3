"""Inference engine: latent-KV-cache MLA decoding, sampling, continuous batching, weight swap, server.

See docs/inference.md. The jitted math is in `forward`, `sampling` and `steps`; `engine` schedules it.
"""

from c2jax.models.inference.engine import (
    ContextWindowExceeded,
    EngineConfig,
    GenerationResult,
    InferenceEngine,
    Request,
)
from c2jax.models.inference.forward import LayerCache, cache_bytes_per_token, extend, init_cache
from c2jax.models.inference.sampling import Sample, SamplingParams, sample

__all__ = [
    "ContextWindowExceeded", "EngineConfig", "GenerationResult", "InferenceEngine", "LayerCache", "Request",
    "Sample", "SamplingParams", "cache_bytes_per_token", "extend", "init_cache", "sample",
]
