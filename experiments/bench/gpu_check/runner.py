"""Driver of the GPU check: runs each section in its own subprocess with a deadline, collects what it recorded,
and writes gpu_check.json, gpu_check.md and gpu_check.log.

Why subprocesses: a section can hang (a Triton or XLA compile that does not finish), crash the process (a CUDA
fault, an abort in a kernel library) or leave the device in a bad state; in its own process group it is killed
at its deadline (SIGTERM, then SIGKILL) and the next section starts afresh. A section writes what it has
measured to its result file after every sub-measurement, so a section killed at its deadline still reports the
figures it had. This module imports no JAX: the driver never initialises (or preallocates) the GPU itself.

Statuses: ok (ran; every check passed), fail (ran; an equality check failed), error (an exception; traceback
tail kept), timeout (killed at its deadline; partial results kept), crashed (the process died without
reporting), skipped (with the reason: not selected, budget spent, no GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from c2jax.bench_report import write_json, write_text
from c2jax.machine import describe, finish, summary_line

REPO = Path(__file__).resolve().parents[3]
JSON_NAME, MD_NAME, LOG_NAME = "gpu_check.json", "gpu_check.md", "gpu_check.log"
DEFAULT_BUDGET_S = 450.0  # the "under 8 minutes" with room for process starts and the report
MIN_SECTION_S = 15.0  # a section is not started with less than this left of the budget (GPU run)


@dataclass(frozen=True)
class Spec:
    name: str
    title: str
    deadline_s: float  # on a GPU
    dry_deadline_s: float  # in --dry-run on the CPU (tiny shapes; the deadline only guards against hangs)
    selftest: bool = False  # only with --selftest: sections that exercise the driver's failure paths


# In order of value (issue 24): a later section runs only with the budget the earlier ones left. The two
# self-test sections (--selftest only) come first, so that the test sees every real section run after them.
SPECS = (
    Spec("selftest_error", "Driver self-test: a section that raises", 10, 10, selftest=True),
    Spec("selftest_timeout", "Driver self-test: a section that overruns its deadline", 3, 3, selftest=True),
    Spec("env", "Versions, device, measured bf16 matmul peak and copy bandwidth", 35, 60),
    Spec("model", "Model forward + gradients on the device vs the CPU reference (tiny, fp32 and bf16)", 80, 120),
    Spec("attention", "Attention backends: equality with the dense oracle, tokens/s at 8k and 32k", 60, 120),
    Spec("grouped_gemm", "Grouped GEMMs + MoE layer: equality, TFLOP/s at DeepSeek-V3 expert shapes, bf16/FP8",
         90, 120),
    Spec("moe_mxfp8", "MoE layer fwd+bwd at `medium` shapes, bf16 vs MXFP8: the report's 3.5x claim", 60, 90),
    Spec("quantizers", "Quantizers (MXFP8, NVFP4 per token, DeepSeek FP8, permute+MXFP8): GB/s", 35, 90),
    Spec("train_medium", "`medium` preset training step, bf16: tokens/s and MFU at S = 4k and 32k, and at 4k per "
         "MoE kernel choice", 180, 150),
    Spec("sampler", "Sampler decode tokens/s and bandwidth utilisation at batch 1/8/32; MTP speculation", 70, 120),
    Spec("rl_step", "One RL learner step with router replay", 70, 120),
)
SPEC_BY_NAME = {s.name: s for s in SPECS}


def _now_utc() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _log_tail(log_path: Path, offset: int, limit: int = 4000) -> str:
    try:
        with open(log_path, "rb") as fh:
            fh.seek(max(offset, os.path.getsize(log_path) - limit))
            return _tail(fh.read().decode("utf-8", "replace"))
    except OSError:
        return ""


def _child_env(dry_run: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
        # tiny shapes: compile time is all there is; LLVM -O0 compiles faster (as tests/conftest.py does)
        if "--xla_backend_optimization_level" not in env.get("XLA_FLAGS", ""):
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM then SIGKILL to the section's own process group (it was started in a new session)."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_section_subprocess(spec: Spec, deadline_s: float, args, log_path: Path, tmp: Path) -> dict:
    result_path = tmp / f"{spec.name}.json"
    cmd = [sys.executable, "-m", "experiments.bench.gpu_check", "--worker", spec.name, "--result", str(result_path),
           "--deadline-s", f"{deadline_s:.1f}"]
    if args.dry_run:
        cmd.append("--dry-run")
    if args.allow_cpu:
        cmd.append("--allow-cpu")
    with open(log_path, "ab") as log:
        log.write(f"\n===== section {spec.name} (deadline {deadline_s:.0f} s) {_now_utc()}\n".encode())
        log.flush()
        offset = log.tell()
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env=_child_env(args.dry_run), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        seconds = time.monotonic() - start
    record = _read_json(result_path) or {}
    out = {"status": record.get("status", "crashed"), "seconds": round(seconds, 1), "cpu_s": record.get("cpu_s"),
           "results": record.get("results", {}), "checks": record.get("checks", []),
           "targets": record.get("targets", []), "headline": record.get("headline", []),
           "sub_seconds": record.get("sub_seconds", {})}
    for key in ("reason", "error"):
        if record.get(key):
            out[key] = record[key]
    if timed_out:
        out["status"] = "timeout"
        out["reason"] = (f"killed at its deadline of {deadline_s:.0f} s; results measured before then are kept"
                         + (f" (was in: {record['current']})" if record.get("current") else ""))
    elif proc.returncode != 0 and out["status"] not in ("error",):
        out["status"] = "crashed"
        out["reason"] = f"exit code {proc.returncode}" + (
            f" (signal {signal.Signals(-proc.returncode).name})" if proc.returncode < 0 else "")
        out["error"] = _log_tail(log_path, offset)
    elif out["status"] == "running":  # exited 0 without finishing its record: should not happen
        out["status"] = "crashed"
        out["reason"] = "the section exited without writing its final status"
    return out


def run_section_inprocess(spec: Spec, deadline_s: float, args) -> dict:
    """Debugging aid (--isolation inprocess): no hard deadline, only the checks between sub-measurements."""
    from experiments.bench.gpu_check import sections

    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        sections.run_worker(spec.name, path, args.dry_run, deadline_s, args.allow_cpu)
        record = _read_json(path) or {"status": "crashed"}
    record.pop("current", None)
    record["seconds"] = round(time.monotonic() - start, 1)
    return record


# -------------------------------------------------------------------------------------------------- report


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v == 0:
            return "0"
        a = abs(v)
        return f"{v:.3g}" if a < 1e-2 or a >= 1e5 else (f"{v:.4g}" if a < 1000 else f"{v:,.0f}")
    if isinstance(v, (list, tuple)) and len(v) <= 8 and all(not isinstance(x, (dict, list)) for x in v):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    text = str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def _flatten(d, prefix="") -> list[tuple[str, object]]:
    rows = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            rows.extend(_flatten(v, key + "."))
        else:
            rows.append((key, v))
    return rows


def _env_line(env: dict) -> str:
    parts = [f"{k} {env[k]}" for k in ("device_kind", "backend", "jax", "jaxlib", "python") if env.get(k)]
    cuda = env.get("cuda_versions")
    if isinstance(cuda, dict):
        parts += [f"{k} {v}" for k, v in cuda.items()]
    return ", ".join(parts)


def markdown(report: dict) -> str:
    mode = "dry run on the CPU (tiny shapes; not performance figures)" if report["dry_run"] else "full run"
    lines = [f"# GPU check: {mode}", "",
             f"Started {report['started_utc']}, {report['total_s']:.0f} s in all (budget {report['budget_s']:.0f} s). "
             f"`{' '.join(report['argv'])}`", ""]
    env = report.get("env") or {}
    if env:
        lines += [f"Environment: {_env_line(env)}.", ""]
    if report.get("machine"):
        lines += [f"Host: {summary_line(report['machine'])}.", ""]
    lines += ["| # | section | status | s | headline |", "| --- | --- | --- | --- | --- |"]
    for i, s in enumerate(report["sections"], 1):
        status = s["status"] + (f": {s['reason']}" if s.get("reason") and s["status"] != "ok" else "")
        headline = "; ".join(s.get("headline") or [])
        lines.append(f"| {i} | {s['name']} | {_fmt(status)} | {_fmt(s.get('seconds', 0.0))} | {_fmt(headline)} |")
    targets = report.get("targets") or []
    if targets:
        lines += ["", "## Targets", "", "| target | measured | met |", "| --- | --- | --- |"]
        for t in targets:
            met = {True: "yes", False: "**no**", None: "n/a"}[t.get("met")]
            lines.append(f"| {_fmt(t['name'])} | {_fmt(t.get('value'))} | {met}"
                         f"{' (' + _fmt(t['note']) + ')' if t.get('note') else ''} |")
    for s in report["sections"]:
        lines += ["", f"## {s['name']}: {s['status']} ({_fmt(s.get('seconds', 0.0))} s)", "", s.get("title", "")]
        if s.get("reason"):
            lines += ["", f"Reason: {s['reason']}"]
        checks = s.get("checks") or []
        if checks:
            lines += ["", "| check | passed | detail |", "| --- | --- | --- |"]
            for c in checks:
                passed = "yes" if c["passed"] else "**no**"
                lines.append(f"| {_fmt(c['name'])} | {passed} | {_fmt(c.get('detail', ''))} |")
        rows = _flatten(s.get("results") or {})
        if rows:
            lines += ["", "| measurement | value |", "| --- | --- |"]
            lines += [f"| {_fmt(k)} | {_fmt(v)} |" for k, v in rows]
        if s.get("error"):
            lines += ["", "```", s["error"], "```"]
    return "\n".join(lines) + "\n"


def _summarise_targets(sections: list[dict], dry_run: bool) -> list[dict]:
    real = [s for s in sections if not SPEC_BY_NAME[s["name"]].selftest]
    checks = [c for s in real for c in s.get("checks", [])]
    ran = [s["name"] for s in real if s["status"] not in ("skipped",)]
    failed = [f"{s['name']}: {c['name']}" for s in real for c in s.get("checks", []) if not c["passed"]]
    incomplete = [s["name"] for s in real if s["status"] in ("error", "timeout", "crashed", "partial")]
    out = [{"name": "every equality check passes", "value": f"{len(checks) - len(failed)}/{len(checks)} passed"
            + (f"; failed: {', '.join(failed)}" if failed else "")
            + (f"; sections not finished: {', '.join(incomplete)}" if incomplete else ""),
            "met": (not failed and not incomplete and bool(ran)) if checks else None}]
    for s in sections:
        for t in s.get("targets", []):
            t = dict(t)
            if dry_run:
                t["met"], t["note"] = None, "dry run: tiny shapes on the CPU, not a measurement of the target"
            out.append(t)
    return out


def write_report(report: dict, out_dir: Path) -> None:
    """gpu_check.json (with the host under "machine") and gpu_check.md, each replaced whole (atomically)."""
    report["targets"] = _summarise_targets(report["sections"], report["dry_run"])
    write_json(out_dir / JSON_NAME, report, indent=1)
    write_text(out_dir / MD_NAME, markdown(report))


# -------------------------------------------------------------------------------------------------- main


def _print_done(entry: dict) -> None:
    print(f"[gpu_check] {entry['name']}: {entry['status']} ({entry.get('seconds', 0):.1f} s)"
          + (f": {entry['reason']}" if entry.get("reason") else ""), flush=True)


def _set_env(report: dict, entry: dict) -> None:
    report["env"] = {k: v for k, v in entry["results"].items() if k != "host"}


def _run_parallel(chosen, args, report, out_dir: Path, log_path: Path, tmp: Path, start: float, budget: float):
    """--jobs N (dry run only: on a device the sections would compete for the GPU and their timings would
    mean nothing): N sections at a time, each with its own log, appended to the main log in order."""
    from concurrent.futures import ThreadPoolExecutor

    done: dict[str, dict] = {}

    def one(spec: Spec) -> None:
        left = budget - (time.monotonic() - start)
        deadline = min(spec.dry_deadline_s, left)
        entry = {"name": spec.name, "title": spec.title, "deadline_s": round(deadline, 1)}
        if deadline < min(MIN_SECTION_S, spec.dry_deadline_s):
            entry.update(status="skipped", seconds=0.0,
                         reason=f"budget spent: {max(left, 0):.0f} s of --budget-s {budget:.0f} left")
        else:
            entry.update(run_section_subprocess(spec, deadline, args, tmp / f"{spec.name}.log", tmp))
        done[spec.name] = entry
        _print_done(entry)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for future in [pool.submit(one, spec) for spec in chosen]:
            future.result()
            report["sections"] = [done[s.name] for s in chosen if s.name in done]
            report["total_s"] = round(time.monotonic() - start, 1)
            write_report(report, out_dir)
    with open(log_path, "ab") as log:
        for spec in chosen:
            part = tmp / f"{spec.name}.log"
            if part.exists():
                log.write(part.read_bytes())
    if "env" in done and done["env"].get("results"):
        _set_env(report, done["env"])


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m experiments.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="every section at tiny shapes on the CPU")
    p.add_argument("--sections", default="", help="comma-separated subset, in any order (run in the fixed order)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"wall-clock budget for all sections (default {DEFAULT_BUDGET_S:.0f}; dry run: 600)")
    p.add_argument("--out", default=None, help="output folder (default: $OUT, else runs/bench/gpu_check)")
    p.add_argument("--isolation", choices=("subprocess", "inprocess"), default="subprocess",
                   help="inprocess: for debugging only (deadlines are checked between sub-measurements only)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="run the full-size sections even when no GPU is found (hours on a CPU)")
    p.add_argument("--selftest", action="store_true",
                   help="also run two sections that raise and overrun (the driver's failure paths; tests)")
    p.add_argument("--jobs", type=int, default=1,
                   help="dry run only: sections run this many at a time (each still in its own process)")
    p.add_argument("--list", action="store_true", help="print the sections and exit")
    p.add_argument("--lower-only", action="store_true",
                   help="lower every device program for CUDA on this machine (no GPU needed) and check the custom "
                        "calls and collectives it must contain (experiments/bench/gpu_check/lowering.py)")
    p.add_argument("--programs", default="", help="with --lower-only: comma-separated substrings of program names")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--deadline-s", type=float, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.worker:  # inside a section's subprocess
        from experiments.bench.gpu_check import sections

        return sections.run_worker(args.worker, Path(args.result), args.dry_run, args.deadline_s, args.allow_cpu)
    if args.lower_only:  # its own process: JAX on the CPU with 8 host devices, never this driver's
        out = args.out or os.environ.get("OUT") or str(REPO / "runs" / "bench" / "gpu_check")
        command = [sys.executable, "-m", "experiments.bench.gpu_check.lowering", "--out", out]
        return subprocess.call(command + (["--programs", args.programs] if args.programs else []), cwd=REPO)
    if args.list:
        for s in SPECS:
            print(f"{s.name:18s} {s.deadline_s:5.0f} s  {s.title}{'  (--selftest)' if s.selftest else ''}")
        return 0
    chosen = [s for s in SPECS if not s.selftest or args.selftest]
    if args.sections:
        wanted = [n.strip() for n in args.sections.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in SPEC_BY_NAME]
        if unknown:
            print(f"unknown section(s) {unknown}; choices: {[s.name for s in SPECS]}", file=sys.stderr)
            return 2
        chosen = [s for s in SPECS if s.name in wanted]
    if args.jobs < 1 or (args.jobs > 1 and (not args.dry_run or args.isolation != "subprocess")):
        print("--jobs > 1 needs --dry-run and subprocess isolation (on a device the sections would share the GPU)",
              file=sys.stderr)
        return 2
    budget = args.budget_s if args.budget_s is not None else (600.0 if args.dry_run else DEFAULT_BUDGET_S)
    out_dir = Path(args.out or os.environ.get("OUT") or REPO / "runs" / "bench" / "gpu_check")
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / LOG_NAME
    log_path.write_text(f"gpu_check log, started {_now_utc()}\n")
    start = time.monotonic()
    shown_argv = ["gpu_check", *(argv if argv is not None else sys.argv[1:])]
    report = {"tool": "experiments.bench.gpu_check", "argv": shown_argv,
              "dry_run": args.dry_run, "started_utc": _now_utc(), "budget_s": budget, "total_s": 0.0,
              "env": {}, "sections": [], "machine": describe()}
    no_gpu_reason = None
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        if args.jobs > 1:
            _run_parallel(chosen, args, report, out_dir, log_path, Path(tmp), start, budget)
        for spec in chosen if args.jobs == 1 else ():
            left = budget - (time.monotonic() - start)
            own = spec.dry_deadline_s if args.dry_run else spec.deadline_s
            deadline = min(own, left)
            entry = {"name": spec.name, "title": spec.title, "deadline_s": round(deadline, 1)}
            if no_gpu_reason and spec.name != "env" and not spec.selftest:
                entry.update(status="skipped", reason=no_gpu_reason, seconds=0.0)
            elif deadline < min(MIN_SECTION_S, own):
                entry.update(status="skipped", seconds=0.0,
                             reason=f"budget spent: {max(left, 0):.0f} s of --budget-s {budget:.0f} left")
            else:
                print(f"[gpu_check] {spec.name}: running (deadline {deadline:.0f} s)", flush=True)
                if args.isolation == "subprocess":
                    entry.update(run_section_subprocess(spec, deadline, args, log_path, Path(tmp)))
                else:
                    entry.update(run_section_inprocess(spec, deadline, args))
            _print_done(entry)
            report["sections"].append(entry)
            if spec.name == "env" and entry.get("results"):
                _set_env(report, entry)
                backend = entry["results"].get("backend")
                if not args.dry_run and not args.allow_cpu and backend not in (None, "gpu"):
                    no_gpu_reason = (f"needs GPU: the JAX backend here is {backend!r}; the full-size sections would "
                                     f"take hours on it (use --dry-run, or --allow-cpu)")
            report["total_s"] = round(time.monotonic() - start, 1)
            write_report(report, out_dir)  # after every section: a killed run still leaves its report
    report["total_s"] = round(time.monotonic() - start, 1)
    finish(report["machine"])
    write_report(report, out_dir)
    print(markdown(report).split("\n## ", 1)[0].split("## Targets")[0])
    for t in report["targets"]:
        print(f"target: {t['name']}: {t.get('value')} -> met {t.get('met')}")
    print(f"[gpu_check] wrote {out_dir / JSON_NAME}, {out_dir / MD_NAME}, {log_path} in {report['total_s']:.0f} s")
    bad = [s["name"] for s in report["sections"] if s["status"] not in ("ok", "skipped") and not
           SPEC_BY_NAME[s["name"]].selftest]
    return 1 if bad else 0
