"""What every ablation script shares: its command line, and what its result records about how it was made
(the code's git commit, the machine and its load at the start and at the end)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    """HEAD of the checkout plus '+dirty' when tracked files differ; 'unknown' outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def ablation_args(argv, doc: str, here: Path, quick_help: str):
    """(args, config dict) of an ablation script's command line: --config (default here/config.yaml),
    --out (default here/results) and --quick (`quick_help` says what it shrinks). `args.machine` is the machine
    described as the run starts (its load before the measurement), for `write_result`."""
    import argparse

    import yaml

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(here / "config.yaml"))
    ap.add_argument("--out", default=str(here / "results"))
    ap.add_argument("--quick", action="store_true", help=quick_help)
    args = ap.parse_args(argv)
    from c2jax.machine import describe

    args.machine = describe()
    return args, yaml.safe_load(Path(args.config).read_text())


def write_result(out: str | Path, result: dict, machine: dict | None = None, *, indent: int = 2) -> Path:
    """`result` as out/results.json (atomically: a crash mid-write leaves the previous file), with the git commit
    (unless `result` has one) and `machine` (`args.machine` from `ablation_args`; its end load is taken now)."""
    from c2jax.bench_report import write_json
    from c2jax.machine import describe, finish

    result = {"git_commit": git_commit(), **result}
    return write_json(Path(out) / "results.json", result, machine=finish(machine or describe()), indent=indent)
