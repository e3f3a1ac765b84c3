"""Section `grouped_gemm`: every grouped GEMM implementation against the reference (bf16, and MXFP8 on
dequantized operands), their TFLOP/s at DeepSeek-V3 expert shapes in bf16 and FP8, and the MoE layer's
forward + backward as % of the bf16 peak."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from c2jax.kernels.grouped_gemm import grouped_matmul, grouped_matmul_reference
from c2jax.kernels.mxfp8 import dequantize_mx, quantize_mx
from c2jax.kernels.pallas_grouped import grouped_matmul_mx_pallas
from c2jax.models.config import ModelConfig
from c2jax.models.moe import MoE
from experiments.bench.gpu_check.sections.context import Context, Skip, peak_flops, rel_err, timed

IMPLS = ("xla", "pallas_triton", "mosaic_sm90", "jax_triton", "ragged_dot")
INTERPRETED = "interpret mode (CPU): exercises the call, not a speed"


@dataclass(frozen=True)
class Equality:
    """The equality problem: one empty group and rows past sum(group_sizes), which must come back zero."""

    lhs: jax.Array
    rhs: jax.Array
    sizes: jax.Array
    sizes_np: np.ndarray
    ref: np.ndarray


@dataclass(frozen=True)
class Operands:
    """The throughput problem: R routed rows of width d into G experts' d x f weights; `rate` reads a time."""

    a: jax.Array
    w: jax.Array
    group_sizes: jax.Array
    flops: float  # useful FLOPs of one grouped product
    peak: float
    repeats: int

    def rate(self, t: float) -> dict:
        tflops = self.flops / t / 1e12
        return {"ms": 1e3 * t, "tflops": tflops, "pct_peak_bf16": 100 * self.flops / t / self.peak}


def run(ctx: Context) -> None:
    peak, note = peak_flops(ctx)
    rng = np.random.default_rng(0)  # the equality problem's, then the throughput's group sizes
    eq = equality_problem(ctx, rng)
    for impl in IMPLS:
        ctx.sub(f"equality/bf16/{impl}", bf16_equality, ctx, eq, impl, need_s=ctx.size(5, 1))
    ql, qr = quantize_mx(eq.lhs, axis=1), quantize_mx(eq.rhs, axis=1)
    deq_l = dequantize_mx(ql, axis=1).astype(jnp.float32)
    deq_r = dequantize_mx(qr, axis=1).astype(jnp.float32)
    ref_q = np.asarray(grouped_matmul_reference(deq_l, deq_r, eq.sizes), np.float32)
    ctx.sub("equality/mxfp8/pallas_triton", mxfp8_pallas_equality, ctx, ql, qr, eq.sizes, ref_q,
            need_s=ctx.size(5, 1))
    ctx.sub("equality/mxfp8/jax_triton", mxfp8_jax_triton_equality, ctx, ql, qr, eq.sizes, ref_q,
            need_s=ctx.size(5, 1))

    ops = throughput_operands(ctx, rng, peak, note)
    bf16_rates, fp8_rates = {}, {}
    ctx.sub("throughput/bf16/dense_equal_flops",
            lambda: ops.rate(timed(jax.jit(lambda x, y: x @ y), ops.a, ops.w[0], repeats=ops.repeats)),
            need_s=ctx.size(5, 1))
    for impl in ("mosaic_sm90", "xla", "pallas_triton", "jax_triton"):
        ctx.sub(f"throughput/bf16/{impl}", bf16_throughput, ctx, ops, impl, bf16_rates, need_s=ctx.size(10, 1))

    moe = moe_layer(ctx, peak)

    # FP8: MXFP8 operands (E4M3, E8M0 scales per 32 along K)
    qa = jax.jit(lambda x: quantize_mx(x, axis=1))(ops.a)
    qw = jax.jit(lambda x: quantize_mx(x, axis=1))(ops.w)
    ctx.sub("throughput/fp8/mxfp8_pallas_triton", fp8_pallas, ctx, ops, qa, qw, fp8_rates, need_s=ctx.size(10, 1))
    ctx.sub("throughput/fp8/fp8_xla_batched_einsum", fp8_xla_batched, ops, fp8_rates, need_s=ctx.size(8, 1))
    ctx.sub("throughput/fp8/dense_equal_flops", fp8_dense, ops, need_s=ctx.size(5, 1))
    ctx.sub("throughput/fp8/mxfp8_jax_triton", fp8_jax_triton, ctx, ops, qa, qw, fp8_rates, need_s=ctx.size(10, 1))
    ctx.sub("throughput/bf16/ragged_dot_oracle",
            lambda: ops.rate(timed(jax.jit(lambda x, y, z: grouped_matmul(x, y, z, impl="ragged_dot")),
                                   ops.a, ops.w, ops.group_sizes, repeats=2)),
            need_s=ctx.size(10, 1))

    best_bf16 = max(bf16_rates.values(), default=None)
    best_fp8 = max(fp8_rates.values(), default=None)
    ctx.set("summary", {"best_bf16_grouped_tflops": best_bf16, "best_fp8_grouped_tflops": best_fp8,
                        "bf16_by_impl": bf16_rates, "fp8_by_impl": fp8_rates})
    if best_bf16:
        ctx.headline(f"best bf16 grouped {best_bf16:.3g} TFLOP/s ({100 * best_bf16 * 1e12 / peak:.0f}% peak)")
    ctx.target("MoE layer (fwd+bwd) % of bf16 peak", moe, 50.0, "%")
    ctx.target("FP8 grouped GEMM / bf16 grouped GEMM", best_fp8 / best_bf16 if best_fp8 and best_bf16 else None,
               1.5, "x")


def require(ctx: Context, impl: str) -> None:
    """Skip unless `impl` runs here: mosaic_sm90 needs a Hopper GPU (its interpreter is too slow for this section),
    jax_triton a GPU with jax-triton installed (no interpreter)."""
    if impl == "mosaic_sm90":
        ctx.needs_gpu("Mosaic GPU Hopper kernel; Pallas' Mosaic GPU interpreter runs it on the CPU, as "
                      "tests/test_grouped_path.py does, but at seconds a call it is too slow for these shapes")
        kind = jax.devices()[0].device_kind
        if not any(k in kind for k in ("H100", "H200", "H800", "H20")):
            raise Skip(f"needs a Hopper GPU, this is {kind!r}")
    if impl == "jax_triton":
        ctx.needs_gpu("raw Triton through jax-triton, no interpreter")
        try:
            import jax_triton  # noqa: F401
        except ImportError as e:
            raise Skip(f"jax-triton is not installed here ({e}); docs/gpu_check.md says how to carry it") from None


# ------------------------------------------------------------------------------------------------ equality


def equality_problem(ctx: Context, rng: np.random.Generator) -> Equality:
    m, k, n, groups = ctx.size((2048, 512, 1024, 8), (96, 64, 128, 4))
    sizes_np = rng.multinomial(m - 40, np.ones(groups) / groups)
    sizes_np[1] += sizes_np[2]
    sizes_np[2] = 0
    sizes = jnp.asarray(sizes_np, jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((groups, k, n)) / np.sqrt(k), jnp.bfloat16)
    ref = np.asarray(grouped_matmul_reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes), np.float32)
    ctx.set("equality/shape", {"M": m, "K": k, "N": n, "G": groups, "group_sizes": sizes_np.tolist()})
    return Equality(lhs, rhs, sizes, sizes_np, ref)


def bf16_equality(ctx: Context, eq: Equality, impl: str) -> dict:
    require(ctx, impl)
    out = np.asarray(jax.jit(lambda a, w, g: grouped_matmul(a, w, g, impl=impl))(eq.lhs, eq.rhs, eq.sizes),
                     np.float32)
    err = rel_err(out, eq.ref)
    tail_zero = bool((out[int(eq.sizes_np.sum()):] == 0).all())
    ctx.check(f"grouped GEMM {impl} bf16 == reference", err <= 1e-2 and tail_zero,
              f"rel L2 {err:.2e} (tol 1e-2), rows past the groups zero: {tail_zero}")
    return {"rel_err": err, "tail_rows_zero": tail_zero}


def mxfp8_pallas_equality(ctx: Context, ql, qr, sizes, ref_q) -> dict:
    interpret = not ctx.gpu
    bm = ctx.size(64, 32)
    out = jax.jit(lambda a, sa, b_, sb, g: grouped_matmul_mx_pallas(a, sa, b_, sb, g, block_m=bm, block_n=bm,
                                                                    interpret=interpret))(
        ql.values, ql.scales, qr.values, qr.scales, sizes)
    err = rel_err(np.asarray(out, np.float32), ref_q)
    ctx.check("grouped GEMM pallas_triton MXFP8 == reference on dequantized operands", err <= 1e-2,
              f"rel L2 {err:.2e} (tol 1e-2){' (interpret mode)' if interpret else ''}")
    return {"rel_err": err, "interpret": interpret}


def mxfp8_jax_triton_equality(ctx: Context, ql, qr, sizes, ref_q) -> dict:
    require(ctx, "jax_triton")
    from c2jax.kernels.jax_triton_grouped import grouped_matmul_mx_jax_triton

    out = jax.jit(grouped_matmul_mx_jax_triton)(ql.values, ql.scales, qr.values, qr.scales, sizes)
    err = rel_err(np.asarray(out, np.float32), ref_q)
    ctx.check("grouped GEMM jax_triton MXFP8 (tl.dot_scaled) == reference", err <= 1e-2, f"rel L2 {err:.2e}")
    return {"rel_err": err}


# ------------------------------------------------------------------------------------------------ throughput


def throughput_operands(ctx: Context, rng: np.random.Generator, peak: float, note: str) -> Operands:
    """At DeepSeek-V3 expert shapes: R routed rows, d = 7168, f = 2048, G local experts."""
    rows, d, f, g = ctx.size((65536, 7168, 2048, 8), (256, 128, 128, 4))
    ctx.set("throughput/shape", {"rows": rows, "d": d, "f": f, "experts": g, "peak": note})
    key = jax.random.key(1)
    a = jax.random.normal(key, (rows, d), jnp.bfloat16)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (g, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    gs = jnp.asarray(rng.multinomial(rows, np.ones(g) / g), jnp.int32)
    return Operands(a, w, gs, flops=2 * rows * d * f, peak=peak, repeats=ctx.size(5, 2))


def bf16_throughput(ctx: Context, ops: Operands, impl: str, rates: dict) -> dict:
    require(ctx, impl)
    r = ops.rate(timed(jax.jit(lambda x, y, z: grouped_matmul(x, y, z, impl=impl)), ops.a, ops.w, ops.group_sizes,
                       repeats=ops.repeats))
    rates[impl] = r["tflops"]
    if impl == "pallas_triton" and not ctx.gpu:
        r["note"] = INTERPRETED
    return r


def fp8_pallas(ctx: Context, ops: Operands, qa, qw, rates: dict) -> dict:
    interpret = not ctx.gpu
    fn = jax.jit(lambda v, s, v2, s2, z: grouped_matmul_mx_pallas(v, s, v2, s2, z, block_m=128, block_n=128,
                                                                  interpret=interpret))
    r = ops.rate(timed(fn, qa.values, qa.scales, qw.values, qw.scales, ops.group_sizes, repeats=ops.repeats))
    rates["mxfp8_pallas_triton"] = r["tflops"]
    if interpret:
        r["note"] = INTERPRETED
    return r


def fp8_jax_triton(ctx: Context, ops: Operands, qa, qw, rates: dict) -> dict:
    require(ctx, "jax_triton")
    from c2jax.kernels.jax_triton_grouped import grouped_matmul_mx_jax_triton

    r = ops.rate(timed(jax.jit(grouped_matmul_mx_jax_triton), qa.values, qa.scales, qw.values, qw.scales,
                       ops.group_sizes, repeats=ops.repeats))
    rates["mxfp8_jax_triton"] = r["tflops"]
    return r


def fp8_xla_batched(ops: Operands, rates: dict) -> dict:
    """The XLA fallback's capacity-padded batched einsum with E4M3 operands (per-tensor scaling: what XLA's
    FP8 GEMM offers without block scales): the hardware FP8 path through XLA, for comparison."""
    (rows, d), g = ops.a.shape, ops.w.shape[0]
    cap = int(1.25 * rows / g)
    x8 = jax.random.normal(jax.random.key(3), (g, cap, d), jnp.bfloat16).astype(jnp.float8_e4m3fn)
    w8 = ops.w.astype(jnp.float8_e4m3fn)
    fn = jax.jit(lambda x, y: jnp.einsum("gck,gkn->gcn", x, y, preferred_element_type=jnp.bfloat16))
    r = ops.rate(timed(fn, x8, w8, repeats=ops.repeats))
    r["note"] = "capacity 1.25x balanced: useful FLOPs = rows x d x f x 2"
    rates["fp8_xla_batched_einsum"] = r["tflops"]
    return r


def fp8_dense(ops: Operands) -> dict:
    x8, y8 = ops.a.astype(jnp.float8_e4m3fn), ops.w[0].astype(jnp.float8_e4m3fn)
    return ops.rate(timed(jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16)), x8, y8,
                          repeats=ops.repeats))


# ------------------------------------------------------------------------------------------------ MoE layer


def moe_layer(ctx: Context, peak: float) -> float | None:
    """The MoE layer (models/moe.py: router, dispatch, SwiGLU experts, shared expert), forward + backward in
    bf16 with fp32 master weights, at DeepSeek-V3 expert dims (d 7168, f 2048, top-8) with 32 local experts and
    8192 tokens: 65,536 routed rows. Returns the best % of peak (useful FLOPs: routed + shared + router)."""
    best = None
    for impl in ("sorted", "ragged"):
        r = ctx.sub(f"moe_layer/{impl}", moe_layer_rate, ctx, impl, peak, need_s=ctx.size(15, 1))
        if isinstance(r, dict):
            best = r["pct_peak_bf16"] if best is None else max(best, r["pct_peak_bf16"])
            ctx.headline(f"MoE layer {impl} {r['tflops']:.3g} TFLOP/s ({r['pct_peak_bf16']:.0f}% peak)")
    return best


def moe_layer_rate(ctx: Context, impl: str, peak: float) -> dict:
    if impl == "ragged" and ctx.dry_run:
        raise Skip("dry run: the `sorted` run's code with moe_impl='ragged' (lax.ragged_dot, a dense "
                   "masked matmul on the CPU), left out to keep the dry run short")
    d, f, e, k, tokens = ctx.size((7168, 2048, 32, 8, 8192), (64, 32, 8, 2, 64))
    cfg = ModelConfig(hidden_size=d, moe_intermediate_size=f, n_routed_experts=e, num_experts_per_tok=k,
                      n_shared_experts=1, n_group=1, topk_group=1, dtype="bfloat16", moe_impl=impl,
                      moe_capacity_factors=ctx.size(ModelConfig.moe_capacity_factors, (2.0,)))
    t = moe_fwd_bwd_seconds(cfg, tokens, repeats=ctx.size(5, 2))
    flops = moe_fwd_bwd_flops(cfg, tokens)
    return {"ms": 1e3 * t, "tflops": flops / t / 1e12, "pct_peak_bf16": 100 * flops / t / peak,
            "shape": {"tokens": tokens, "d": d, "f": f, "experts": e, "top_k": k, "routed_rows": tokens * k}}


def moe_fwd_bwd_seconds(cfg: ModelConfig, tokens: int, repeats: int) -> float:
    """Median seconds of one MoE layer's (models/moe.py) forward + backward under `cfg` (compiled and warmed first):
    gradients of a mean-square loss with respect to every parameter (fp32 master weights) and the bf16 input of
    `tokens` random tokens. Also the `moe_mxfp8` section's measurement."""
    graphdef, params, rest = nnx.split(MoE(cfg, nnx.Rngs(params=0)), nnx.Param, ...)
    x = jax.random.normal(jax.random.key(2), (1, tokens, cfg.hidden_size), jnp.bfloat16)

    def loss(params, x):
        y, _ = nnx.merge(graphdef, params, rest)(x)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    return timed(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x, repeats=repeats)


def moe_fwd_bwd_flops(cfg: ModelConfig, tokens: int) -> float:
    """Useful FLOPs of the layer's forward + backward (3x the forward): routed and shared experts' SwiGLU, router."""
    d, f, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    return 3 * 2 * tokens * (3 * d * f * (k + cfg.n_shared_experts) + d * e)
