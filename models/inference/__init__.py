"""Inference engine: latent-KV-cache MLA decoding, sampling, continuous batching, weight swap, server.

See docs/inference.md. The jitted math is in `forward`, `sampling`, `steps` and `speculative` (MTP speculative
decoding); `engine` schedules it.
"""

from c2jax.models.inference.engine import (
    ContextWindowExceeded,
    EngineConfig,
    GenerationResult,
    InferenceEngine,
    Request,
)
from c2jax.models.inference.forward import (
    LayerCache,
    cache_bytes_per_token,
    extend,
    init_cache,
    init_mtp_cache,
)
from c2jax.models.inference.sampling import Sample, SamplingParams, sample
from c2jax.models.inference.speculative import speculative_accept

__all__ = [
    "ContextWindowExceeded", "EngineConfig", "GenerationResult", "InferenceEngine", "LayerCache", "Request",
    "Sample", "SamplingParams", "cache_bytes_per_token", "extend", "init_cache", "init_mtp_cache", "sample",
    "speculative_accept",
]
