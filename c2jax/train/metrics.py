"""Run observability: metrics.jsonl + TensorBoard event files (tensorboardX, no TensorFlow), and the
throughput/MFU arithmetic."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

# dense bf16 peak FLOP/s per device, from vendor datasheets (no sparsity)
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "B300": 2250e12, "A100": 312e12,
              "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v6 lite": 918e12}


def device_peak_flops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return flops
    return None


def measure_peak_flops(n: int = 1024, dtype="float32", repeats: int = 5) -> float:
    """Achieved matmul FLOP/s on the default device: the practical peak on CPUs, which have no datasheet
    number that XLA can reach. dtype: a name or a NumPy / jnp / torch dtype (models.config.dtype_name)."""
    import jax
    import jax.numpy as jnp

    from c2jax.models.config import dtype_name

    a = jnp.ones((n, n), dtype_name(dtype))
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _scalars(prefix: str, value) -> dict[str, float]:
    """Flatten a metric (scalar, or per-layer vector) into named floats."""
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim == 0:
        return {prefix: float(arr)}
    return {f"{prefix}/layer{i}": float(v) for i, v in enumerate(arr.reshape(-1))}


class MetricsWriter:
    """Appends one JSON object per log event to <run>/metrics.jsonl and mirrors scalars to TensorBoard.
    `enabled=False` (every process but process 0 of a multi-process run) opens no file and writes nothing."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.jsonl = self.tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any], kind: str = "train") -> dict[str, float]:
        flat: dict[str, float] = {}
        for name, value in metrics.items():
            flat.update(_scalars(name, value))
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, "kind": kind, **flat}) + "\n")
        if self.tb is not None:
            for name, value in flat.items():
                self.tb.add_scalar(f"{kind}/{name}", value, step)
        return flat

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: str | Path, kind: str | None = "train") -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r["kind"] == kind]
