"""The GPU check's sections, one module each. Each section runs in its own process (runner.py) as
`run_worker(name, ...)`: it records figures through a `Context` (context.py), which rewrites the section's
result file after every sub-measurement, so a section killed at its deadline still reports what it measured.

Every section has two sizes, GPU and dry run (`Context.size`); the dry run takes the same code path at tiny
shapes on the CPU, with the Pallas kernels in interpret mode, and skips (with the reason) only what cannot run
on a CPU: the cuDNN attention backend, the Mosaic GPU (Hopper) and jax-triton grouped GEMMs, FP8 hardware
matmuls.

The section modules import JAX at their top, so this package imports one only when its section is run:
`run_worker` sets the platform first (the dry run's CPU), and the driver, which never touches the GPU itself,
can import this package without loading JAX.
"""

from __future__ import annotations

import importlib
import os
import traceback
from collections.abc import Callable
from pathlib import Path

from experiments.bench.gpu_check.sections.context import Context, tail


def _section(module: str, function: str = "run") -> Callable[[Context], None]:
    """`module.function(ctx)`, its module imported when first called (module docstring)."""

    def run(ctx: Context) -> None:
        getattr(importlib.import_module(f"{__name__}.{module}"), function)(ctx)

    run.__name__ = run.__qualname__ = f"{module}.{function}"
    return run


SECTIONS: dict[str, Callable[[Context], None]] = {
    "env": _section("env"), "model": _section("model"), "attention": _section("attention"),
    "grouped_gemm": _section("grouped_gemm"), "moe_mxfp8": _section("moe_mxfp8"), "quantizers": _section("quantizers"),
    "train_medium": _section("train_medium"), "sampler": _section("sampler"), "rl_step": _section("rl_step"),
    "selftest_error": _section("selftest", "run_error"), "selftest_timeout": _section("selftest", "run_timeout"),
}


def run_worker(name: str, path: Path, dry_run: bool, deadline_s: float | None, allow_cpu: bool = False) -> int:
    """Run one section, recording into `path`. Exit code 0 unless the section raised. Without --dry-run a
    section other than `env` and the self-tests refuses to start its full-size work without a GPU."""
    if dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    ctx = Context(name, path, dry_run, deadline_s)
    try:
        if not (dry_run or allow_cpu or name == "env" or name.startswith("selftest") or ctx.gpu):
            import jax

            ctx.record["status"] = "skipped"
            ctx.record["reason"] = (f"needs GPU: the JAX backend here is {jax.default_backend()!r}; the full-size "
                                    "section would take hours on it (use --dry-run, or --allow-cpu)")
            ctx.record.pop("errors", None)
            ctx.flush()
            return 0
        SECTIONS[name](ctx)
    except Exception as e:  # noqa: BLE001 - recorded; the driver goes on with the next section
        ctx.record["status"] = "error"
        ctx.record["error"] = tail(traceback.format_exc())
        ctx.record["reason"] = f"{type(e).__name__}: {str(e)[:300]}"
        ctx.flush()
        traceback.print_exc()
        return 1
    failed = [c["name"] for c in ctx.record["checks"] if not c["passed"]]
    errors = ctx.record.pop("errors")
    if failed:
        ctx.record["status"] = "fail"
        ctx.record["reason"] = f"failed checks: {', '.join(failed)}"
    elif errors:
        ctx.record["status"] = "partial"
        ctx.record["reason"] = f"sub-measurements raised: {', '.join(errors)}"
    else:
        ctx.record["status"] = "ok"
    if errors and failed:
        ctx.record["reason"] += f"; sub-measurements raised: {', '.join(errors)}"
    ctx.flush()
    return 0
