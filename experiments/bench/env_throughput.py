"""Environment-layer throughput: sandbox start-up, command latency and concurrency scaling.

Definitions (docs/sandbox.md):
- start: `SandboxPool.acquire` returning, i.e. the sandbox is ready to accept a command (workspace
  mounted, cgroup made). The base snapshot is already cached (first acquire of a repo is excluded).
- first command: wall time of the first `exec("true")` on a fresh sandbox (one bwrap start).
- exec latency: `exec("true")` and `exec("python -c pass")` on a started sandbox.
- sandboxes/s: acquire + exec("true") + close, back to back, over N worker threads.
- tool calls: `ToolRegistry.execute` of each Cursor-like tool on a started sandbox over the synthetic
  200-file package (argument validation + the tool + output capping), as the episode loop calls it.
- grading: `c2jax.rl.tasks.grading.grade` of the reference solution of ladder `micro_bug` tasks (fresh sandbox,
  patch applied, hidden tests overlaid, pytest run and parsed), tasks graded per minute over N workers.

Sections are functions in SECTIONS taking a `Bench` and returning a dict of results; add one by
appending a function.

    python -m experiments.bench.env_throughput [--repeats 200 --out runs/bench/env_throughput.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from c2jax.bench_report import write_results
from c2jax.machine import describe
from c2jax.rl.harness.registry import ToolCall, ToolContext
from c2jax.rl.harness.tools import default_registry
from c2jax.rl.sandbox import Limits, SandboxPool, find_bwrap
from c2jax.rl.tasks.grading import grade
from c2jax.rl.tasks.ladder import build_ladder
from c2jax.rl.tasks.task import load_task


@dataclass
class Bench:
    pool: SandboxPool
    repo: Path
    repeats: int


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _ms_stats(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": 1e3 * statistics.median(xs), "p99_ms": 1e3 * _pct(xs, 0.99), "n": len(xs)}


def make_repo(root: Path, files: int = 200) -> Path:
    """A sdist-sized synthetic Python package (files x ~2 KB)."""
    repo = root / "repo"
    for i in range(files):
        p = repo / "pkg" / f"sub{i % 10}" / f"mod{i}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(f"def f{j}(x):\n    return x + {j}\n\n" for j in range(60)))
    return repo


def section_start(b: Bench) -> dict:
    b.pool.acquire(b.repo).close()  # builds the snapshot: a one-off per repository
    starts, firsts = [], []
    for _ in range(b.repeats):
        t = time.perf_counter()
        s = b.pool.acquire(b.repo)
        starts.append(time.perf_counter() - t)
        firsts.append(s.exec("true").wall_s)
        s.close()
    return {"start": _ms_stats(starts), "first_command": _ms_stats(firsts), "mode": s.mode,
            "cgroup_limited": s.cgroup_limited}


def section_exec(b: Bench) -> dict:
    out = {}
    with b.pool.acquire(b.repo) as s:
        for cmd, n in [("true", b.repeats), ("python -c pass", max(10, b.repeats // 10))]:
            out[cmd] = _ms_stats([s.exec(cmd).wall_s for _ in range(n)])
    return out


def _throughput(b: Bench, workers: int, seconds: float) -> float:
    done = 0
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            with b.pool.acquire(b.repo) as s:
                s.exec("true")
            with lock:
                done += 1

    t = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        for f in [ex.submit(worker) for _ in range(workers)]:
            f.result()
    return done / (time.perf_counter() - t)


def section_scaling(b: Bench) -> dict:
    cores = os.cpu_count() or 1
    counts = sorted({1, 2, *[c for c in (4, 8, 16, 32) if c <= cores], cores})
    return {f"{w}_workers": {"sandboxes_per_s": _throughput(b, w, seconds=3.0)} for w in counts}


def section_launch_breakdown(b: Bench) -> dict:
    """Host fork+exec, a minimal bwrap and our full exec, interleaved so machine load hits all alike."""
    bwrap = find_bwrap()
    minimal = [bwrap, "--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib",
               "--symlink", "usr/lib64", "/lib64", "--", "/usr/bin/true"]
    times: dict[str, list[float]] = {"host /usr/bin/true": [], "minimal bwrap true": [], "sandbox exec true": []}
    with b.pool.acquire(b.repo) as s:
        for _ in range(max(10, b.repeats // 4)):
            for name, run in [("host /usr/bin/true", lambda: subprocess.run(["/usr/bin/true"])),
                              ("minimal bwrap true", lambda: subprocess.run(minimal)),
                              ("sandbox exec true", lambda: s.exec("true"))]:
                t = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t)
    return {k: _ms_stats(v) for k, v in times.items()}


TOOL_CALLS: list[tuple[str, dict]] = [
    ("read_file", {"path": "pkg/sub3/mod3.py", "offset": 1, "limit": 200}),
    ("list_dir", {"path": "pkg/sub3"}),
    ("glob", {"pattern": "**/mod1*.py"}),
    ("grep", {"pattern": r"def f59\(", "path": "pkg"}),
    ("edit_file", {"path": "pkg/sub0/mod0.py", "old_string": "return x + 7\n", "new_string": "return x + 7  # \n"}),
    ("write_file", {"path": "notes/scratch.py", "content": "x = 1\n" * 50}),
    ("read_lints", {"paths": ["pkg/sub0/mod0.py", "notes/scratch.py"]}),
    ("run_terminal_cmd", {"command": "true"}),
    ("run_terminal_cmd", {"command": "ls pkg/sub3 | wc -l"}),
]


def section_tools(b: Bench) -> dict:
    registry = default_registry()
    times: dict[str, list[float]] = {}
    with b.pool.acquire(b.repo) as s:
        ctx = ToolContext(sandbox=s)
        for i in range(max(10, b.repeats // 4)):
            for j, (name, args) in enumerate(TOOL_CALLS):
                if name == "edit_file":  # alternate the edit so that each call finds a unique match
                    args = args if i % 2 == 0 else {**args, "old_string": args["new_string"],
                                                    "new_string": args["old_string"]}
                result = registry.execute(ToolCall(f"c{i}-{j}", name, args), ctx)
                if result.is_error:
                    raise RuntimeError(f"bench tool call {name}({args}) failed: {result.output[:300]}")
                key = name if name != "run_terminal_cmd" else f"run_terminal_cmd {args['command']!r}"
                times.setdefault(key, []).append(result.wall_s)
    return {k: _ms_stats(v) for k, v in times.items()}


def section_grading(b: Bench) -> dict:
    tasks = [load_task(p) for p in build_ladder(b.repo.parent / "ladder", seed=0,
                                                 per_rung=max(4, b.repeats // 25), rungs=("micro_bug",))]

    def grade_one(task):
        res = grade(task, task.solution_patch, b.pool.acquire)
        if not res.resolved:
            raise RuntimeError(f"reference solution of {task.id} did not resolve: {res.status} {res.reason}")
        return res.wall_s

    out: dict = {"tasks": len(tasks), "rung": "micro_bug"}
    grade_one(tasks[0])  # first snapshot of a repository is a one-off; warm the interpreter's imports
    for workers in sorted({1, os.cpu_count() or 1}):
        t = time.perf_counter()
        with ThreadPoolExecutor(workers) as ex:
            walls = list(ex.map(grade_one, tasks))
        elapsed = time.perf_counter() - t
        out[f"{workers}_workers"] = {"tasks_per_min": 60 * len(tasks) / elapsed,
                                     "grade_p50_ms": 1e3 * statistics.median(walls)}
    return out


SECTIONS: list[Callable[[Bench], dict]] = [section_start, section_exec, section_launch_breakdown, section_scaling,
                                           section_tools, section_grading]


def _table_rows(results: dict) -> list[dict]:
    """One row per measurement: section, measure, its figures as `k=v` pairs."""
    rows = []
    for sec, res in results.items():
        for key, val in res.items():
            if isinstance(val, dict):
                val = ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in val.items())
            rows.append({"section": sec, "measure": key, "value": str(val)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default="runs/bench/env_throughput.json")
    args = ap.parse_args()
    machine = describe()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="env-bench-") as tmp, SandboxPool(limits=Limits()) as pool:
        bench = Bench(pool=pool, repo=make_repo(Path(tmp)), repeats=args.repeats)
        for section in SECTIONS:
            results[section.__name__.removeprefix("section_")] = section(bench)
    write_results(args.out, _table_rows(results), columns=["section", "measure", "value"], meta=results,
                  machine=machine, rows_key=None)


if __name__ == "__main__":
    main()
