"""kernels/: quantizers bitwise against an independent NumPy/ml_dtypes implementation, grouped GEMMs and
fused permute-quantize (Pallas in interpret mode) against references, the registry, the quantized
linear's custom VJP, per-tensor vs per-token NVFP4, the quantized MoE dispatch path, and MXFP8 vs BF16 training."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import yaml

from c2jax.kernels import dispatch, fp8_deepseek, mxfp8, nvfp4, qlinear
from c2jax.kernels.grouped_gemm import (
    MX_OP,
    grouped_matmul,
    grouped_matmul_mx,
    grouped_matmul_reference,
    grouped_matmul_xla,
)
from c2jax.kernels.pallas_grouped import grouped_matmul_mx_pallas, grouped_matmul_pallas
from c2jax.kernels.permute import permute_quantize_mx

requires_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="device-only kernel: needs a GPU")

NP_DTYPES = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 8), "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 15),
             "e2m1": (ml_dtypes.float4_e2m1fn, 6.0, 2)}


def bits(a):
    return np.asarray(a).view(np.uint8)


# Independent NumPy references: float64 log2 for the exponent, numpy float32 arithmetic, ml_dtypes casts.
def np_mx(x, fmt, rule, division, block=32):
    dtype, vmax, emax = NP_DTYPES[fmt]
    xb = np.asarray(x, np.float32).reshape(-1, block)
    with np.errstate(all="ignore"):
        amax = np.max(np.abs(xb), axis=1)
        if rule == "rceil":
            e = np.ceil(np.log2((amax / np.float32(vmax)).astype(np.float64)))
        else:
            e = np.floor(np.log2(amax.astype(np.float64))) - emax
        e = np.clip(np.nan_to_num(e, nan=0.0, neginf=-127.0), -127, 127)
        scale = np.where(np.isfinite(amax), 2.0 ** e, np.nan).astype(np.float32)  # NaN scale: NaN block
        scaled = xb / scale[:, None] if division == "ieee" else xb * (np.float32(1) / scale)[:, None]
        q = np.where(np.isnan(scaled), np.nan, np.clip(scaled, -vmax, vmax)).astype(dtype)  # keep NaN
    scale_bits = np.where(np.isfinite(amax), e + 127, 255).astype(np.uint8)
    return q.view(np.uint8).reshape(np.shape(x)), scale_bits.reshape(*np.shape(x)[:-1], -1)


def np_nvfp4(x, scaling, division, block=16):
    x = np.asarray(x, np.float32)
    xb = x.reshape(*x.shape[:-1], -1, block)
    amax_g = np.max(np.abs(x)) if scaling == "per_tensor" else np.max(np.abs(x), axis=-1)[..., None]
    with np.errstate(all="ignore"):
        s_enc = np.where(amax_g > 0, np.float32(2688.0) / amax_g, np.float32(1.0)).astype(np.float32)
        s_dec = (np.float32(1.0) / s_enc).astype(np.float32)
        d_b = np.clip(np.max(np.abs(xb), -1) / np.float32(6.0) * s_enc, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        eff = (d_b.astype(np.float32) * s_dec)[..., None]
        scaled = xb / eff if division == "ieee" else xb * (np.float32(1.0) / eff)
        scaled = np.where(eff > 0, scaled, np.float32(0))
    q = np.clip(scaled, -6, 6).astype(ml_dtypes.float4_e2m1fn).reshape(x.shape)
    return q.view(np.uint8), d_b.view(np.uint8), s_dec


def mx_test_data():
    rng = np.random.default_rng(0)
    gauss = rng.standard_normal((64, 64)) * np.exp(rng.uniform(-12, 12, (64, 1)))
    special = np.zeros((8, 64))
    special[1, :32] = np.inf  # block with inf
    special[1, 40] = -np.inf
    special[2, 5] = np.nan
    special[3, :4] = [448.0, 464.0, 465.0, -500.0]  # near and past the E4M3 max
    special[4, :4] = [449.0, 511.0, 1.0, -2.0 ** -12]  # FLOOR clips 511; tiny value becomes subnormal/zero
    special[5, :32] = 2.0 ** -np.arange(32)  # walks down through the element subnormals
    special[6] = rng.uniform(-1, 1, 64) * 2.0 ** -100  # small blocks, still normal FP32
    special[7, 32:] = [(i % 8) * 0.25 * 2 ** 4 for i in range(32)]  # exact ties
    return np.concatenate([gauss, special]).astype(np.float32)


@pytest.mark.xla_default_codegen
def test_marked_tests_run_with_xla_default_codegen():
    """The mark's contract (tests/conftest.py): XLA's default CPU codegen, whose f32 -> E2M1 cast rounds once
    (1.250486 is nearer 1.5 than 1.0; rounding through a 16-bit float first makes it the tie 1.25, then 1.0)."""
    import os

    assert "--xla_cpu_use_fusion_emitters=false" not in os.environ.get("XLA_FLAGS", "").split()
    x = np.array([1.250486, -0.74990135], np.float32)
    assert np.asarray(jnp.asarray(x).astype(jnp.float4_e2m1fn), np.float32).tolist() == [1.5, -0.5]


@pytest.mark.xla_default_codegen  # FP4 codes, bit for bit (tests/conftest.py)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("division", ["ieee", "approx"])
def test_mx_quantizer_bitwise_vs_numpy(fmt, rule, division):
    x = mx_test_data()
    if fmt == "e2m1":
        x = np.where(np.isfinite(x), x, 0.0)  # E2M1 has no NaN/inf
    q = mxfp8.quantize_mx(jnp.asarray(x), fmt=fmt, scale_rule=rule, division=division)
    ref_values, ref_scales = np_mx(x, fmt, rule, division)
    np.testing.assert_array_equal(bits(q.scales), ref_scales)
    np.testing.assert_array_equal(bits(q.values), ref_values)


def test_mx_special_cases():
    x = mx_test_data()
    q = mxfp8.quantize_mx(jnp.asarray(x))
    scale_bits = bits(q.scales)
    assert (scale_bits[64] == 0).all() and (bits(q.values)[64] == 0).all()  # zeros: 2^-127, zero codes
    assert scale_bits[65, 0] == 255 and scale_bits[65, 1] == 255 and scale_bits[66, 0] == 255  # inf / NaN
    assert np.isnan(np.asarray(q.values[65, :32], np.float32)).all()
    # RCEIL never clips: 465 and 500 get scale 2 and stay representable
    # (block max 500: scale 2^ceil(log2(500 / 448)) = 2, biased 128; -500 / 2 = -250 rounds to -256 in E4M3)
    assert scale_bits[67, 0] == 128 and float(q.values[67, 3]) == -256.0
    deq = np.asarray(mxfp8.dequantize_mx(q))
    assert np.abs(deq[67, 3] + 500) <= 16
    qf = mxfp8.quantize_mx(jnp.asarray(x), scale_rule="floor")
    assert float(np.asarray(mxfp8.dequantize_mx(qf))[68, 1]) == 448.0  # FLOOR saturates 511
    # the MX quantizers along another axis agree with quantizing the transpose
    qt = mxfp8.quantize_mx(jnp.asarray(x[:64].T), axis=0)
    np.testing.assert_array_equal(bits(qt.values), bits(q.values[:64]).T)


def test_mx_division_modes_agree():  # power-of-two scales: x / 2^e == x * 2^-e exactly
    x = jnp.asarray(mx_test_data())
    a, b = mxfp8.quantize_mx(x, division="ieee"), mxfp8.quantize_mx(x, division="approx")
    np.testing.assert_array_equal(bits(a.values), bits(b.values))


@pytest.mark.xla_default_codegen  # FP4 codes, bit for bit (tests/conftest.py)
@pytest.mark.parametrize("scaling", ["per_tensor", "per_token"])
@pytest.mark.parametrize("division", ["ieee", "approx"])
def test_nvfp4_bitwise_vs_numpy(scaling, division):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((48, 64)) * np.exp(rng.uniform(-4, 4, (48, 1)))).astype(np.float32)
    x[0] = 0.0
    x[1, :16] = [6.0 * 448, 7.0, -1e-30, 2.0 ** -20] + [0.0] * 12  # near the max, below E4M3's range
    x[2] = np.repeat([0.25, 0.75, 1.25, 2.5], 16) * 3.0  # ties
    q = nvfp4.quantize_nvfp4(jnp.asarray(x), scaling=scaling, division=division)
    values, d_b, s_dec = np_nvfp4(x, scaling, division)
    np.testing.assert_array_equal(bits(q.block_scales), d_b)
    np.testing.assert_array_equal(bits(q.values), values)
    np.testing.assert_array_equal(np.asarray(q.tensor_scale).reshape(np.shape(s_dec)), s_dec)
    deq = np.asarray(nvfp4.dequantize_nvfp4(q))
    rel = np.linalg.norm(deq[3:] - x[3:]) / np.linalg.norm(x[3:])
    assert rel < (0.2 if scaling == "per_tensor" else 0.12)


def test_nvfp4_approx_division_changes_ties():
    """Composer 2's ablation: approximate division moves values that sit on an E2M1 rounding boundary."""
    eff = np.float32(3.0) / np.float32(7.0)
    x = (np.float32(0.75) * eff * np.ones((1, 16), np.float32)).astype(np.float32)
    x[0, 0] = 6 * eff
    a = nvfp4.quantize_nvfp4(jnp.asarray(x), division="ieee")
    b = nvfp4.quantize_nvfp4(jnp.asarray(x), division="approx")
    for mode, q in (("ieee", a), ("approx", b)):
        np.testing.assert_array_equal(bits(q.values), np_nvfp4(x, "per_token", mode)[0])


def np_fp8_tiles(x, division):
    xb = np.asarray(x, np.float32).reshape(x.shape[0], -1, 128)
    amax = np.max(np.abs(xb), -1)
    scale = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    scaled = xb / scale[..., None] if division == "ieee" else xb * (np.float32(1) / scale)[..., None]
    return np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(x.shape), scale


@pytest.mark.parametrize("division", ["ieee", "approx"])
def test_fp8_deepseek_bitwise_vs_numpy(division):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((16, 256)) * np.exp(rng.uniform(-6, 6, (16, 1)))).astype(np.float32)
    x[0, :128] = 0.0
    q = fp8_deepseek.quantize_fp8_tiles(jnp.asarray(x), division=division)
    values, scale = np_fp8_tiles(x, division)
    np.testing.assert_array_equal(bits(q.values), values)
    np.testing.assert_array_equal(np.asarray(q.scales), scale)
    w = (rng.standard_normal((256, 384)) * np.exp(rng.uniform(-3, 3, (256, 1)))).astype(np.float32)
    qw = fp8_deepseek.quantize_fp8_blocks(jnp.asarray(w), division=division)
    assert qw.scales.shape == (2, 3)
    wb = w.reshape(2, 128, 3, 128)
    scale_w = (np.max(np.abs(wb), axis=(1, 3)) / np.float32(448)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(qw.scales), scale_w)
    scaled = wb / scale_w[:, None, :, None] if division == "ieee" else wb * (np.float32(1) / scale_w)[:, None, :, None]
    ref = np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn).reshape(256, 384)
    np.testing.assert_array_equal(bits(qw.values), ref.view(np.uint8))
    deq = np.asarray(fp8_deepseek.dequantize_fp8_blocks(qw))
    assert np.linalg.norm(deq - w) / np.linalg.norm(w) < 0.04


def test_quantizer_errors_name_the_problem():
    with pytest.raises(ValueError, match="scale_rule"):
        mxfp8.quantize_mx(jnp.ones((2, 32)), scale_rule="round")
    with pytest.raises(ValueError, match="division"):
        nvfp4.quantize_nvfp4(jnp.ones((2, 32)), division="fast")
    with pytest.raises(ValueError, match="element format"):
        mxfp8.quantize_mx(jnp.ones((2, 32)), fmt="e3m4x")
    with pytest.raises(ValueError, match="unknown quantization recipe"):
        qlinear.get_recipe("int8")


# grouped GEMM -------------------------------------------------------------------------------------
GROUP_SIZES = [0, 1, 31, 33, 0]


def grouped_operands(dtype=jnp.float32, k=40, n=72, extra_rows=3):
    rng = np.random.default_rng(3)
    m = sum(GROUP_SIZES) + extra_rows  # rows past the groups must come out zero
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(GROUP_SIZES), k, n)), dtype)
    return lhs, rhs, jnp.asarray(GROUP_SIZES, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_matmul_pallas_interpret_matches_reference(dtype):
    lhs, rhs, gs = grouped_operands(dtype)
    ref = grouped_matmul_reference(lhs, rhs, gs, preferred_element_type=jnp.float32)
    out = grouped_matmul_pallas(lhs, rhs, gs, block_m=16, block_n=32, block_k=16, interpret=True,
                                preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert not np.asarray(out[sum(GROUP_SIZES):]).any()
    via_registry = grouped_matmul(lhs, rhs, gs, impl="pallas_triton", preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(via_registry), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_grouped_matmul_mosaic_sm90_interpret_matches_reference():
    """JAX's Hopper kernel in the Mosaic GPU interpreter: fewer rows than one 128-row block (TMA reads past the
    end, zero-filled as on the GPU), empty groups, rows past the groups zero; bf16 output of fp32 sums."""
    lhs, rhs, gs = grouped_operands(jnp.bfloat16, k=128, n=128)
    ref = np.asarray(grouped_matmul_reference(lhs, rhs, gs, preferred_element_type=jnp.float32))
    out = np.asarray(grouped_matmul(lhs, rhs, gs, impl="mosaic_sm90"), np.float32)
    np.testing.assert_allclose(out, ref, rtol=8e-3, atol=1e-3 * np.abs(ref).max())  # bf16 eps 7.8e-3
    assert not out[sum(GROUP_SIZES):].any()


def test_grouped_matmul_xla_fallback_value_and_grad():
    lhs, rhs, gs = grouped_operands()
    np.testing.assert_allclose(np.asarray(grouped_matmul_xla(lhs, rhs, gs)),
                               np.asarray(grouped_matmul_reference(lhs, rhs, gs)), rtol=1e-5, atol=1e-5)
    skewed = jnp.asarray([0, 0, 65, 0, 0], jnp.int32)  # one group takes every row: the last bucket
    np.testing.assert_allclose(np.asarray(grouped_matmul_xla(lhs, rhs, skewed)),
                               np.asarray(grouped_matmul_reference(lhs, rhs, skewed)), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b, gs)))
    g_xla = jax.grad(loss(grouped_matmul_xla), (0, 1))(lhs, rhs)
    g_ref = jax.grad(loss(grouped_matmul_reference), (0, 1))(lhs, rhs)
    for a, b in zip(g_xla, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sizes", [[5, 0, 37, 22], [0, 0, 0, 0], [0, 64, 0, 0], [3, 1, 2, 1]],
                         ids=["mixed", "all empty", "one group", "tiny groups"])
@pytest.mark.parametrize("impl", ["xla", "pallas_triton", "ragged_dot"])
def test_grouped_wgrad_is_each_groups_rows_transposed_times_dout(impl, sizes):
    """out[g] = lhs[rows of g]^T dout[rows of g] against NumPy in float64, rows past sum(sizes) ignored (7 extra
    rows of noise), a tile that spans two groups masked, empty groups zero; pallas_triton in Pallas' interpreter."""
    from c2jax.kernels.grouped_wgrad import grouped_wgrad

    rng = np.random.default_rng(0)
    m, k, n = sum(sizes) + 7, 48, 80  # K, N not multiples of the kernel's 64-wide tiles
    lhs, dout = rng.standard_normal((m, k)), rng.standard_normal((m, n))
    starts = np.cumsum(sizes) - sizes
    want = np.stack([lhs[s:s + c].T @ dout[s:s + c] for s, c in zip(starts, sizes)])
    got = grouped_wgrad(jnp.asarray(lhs, jnp.float32), jnp.asarray(dout, jnp.float32), jnp.asarray(sizes, jnp.int32),
                        impl=impl)
    assert got.shape == (len(sizes), k, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 * max(np.abs(want).max(), 1.0))


def test_grouped_wgrad_pallas_refuses_mixed_dtypes_so_the_registry_falls_through():
    from c2jax.kernels.grouped_wgrad import OP, grouped_wgrad

    call = ((jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), jax.ShapeDtypeStruct((64, 16), jnp.float32),
             jax.ShapeDtypeStruct((4,), jnp.int32)), {})
    with pytest.raises(NotImplementedError, match="one dtype"):
        dispatch.choose(OP, call, impl="pallas_triton")
    assert dispatch.choose(OP, call) == "xla"
    out = grouped_wgrad(jnp.ones((8, 4), jnp.bfloat16), jnp.ones((8, 2)), jnp.asarray([3, 5]))
    assert out.shape == (2, 4, 2) and out[1, 0, 0] == 5


def test_grouped_path_weight_gradient_runs_the_registrys_wgrad_not_the_ragged_contraction():
    """drhs of the bf16 grouped path and wgrad of the quantized one go through kernels/grouped_wgrad (no
    ragged_dot_general, which XLA:CPU/GPU lower to a G x dense masked dot, is left in the backward's jaxpr)."""
    from c2jax.kernels import grouped_qlinear
    from c2jax.models.moe_dispatch import _registry_grouped_matmul

    lhs, rhs, gs = grouped_operands()
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda w: jnp.sum(_registry_grouped_matmul("xla", lhs, w, gs))))(rhs))
    assert "ragged_dot" not in jaxpr
    q = grouped_qlinear.GroupedQuant(qlinear.get_recipe("mxfp8"), gemm="xla")
    x, w = jnp.ones((40, 64)), jnp.ones((4, 64, 32))
    sizes = jnp.asarray([10, 0, 20, 10], jnp.int32)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda w: jnp.sum(grouped_qlinear.grouped_linear(q, x, w, sizes))))(w))
    assert "ragged_dot" not in jaxpr


def test_grouped_matmul_mx_pallas_matches_dequantized_reference():
    lhs, rhs, gs = grouped_operands(k=64, n=32)
    ql, qr = mxfp8.quantize_mx(lhs, axis=1), mxfp8.quantize_mx(rhs, axis=1)
    out = grouped_matmul_mx_pallas(ql.values, ql.scales, qr.values, qr.scales, gs, block_m=16, block_n=32,
                                   interpret=True, out_dtype=jnp.float32)
    ref = grouped_matmul_reference(mxfp8.dequantize_mx(ql, axis=1), mxfp8.dequantize_mx(qr, axis=1), gs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-4)


def mx_operands(k=64, n=32):
    lhs, rhs, gs = grouped_operands(k=k, n=n)
    return mxfp8.quantize_mx(lhs, axis=1), mxfp8.quantize_mx(rhs, axis=1), gs


def test_grouped_matmul_mx_registry_pallas_interpret_matches_xla_reference():
    """The registry's block-scaled grouped GEMM (op grouped_matmul_mx): the Pallas kernel interpreted against the
    XLA reference (dequantize, FP32 einsum). Products of E4M3 values are exact in FP32; the kernel sums per 32-block
    and scales, the reference sums over K: the same terms in another order, hence 1e-5, not 0."""
    ql, qr, gs = mx_operands()
    ref = np.asarray(grouped_matmul_mx(ql, qr, gs, impl="xla", out_dtype=jnp.float32))
    want = grouped_matmul_reference(mxfp8.dequantize_mx(ql, axis=1), mxfp8.dequantize_mx(qr, axis=1), gs)
    np.testing.assert_allclose(ref, np.asarray(want), rtol=1e-5, atol=1e-5)
    out = np.asarray(grouped_matmul_mx(ql, qr, gs, impl="pallas_triton", out_dtype=jnp.float32))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert not out[sum(GROUP_SIZES):].any() and not ref[sum(GROUP_SIZES):].any()
    assert dispatch.choose(MX_OP) == "xla"  # on CPU; the interpreter only when named
    names = [i.name for i, _ in dispatch.candidates(MX_OP, platform="gpu", device_kind="NVIDIA B200")]
    assert names == ["pallas_triton", "xla"]  # jax_triton only when named
    ql40, qr40, gs = mx_operands(k=40)  # K not whole 32-blocks: the kernel refuses, the registry falls through
    with pytest.raises(NotImplementedError, match="multiple of 32"):
        grouped_matmul_mx(ql40, qr40, gs, impl="pallas_triton")
    assert grouped_matmul_mx(ql40, qr40, gs).shape == (ql40.values.shape[0], 32)


def _capacity_reference(recipe, capacity):
    """The sorted path's form of grouped_qlinear.grouped_linear: rows in [G, C, K] capacity buffers through
    qlinear.quantized_bmm (fake quantization), gathered back to rows."""
    def linear(x, w, gs, src):
        starts = jnp.cumsum(gs) - gs
        c = jnp.arange(capacity)
        pos = jnp.where(c[None] < gs[:, None], starts[:, None] + c[None], src.shape[0])  # empty slot: a zero row
        rows = jnp.concatenate([x, jnp.zeros_like(x[:1])])[jnp.concatenate([src, jnp.full((1,), x.shape[0])])]
        out = qlinear.quantized_bmm(rows[pos], w, recipe)  # [G, C, N]
        group = jnp.searchsorted(jnp.cumsum(gs), jnp.arange(src.shape[0]), side="right")
        slot = jnp.where(group < gs.shape[0], group * capacity + jnp.arange(src.shape[0]) - starts[
            jnp.minimum(group, gs.shape[0] - 1)], gs.shape[0] * capacity)
        return jnp.concatenate([out.reshape(-1, out.shape[-1]), jnp.zeros_like(out[0, :1])])[slot]
    return linear


@pytest.mark.parametrize("kernels", ["xla", "pallas_triton"])
def test_grouped_qlinear_mxfp8_equals_the_sorted_paths_quantization(kernels):
    """c2jax.kernels.grouped_qlinear (fused permute + MXFP8 quantize, block-scaled grouped GEMM for fprop and dgrad,
    wgrad over group-aligned 32-row blocks) against qlinear on capacity buffers, the sorted path's recipe: the same
    codes and scales everywhere (the next test checks the wgrad's bit for bit), so only FP32 sums differ in order:
    XLA:CPU's dots of other shapes (measured: y and dx equal, dw 7.6e-6 of 137), the Pallas block-scaled kernel's
    per-32-block partial sums (interpreted). Tolerance 1e-5 of each quantity's scale for both.
    Groups of 0, 1, 31, 33 rows (blocks along M at each group's start), 3 rows past the groups (zeros)."""
    from c2jax.kernels.grouped_qlinear import GroupedQuant, grouped_linear

    rng = np.random.default_rng(11)
    t, k, n = 20, 64, 32
    x = jnp.asarray(rng.standard_normal((t, k)) * np.exp(rng.uniform(-3, 3, (t, 1))), jnp.float32)
    gs = jnp.asarray(GROUP_SIZES, jnp.int32)
    src = jnp.asarray(np.concatenate([rng.integers(0, t, sum(GROUP_SIZES)), [t, t, t]]), jnp.int32)
    w = jnp.asarray(rng.standard_normal((len(GROUP_SIZES), k, n)) / 8, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((src.shape[0], n)), jnp.float32)
    recipe = qlinear.get_recipe("mxfp8")
    q = GroupedQuant(recipe, gemm=kernels, permute=kernels)
    value_and_vjp = lambda fn: jax.jit(lambda x, w: (lambda y, vjp: (y, *vjp(dy)))(*jax.vjp(fn, x, w)))
    got = value_and_vjp(lambda x, w: grouped_linear(q, x, w, gs, src))(x, w)
    want = value_and_vjp(lambda x, w: _capacity_reference(recipe, 40)(x, w, gs, src))(x, w)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        a, b = np.asarray(a), np.asarray(b)
        diff = np.abs(a - b).max()
        print(f"[grouped_qlinear {kernels}] {name}: max |diff| {diff:.3g} of scale {np.abs(b).max():.3g}")
        assert diff <= 1e-5 * np.abs(b).max(), (name, diff)
    assert not np.asarray(got[0][sum(GROUP_SIZES):]).any()


def test_grouped_wgrad_quantizes_the_blocks_of_the_capacity_buffers_bit_for_bit():
    """The wgrad operands' quantization along M in group-aligned 32-row blocks is, row for row, the sorted path's
    quantization along the capacity axis of [G, C, .] buffers: the same codes and scales (bit for bit); only the
    wgrad's FP32 sum (ragged_dot_general vs a batched einsum) differs in order."""
    from c2jax.kernels.grouped_qlinear import group_aligned

    rng = np.random.default_rng(12)
    sizes = np.asarray(GROUP_SIZES)
    m, capacity = int(sizes.sum()), 40
    a = jnp.asarray(rng.standard_normal((m, 48)) * np.exp(rng.uniform(-6, 6, (m, 1))), jnp.float32)
    aligned, _ = group_aligned(a, jnp.asarray(sizes))
    deq, _ = mxfp8.fake_quantize_mx(aligned, 0)
    starts, pstarts = np.cumsum(sizes) - sizes, np.cumsum(-(-sizes // 32) * 32) - -(-sizes // 32) * 32
    buffers = np.zeros((len(sizes), capacity, 48), np.float32)
    for g, (s0, n) in enumerate(zip(starts, sizes)):
        buffers[g, :n] = np.asarray(a)[s0:s0 + n]
    buf_deq = np.asarray(mxfp8.fake_quantize_mx(jnp.asarray(buffers), 1)[0])
    for g, (p0, n) in enumerate(zip(pstarts, sizes)):
        np.testing.assert_array_equal(np.asarray(deq)[p0:p0 + n], buf_deq[g, :n])


def test_grouped_qlinear_refuses_recipes_that_need_masks():
    from c2jax.kernels.grouped_qlinear import GroupedQuant, group_aligned

    for recipe in ("mxfp8_floor", "nvfp4_per_tensor_fwd+mxfp8_bwd", "fp8_deepseek"):
        with pytest.raises(ValueError, match="RCEIL"):
            GroupedQuant(qlinear.get_recipe(recipe))
    GroupedQuant(qlinear.get_recipe("nvfp4_per_token_fwd+mxfp8_bwd"))  # Composer 2's: masks recomputed in the bwd
    a, sizes = group_aligned(jnp.arange(1.0, 6.0)[:, None], jnp.asarray([2, 0, 3]), block=4)
    assert a.shape == (4 * 4, 1) and sizes.tolist() == [4, 0, 4]  # 5 + 3 x 3 rows, rounded up to 4
    assert a[:, 0].tolist() == [1, 2, 0, 0, 3, 4, 5] + [0] * 9


def test_registry_selection_and_overrides(monkeypatch):
    names = [i.name for i, _ in dispatch.candidates("grouped_matmul", platform="gpu", device_kind="NVIDIA H200")]
    assert names == ["mosaic_sm90", "pallas_triton", "xla"]
    names = [i.name for i, _ in dispatch.candidates("grouped_matmul", platform="gpu", device_kind="NVIDIA B200")]
    assert names == ["pallas_triton", "xla"]
    assert dispatch.candidates("grouped_matmul", platform="cpu", device_kind="cpu")[0][0].name == "xla"
    impl, interpret = dispatch.candidates("grouped_matmul", impl="pallas_triton", platform="cpu", device_kind="cpu")[0]
    assert impl.name == "pallas_triton" and interpret
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "grouped_matmul=ragged_dot")
    assert dispatch.candidates("grouped_matmul", platform="cpu", device_kind="cpu")[0][0].name == "ragged_dot"
    with pytest.raises(ValueError, match="unknown implementation 'nope'"):
        dispatch.candidates("grouped_matmul", impl="nope")
    impl, interpret = dispatch.candidates("grouped_matmul", impl="mosaic_sm90", platform="cpu", device_kind="cpu")[0]
    assert impl.name == "mosaic_sm90" and interpret  # Pallas' Mosaic GPU interpreter
    with pytest.raises(ValueError, match="jax_triton"):
        dispatch.candidates("grouped_matmul", impl="jax_triton", platform="cpu", device_kind="cpu")


@pytest.mark.skipif(importlib.util.find_spec("jax_triton") is not None, reason="jax_triton is installed")
def test_jax_triton_module_imports_and_fails_clearly_without_it():
    from c2jax.kernels import jax_triton_grouped

    lhs, rhs, gs = grouped_operands()
    with pytest.raises(RuntimeError, match="jax-triton"):
        jax_triton_grouped.grouped_matmul_jax_triton(lhs, rhs, gs)


@requires_gpu
@pytest.mark.parametrize("impl", ["pallas_triton", "mosaic_sm90", "jax_triton"])
def test_grouped_matmul_on_gpu(impl):
    """Device-only: the compiled kernels (not the interpreter) against the oracle, on a lent GPU."""
    if impl == "jax_triton" and importlib.util.find_spec("jax_triton") is None:
        pytest.skip("jax_triton not installed")
    rng = np.random.default_rng(4)
    sizes = jnp.asarray([0, 1, 31, 33, 191, 0, 256, 0], jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((512, 256)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((8, 256, 256)), jnp.bfloat16)
    ref = grouped_matmul_reference(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    try:
        out = grouped_matmul(lhs, rhs, sizes, impl=impl)
    except ValueError as e:  # e.g. mosaic_sm90 on a non-Hopper GPU
        pytest.skip(str(e))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=2e-2, atol=0.5)


def test_permute_quantize_equals_quantize_then_permute():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((12, 96)) * np.exp(rng.uniform(-8, 8, (12, 1))), jnp.bfloat16)
    src = jnp.asarray([3, 12, 0, 11, 11, 12, 1, 7], jnp.int32)  # 12 = empty slot
    ref = mxfp8.quantize_mx(jnp.concatenate([x, jnp.zeros((1, 96), x.dtype)])[src])
    for impl in ("xla", "pallas_triton"):
        q = permute_quantize_mx(x, src, impl=impl)
        np.testing.assert_array_equal(bits(q.values), bits(ref.values))
        np.testing.assert_array_equal(bits(q.scales), bits(ref.scales))


# quantized linear ---------------------------------------------------------------------------------
def linear_operands(m=64, k=96, n=48, seed=6):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((m, k)), jnp.float32),
            jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32),
            jnp.asarray(rng.standard_normal((m, n)), jnp.float32))


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4_per_token_fwd+mxfp8_bwd", "fp8_deepseek", "mxfp8_floor"])
def test_quantized_linear_vjp_is_each_gemm_quantized_along_its_contraction(recipe):
    x, w, c = linear_operands()
    r = qlinear.get_recipe(recipe)

    @jax.jit
    def run(x, w, c):
        y, vjp = jax.vjp(lambda a, b: qlinear.quantized_linear(a, b, r), x, w)
        return (y, *vjp(c))

    y, dx, dw = run(x, w, c)
    fq = jax.jit(qlinear.fake_quantize, static_argnums=(1, 2, 3))
    xf, mx = fq(x, -1, r.forward)
    wf, mw = fq(w, -2, r.forward, weight_axes=(-2, -1))
    np.testing.assert_allclose(np.asarray(y), np.asarray(xf @ wf), rtol=1e-6, atol=1e-6)
    dx_ref = fq(c, -1, r.backward)[0] @ fq(w, -1, r.backward, weight_axes=(-2, -1))[0].T
    dw_ref = fq(x, 0, r.backward)[0].T @ fq(c, 0, r.backward)[0]
    dx_ref = dx_ref if mx is None else jnp.where(mx, dx_ref, 0)
    dw_ref = dw_ref if mw is None else jnp.where(mw, dw_ref, 0)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=1e-5, atol=1e-5)


def test_quantized_linear_forward_only_recipe_passes_high_precision_grads_through_ste():
    """With an unquantized backward, dx = m_x * (dy w^T) and dw = m_w * (x^T dy): the backward reads the
    high-precision residuals, and the STE masks of the forward quantizer gate the result."""
    x, w, c = linear_operands()
    # a block whose E4M3 scale lands in the subnormals and rounds down (amax_b / 6 * s_enc = 0.0029 -> 2^-9):
    # its largest elements scale to ~8.9 > 6 and saturate
    x = x.at[0, :16].set(jnp.linspace(-1, 1, 16) * jnp.max(jnp.abs(x)) * 6.5e-6)
    recipe = qlinear.Recipe("nvfp4_fwd_only", qlinear.QuantSpec("nvfp4", scaling="per_tensor"), qlinear.QuantSpec())
    grads = jax.jit(jax.grad(lambda a, b: jnp.sum(c * qlinear.quantized_linear(a, b, recipe)), (0, 1)))(x, w)
    mask_x = qlinear.fake_quantize(x, -1, recipe.forward)[1]
    mask_w = qlinear.fake_quantize(w, -2, recipe.forward, (-2, -1))[1]
    assert not bool(mask_x.all())
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(jnp.where(mask_x, c @ w.T, 0)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads[1]), np.asarray(jnp.where(mask_w, x.T @ c, 0)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_deepseek"])
def test_quantized_linear_grads_match_finite_differences(recipe):
    """The quantized backward approximates the true gradient (central differences of the FP32
    function) to within the formats' error (forward and backward quantization compound: ~5%)."""
    x, w, c = linear_operands(m=32, k=64, n=32)
    loss = lambda a, b, r: jnp.sum(c * jnp.tanh(qlinear.quantized_linear(a, b, r)))
    dx, dw = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)(x, w, recipe)
    rng = np.random.default_rng(7)
    for grad, arg in ((dx, 0), (dw, 1)):
        v = jnp.asarray(rng.standard_normal((x, w)[arg].shape), jnp.float32)
        eps = 1e-3
        shift = lambda s, v=v, arg=arg: loss(*[(x, w)[i] + (s * v if i == arg else 0) for i in range(2)], "bf16")
        fd = (shift(eps) - shift(-eps)) / (2 * eps)
        assert abs(float(jnp.sum(grad * v)) - float(fd)) < 0.1 * abs(float(fd)) + 1e-2


def test_ste_zeroes_gradient_where_floor_rule_clipped():
    x = jnp.ones((4, 32), jnp.float32).at[0, 0].set(511.0 / 256.0)  # FLOOR: 511/256 -> amax/X = 511 > 464
    w = jnp.ones((32, 8), jnp.float32)
    grad = lambda recipe: jax.jit(jax.grad(lambda a: jnp.sum(qlinear.quantized_linear(a, w, recipe))))(x)
    dx = grad("mxfp8_floor")
    assert float(dx[0, 0]) == 0.0 and bool(jnp.all(dx[1:] != 0)) and bool(jnp.all(dx[0, 1:] != 0))
    dx_rceil = grad("mxfp8")
    assert bool(jnp.all(dx_rceil != 0))


@pytest.mark.parametrize("scaling, leaks", [("per_tensor", True), ("per_token", False)])
def test_nvfp4_per_tensor_leaks_across_sequences_per_token_does_not(scaling, leaks):
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32)  # [batch, seq, d]
    w = jnp.asarray(rng.standard_normal((64, 32)) / 8, jnp.float32)
    x_other = x.at[1].multiply(1000.0)  # only the second sequence changes
    recipe = f"nvfp4_{scaling}_fwd+mxfp8_bwd"
    y, y_other = (qlinear.quantized_linear(v, w, recipe) for v in (x, x_other))
    changed = not np.array_equal(np.asarray(y[0]), np.asarray(y_other[0]))
    assert changed == leaks


# model integration --------------------------------------------------------------------------------
def test_moe_quant_config_validation():
    from c2jax.models.config import MOE_QUANT_RECIPES, ConfigError, ModelConfig

    assert set(MOE_QUANT_RECIPES) == set(qlinear.RECIPES)
    with pytest.raises(ConfigError, match="moe_quant"):
        ModelConfig(moe_quant="int4")
    with pytest.raises(ConfigError, match="moe_quant_division"):
        ModelConfig(moe_quant_division="fast")
    with pytest.raises(ConfigError, match="moe_impl"):
        ModelConfig(moe_quant="mxfp8", moe_impl="dense")


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4_per_token_fwd+mxfp8_bwd"])
def test_quantized_sorted_dispatch_matches_fake_quantized_reference(recipe):
    from c2jax.models import moe_dispatch
    from c2jax.models.config import ModelConfig
    from c2jax.models.moe_routing import Routing

    cfg = ModelConfig(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                      moe_quant=recipe)
    rng = np.random.default_rng(9)
    t, d, f, e, k = 24, 64, 32, 4, 2
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((e, d, 2 * f)) / 8, jnp.float32)
    down = jnp.asarray(rng.standard_normal((e, f, d)) / 6, jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.2, 1.0, (t, k)), jnp.float32)
    routing = Routing(ids, weights, None, None)
    r = qlinear.get_recipe(recipe)

    plan = moe_dispatch._plan(ids, e)
    buckets = moe_dispatch.capacity_buckets(cfg, t)
    capacity = buckets[int(moe_dispatch._bucket_index(buckets, plan.counts, e))]
    slot, src = moe_dispatch._slots(plan, capacity, e)

    def reference(x, weights, gate_up, down):
        h = moe_dispatch._pad_row(x)[src // k].reshape(e, capacity, d)
        gu = qlinear.quantized_bmm(h, gate_up, r)
        out = qlinear.quantized_bmm(jax.nn.silu(gu[..., :f]) * gu[..., f:], down, r)
        return jnp.einsum("tkd,tk->td", out.reshape(e * capacity, d)[slot].reshape(t, k, d), weights)

    def model(x, weights, gate_up, down):
        return moe_dispatch.dispatch_sorted(cfg, x, routing._replace(weights=weights), gate_up, down)

    dy = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    value_and_vjp = lambda fn: jax.jit(lambda *a: (lambda y, vjp: (y, vjp(dy)))(*jax.vjp(fn, *a)))
    y, grads = value_and_vjp(model)(x, weights, gate_up, down)
    y_ref, grads_ref = value_and_vjp(reference)(x, weights, gate_up, down)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=2e-4, atol=2e-4)
    # and the unquantized path is the plain model (jitted: one compile, not one per eager op)
    bf16 = jax.jit(lambda *a: moe_dispatch.dispatch_sorted(cfg.replace(moe_quant="bf16"), *a))
    y_bf16 = bf16(x, routing, gate_up, down)
    assert 0 < float(jnp.linalg.norm(y - y_bf16) / jnp.linalg.norm(y_bf16)) < 0.3


# training ------------------------------------------------------------------------------------------
def _ablation(name: str):
    path = Path(__file__).resolve().parent.parent / "experiments" / "ablations" / name / "run.py"
    spec = importlib.util.spec_from_file_location(f"ablation_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mxfp8_tiny_moe_training_ends_within_3x_bf16_seed_spread():
    """Issue 10, cheap version of experiments/ablations/09_mxfp8_vs_bf16 (600 steps, 4 seeds; this test:
    3 seeds, 60 steps, the same model and code).

    A tiny MoE (every routed-expert GEMM quantized, fprop + dgrad + wgrad) is pretrained on the
    deterministic Markov source with AdamW, once per seed under BF16 (no quantization) and once under
    MXFP8; for a seed both start from the same weights and read the same batches. Final loss = mean
    training loss of the last 10 steps. Criterion: for every seed, |final_MXFP8 - mean final_BF16| <=
    3 x max(std of the BF16 finals over seeds, 0.001 nats). The floor only matters when a 3-seed sample std
    happens to come out near zero: 0.001 nats is below every BF16 std we measured (0.0085 here, 0.0016 at
    600 steps x 4 seeds, 0.0014 at 200 steps x 2 seeds)."""
    run = _ablation("09_mxfp8_vs_bf16")
    raw = yaml.safe_load((run.HERE / "config.yaml").read_text())
    raw = raw | {"seeds": [0, 1, 2], "steps": 60, "final_window": 10}
    # LLVM -O1: a quarter less CPU than the default, same HLO and float semantics (see train_curves)
    curves = run.run_recipes(raw, ["bf16", "mxfp8"], compiler_options={"xla_backend_optimization_level": 1})
    summary = run.summarize(raw, curves)
    for recipe in ("bf16", "mxfp8"):
        loss = curves[recipe]["loss"]
        assert loss.shape == (3, 60) and np.isfinite(loss).all() and not curves[recipe]["skipped"].any()
        assert (loss[:, -10:].mean(1) < 0.5 * loss[:, 0]).all()  # both learned (from ~log 64 = 4.2 nats)
    assert not np.array_equal(curves["mxfp8"]["loss"], curves["bf16"]["loss"])  # MXFP8 did quantize
    verdict = summary["mxfp8"]["vs_bf16"]
    assert raw["tolerance_floor"] == 0.001 and raw["tolerance_sigmas"] == 3.0
    assert verdict["tolerance"] == 3 * max(verdict["reference_std"], 0.001)
    assert verdict["within"], verdict
