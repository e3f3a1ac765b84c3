"""Run one experiment over several seeds and summarise it (python -m experiments.seeds --help).

Each seed runs as its own process (a fresh JAX and Ray per run, as a user would start it) in OUT/seed-S/, its
output in OUT/seed-S/log.txt. Seeds run in sequence by default; `--parallel N` runs N at once on this machine
(each seed then shares the cores: timings are not comparable with a sequential run), `--ray` runs each seed
as a Ray task with `--cpus-per-seed` CPUs on the cluster `ray.init` finds (OUT must then be on a path every
node shares; each seed's own Ray system is started privately inside its task). A seed that finished before
(OUT/seed-S/seed_done.json with exit status 0) is not run again unless --force, so an interrupted study
resumes where it stopped; a failed seed is reported and does not stop the others.

OUT/seeds.json: the command, the machine (CPU, load at start and end), each seed's status, figures and
wall time, and the summary (mean, 95% intervals over seeds and over seeds and tasks; experiments/seeds/
figures.py). OUT/SEEDS.md: the same as tables.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from experiments.seeds.figures import EXTRACTORS, POOLED, summarize

ROOT = Path(__file__).resolve().parents[2]
ABLATIONS = ROOT / "experiments" / "ablations"


def parse_seeds(text: str) -> list[int]:
    """'0-4' -> [0, 1, 2, 3, 4]; '0,2,7' -> [0, 2, 7]; ranges and lists combine ('0-2,9')."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"--seeds: {part!r} is not a seed or a range like 0-4 (in {text!r})")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"--seeds: range {part!r} runs backwards")
        seeds += range(lo, hi + 1)
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: {text!r} names a seed twice")
    return seeds


def ablation_dir(name: str) -> Path:
    """'02', 'ablation02' or '02_rl_lifts_best_of_k' -> its folder under experiments/ablations."""
    m = re.fullmatch(r"(?:ablation)?(\d\d)(?:_\w+)?", name)
    found = sorted(ABLATIONS.glob(f"{m.group(1)}_*")) if m else []
    if not found:
        names = ", ".join(p.name for p in sorted(ABLATIONS.glob("[0-9][0-9]_*")))
        raise ValueError(f"no ablation {name!r}; there are: {names}")
    return found[0]


def seed_config(base: Path, seed: int, run_dir: Path) -> Path:
    """A copy of an ablation's YAML config with `seed: <seed>` (the ablations read their seed from it)."""
    import yaml

    raw = yaml.safe_load(base.read_text()) or {}
    if "seed" not in raw:
        raise ValueError(f"{base}: has no top-level `seed:` for the seed runner to set")
    raw["seed"] = seed
    run_dir.mkdir(parents=True, exist_ok=True)  # the plan is made before any seed runs
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def build_command(target: list[str], seed: int, run_dir: Path) -> tuple[list[str], str]:
    """(argv for this seed, figures extractor name) of `target`: `demo [flags]`, `ablationNN [flags]`, or a
    command whose arguments may contain {seed} and {out}."""
    if not target:
        raise ValueError("name what to run: demo, ablationNN, or -- COMMAND with {seed} and {out}")
    head, rest = target[0], list(target[1:])
    if head == "demo":
        if any(a in ("--seed", "--out") or a.startswith(("--seed=", "--out=")) for a in rest):
            raise ValueError("demo: --seed and --out are set by the seed runner (use --seeds and --out)")
        rest = [a.replace("{seed}", str(seed)) for a in rest]  # e.g. --sft-from runs/seeds/demo/seed-{seed}
        return [sys.executable, "-m", "experiments.demo", "--seed", str(seed), "--out", str(run_dir), *rest], "demo"
    if re.fullmatch(r"(?:ablation)?\d\d(?:_\w+)?", head):
        folder = ablation_dir(head)
        config = folder / "config.yaml"
        if "--config" in rest:
            i = rest.index("--config")
            config = Path(rest[i + 1])
            del rest[i:i + 2]
        if "--out" in rest:
            raise ValueError(f"{head}: --out is set by the seed runner (use its --out)")
        argv = [sys.executable, "-m", f"experiments.ablations.{folder.name}.run", "--config",
                str(seed_config(config, seed, run_dir)), "--out", str(run_dir), *rest]
        return argv, {"01": "ablation01", "02": "ablation02"}.get(folder.name[:2], "json")
    if "{seed}" not in " ".join(target):
        raise ValueError("a custom command must take the seed: put {seed} (and {out}) in its arguments")
    return [a.replace("{seed}", str(seed)).replace("{out}", str(run_dir)) for a in target], "json"


def portable(argv: list[str]) -> list[str]:
    """argv as recorded in seeds.json / SEEDS.md: this interpreter as `python`, paths inside the repository
    relative to its root (the runs are started from there), so a committed study names no machine's paths."""
    root, python = f"{ROOT}{os.sep}", {sys.executable, str(Path(sys.executable).resolve())}
    return ["python" if a in python or a.endswith(("/bin/python", "/bin/python3")) else a.replace(root, "")
            for a in argv]


def run_one(argv: list[str], run_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    """Runs argv with its output in run_dir/log.txt; the record of how it went (also run_dir/seed_done.json)."""
    from c2jax.machine import load_average

    run_dir.mkdir(parents=True, exist_ok=True)
    start, load0 = time.time(), load_average()
    with (run_dir / "log.txt").open("w") as log:
        rc = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    record = {"argv": argv, "returncode": rc, "wall_s": time.time() - start, "load_start": load0,
              "load_end": load_average(), "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    (run_dir / "seed_done.json").write_text(json.dumps(record, indent=1))
    return record


def _ray_run(argv, run_dir, env, cpus):
    import ray

    remote = ray.remote(num_cpus=cpus)(run_one)
    return remote.remote(argv, run_dir, env)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m experiments.seeds", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", required=True, help="e.g. 0-4 or 0,1,5")
    ap.add_argument("--out", required=True, help="study directory (one seed-S/ per seed, seeds.json, SEEDS.md)")
    ap.add_argument("--parallel", type=int, default=1, help="seeds at once on this machine (default 1)")
    ap.add_argument("--ray", action="store_true", help="run each seed as a Ray task (ray.init finds the cluster)")
    ap.add_argument("--cpus-per-seed", type=float, default=2.0, help="Ray CPUs per seed (with --ray)")
    ap.add_argument("--figures", choices=sorted(EXTRACTORS), default=None,
                    help="what to read from each run (default: by target)")
    ap.add_argument("--force", action="store_true", help="rerun seeds that finished before")
    ap.add_argument("--summary-only", action="store_true", help="run nothing; summarise the seeds found in --out")
    ap.add_argument("target", nargs=argparse.REMAINDER,
                    help="demo [flags] | ablationNN [flags] | -- COMMAND ... {seed} ... {out}")
    args = ap.parse_args(argv)
    if args.target[:1] == ["--"]:
        args.target = args.target[1:]
    if args.parallel < 1:
        ap.error(f"--parallel must be >= 1, got {args.parallel}")
    return args


def main(argv=None) -> int:
    from c2jax.bench_report import render_table, write_json, write_text
    from c2jax.machine import describe, finish

    args = parse_args(argv)
    seeds = parse_seeds(args.seeds)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    machine = describe()
    plans = {s: build_command(args.target, s, out / f"seed-{s}") for s in seeds}
    kind = args.figures or plans[seeds[0]][1]
    extractor = EXTRACTORS[kind]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # each seed starts its own Ray system
    records: dict[int, dict] = {}
    todo = []
    for s in seeds:
        done = out / f"seed-{s}" / "seed_done.json"
        if done.is_file() and not args.force and (json.loads(done.read_text()).get("returncode") == 0
                                                  or args.summary_only):
            records[s] = json.loads(done.read_text()) | {"reused": True}
        elif not args.summary_only:
            todo.append(s)
    if todo:
        print(f"seeds {todo} of {seeds}: {' '.join(plans[todo[0]][0])}" + (f" (+{len(todo) - 1} more)"
                                                                           if len(todo) > 1 else ""), flush=True)
    if args.ray and todo:
        import ray

        ray.init(ignore_reinit_error=True)
        refs = {s: _ray_run(plans[s][0], out / f"seed-{s}", env, args.cpus_per_seed) for s in todo}
        for s, ref in refs.items():
            records[s] = ray.get(ref)
            print(f"seed {s}: exit {records[s]['returncode']} in {records[s]['wall_s']:.0f}s", flush=True)
        ray.shutdown()
    else:
        def one(s):
            rec = run_one(plans[s][0], out / f"seed-{s}", env)
            print(f"seed {s}: exit {rec['returncode']} in {rec['wall_s']:.0f}s (log {out / f'seed-{s}' / 'log.txt'})",
                  flush=True)
            return s, rec

        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            records.update(dict(pool.map(one, todo)))
    figures, per_seed = {}, {}
    for s in seeds:
        rec = records.get(s)
        row: dict[str, Any] = {"seed": s, "status": "not run" if rec is None else
                               ("ok" if rec["returncode"] == 0 else f"exit {rec['returncode']}"),
                               "wall_s": None if rec is None else rec["wall_s"],
                               "load_start": None if rec is None else rec.get("load_start")}
        if rec is not None and rec["returncode"] == 0:
            try:
                figures[s] = extractor(out / f"seed-{s}")
                row["figures"] = figures[s].scalars
                row["within_seed_ci"] = figures[s].within
            except (FileNotFoundError, KeyError) as e:
                row["status"] = f"unreadable: {e}"
        per_seed[s] = row
    summary = summarize(figures) if figures else {}
    result = {"command": portable(args.target), "summary_only": bool(args.summary_only), "seeds": seeds,
              "per_seed": list(per_seed.values()), "summary": summary}
    if kind in POOLED and figures:
        result["pooled"] = POOLED[kind]({s: out / f"seed-{s}" for s in figures})
    write_json(out / "seeds.json", result, machine=finish(machine))
    text = seeds_markdown(result, machine, render_table)
    write_text(out / "SEEDS.md", text)
    print(text)
    failed = [s for s in seeds if per_seed[s]["status"] != "ok"]
    if failed:
        print(f"seeds not ok: {failed} (see their log.txt)", file=sys.stderr)
    return 1 if failed else 0


def _fmt_ci(ci) -> str:
    return "" if not ci else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def seeds_markdown(result: dict, machine: dict, render_table) -> str:
    """SEEDS.md: one row per figure, a column per seed, then the mean and its intervals; then each seed's status."""
    from c2jax.machine import summary_line

    seeds = result["seeds"]
    by_seed = {r["seed"]: r for r in result["per_seed"]}
    rows = []
    for name, s in result["summary"].items():
        if not s.get("seeds"):
            continue
        rows.append({"figure": name, **{f"seed {k}": by_seed[k].get("figures", {}).get(name, float("nan"))
                                        for k in seeds},
                     "mean": s["mean"], "95% CI over seeds": _fmt_ci(s["ci_over_seeds"]),
                     "95% CI seeds+tasks": _fmt_ci(s.get("ci_seeds_and_tasks")),
                     "seeds CI>0": (f"{s['seeds_ci_above_0']}/{s['seeds_with_ci']}" if "seeds_with_ci" in s else "")})
    status = [{"seed": r["seed"], "status": r["status"], "wall_s": r["wall_s"] or 0.0,
               "load at start": "/".join(f"{x:.2f}" for x in r["load_start"]) if r.get("load_start") else ""}
              for r in result["per_seed"]]
    pooled = ""
    if result.get("pooled"):
        prow = [{"RL reward vs post-SFT loss (all seeds x budgets)": k, "Spearman": v["spearman"],
                 "95% CI (seeds resampled)": _fmt_ci(v.get("spearman_ci")), "slope (reward / nat)": v["slope"],
                 "slope 95% CI": _fmt_ci(v.get("slope_ci"))}
                for k, v in result["pooled"].items() if isinstance(v, dict)]
        pooled = "\n\n" + render_table(prow)
    # --summary-only: the machine line is when the table was made; each seed's own load is in the status table
    where = "Summarised (nothing run) on" if result.get("summary_only") else "Machine"
    return (f"# `{' '.join(result['command'])}` over seeds {seeds}\n\n{where}: {summary_line(machine)}\n\n"
            + (render_table(rows) if rows else "(no finished seed)") + pooled + "\n\n" + render_table(status) + "\n")


__all__ = ["build_command", "main", "parse_seeds", "portable", "run_one", "seeds_markdown"]
