"""What a seed's run contributes to a multi-seed table, and how the seeds are summarised.

An extractor reads one finished run directory and returns its `SeedFigures`: named scalars, and for the
figures that are means over tasks, the per-task values (so the summary can bootstrap over seeds and over
tasks within each seed) and the run's own within-seed interval (a task bootstrap).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SeedFigures:
    scalars: dict[str, float]
    per_task: dict[str, list[float]] = field(default_factory=dict)  # figure -> per-task values (mean = scalar)
    within: dict[str, tuple[float, float]] = field(default_factory=dict)  # figure -> the run's own 95% interval


def _read(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (did the run finish?)")
    return json.loads(path.read_text())


def demo_figures(run: Path) -> SeedFigures:
    """`python -m experiments.demo` (any --until): the SFT start (eval before RL), the copy probe's formation
    step, and with RL the after-RL figures and the paired RL effect (after - before per task)."""
    res = _read(run / "results.json")
    cfg = res["meta"]["config"]
    k, kk = cfg["best_of"], cfg["eval_k"]
    scalars: dict[str, float] = {}
    per_task: dict[str, list[float]] = {}
    within: dict[str, tuple[float, float]] = {}
    cpt = res.get("cpt") or {}
    if cpt.get("copy_probe"):
        formed = cpt.get("copy_formed_at_sft_step")
        scalars["copy_formed_at_sft_step"] = float("nan") if formed is None else float(formed)
        scalars["copy_answer_nll_end"] = float(cpt["copy_probe"][-1]["copy_answer"])
    keys = ["avg@1", f"best_of_{k}", f"pass@{k}", f"best_of_{kk}", f"pass@{kk}"]
    for label in ("before", "after"):
        if f"eval_{label}" not in res:
            continue
        row = res[f"eval_{label}"]
        for key in dict.fromkeys(keys):
            scalars[f"{label}/{key}"] = float(row[key])
        for rung, m in row["by_rung"].items():
            scalars[f"{label}/{rung}/avg@1"] = float(m["avg@1"])
        if al := row.get("answer_likelihood"):
            for name in ("context_share_of_word_mass", "answer_over_distractor"):
                if name in al:
                    scalars[f"{label}/{name}"] = float(al[name])
    if "eval_before" in res:
        before = _read(run / "eval" / "before" / "summary.json")["summary"]["per_task"]
        per_task["before/avg@1"] = [before[t]["avg@1"] for t in sorted(before)]
    if "rl_effect" in res:
        after = _read(run / "eval" / "after" / "summary.json")["summary"]["per_task"]
        for key in ("avg@1", f"best_of_{k}", f"pass@{k}"):
            eff = res["rl_effect"]["all"][key]
            scalars[f"rl_effect/{key}"] = float(eff["diff"])
            within[f"rl_effect/{key}"] = (float(eff["ci_low"]), float(eff["ci_high"]))
            per_task[f"rl_effect/{key}"] = [after[t][key] - before[t][key] for t in sorted(before)]
    if "total_s" in res:
        scalars["total_s"] = float(res["total_s"])
    return SeedFigures(scalars, per_task, within)


def ablation02_figures(run: Path) -> SeedFigures:
    """Ablation 02: the first and last online evals and the last eval's paired difference from step 0."""
    res = _read(run / "results.json")
    evals = res["eval"]
    first, last = evals[0], evals[-1]
    scalars, per_task, within = {}, {}, {}
    keys = [key for key in last if key == "avg@1" or key.startswith(("best_of_", "pass@"))]
    keys = [key for key in keys if not key.endswith("/ci")]
    for key in keys:
        scalars[f"step0/{key}"] = float(first[key])
        scalars[f"last/{key}"] = float(last[key])
        if key in (last.get("vs_step0") or {}):
            d = last["vs_step0"][key]
            scalars[f"diff/{key}"] = float(d["diff"])
            within[f"diff/{key}"] = (float(d["ci_low"]), float(d["ci_high"]))
        if first.get("per_prompt") and last.get("per_prompt"):
            tids = sorted(first["per_prompt"])
            per_task[f"diff/{key}"] = [last["per_prompt"][t][key] - first["per_prompt"][t][key] for t in tids]
    scalars["last_step"] = float(last["step"])
    return SeedFigures(scalars, per_task, within)


def spearman(x, y) -> float:
    """Spearman's rank correlation (scipy; tied values get their average rank); nan below 3 points or when either
    side is constant."""
    from scipy.stats import spearmanr

    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(spearmanr(x, y).statistic)


def slope(x, y) -> float:
    """Least-squares slope of y on x (RL reward per nat of post-SFT loss)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    return float(np.polyfit(x, y, 1)[0]) if len(x) >= 2 and np.ptp(x) > 0 else float("nan")


AB01_Y = ("rl_final_train_reward", "eval_reward_after_rl")  # the RL reward the report's Fig. 2 left plots


def ablation01_figures(run: Path) -> SeedFigures:
    """Ablation 01: per CPT budget its losses and RL rewards, and within the seed Spearman and slope of each RL
    reward on the post-SFT loss across budgets (the report: lower post-SFT loss, higher RL reward)."""
    res = _read(run / "results.json")
    scalars: dict[str, float] = {}
    for r in res["runs"]:
        for key in ("cpt_eval_loss", "sft_eval_loss", *AB01_Y, "eval_reward_before_rl"):
            scalars[f"budget_{r['budget']}/{key}"] = float(r[key])
    x = [r["sft_eval_loss"] for r in res["runs"]]
    for key in AB01_Y:
        y = [r[key] for r in res["runs"]]
        scalars[f"spearman/sft_loss_vs_{key}"] = spearman(x, y)
        scalars[f"slope/{key}_per_nat_sft_loss"] = slope(x, y)
    return SeedFigures(scalars)


def ablation01_pooled(runs: dict[int, Path], *, n_boot: int = 4000, seed: int = 0) -> dict[str, Any]:
    """Every (seed, budget) point of ablation 01 pooled: Spearman and slope of each RL reward on the post-SFT
    loss, with 95% intervals from resampling seeds (each drawn seed brings all its budgets)."""
    points = {s: [(r["sft_eval_loss"], {k: r[k] for k in AB01_Y}) for r in _read(d / "results.json")["runs"]]
              for s, d in sorted(runs.items())}
    seeds = list(points)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"seeds": seeds, "points": sum(len(v) for v in points.values())}
    for key in AB01_Y:
        def stats(chosen, key=key):
            pts = [p for s in chosen for p in points[s]]
            xs, ys = [p[0] for p in pts], [p[1][key] for p in pts]
            return spearman(xs, ys), slope(xs, ys)

        rho, b = stats(seeds)
        boot = np.array([stats(rng.choice(seeds, len(seeds))) for _ in range(n_boot if len(seeds) > 1 else 0)])
        row = {"spearman": rho, "slope": b}
        if len(boot):
            for i, name in enumerate(("spearman", "slope")):
                v = boot[:, i][~np.isnan(boot[:, i])]
                row[f"{name}_ci"] = [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))] if len(v) else None
        out[key] = row
    return out


def json_figures(run: Path) -> SeedFigures:
    """Any run that writes results.json: its numeric leaves outside lists, as dotted names."""
    res = _read(run / "results.json")
    scalars: dict[str, float] = {}

    def walk(name: str, v: Any) -> None:
        if isinstance(v, dict):
            for k2, v2 in v.items():
                walk(f"{name}.{k2}" if name else str(k2), v2)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            scalars[name] = float(v)

    walk("", {k: v for k, v in res.items() if k not in ("machine", "git_commit")})
    return SeedFigures(scalars)


EXTRACTORS: dict[str, Callable[[Path], SeedFigures]] = {
    "demo": demo_figures, "ablation01": ablation01_figures, "ablation02": ablation02_figures, "json": json_figures}
# figures that need every seed at once (seed dir by seed -> a dict for seeds.json's "pooled")
POOLED: dict[str, Callable[[dict[int, Path]], dict]] = {"ablation01": ablation01_pooled}


def summarize(figures: dict[int, SeedFigures], *, n_boot: int = 4000, seed: int = 0) -> dict[str, dict]:
    """Per figure over the seeds that have it: the mean, sd, min/max, a 95% percentile-bootstrap interval over
    seeds (None with fewer than 2), the two-level interval (seeds, then tasks within each seed) where per-task
    values exist, and how many seeds' own interval lies above / below 0 where the runs have one."""
    from c2jax.rl.eval.metrics import bootstrap_ci, hierarchical_bootstrap_ci

    names = list(dict.fromkeys(n for f in figures.values() for n in f.scalars))
    out: dict[str, dict] = {}
    for name in names:
        seeds = [s for s, f in sorted(figures.items()) if name in f.scalars and not math.isnan(f.scalars[name])]
        vals = np.array([figures[s].scalars[name] for s in seeds])
        row: dict[str, Any] = {"seeds": len(seeds), "missing": len(figures) - len(seeds)}
        if len(seeds):
            row.update(mean=float(vals.mean()), sd=float(vals.std(ddof=1)) if len(vals) > 1 else None,
                       min=float(vals.min()), max=float(vals.max()))
            row["ci_over_seeds"] = list(bootstrap_ci(vals, n_boot=n_boot, seed=seed)) if len(vals) > 1 else None
            groups = [figures[s].per_task[name] for s in seeds if name in figures[s].per_task]
            if len(groups) == len(seeds):
                row["ci_seeds_and_tasks"] = list(hierarchical_bootstrap_ci(groups, n_boot=n_boot, seed=seed))
            ci = [figures[s].within[name] for s in seeds if name in figures[s].within]
            if ci:
                row["seeds_ci_above_0"] = sum(lo > 0 for lo, _ in ci)
                row["seeds_ci_below_0"] = sum(hi < 0 for _, hi in ci)
                row["seeds_with_ci"] = len(ci)
                row["seeds_positive"] = int(sum(figures[s].scalars[name] > 0 for s in seeds))
        out[name] = row
    return out
