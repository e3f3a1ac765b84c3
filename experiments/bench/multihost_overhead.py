"""Per-step cost of running pretraining as 2 processes x 4 devices instead of 1 process x 8 devices: the same
2 x 4 mesh, model, batch shape and step count, through `c2jax pretrain` (CPU, gloo collectives over loopback).

    .venv/bin/python -m experiments.bench.multihost_overhead [--preset tiny --steps 16 --seq 128 --batch 16]

The step time is the loop's own (metrics.jsonl: trained tokens / tokens_per_s, one row per step: data,
global-batch assembly, step dispatch and the host read of the loss), median over the steps after `--warmup`;
checkpoints and eval are off until the last step. Runs alternate (1, 2, 1, 2, ...) so that a change of load
on a shared machine hits both. Writes runs/bench/multihost_overhead.json with the machine (CPU model, cores,
load at the start and end).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from c2jax.bench_report import Col, write_results
from c2jax.machine import describe
from c2jax.models.config import preset
from c2jax.train.metrics import read_metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp: Path, name: str, args) -> Path:
    rng = np.random.default_rng(0)
    corpus = tmp / "corpus.jsonl"
    if not corpus.exists():
        words = "def class return import for while if else lambda yield self value index data batch".split()
        corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(20, 400)))}) + "\n"
                                  for _ in range(2000)))
    cfg = dict(name=name, output_dir=str(tmp / "runs"), log_every=1, progress=False, mtp_init_step=0,
               model=dict(preset=args.preset, vocab_size=max(preset(args.preset).vocab_size, 264), moe_impl="dense"),
               mesh=dict(data=2, fsdp=-1),
               data=dict(tokenizer="bytes", sources=[dict(name="text", kind="jsonl", path=str(corpus),
                                                          heldout_fraction=0.0)]),
               phases=[dict(name="main", steps=args.steps, seq_len=args.seq, batch_size=args.batch)],
               checkpoint=dict(every=10**6), eval=dict(every=0), optimizer=dict(lr=1e-3, warmup_steps=2),
               distributed=dict(heartbeat_timeout_s=60, initialization_timeout_s=120))
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _c2jax() -> list[str]:
    exe = Path(sys.executable).parent / "c2jax"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "from c2jax.cli import main; raise SystemExit(main())"]


def _env(devices: int) -> dict:
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}")


def run(tmp: Path, name: str, processes: int, args) -> list[float]:
    config = _config(tmp, name, args)
    cmd = [*_c2jax(), "pretrain", "--config", str(config)]
    if processes == 1:
        procs = [subprocess.Popen(cmd, env=_env(8), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)]
    else:
        port = _free_port()
        env = dict(_env(8 // processes), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes))
        procs = [subprocess.Popen([*cmd, "distributed.enabled=true"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, env=dict(env, JAX_PROCESS_ID=str(i)))
                 for i in range(processes)]
    errors = [p.communicate(timeout=1800)[1].decode(errors="replace") for p in procs]
    for p, err in zip(procs, errors):
        if p.returncode:
            raise RuntimeError(f"{name}: exit {p.returncode}\n{err[-3000:]}")
    rows = read_metrics(tmp / "runs" / name)
    return [r["tokens"] / r["tokens_per_s"] for r in rows if r["step"] > args.warmup]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="runs/bench/multihost_overhead.json")
    args = p.parse_args(argv)
    machine = describe()
    times: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for procs in (1, 2):
                t = time.perf_counter()
                steps = run(Path(tmp), f"p{procs}_r{r}", procs, args)
                times[procs] += steps
                print(f"{procs} process(es), repeat {r}: median step {statistics.median(steps) * 1e3:.1f} ms "
                      f"({time.perf_counter() - t:.0f} s in all)", flush=True)
    one, two = statistics.median(times[1]), statistics.median(times[2])
    result = dict(preset=args.preset, seq=args.seq, batch=args.batch, steps=args.steps, warmup=args.warmup,
                  mesh="data=2 x fsdp=4", step_s={"1x8": times[1], "2x4": times[2]},
                  median_step_s={"1x8": one, "2x4": two}, overhead_s=two - one, ratio=two / one)
    table = [{"layout": f"{procs} process(es) x {8 // procs} devices", "median_step_s": statistics.median(times[procs]),
              "steps": len(times[procs])} for procs in (1, 2)]
    write_results(args.out, table, columns=["layout", Col("median_step_s", "median step ms", ".1f", scale=1e3),
                                             "steps"],
                  title=f"{args.preset}, {args.batch} x {args.seq} tokens per step, mesh data=2 x fsdp=4 "
                        "(8 CPU devices)",
                  notes=[f"overhead: {(two - one) * 1e3:+.1f} ms per step ({two / one:.2f}x)"], meta=result,
                  machine=machine, rows_key=None, indent=1)


if __name__ == "__main__":
    main()
