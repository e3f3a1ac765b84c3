"""A mixed-suite async RL run on CPU (issue 40's acceptance run): c2bench v1 + generated ladder tasks + image tasks,
one environment worker killed mid-run.

    python -m experiments.suites.mixed_run --c2bench runs/tasks/c2bench_v1 --image-store runs/images \
        --out runs/suites/mixed [--steps 5] [--kill-env-at 2]

Sources: c2bench v1 (the pinned 64 tasks, 25% held out by task-id hash), a generated ladder (echo + lookup), and
image tasks written here (experiments/suites/image_tasks.py): one running in the store's Debian image (`c2jax
images debian`, an `oci-image` environment) and one whose Dockerfile builds over it (`dockerfile`). The tiny
preset on the byte tokenizer cannot solve c2bench or the image tasks, so the pass-rate filter drops them; the
report says which, how each episode's environment was made, and whether any group or episode was lost when the
environment worker was killed (Ray restarts it; episodes whose sandbox died with it run again).

Writes OUT/mixed_run.json and OUT/MIXED_RUN.md (the run itself: OUT/mixed/, TensorBoard in OUT/mixed/tensorboard).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

from experiments.suites.image_tasks import DEBIAN_REFERENCE, write_image_tasks


def run_config(args, out: Path, image_tasks: Path):
    from c2jax.config import load
    from c2jax.rl.system.cli import QUICK_SUITE
    from c2jax.rl.system.config import RLSystemConfig

    sources = [{"path": str(args.c2bench), "name": "c2bench", "held_out_fraction": 0.25},
               {"ladder": {"rungs": ["echo", "lookup"], "per_rung": 8}, "name": "ladder"},
               {"path": str(image_tasks), "name": "images", "split": "train"}]
    overrides = [("env.sources", sources), ("output_dir", str(out)), "name=mixed", f"system.steps={args.steps}",
                 f"seed={args.seed}", "resume=false", "dashboard=false",
                 # the short system prompt (one line per tool) keeps byte-token prompts under 2k
                 "env.episode.tool_schemas=signatures", "engine.max_len=4096", "system.seq_len=4096",
                 "env.episode.max_context_tokens=4000", "env.eval_prompts=4", "eval.every=5", "eval.k=2",
                 "curriculum.filter.window=1", "curriculum.filter.min_groups=1", "curriculum.filter.reprobe_rate=0.05",
                 "system.max_episode_retries=2", "system.max_group_retries=3", "checkpoint.every=100"]
    return load(RLSystemConfig, QUICK_SUITE, [*overrides, *args.overrides])


def pinned_share(c2bench: Path) -> dict:
    """How many of the directory's tasks are c2bench v1 tasks exactly as pinned (sha256 of the task directory equal
    to experiments/configs/c2bench_v1.json's row): a partial build (some libraries) is still the pinned tasks."""
    from c2jax.rl.eval.suite import task_sha256
    from c2jax.rl.tasks.task import load_tasks

    manifest = Path(__file__).resolve().parents[1] / "configs" / "c2bench_v1.json"
    pinned = {r["id"]: r["sha256"] for r in json.loads(manifest.read_text())["tasks"]}
    tasks = load_tasks(c2bench)
    same = [t.id for t in tasks if pinned.get(t.id) == task_sha256(t)]
    return {"tasks": len(tasks), "pinned_equal": len(same), "pinned_total": len(pinned),
            "not_pinned": sorted(t.id for t in tasks if t.id not in same)}


def tensorboard_tags(run_dir: Path) -> dict:
    """The scalar tags TensorBoard shows for the run, grouped: how many per-category and per-source ones."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in (run_dir / "tensorboard").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return {"scalars": len(tags), "category": sorted(t for t in tags if "category/" in t),
            "source": sorted(t for t in tags if "source/" in t)}


def summarize(run_dir: Path, out: dict) -> dict:
    rows = [json.loads(line) for line in (run_dir / "groups.jsonl").read_text().splitlines() if line.strip()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    meta = {}
    cfg_tasks = out.get("tasks", {})
    kinds = collections.Counter()
    per_source = collections.defaultdict(collections.Counter)
    for r in rows:
        for x in r.get("rollouts") or []:
            graded = x.get("error") is None
            kinds[(x.get("env_kind") or "?", "graded" if graded else "errored")] += 1
        meta.setdefault(r["prompt_id"], 0)
        meta[r["prompt_id"]] += 1
    filtered = [e for e in events if e["event"] == "filter_filtered"]
    reinstated = [e for e in events if e["event"] == "filter_reinstated"]
    for e in filtered:
        per_source[e["source"]]["filtered"] += 1
    c = out["counts"]
    made = c.get("groups_dispatched", 0)
    settled = c.get("groups_returned", 0) + c.get("groups_lost", 0) + out["inflight_at_end"] + out["retry_at_end"]
    return {"steps": out["steps"], "wall_s": out["wall_s"], "counts": c,
            "episodes_by_environment": {f"{k}/{s}": n for (k, s), n in sorted(kinds.items())},
            "tasks": cfg_tasks,
            "filtered": [{k: e[k] for k in ("prompt_id", "source", "solve_rate")} for e in filtered],
            "reinstated": [e["prompt_id"] for e in reinstated], "groups_dispatched": made, "groups_settled": settled,
            "groups_lost": c.get("groups_lost", 0), "episodes_errored": c.get("episodes_errored", 0),
            "eval": [{k: v for k, v in e.items() if k != "per_prompt"} for e in out.get("eval", [])]}


def markdown(report: dict) -> str:
    lines = ["# Mixed-suite RL run", "", f"machine: {report['machine']}", f"command: `{report['command']}`", "",
             f"{report['steps']} async steps in {report['wall_s']:.0f} s; groups dispatched "
             f"{report['groups_dispatched']}, settled {report['groups_settled']}, lost {report['groups_lost']}; "
             "episodes errored "
             f"{report['episodes_errored']}; environment worker killed at step {report['killed_env_at']} "
             f"(restarts seen: {report['env_restarts']}).", "",
             f"c2bench source: {report['c2bench']['tasks']} tasks, {report['c2bench']['pinned_equal']} of them c2bench "
             f"v1 tasks as pinned (sha256 equal to the manifest's rows; the manifest has "
             f"{report['c2bench']['pinned_total']}).", "", "| environment kind / outcome | episodes |",
             "|---|---|"]
    lines += [f"| {k} | {n} |" for k, n in report["episodes_by_environment"].items()]
    lines += ["", "| source / category | train | held out |", "|---|---|---|"]
    lines += [f"| {k} | {v['train']} | {v['held_out']} |" for k, v in sorted(report["tasks"].items())]
    tb = report.get("tensorboard", {})
    if tb:
        lines += ["", f"TensorBoard: {tb['scalars']} scalar tags, {len(tb['category'])} per category (e.g. "
                      f"{', '.join(tb['category'][:3])}), {len(tb['source'])} per source."]
    lines += ["", f"filtered ({len(report['filtered'])}): " + ", ".join(
        f"{f['prompt_id']} ({f['source']}, {f['solve_rate']:.2f})" for f in report["filtered"])]
    if report["eval"]:
        last = report["eval"][-1]
        cats = sorted(k[len("category/"):-len("/avg@1")] for k in last
                      if k.startswith("category/") and k.endswith("/avg@1"))
        lines += ["", f"online eval at step {last['step']}: avg@1 {last['avg@1']:.3f} "
                      f"[{last['avg@1/ci_low']:.3f}, {last['avg@1/ci_high']:.3f}]; by category: " + ", ".join(
                          f"{c} {last[f'category/{c}/avg@1']:.3f}" for c in cats)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--c2bench", required=True, type=Path, help="a built c2bench v1 directory (with c2bench.json)")
    p.add_argument("--image-store", required=True, type=Path,
                   help=f"an image store holding {DEBIAN_REFERENCE} (`c2jax images debian --store DIR`)")
    p.add_argument("--out", type=Path, default=Path("runs/suites/mixed"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-env-at", type=int, default=2, help="kill environment worker 0 after this step; 0: never")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    from c2jax.machine import summary_line
    from c2jax.rl.sandbox.oci import IMAGE_CACHE_ENV, IMAGE_STORE_ENV

    # Ray actors inherit the driver's environment: the store must be set before the cluster starts
    os.environ[IMAGE_STORE_ENV] = str(args.image_store.resolve())
    os.environ.setdefault(IMAGE_CACHE_ENV, str((args.out / "image-cache").resolve()))
    args.out.mkdir(parents=True, exist_ok=True)
    image_tasks = write_image_tasks(args.out / "image_tasks")
    cfg = run_config(args, args.out, image_tasks)
    import ray

    from c2jax.rl.system.reconciler import Reconciler

    killed = {"step": 0, "pid_before": None}

    def on_step(rec):
        if args.kill_env_at and rec.version == args.kill_env_at and not killed["step"]:
            killed["pid_before"] = ray.get(rec.env_workers[0].check_tasks.remote())["pid"]
            ray.kill(rec.env_workers[0], no_restart=False)  # Ray restarts it (system.max_restarts)
            killed["step"] = rec.version
            print(f"killed environment worker 0 (pid {killed['pid_before']}) after step {rec.version}", flush=True)

    t0 = time.time()
    load0 = summary_line()
    rec = Reconciler(cfg, on_step=on_step)
    try:
        rec.start()
        out = rec.run()
        after = ray.get(rec.env_workers[0].check_tasks.remote(), timeout=120)["pid"]
    finally:
        rec.shutdown()
    report = summarize(cfg.run_dir, out) | {"c2bench": pinned_share(args.c2bench),
                                            "tensorboard": tensorboard_tags(cfg.run_dir)}
    report |= {"machine": f"{load0} (at start); {summary_line()} (at end)", "wall_total_s": time.time() - t0,
               "command": "python -m experiments.suites.mixed_run "
                          + " ".join(argv if argv is not None else sys.argv[1:]),
               "killed_env_at": killed["step"], "env_restarts": int(killed["pid_before"] is not None
                                                                    and after != killed["pid_before"])}
    (args.out / "mixed_run.json").write_text(json.dumps(report, indent=1, default=float))
    (args.out / "MIXED_RUN.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
