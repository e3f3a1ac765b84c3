"""`c2jax rl --config experiments/configs/rl_small.yaml [key=value ...]`: an asynchronous RL run on Ray."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("rl", help="asynchronous RL on Ray (rl/system)", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="RL system YAML (see experiments/configs/rl_small.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. system.mode=sync")
    return parser


def run(args) -> int:
    import json
    import sys

    from rich.console import Console

    from c2jax.config import load
    from c2jax.rl.system.config import RLSystemConfig
    from c2jax.rl.system.dashboard import Dashboard
    from c2jax.rl.system.reconciler import Reconciler

    cfg = load(RLSystemConfig, args.config, args.overrides)
    console = Console()
    rec = Reconciler(cfg)
    live = cfg.dashboard and sys.stdout.isatty()
    try:
        console.print(f"[bold]c2jax rl[/] {cfg.name}: {cfg.system.mode}, {cfg.system.steps} steps -> {cfg.run_dir}")
        rec.start()
        if rec.start_version:
            console.print(f"resumed at learner version {rec.start_version} with "
                          f"{rec.counts['groups_resumed']} persisted groups")
        if live:
            with Dashboard(console) as dash:
                out = rec.run(dash)
        else:
            out = rec.run(_Printer(console, cfg.log_every))
    finally:
        rec.shutdown()
    summary = {k: v for k, v in out.items() if k not in ("history",)}
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    first = out["history"][0]["reward/mean"] if out["history"] else float("nan")
    last = out["history"][-1]["reward/mean"] if out["history"] else float("nan")
    console.print(f"done: {out['steps']} steps in {out['wall_s']:.1f}s, reward {first:.3f} -> {last:.3f}; "
                  f"counts {dict(out['counts'])}")
    return 0


class _Printer:
    """Non-TTY progress: one line per logged step."""

    def __init__(self, console, every: int):
        self.console, self.every, self.seen, self.evals_seen = console, every, 0, 0

    def update(self, rec) -> None:
        if len(rec.history) == self.seen:
            return
        self.seen = len(rec.history)
        h = rec.history[-1]
        if h["step"] % self.every == 0 or h["step"] >= rec.cfg.system.steps:
            print(
                f"step {h['step']:4d}  reward {h['reward/mean']:.3f}  staleness max {h['staleness/batch_max']:.0f}  "
                f"ready {h['queue/ready']:.0f} inflight {h['queue/inflight']:.0f}  "
                f"tok/s {h['throughput/tokens_per_s']:.1f}  sync {h['sync/bytes'] / 1024:.1f} KiB")
        for e in rec.eval_history[self.evals_seen:]:
            print(f"eval  v{e['step']}: " + ", ".join(f"{k} {v:.3f}" for k, v in e.items()
                                                                   if k not in ("step", "prompts", "per_prompt")))
        self.evals_seen = len(rec.eval_history)
