"""Composer 2's concave length penalty (report sec. 4.2, Fig. 6)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from c2jax.rl.config import LengthPenaltyConfig

# summary-dict key -> LengthPenaltyConfig weight field
EFFORT_FIELDS = ("thinking_tokens", "tool_call_tokens", "tool_output_tokens", "final_message_tokens",
                 "tool_calls", "turns")


def concave_length_cost(x, k: float, q: float):
    """C_{k,q}(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q))  (Composer 2 sec. 4.2), with the q -> 1 limit
    log(1 + k x) / k. C(0) = 0, C'(x) = (1 + k x)^(-q) > 0 and C''(x) = -q k (1 + k x)^(-q-1) < 0 for
    k, q > 0: each extra unit of effort costs less the more effort is already spent. q = 0 is linear (x);
    q > 1 saturates at 1 / (k (q - 1)). Works on floats and NumPy / JAX arrays (x >= 0)."""
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    lib = np if isinstance(x, (int, float, np.ndarray, np.generic)) else _jnp()
    if abs(1.0 - q) < 1e-6:
        return lib.log1p(k * x) / k
    return lib.expm1((1.0 - q) * lib.log1p(k * x)) / (k * (1.0 - q))


def _jnp():
    import jax.numpy as jnp
    return jnp


def effort(summary: Mapping[str, float], cfg: LengthPenaltyConfig) -> float:
    """x = sum_c w_c * count_c over thinking / tool-call / tool-output / final-message tokens, tool calls
    and turns (Composer 2 sec. 4.2: "a weighted combination"; the weights are unpublished, ours are config).
    Missing keys count 0; negative counts are an error."""
    total = 0.0
    for name in EFFORT_FIELDS:
        count = float(summary.get(name, 0))
        if count < 0 or math.isnan(count):
            raise ValueError(f"trajectory summary field {name!r} must be a count >= 0, got {count}")
        total += getattr(cfg, name) * count
    return total


def length_penalty(summary: Mapping[str, float], cfg: LengthPenaltyConfig) -> float:
    """scale * C_{k,q}(x(summary)) >= 0; subtracted from the reward."""
    if cfg.scale == 0:
        return 0.0
    return float(cfg.scale * concave_length_cost(effort(summary, cfg), cfg.k, cfg.q))
