"""MoE kernel benchmark: grouped GEMM implementations and quantizer throughput. Prints a table and
writes JSON under runs/bench/.

CPU section (always): the XLA fallback grouped GEMM (capacity-padded batched einsum) against one dense
matmul with the same useful FLOPs (target: within 1.5x), lax.ragged_dot for contrast, and quantizer
throughput (MXFP8, NVFP4 per-token, DeepSeek FP8 tiles, fused permute+quantize) in GB/s of input read.
GPU section (only when jax.default_backend() == "gpu"): TFLOP/s and % of peak of bf16 vs FP8 grouped GEMM
at DeepSeek-V3 expert shapes (R = 65536 routed rows, d = 7168, f = 2048, 8 local experts) for each
registered implementation, and quantizer TB/s.

    python -m experiments.bench.moe_kernels [--rows 4096 --d 512 --f 1024 --experts 8 --out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from c2jax.bench_report import print_table, write_results
from c2jax.kernels import dispatch
from c2jax.kernels.fp8_deepseek import quantize_fp8_tiles
from c2jax.kernels.grouped_gemm import grouped_matmul
from c2jax.kernels.mxfp8 import quantize_mx
from c2jax.kernels.nvfp4 import quantize_nvfp4
from c2jax.kernels.permute import permute_quantize_mx
from c2jax.machine import describe

PEAK_TFLOPS = {"H100": (989, 1979), "H200": (989, 1979), "B200": (2250, 4500)}  # (bf16, fp8) dense


def timed(fn, *args, repeats=5):
    """Median wall seconds of a jitted call (compiled and warmed first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def balanced_groups(rows, experts, seed=0):
    """Routed-row counts of a random top-k router: multinomial around the balanced load."""
    return jnp.asarray(np.random.default_rng(seed).multinomial(rows, np.ones(experts) / experts), jnp.int32)


def grouped_gemm_section(rows, d, f, experts, dtype, impls, repeats):
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((rows, d)), dtype)
    rhs = jnp.asarray(rng.standard_normal((experts, d, f)) / np.sqrt(d), dtype)
    dense_w = rhs[0]
    sizes = balanced_groups(rows, experts)
    flops = 2 * rows * d * f
    results = {"dense": timed(jax.jit(lambda a, b: a @ b), lhs, dense_w, repeats=repeats)}
    for impl in impls:
        fn = jax.jit(lambda a, b, g, impl=impl: grouped_matmul(a, b, g, impl=impl))
        try:
            results[impl] = timed(fn, lhs, rhs, sizes, repeats=repeats)
        except (ValueError, NotImplementedError, RuntimeError) as e:
            results[impl] = f"skipped: {e}"
    return {name: ({"ms": 1e3 * t, "gflops": flops / t / 1e9, "vs_dense": t / results["dense"]}
                   if isinstance(t, float) else t) for name, t in results.items()}


def quantizer_section(rows, d, repeats):
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, d)), jnp.bfloat16)
    src = jnp.asarray(np.random.default_rng(2).permutation(rows), jnp.int32)
    fns = {
        "mxfp8 e4m3 (1x32)": jax.jit(lambda a: quantize_mx(a)),
        "nvfp4 per-token (1x16)": jax.jit(lambda a: quantize_nvfp4(a, scaling="per_token")),
        "fp8 deepseek (1x128)": jax.jit(lambda a: quantize_fp8_tiles(a)),
        "permute+mxfp8 (xla)": jax.jit(lambda a: permute_quantize_mx(a, src, impl="xla")),
    }
    nbytes = x.size * x.dtype.itemsize
    return {name: {"ms": 1e3 * (t := timed(fn, x, repeats=repeats)), "GB/s_read": nbytes / t / 1e9}
            for name, fn in fns.items()}


def gpu_section(repeats):
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)
    rows, d, f, experts = 65536, 7168, 2048, 8
    out = {"device_kind": kind, "shape": dict(rows=rows, d=d, f=f, experts=experts)}
    bf16 = grouped_gemm_section(rows, d, f, experts, jnp.bfloat16, ["mosaic_sm90", "pallas_triton", "xla"], repeats)
    for v in bf16.values():
        if isinstance(v, dict):
            v["tflops"] = v["gflops"] / 1e3
            v["pct_peak_bf16"] = None if peak is None else 100 * v["tflops"] / peak[0]
    out["bf16"] = bf16
    # FP8: MXFP8-quantized operands through the block-scaled Pallas kernel (dequantize in registers)
    from c2jax.kernels.pallas_grouped import grouped_matmul_mx_pallas

    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((experts, d, f)) / np.sqrt(d), jnp.bfloat16)
    ql, qr = jax.jit(lambda a: quantize_mx(a, axis=1))(lhs), jax.jit(lambda b: quantize_mx(b, axis=1))(rhs)
    sizes = balanced_groups(rows, experts)
    fn = jax.jit(lambda a, sa, b, sb, g: grouped_matmul_mx_pallas(a, sa, b, sb, g, block_m=128, block_n=128))
    t = timed(fn, ql.values, ql.scales, qr.values, qr.scales, sizes, repeats=repeats)
    tflops = 2 * rows * d * f / t / 1e12
    out["mxfp8_pallas"] = {"ms": 1e3 * t, "tflops": tflops,
                           "pct_peak_fp8": None if peak is None else 100 * tflops / peak[1]}
    quant = quantizer_section(rows, d, repeats)
    for v in quant.values():
        v["TB/s_read+write"] = v["GB/s_read"] / 1e3 * 1.53  # bf16 read + fp8 write + scales ~ 3.06 B/elem
    out["quantizers"] = quant
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--f", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="runs/bench/moe_kernels.json")
    args = p.parse_args(argv)
    machine = describe()
    report = {"backend": jax.default_backend(),
              "candidates": [i.name for i, _ in dispatch.candidates("grouped_matmul")]}
    shape = dict(rows=args.rows, d=args.d, f=args.f, experts=args.experts)
    report["cpu_shape"] = shape
    report["grouped_gemm_f32"] = grouped_gemm_section(args.rows, args.d, args.f, args.experts, jnp.float32,
                                                      ["xla", "ragged_dot"], args.repeats)
    report["quantizers"] = quantizer_section(args.rows, args.d, args.repeats)
    if jax.default_backend() == "gpu":
        report["gpu"] = gpu_section(args.repeats)
    gemm = [{"impl": name, **v, "note": ""} if isinstance(v, dict) else  # a skipped impl: its reason
            {"impl": name, "ms": None, "gflops": None, "vs_dense": None, "note": v}
            for name, v in report["grouped_gemm_f32"].items()]
    print_table(gemm, ["impl", ("ms", "ms", ".2f"), ("gflops", "GFLOP/s", ".1f"), ("vs_dense", "x dense", ".2f"),
                       "note"],
                title=f"grouped GEMM {shape} float32 on {report['backend']}")
    write_results(args.out, [{"quantizer": name, **v} for name, v in report["quantizers"].items()],
                  columns=["quantizer", ("ms", "ms", ".2f"), ("GB/s_read", "GB/s read", ".2f")],
                  title="quantizers (bf16 input)", meta=report, machine=machine, rows_key=None, indent=1,
                  notes=[json.dumps(report["gpu"], indent=1)] if "gpu" in report else ())
    return report


if __name__ == "__main__":
    main()
