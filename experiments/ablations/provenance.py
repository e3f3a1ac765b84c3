"""What every ablation script shares: its command line, and what its result records about how it was made
(the code's git commit)."""

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
    --out (default here/results) and --quick (`quick_help` says what it shrinks)."""
    import argparse

    import yaml

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(here / "config.yaml"))
    ap.add_argument("--out", default=str(here / "results"))
    ap.add_argument("--quick", action="store_true", help=quick_help)
    args = ap.parse_args(argv)
    return args, yaml.safe_load(Path(args.config).read_text())
