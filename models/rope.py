"""Rotary position embeddings: plain, YaRN-scaled and Llama-3-scaled, matching Hugging Face's numerics (DeepseekV3,
Llama, Qwen3)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from c2jax.models.config import ModelConfig, yarn_mscale


def _yarn_correction_range(cfg: ModelConfig, dim: int) -> tuple[float, float]:
    """Dimension range [low, high] between pure extrapolation and pure interpolation (YaRN eq. 17-18)."""
    rs = cfg.rope_scaling
    base = cfg.rope_theta

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rs.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def inverse_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Per-pair inverse frequencies (dim/2,) and the cos/sin scale ("attention_factor").

    Plain RoPE: inv_freq_i = theta^(-2i/d) (Su et al. 2021).
    YaRN (Peng et al. 2023): blend interpolated (inv_freq / factor) and extrapolated frequencies with a
    linear ramp over the correction range; attention_factor = mscale(f, mscale) / mscale(f, mscale_all_dim)
    when both are set, else mscale(f). Computed in float32 like HF so parity holds bit for bit in spirit.
    """
    dim = cfg.rope_dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(cfg.rope_theta) ** exponents
    inv_freq_extra = (1.0 / pos_freqs).astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq_extra, 1.0
    if rs.type == "llama3":
        return _llama3_inverse_frequencies(inv_freq_extra, rs), 1.0
    if rs.type == "linear":  # position interpolation: positions / factor, i.e. every frequency / factor
        return (inv_freq_extra / np.float32(rs.factor)).astype(np.float32), 1.0
    inv_freq_inter = (1.0 / (np.float32(rs.factor) * pos_freqs)).astype(np.float32)
    low, high = _yarn_correction_range(cfg, dim)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extra_weight = 1.0 - ramp
    inv_freq = inv_freq_inter * (1 - extra_weight) + inv_freq_extra * extra_weight
    if rs.attention_factor is not None:
        attention_factor = rs.attention_factor
    elif rs.mscale and rs.mscale_all_dim:
        attention_factor = yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(rs.factor)
    return inv_freq.astype(np.float32), float(attention_factor)


def _llama3_inverse_frequencies(inv_freq: np.ndarray, rs) -> np.ndarray:
    """Llama 3.1's frequency-dependent scaling: wavelengths longer than original / low_freq_factor are
    interpolated (inv_freq / factor), shorter than original / high_freq_factor kept, and the band between
    blended by smooth = (original / wavelength - low) / (high - low) (transformers' _compute_llama3_parameters)."""
    original, low, high = rs.original_max_position_embeddings, rs.low_freq_factor, rs.high_freq_factor
    wavelength = np.float32(2 * math.pi) / inv_freq
    low_freq_wavelength, high_freq_wavelength = original / low, original / high
    scaled = np.where(wavelength > low_freq_wavelength, inv_freq / np.float32(rs.factor), inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / np.float32(rs.factor) + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(cfg: ModelConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin of shape positions.shape + (rope_dim/2,), already scaled by the attention factor."""
    inv_freq, attention_factor = inverse_frequencies(cfg)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, interleave: bool) -> jnp.ndarray:
    """Rotate x[..., S, (H,) D] by position.

    interleave=True treats (x0, x1), (x2, x3), ... as pairs (DeepSeek's weight layout); the result is
    written de-interleaved ([rotated evens | rotated odds]) exactly as HF does. Since q and k get the same
    permutation, q.k is unchanged. interleave=False pairs x_i with x_{i+d/2} (rotate_half convention).
    cos/sin have shape [B, S, D/2] and broadcast over a head axis if x has one.
    """
    if x.ndim == cos.ndim + 1:
        cos, sin = cos[..., None, :], sin[..., None, :]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
