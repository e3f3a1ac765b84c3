"""`c2jax rl --config experiments/configs/rl_small.yaml [key=value ...]`: an asynchronous RL run on Ray.

`c2jax rl --tasks PATH [--tasks PATH ...] [--preset NAME] [--steps N] [--out DIR] [key=value ...]`: RL on task
suites (docs/rl_on_suites.md): each PATH (a directory of task directories in any layout `c2jax eval` runs, a
pinned c2bench directory, or a SWE-bench .json/.jsonl with `env.sources` settings for its repositories) is one
`env.kind: suite` source, split train / held-out by task-id hash. Without --config the run starts from
QUICK_SUITE, a laptop-sized setting (the `tiny` preset on the byte tokenizer, 2 rollout workers, the pass-rate
filter on, an online eval every 2 steps on the held-out split); --config gives every other setting instead.
"""

from __future__ import annotations

import argparse

# `c2jax rl --tasks` without --config: byte tokens, so a prompt costs one token per character: the short system
# prompt (one line per tool, ~0.6k) plus task instructions of up to ~10k characters (SWE-bench problem statements
# run that long) fit the engine's and the packed rows' 12288; everything else is the RLSystemConfig default
QUICK_SUITE = {
    "name": "rl_suite",
    "model": {"preset": "tiny", "moe_impl": "dense", "vocab_size": 264, "max_position_embeddings": 16384,
              "num_nextn_predict_layers": 0},
    "rl": {"learning_rate": 1.0e-3, "loss": {"constant_normalizer": 256.0}},
    "engine": {"slots": 4, "max_len": 12288, "chunk_steps": 8, "key_bucket": 512, "min_prompt_bucket": 16},
    "env": {"kind": "suite", "sandbox": "bwrap", "prompt_level": "terse", "eval_prompts": 4,
            "episode": {"max_turns": 2, "max_model_tokens": 48, "max_new_tokens_per_turn": 24,
                        "max_context_tokens": 12000, "wall_clock_s": 300.0, "tool_schemas": "signatures"}},
    "system": {"steps": 5, "group_size": 2, "groups_per_step": 2, "num_rollout_workers": 2, "seq_len": 12288,
               "min_rows": 2, "call_timeout_s": 600.0, "group_timeout_s": 1200.0},
    "curriculum": {"by": "turns", "filter": {"enabled": True, "window": 2, "min_groups": 1}},
    "eval": {"every": 2, "k": 2},
    "checkpoint": {"every": 5},
    "ray": {"num_cpus": 2},
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("rl", help="asynchronous RL on Ray (rl/system)", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="RL system YAML (see experiments/configs/rl_small.yaml)")
    parser.add_argument("--tasks", action="append", default=[], metavar="PATH",
                        help="train on this task suite (repeatable: one env.sources entry each)")
    parser.add_argument("--preset", default=None, help="model preset (with --tasks; default tiny)")
    parser.add_argument("--steps", type=int, default=None, help="learner steps (system.steps)")
    parser.add_argument("--out", default=None, help="output directory (output_dir); the run is OUT/NAME")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. system.mode=sync")
    return parser


def command_line_config(args):
    """The RLSystemConfig the command line names: --config (or QUICK_SUITE with --tasks), the --tasks /
    --preset / --steps / --out shorthands, then KEY=VALUE overrides."""
    from c2jax.config import ConfigError, load
    from c2jax.rl.system.config import RLSystemConfig

    tasks = [p for spec in args.tasks for p in spec.split(",") if p]
    if (args.preset or args.steps is not None or args.out) and not (tasks or args.config):
        raise ConfigError("--preset / --steps / --out shorten a --tasks run; give --tasks PATH (or use --config "
                          "and KEY=VALUE overrides)")
    source = args.config if args.config is not None else (QUICK_SUITE if tasks else None)
    shorthand: list = []
    if tasks:
        shorthand += [("env.kind", "suite"), ("env.sources", [{"path": p} for p in tasks])]
    if args.preset:
        shorthand.append(("model.preset", args.preset))
    if args.steps is not None:
        if args.steps <= 0:
            raise ConfigError(f"--steps must be positive, got {args.steps}")
        shorthand.append(("system.steps", args.steps))
    if args.out:
        shorthand.append(("output_dir", args.out))
    return load(RLSystemConfig, source, [*shorthand, *args.overrides])


def run(args) -> int:
    import json
    import sys

    from rich.console import Console

    from c2jax.rl.system.dashboard import Dashboard
    from c2jax.rl.system.reconciler import Reconciler

    cfg = command_line_config(args)
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
            # the overall figures; per-category ones (category/NAME/...) and intervals are in metrics.jsonl
            print(f"eval  v{e['step']}: " + ", ".join(f"{k} {v:.3f}" for k, v in e.items()
                                                     if k not in ("step", "prompts", "per_prompt") and "/" not in k
                                                     or k == "reward/mean"))
        self.evals_seen = len(rec.eval_history)
