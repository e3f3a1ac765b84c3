"""How much of decoding is matrix multiplication: c2jax's InferenceEngine vs HF transformers `generate`, same
weights, same requests (decode_throughput.py's setup: `small`, random weights, batch B of P-token prompts, N new
tokens, greedy).

Per batch size, alternated `--repeats` times (medians):
  wall_s         one time-to-first-token generation plus one full generation, not profiled
  gemm_s         time inside matrix-multiplication kernels during the same two generations run under a profiler
                   c2jax: jax.profiler events of XLA ops that are, or fuse, a dot (read from the optimized HLO
                          that XLA dumps while this script runs), as the union of their intervals: two GEMMs
                          on the two threads at once count once
                   HF:    torch.profiler self time of aten::mm, addmm, bmm, baddbmm, _grouped_mm
  gemm_share     gemm_s / the profiled run's wall time (profilers slow a run, torch's by ~50% here)
  speed-up       HF wall / c2jax wall
  bound          HF wall / (c2jax gemm_share x c2jax wall): c2jax's speed-up over HF if everything but its GEMMs
                 took no time
A bound above the measured speed-up is the room left outside c2jax's GEMMs; a bound below a target means the
target needs faster GEMM kernels, not a better sampler. Each batch size runs in its own process (HLO op names
repeat between compilations of one function). Writes runs/bench/gemm_share.json.

  .venv/bin/python experiments/bench/gemm_share.py [--batches 8 32] [--prompt 64] [--new 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm")


def _hlo_gemm_ops(text: str) -> dict[str, bool]:
    """Instruction name -> whether it is a matrix multiplication, for one optimized HLO module: a dot or
    convolution, or a fusion whose computation holds one or a reduce named after a dot_general."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        header = re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if header and not line.startswith(" "):
            current = header.group(1)
            bodies[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            bodies[current].append(line)

    def is_gemm_line(line: str) -> bool:
        # a dot, or the multiply + reduce XLA makes of a matrix-vector dot (it keeps the jax op name); a copy
        # or transpose of a dot's output also carries that name, and is not a GEMM
        return bool(re.search(r" (dot|convolution)\(", line)
                    or (re.search(r" reduce\(", line) and "dot_general" in line))

    kinds = {}
    for lines in bodies.values():
        for line in lines:
            m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*?\s([a-z][\w\-]*)\(", line)
            if not m:
                continue
            name, op = m.groups()
            if op in ("while", "conditional", "call"):
                kinds[name] = False  # control flow: its body's ops are profiled on their own
                continue
            called = re.search(r"calls=%([\w.\-]+)", line)
            inner = bodies.get(called.group(1), []) if called and op == "fusion" else []
            kinds[name] = is_gemm_line(line) or any(is_gemm_line(x) for x in inner)
    return kinds


def _dot_ops(dump_dir: str) -> dict[tuple[str, str], bool]:
    """(module name, op name) -> whether the op is a matrix multiplication, from XLA's optimized HLO dumps."""
    kinds: dict[tuple[str, str], bool] = {}
    for path in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
        module = Path(path).name.split(".")[1]
        for name, is_gemm in _hlo_gemm_ops(Path(path).read_text()).items():
            key = (module, name)
            if kinds.get(key, is_gemm) != is_gemm:
                raise RuntimeError(f"op {key} is a GEMM in one compilation and not in another")
            kinds[key] = is_gemm
    return kinds


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) intervals in microseconds: ops on both threads at once count
    once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e6


def _c2jax_profiled(run, kinds: dict[tuple[str, str], bool]) -> dict:
    """Wall and GEMM time of run() under jax.profiler; `kinds` from _dot_ops (ops of modules compiled later
    than it was read count as unmapped)."""
    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        trace = sorted(glob.glob(trace_dir + "/**/*.json.gz", recursive=True))[-1]
        events = json.load(gzip.open(trace))["traceEvents"]
    spans = collections.defaultdict(list)
    for e in events:
        args = e.get("args", {})
        if e.get("ph") == "X" and "hlo_op" in args and not e["name"].startswith("end:"):
            kind = kinds.get((args["hlo_module"], args["hlo_op"]))
            spans["gemm" if kind else "other" if kind is not None else "unmapped"].append(
                (e["ts"], e["ts"] + e["dur"]))
    return {"profiled_wall_s": wall, "gemm_s": _union_s(spans["gemm"]), "other_op_s": _union_s(spans["other"]),
            "unmapped_op_s": _union_s(spans["unmapped"])}


def _hf_profiled(run) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
    gemm = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in GEMM_OPS) / 1e6
    return {"profiled_wall_s": wall, "gemm_s": gemm}


def one_batch(batch: int, prompt: int, new: int, repeats: int, dump_dir: str) -> dict:
    import numpy as np

    from c2jax.models.config import preset
    from c2jax.models.transformer import init
    from experiments.bench.decode_throughput import engine_runner, hf_runner

    cfg = preset("small").replace(num_nextn_predict_layers=0)
    model = init(cfg, seed=0)
    prompts = np.random.default_rng(batch).integers(1, cfg.vocab_size, size=(batch, prompt)).tolist()
    ours, theirs = engine_runner(model, prompts, new, 8), hf_runner(model, prompts, new)
    ours(), theirs()  # compile / warm up
    kinds = _dot_ops(dump_dir)  # every module is compiled (and dumped) by now
    def wall(run):
        t0 = time.perf_counter()
        run()
        return time.perf_counter() - t0

    runs = {"c2jax": [], "hf": []}
    for _ in range(repeats):  # the profilers slow the runs (torch's by ~50% here): walls come from plain runs
        runs["c2jax"].append({**_c2jax_profiled(ours, kinds), "wall_s": wall(ours)})
        runs["hf"].append({**_hf_profiled(theirs), "wall_s": wall(theirs)})
    med = {name: {key: float(np.median([r[key] for r in rs])) for key in rs[0]} for name, rs in runs.items()}
    for m in med.values():
        m["gemm_share"] = m["gemm_s"] / m["profiled_wall_s"]
    return {"batch": batch, **med, "speedup": med["hf"]["wall_s"] / med["c2jax"]["wall_s"],
            "bound": med["hf"]["wall_s"] / (med["c2jax"]["gemm_share"] * med["c2jax"]["wall_s"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one-batch", type=int, help=argparse.SUPPRESS)  # internal: this process runs one batch
    ap.add_argument("--out", default="runs/bench/gemm_share.json")
    args = ap.parse_args(argv)
    if args.one_batch is not None:
        row = one_batch(args.one_batch, args.prompt, args.new, args.repeats, os.environ["C2JAX_GEMM_SHARE_DUMP"])
        print("ROW " + json.dumps(row), flush=True)
        return 0
    from c2jax.bench_report import write_results
    from c2jax.machine import describe

    machine = describe()
    rows = []
    for batch in args.batches:
        with tempfile.TemporaryDirectory() as dump:
            env = {**os.environ, "JAX_PLATFORMS": "cpu", "C2JAX_GEMM_SHARE_DUMP": dump,
                   "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                                 " --xla_dump_hlo_module_re=.*(decode_chunk|prefill_slot).*").strip()}
            out = subprocess.run([sys.executable, "-m", "experiments.bench.gemm_share", "--one-batch", str(batch),
                                  "--prompt", str(args.prompt), "--new", str(args.new), "--repeats", str(args.repeats)],
                                 env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
        lines = [line for line in out.stdout.splitlines() if line.startswith("ROW ")]
        if out.returncode or not lines:
            raise RuntimeError(f"batch {batch} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(lines[-1][4:]))
        print(rows[-1], flush=True)
    print()
    write_results(args.out, rows, columns=[
        "batch", ("c2jax.wall_s", "c2jax wall s", ".3f"), ("c2jax.gemm_s", "GEMM s", ".3f"),
        ("c2jax.gemm_share", "share", ".0%"), ("hf.wall_s", "HF wall s", ".3f"), ("hf.gemm_s", "GEMM s", ".3f"),
        ("hf.gemm_share", "share", ".0%"), ("speedup", "speed-up", "{:.2f}x"),
        ("bound", "bound", "{:.2f}x")],
        title=f"small preset, fp32, prompt {args.prompt}, new {args.new}; one TTFT generation + one full "
              f"generation, median of {args.repeats} alternated runs",
        meta={"preset": "small", "prompt_tokens": args.prompt, "new_tokens": args.new}, machine=machine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
