"""What every section records through, and the measuring helpers they share.

A `Context` holds one section's record and rewrites its result file after every sub-measurement (`sub`,
`set`, `check`, ...), so a section killed at its deadline still reports what it measured. A sub-measurement
that cannot run here raises `Skip`; one that raises anything else is recorded as an error under its key, and
the section goes on with the next.

Peak: the H200's dense bf16 matmul rate as measured on this machine kind (an 8192^3 bf16 product through
PyTorch ran at 769-798 TFLOP/s on random data; the device service's KINDS.md), 790 TFLOP/s; the `env`
section measures it again through XLA and reports both. On the CPU (dry run) percentages are against a
float32 matmul measured there and mean nothing.

This module imports no JAX at import time (the package's `run_worker` builds a `Context` before JAX has been
told which platform to use); the helpers import it when called.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

PEAK_BF16_FLOPS = 790e12  # H200, dense bf16, measured on this machine kind (module docstring)
PEAK_NOTE = "790 TFLOP/s: H200 dense bf16 measured on this machine kind (device KINDS.md)"
TAIL_LINES = 25
# Dry run: the same model code with less to compile (one MoE layer, two capacity buckets instead of four).
DRY_MODEL = {"num_hidden_layers": 1, "first_k_dense_replace": 0, "moe_capacity_factors": (2.0,)}


class Skip(Exception):  # noqa: N818 - control flow, not an error
    """A sub-measurement that cannot run here; the message is the reason (recorded as 'skipped: ...')."""


class Context:
    def __init__(self, name: str, path: Path, dry_run: bool, deadline_s: float | None):
        self.name, self.path, self.dry_run = name, path, dry_run
        self.start = time.monotonic()
        self.deadline = self.start + (deadline_s if deadline_s else 3600.0)
        self.record = {"status": "running", "results": {}, "checks": [], "targets": [], "headline": [],
                       "errors": [], "sub_seconds": {}}
        self._gpu = None
        self.flush()

    # the device ---------------------------------------------------------------------------------------
    @property
    def gpu(self) -> bool:
        if self._gpu is None:
            import jax

            self._gpu = jax.default_backend() == "gpu"
        return self._gpu

    def size(self, gpu, dry):
        """The GPU size or the dry run's: every section takes the same code path at both."""
        return dry if self.dry_run else gpu

    def needs_gpu(self, what: str) -> None:
        if not self.gpu:
            raise Skip(f"needs GPU ({what})")

    # recording ----------------------------------------------------------------------------------------
    def left(self) -> float:
        return self.deadline - time.monotonic()

    def flush(self) -> None:
        self.record["cpu_s"] = round(time.process_time(), 1)  # this process's CPU seconds, every thread
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, default=jsonable))
        os.replace(tmp, self.path)

    def set(self, key: str, value) -> None:
        node = self.record["results"]
        *parents, last = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
        self.flush()

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.record["checks"].append({"name": name, "passed": bool(passed), "detail": detail})
        self.flush()
        return bool(passed)

    def target(self, name: str, value: float | None, threshold: float, unit: str = "") -> None:
        met = None if value is None else bool(value >= threshold)
        shown = None if value is None else f"{value:.3g}{unit} (target >= {threshold:g}{unit})"
        self.record["targets"].append({"name": name, "value": shown, "met": met})
        self.flush()

    def headline(self, text: str) -> None:
        self.record["headline"].append(text)
        self.flush()

    def sub(self, key: str, fn: Callable[..., object], *args, need_s: float = 0.0):
        """Run one sub-measurement, `fn(*args)`: its value is recorded under `key`; Skip and exceptions are
        recorded there too (the section goes on); it is not started with less than `need_s` seconds to the
        deadline."""
        if self.left() < need_s:
            left = max(self.left(), 0)
            self.set(key, f"skipped: {left:.0f} s left before the section's deadline, needs ~{need_s:.0f}")
            return None
        self.record["current"] = key
        self.flush()
        start = time.monotonic()
        try:
            value = fn(*args)
        except Skip as e:
            self.set(key, f"skipped: {e}")
            return None
        except Exception as e:  # noqa: BLE001 - recorded, the section goes on
            self.record["errors"].append(key)
            self.set(key, {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": tail(traceback.format_exc())})
            return None
        finally:
            self.record.pop("current", None)
            self.record["sub_seconds"][key] = round(time.monotonic() - start, 2)
        if value is not None:
            self.set(key, value)
        return value


def jsonable(v):
    """json.dumps' fallback for what a section records: NumPy scalars and arrays as numbers, the rest as text."""
    try:
        import numpy as np

        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, np.ndarray):
            return v.tolist()
    except ImportError:
        pass
    return str(v)


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def device_info() -> dict:
    import jax

    d = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": getattr(d, "device_kind", ""),
            "device_count": jax.device_count()}


# ------------------------------------------------------------------------------------------------ timing


def timed(fn, *args, repeats: int = 5) -> float:
    """Median wall seconds of a call (compiled and warmed first); experiments/bench/moe_kernels.py's helper."""
    from experiments.bench.moe_kernels import timed as _timed

    return _timed(fn, *args, repeats=repeats)


def best_time(fn, *args, repeats: int = 5) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def timed_steps(step, state, batch, repeats: int):
    """Run `state, metrics = step(state, batch)` once (compile or warm-up) and `repeats` more times, each to
    completion: (state, metrics, first call's seconds, the repeats' seconds)."""
    import jax

    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics["loss"])
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return state, metrics, first_s, times


def peak_flops(ctx: Context) -> tuple[float, str]:
    if ctx.gpu:
        return PEAK_BF16_FLOPS, PEAK_NOTE
    from experiments.bench.model_throughput import matmul_peak_flops

    peak = matmul_peak_flops(n=256, repeats=3)
    return peak, f"{peak / 1e9:.1f} GFLOP/s: float32 256^3 matmul measured here (dry run, CPU)"


def copy_bandwidth(nbytes: int) -> float:
    """Bytes moved per second (read + write) by x + 1 over an nbytes bf16 array, best of 10."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + 1)
    t = best_time(f, x, repeats=10)
    return 2 * nbytes / t


# ------------------------------------------------------------------------------------------------ errors


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    import numpy as np

    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    den = np.linalg.norm(b)
    num = np.linalg.norm(a - b)
    return float(num / den) if den else float(num)


def tree_rel_err(a, b) -> tuple[float, float]:
    """(global relative L2 error over every leaf, worst leaf's relative error)."""
    import jax
    import numpy as np

    la = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a)]
    lb = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(b)]
    worst = max((rel_err(x, y) for x, y in zip(la, lb)), default=0.0)
    return rel_err(np.concatenate(la), np.concatenate(lb)), worst
