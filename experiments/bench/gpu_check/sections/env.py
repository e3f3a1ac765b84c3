"""Section `env`: versions, the device, and the two rates every other figure is read against, a bf16 matmul's
(the measured peak) and a copy's (the bandwidth)."""

from __future__ import annotations

import os
import platform
import subprocess

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from c2jax.machine import describe
from experiments.bench.gpu_check.sections.context import Context, Skip, best_time, copy_bandwidth, device_info

ENV_VARS = ("JAX_PLATFORMS", "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "CUDA_VISIBLE_DEVICES")
PACKAGES = ("flax", "optax", "chex", "orbax.checkpoint", "triton", "jax_triton")


def run(ctx: Context) -> None:
    for key, value in device_info().items():
        ctx.set(key, value)
    ctx.set("jax", jax.__version__)
    ctx.set("jaxlib", getattr(jaxlib, "__version__", "?"))
    ctx.set("python", platform.python_version())
    ctx.set("numpy", np.__version__)
    ctx.set("env_vars", {k: os.environ[k] for k in ENV_VARS if k in os.environ})
    for mod in PACKAGES:
        try:
            m = __import__(mod, fromlist=["__version__"])
            ctx.set(f"packages/{mod}", getattr(m, "__version__", "installed"))
        except Exception as e:  # noqa: BLE001
            ctx.set(f"packages/{mod}", f"not importable: {type(e).__name__}: {str(e)[:120]}")
    ctx.sub("cuda_versions", cuda_versions)
    ctx.sub("nvidia_smi", nvidia_smi, ctx)
    try:
        print(jax.print_environment_info(return_string=True), flush=True)  # into gpu_check.log
    except Exception as e:  # noqa: BLE001
        print(f"jax.print_environment_info failed: {e}", flush=True)
    n = 8192 if ctx.gpu else 256  # by the device, not the mode: a run without a GPU only reports it
    mm = ctx.sub("bf16_matmul", bf16_matmul_rate, n, need_s=5)
    bw = ctx.sub("copy_GBps", lambda: copy_bandwidth((2 << 30) if ctx.gpu else (8 << 20)) / 1e9, need_s=3)
    if mm:
        ctx.headline(f"bf16 {mm['n']}^3 matmul {mm['tflops']:.3g} TFLOP/s")
    if bw:
        ctx.headline(f"copy {bw:.0f} GB/s")
    ctx.set("host", describe())


def cuda_versions() -> dict:
    try:
        from jax._src.lib import cuda_versions as cv  # private; present in jax 0.10 and 0.11
    except ImportError as e:
        raise Skip(f"jax._src.lib.cuda_versions not importable: {e}") from None
    if cv is None:
        raise Skip("no CUDA plugin (CPU jaxlib)")
    out = {}
    for name in sorted(dir(cv)):
        if name.endswith("_get_version") and callable(getattr(cv, name)):
            try:
                out[name.removesuffix("_get_version")] = getattr(cv, name)()
            except Exception as e:  # noqa: BLE001
                out[name.removesuffix("_get_version")] = f"{type(e).__name__}: {e}"[:100]
    return out


def nvidia_smi(ctx: Context) -> str:
    ctx.needs_gpu("nvidia-smi")
    q = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit"
    out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=20)
    return out.stdout.strip() or out.stderr.strip()[:300]


def bf16_matmul_rate(n: int) -> dict:
    key = jax.random.key(0)
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.bfloat16)
    t = best_time(jax.jit(lambda x, y: x @ y), a, b, repeats=10)
    tflops = 2 * n**3 / t / 1e12
    return {"n": n, "ms": 1e3 * t, "tflops": tflops, "pct_of_790": 100 * tflops / 790}
