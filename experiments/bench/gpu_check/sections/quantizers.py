"""Section `quantizers`: the fused permute + MXFP8 Pallas kernel against the XLA one (bitwise), then each
quantizer's GB/s against the measured copy bandwidth at the same size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from c2jax.kernels.fp8_deepseek import quantize_fp8_tiles
from c2jax.kernels.mxfp8 import quantize_mx
from c2jax.kernels.nvfp4 import quantize_nvfp4
from c2jax.kernels.permute import permute_quantize_mx
from experiments.bench.gpu_check.sections.context import Context, copy_bandwidth, timed


def run(ctx: Context) -> None:
    rows, d = ctx.size((65536, 7168), (64, 256))
    x = jax.random.normal(jax.random.key(0), (rows, d), jnp.bfloat16)
    src = jnp.asarray(np.random.default_rng(2).permutation(rows), jnp.int32)
    ctx.set("shape", {"rows": rows, "d": d, "dtype": "bfloat16"})
    bw = ctx.sub("copy_GBps_same_size", lambda: copy_bandwidth(x.size * 2) / 1e9, need_s=2)
    fns = quantizers(src)
    ctx.sub("equality/permute_mxfp8", permute_equality, ctx, fns, x, need_s=ctx.size(5, 1))
    for name, fn in fns.items():
        r = ctx.sub(f"throughput/{name}", throughput, ctx, name, fn, x, bw, need_s=ctx.size(4, 1))
        if isinstance(r, dict) and name == "mxfp8_e4m3_1x32":
            ctx.headline(f"MXFP8 {r['GBps_read_write']:.3g} GB/s r+w")


def quantizers(src) -> dict:
    """name: the quantizer, one bf16 array in; the permuting ones gather its rows by `src` first."""
    return {
        "mxfp8_e4m3_1x32": lambda a: quantize_mx(a),
        "nvfp4_per_token_1x16": lambda a: quantize_nvfp4(a, scaling="per_token"),
        "fp8_deepseek_1x128": lambda a: quantize_fp8_tiles(a),
        "permute_mxfp8_xla": lambda a: permute_quantize_mx(a, src, impl="xla"),
        # interpreted on the CPU (dispatch.py)
        "permute_mxfp8_pallas_triton": lambda a: permute_quantize_mx(a, src, impl="pallas_triton"),
    }


def permute_equality(ctx: Context, fns: dict, x) -> dict:
    interpret = not ctx.gpu
    a = np.asarray(jax.jit(fns["permute_mxfp8_xla"])(x).values.astype(jnp.float32))
    q = jax.jit(fns["permute_mxfp8_pallas_triton"])(x)
    b = np.asarray(q.values.astype(jnp.float32))
    ref_s = np.asarray(jax.jit(fns["permute_mxfp8_xla"])(x).scales.astype(jnp.float32))
    same = bool(np.array_equal(a, b, equal_nan=True)) and bool(
        np.array_equal(ref_s, np.asarray(q.scales.astype(jnp.float32)), equal_nan=True))
    ctx.check("permute+MXFP8 pallas_triton == xla (bitwise)", same,
              "values and scales identical" + (" (interpret mode)" if interpret else ""))
    return {"identical": same, "interpret": interpret}


def throughput(ctx: Context, name: str, fn, x, bw: float | None) -> dict:
    f = jax.jit(fn)
    out = f(x)
    written = sum(leaf.nbytes for leaf in jax.tree.leaves(out))
    t = timed(f, x, repeats=ctx.size(5, 1))
    r = {"ms": 1e3 * t, "GBps_read": x.nbytes / t / 1e9, "GBps_read_write": (x.nbytes + written) / t / 1e9}
    if bw:
        r["pct_of_copy_bandwidth"] = 100 * r["GBps_read_write"] / bw
    if name.endswith("pallas_triton") and not ctx.gpu:
        r["note"] = "interpret mode (CPU): exercises the call, not a speed"
    return r
