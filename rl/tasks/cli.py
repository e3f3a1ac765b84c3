"""`c2jax tasks build --config CONFIG.yaml --out DIR` and `c2jax tasks validate DIR [--sandbox local]`."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("tasks", help="build and validate task suites (rl/tasks)",
                                   description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="tasks_command", required=True, metavar="ACTION")
    build = sub.add_parser("build", help="build a task suite from a YAML config")
    build.add_argument("--config", required=True, help="suite YAML (see experiments/configs/tasks_small.yaml)")
    build.add_argument("--out", required=True, help="directory the task directories are written to")
    build.add_argument("overrides", nargs="*", help="dotted key=value overrides of the config")
    val = sub.add_parser("validate", help="check hidden tests fail on the base and pass with the reference")
    val.add_argument("dir", help="a task directory or a suite of them")
    val.add_argument("--sandbox", default="bwrap", choices=("bwrap", "local", "docker", "podman", "auto"))
    val.add_argument("--allow-network", action="store_true",
                     help="tasks whose task.toml permits the public internet share the host's network")
    val.add_argument("--json", default=None, help="also write the per-task results to this JSON file")
    return parser


def run(args) -> int:
    import json

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from c2jax.config import load
    from c2jax.progress import progress
    from c2jax.rl.tasks.build import SuiteConfig, build_suite, sandbox_factory, validate_task
    from c2jax.rl.tasks.task import load_tasks

    console = Console()
    if args.tasks_command == "build":
        cfg = load(SuiteConfig, args.config, args.overrides)
        errors: list[str] = []
        written = build_suite(cfg, args.out, errors=errors)
        console.print(f"wrote {len(written)} tasks to {args.out} (manifest.json lists them)")
        for err in errors:
            console.print(f"[red]skipped[/] {escape(err)}")
        return 1 if errors else 0

    factory = sandbox_factory(args.sandbox, allow_network=args.allow_network)
    results = []
    tasks = load_tasks(args.dir)
    network = {t.id: note for t in tasks if t.supported and t.environment is not None
               and (note := t.environment.network_note(args.allow_network)) is not None}
    with progress(len(tasks), desc="tasks validate", unit="task") as bar:
        for task in tasks:
            results.append(validate_task(task, factory))
            bar.update()
    table = Table("task", "ok", "reason")
    for v in results:
        # reasons quote task.toml tables ("[verifier].timeout_sec"), which rich would read as markup
        table.add_row(escape(v.task_id), "[green]yes[/]" if v.ok else "[red]no[/]", escape(v.reason))
    console.print(table)
    bad = [v for v in results if not v.ok]
    console.print(f"{len(results) - len(bad)}/{len(results)} tasks valid")
    if network:
        console.print(f"{len(network)} task(s) permit network access they do not get here "
                      "(--allow-network shares the host network with tasks allowing the public internet):",
                      markup=False)
        for tid, note in sorted(network.items()):
            console.print(f"  {tid}: {note}", markup=False, highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"task_id": v.task_id, "ok": v.ok, "reason": v.reason, "network": network.get(v.task_id)}
                       for v in results], f, indent=1)
    return 1 if bad else 0
