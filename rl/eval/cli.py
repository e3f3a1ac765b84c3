"""`c2jax eval --suite DIR --agent {checkpoint PATH | openai URL | scripted [oracle|noop|nop]} --samples K --out DIR`.

Also: `c2jax eval --suite DIR --manifest` writes the c2bench manifest (c2bench.json) and prints the
suite statistics; `c2jax eval --compare RUN_DIR... --out DIR` plots several runs (Pareto, training).
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("eval", help="evaluate an agent on a task suite (rl/eval)",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default=None,
                        help="task-suite dir, SWE-bench .json/.jsonl, humaneval[:N], or behaviour")
    parser.add_argument("--agent", nargs="+", metavar="KIND [TARGET]", default=None,
                        help="scripted [oracle|noop|nop] | openai URL | checkpoint RUN_DIR")
    parser.add_argument("--samples", type=int, default=None, help="episodes per task (K)")
    parser.add_argument("--out", default=None, help="run directory (results, report; rerun to resume)")
    parser.add_argument("--config", default=None, help="eval YAML (see experiments/configs/eval_small.yaml)")
    parser.add_argument("--repos", default=None, help="SWE-bench: dir with one repository per instance_id")
    parser.add_argument("--image-store", default=None,
                        help="SWE-bench: image store holding each instance's container image "
                             "(default $C2JAX_IMAGE_STORE; used when --repos is not given)")
    parser.add_argument("--model", default=None, help="openai: served model name")
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--sandbox", choices=("bwrap", "local", "docker", "podman", "auto"), default=None)
    parser.add_argument("--label", default=None, help="name of this run in reports")
    parser.add_argument("--step", type=int, default=None, help="training step (x axis of training.png)")
    parser.add_argument("--retry-errors", action="store_true", help="rerun samples that ended in an infra error")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--manifest", action="store_true", help="write c2bench.json for --suite and print stats")
    parser.add_argument("--version", default="v1", help="c2bench version written by --manifest")
    parser.add_argument("--split", default="eval", help="split c2bench takes from the suite ('' = all)")
    parser.add_argument("--compare", nargs="+", default=None, metavar="RUN_DIR",
                        help="plot several finished runs into --out")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides of the eval config")
    return parser


def _config(args):
    """The eval config: --config's YAML, then the KEY=VALUE overrides, then the flags (which win)."""
    from c2jax.config import load
    from c2jax.rl.eval.config import EvalConfig

    flags = [(key, value) for key, value in (
        ("suite", args.suite), ("repos", args.repos), ("image_store", args.image_store), ("out", args.out),
        ("samples", args.samples), ("concurrency", args.concurrency), ("sandbox", args.sandbox),
        ("label", args.label)) if value is not None]
    if args.agent:
        kind, rest = args.agent[0], args.agent[1:]
        if len(rest) > 1:
            raise ValueError(f"--agent takes a kind and at most one target, got {args.agent}")
        flags.append(("agent.kind", kind))
        if rest:
            flags.append(("agent.target", rest[0]))
        elif kind == "scripted":
            flags.append(("agent.target", "oracle"))
        elif kind in ("openai", "checkpoint"):
            raise ValueError(f"--agent {kind} needs a {'base URL' if kind == 'openai' else 'run directory'}")
        if args.model:
            flags.append(("agent.model", args.model))
        if args.step is not None and kind == "checkpoint":
            flags.append(("agent.step", args.step))
    return load(EvalConfig, args.config, [*args.overrides, *flags])


def run(args) -> int:
    import json
    import sys
    from pathlib import Path

    from rich.console import Console

    from c2jax.rl.eval import report, suite
    from c2jax.rl.tasks.task import TaskFormatError

    console = Console()
    try:
        if args.compare:
            if not args.out:
                raise ValueError("--compare needs --out DIR for the plots")
            runs = []
            for d in args.compare:
                p = Path(d) / "results.json"
                if not p.is_file():
                    raise ValueError(f"{d}: no results.json (is it a finished eval run directory?)")
                runs.append(json.loads(p.read_text()))
            for path in report.write_plots(args.out, runs):
                console.print(f"wrote {path}")
            return 0
        cfg = _config(args)
        if args.manifest:
            path = suite.write_manifest(cfg.suite, version=args.version, split=args.split)
            stats = json.loads(path.read_text())["stats"]
            console.print(f"wrote {path}")
            print(suite.stats_markdown(stats))
            return 0
        return _run_eval(cfg, args, console)
    except (suite.SuiteError, TaskFormatError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run_eval(cfg, args, console) -> int:
    from pathlib import Path

    from c2jax.rl.eval import report, suite
    from c2jax.rl.eval.agents import make_factory
    from c2jax.rl.eval.runner import evaluate

    if not cfg.suite:
        raise ValueError("--suite is required")
    out = Path(cfg.out)
    tasks = suite.load_suite(cfg.suite, repos=cfg.repos, image_store=cfg.image_store or None,
                             cache_dir=out / "suite-cache")
    tasks = suite.select(tasks, categories=cfg.categories, split=cfg.split)
    factory = make_factory(cfg.agent)
    step = args.step if args.step is not None else (cfg.agent.step if cfg.agent.step >= 0 else None)
    results = evaluate(tasks, factory, config=cfg, out_dir=out, step=step, progress=not args.no_progress,
                       retry_errors=args.retry_errors)
    summary = results.summary(cfg)
    stats_md = suite.stats_markdown(suite.suite_stats([suite.task_row(t) for t in tasks]))
    for path in report.write_report(out, results, summary, suite_stats_md=stats_md):
        console.print(f"wrote {path}")
    restricted = results.config.get("network_restricted") or {}
    if restricted:
        console.print(f"{len(restricted)} task(s) permit network access they did not get (listed in summary.md; "
                      "allow_network=true shares the host network with tasks allowing the public internet)",
                      markup=False)
    acc = summary["accuracy"]["avg@1"]
    console.print(f"{results.label}: avg@1 {100 * acc['mean']:.1f}% [{100 * acc['ci_low']:.1f}, "
                  f"{100 * acc['ci_high']:.1f}] over {summary['tasks']} tasks x {summary['samples_per_task']}")
    return 0
