"""Element and scale formats of the low-precision MoE recipes, and the two primitive steps every
quantizer shares: divide by a scale (IEEE or approximate reciprocal) and clip-then-cast.

Element formats (jnp / ml_dtypes dtypes, OCP FP8 and OCP MX v1.0 names):

    name   dtype             max     emax  note
    e4m3   float8_e4m3fn     448     8     no inf; casting |x| > 464 gives NaN, so we clip first
    e5m2   float8_e5m2       57344   15    IEEE inf/NaN; casting past max gives inf, so we clip first
    e2m1   float4_e2m1fn     6       2     grid {0, .5, 1, 1.5, 2, 3, 4, 6}; one value per element in JAX

`emax` is the exponent of the format's largest power of two (448 = 1.75 * 2^8). Scales are E8M0
(`float8_e8m0fnu`, a bare power of two 2^(bits - 127), bits 0xFF = NaN, no zero) for MX, E4M3 for
NVFP4 block scales, FP32 for NVFP4 tensor/token scales and DeepSeek FP8.

Why clip before every cast: a GPU converts with `.satfinite`, while XLA and ml_dtypes turn an
out-of-range E4M3 value into NaN. A reference that does not clip would disagree with the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ElementFormat:
    name: str
    dtype: jnp.dtype
    max_value: float  # largest finite value
    emax: int  # exponent of the largest power of two below max_value
    overflow: float  # midpoint between max_value and the next value the format would have: unclipped
    # RNE would round |v| >= overflow past max_value, so only there did saturation change the code


E4M3 = ElementFormat("e4m3", jnp.dtype(jnp.float8_e4m3fn), 448.0, 8, 464.0)
E5M2 = ElementFormat("e5m2", jnp.dtype(jnp.float8_e5m2), 57344.0, 15, 59392.0)
E2M1 = ElementFormat("e2m1", jnp.dtype(jnp.float4_e2m1fn), 6.0, 2, 7.0)
ELEMENT_FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1)}

# "ieee": x / s, correctly rounded. "approx": x * fl(1/s), the reciprocal-then-multiply that fast GPU
# division (rcp.approx + mul, __fdividef) performs; it can differ from x / s in the last bit, which
# moves values that sit on an E2M1 rounding boundary (Composer 2 sec. 6: an approximate division in the
# NVFP4 quantizer diverged RL after ~100 steps). For power-of-two scales (MX, E8M0) 1/s is exact and
# both modes give identical bits.
DIVISIONS = ("ieee", "approx")


def element_format(name: str | ElementFormat) -> ElementFormat:
    if isinstance(name, ElementFormat):
        return name
    try:
        return ELEMENT_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown element format {name!r}; known: {sorted(ELEMENT_FORMATS)}") from None


def check_division(division: str) -> str:
    if division not in DIVISIONS:
        raise ValueError(f"division must be one of {DIVISIONS}, got {division!r}")
    return division


def divide(x: jnp.ndarray, scale: jnp.ndarray, division: str, *, barrier: bool = True) -> jnp.ndarray:
    """x / scale in float32, rounded as `division` says (see DIVISIONS). `barrier=False` inside Pallas kernels:
    Triton has no optimization_barrier, and XLA's simplifier, which the barrier guards against, does not
    rewrite a kernel's body (gpu_check's quantizer section compares the kernel with the XLA path on a device)."""
    check_division(division)
    x, scale = jnp.asarray(x, jnp.float32), jnp.asarray(scale, jnp.float32)
    if division == "ieee" and not barrier:
        return x / scale
    if division == "ieee":
        # XLA's algebraic simplifier rewrites x / broadcast(s) as x * broadcast(1 / s), even for a run-time
        # s (measured on XLA:CPU, jax 0.10.2: 54% of x / 448 off by one ulp), which is the "approx" mode.
        # A full-shape divisor behind an optimization barrier keeps the division correctly rounded.
        shape = jnp.broadcast_shapes(x.shape, scale.shape)
        divisor = jax.lax.optimization_barrier(jnp.broadcast_to(scale, shape))
        return jnp.broadcast_to(x, shape) / divisor
    return x * (jnp.float32(1.0) / scale)


def clip_cast(scaled: jnp.ndarray, fmt: ElementFormat) -> jnp.ndarray:
    """Round to nearest even into `fmt` after saturating to +-max (what `cvt.rn.satfinite` does).
    NaN stays NaN for E4M3/E5M2; E2M1 has no NaN and the cast maps it to -0 (ml_dtypes and XLA agree)."""
    return jnp.clip(scaled, -fmt.max_value, fmt.max_value).astype(fmt.dtype)


def not_clipped(scaled: jnp.ndarray, fmt: ElementFormat) -> jnp.ndarray:
    """Straight-through-estimator mask: True where |scaled| < fmt.overflow, i.e. where rounding alone
    (no saturation) gives a code within the format. Values in (max, overflow) round to +-max anyway and
    keep their gradient; at or past `overflow` the clip changed the code and the gradient is zeroed.
    NaN gives False."""
    return jnp.abs(scaled) < fmt.overflow


def block_amax(xb: jnp.ndarray, axis=-1) -> jnp.ndarray:
    """max |x| over `axis`, NaN if any element is NaN (XLA:CPU's reduce-max does not propagate NaN). The NaNs are
    counted with a float sum, not `any`: Pallas' Triton lowering has no boolean reduce_or (found by lowering the
    fused permute + quantize kernel for CUDA, experiments/bench/gpu_check --lower-only)."""
    nans = jnp.sum(jnp.isnan(xb).astype(jnp.float32), axis=axis)
    return jnp.where(nans > 0, jnp.float32(jnp.nan), jnp.max(jnp.abs(xb), axis=axis))


# E8M0 ---------------------------------------------------------------------------------------------
E8M0_NAN = 255
_F32_MANTISSA_BITS = 23


def f32_exponent_fields(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(biased exponent, mantissa) bit fields of float32 values, as int32."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    exponent = ((bits >> _F32_MANTISSA_BITS) & 0xFF).astype(jnp.int32)
    mantissa = (bits & 0x7FFFFF).astype(jnp.int32)
    return exponent, mantissa


def e8m0_from_bits(biased: jnp.ndarray) -> jnp.ndarray:
    return jax.lax.bitcast_convert_type(biased.astype(jnp.uint8), jnp.float8_e8m0fnu)


def e8m0_bits(scale: jnp.ndarray) -> jnp.ndarray:
    return jax.lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32)


def pow2_from_biased(biased: jnp.ndarray) -> jnp.ndarray:
    """2^(biased - 127) as float32, built from bits (exact, 2^-127 included as an FP32 subnormal);
    NaN for biased == 255. Never `astype(float8_e8m0fnu)`: that cast rounds to the nearest power of
    two and maps 0 to NaN."""
    biased = biased.astype(jnp.uint32)
    normal = jax.lax.bitcast_convert_type(biased << _F32_MANTISSA_BITS, jnp.float32)
    value = jnp.where(biased == 0, jnp.float32(2.0**-127), normal)
    return jnp.where(biased == E8M0_NAN, jnp.float32(jnp.nan), value)


def divide_pow2(x: jnp.ndarray, biased: jnp.ndarray, division: str, *, barrier: bool = True) -> jnp.ndarray:
    """x / 2^(biased - 127). The 2^-127 scale is an FP32 subnormal that XLA:CPU flushes to zero in a
    division, so that one case multiplies by the exact 2^127 instead (same bits as IEEE division).
    `barrier`: as for `divide` (False inside Pallas kernels)."""
    scaled = divide(x, pow2_from_biased(biased), division, barrier=barrier)
    return jnp.where(biased == 0, x.astype(jnp.float32) * jnp.float32(2.0**127), scaled)
