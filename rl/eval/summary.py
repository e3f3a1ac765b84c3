"""Aggregating per-sample results into the numbers a report shows (pure: results in, dict out)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from c2jax.rl.eval.config import PricingConfig
from c2jax.rl.eval.metrics import best_of_k, bootstrap_ci, cost_usd, median, pass_at_k, pass_hat_k
from c2jax.rl.eval.store import SampleResult


def by_task(results: Sequence[SampleResult]) -> dict[str, list[SampleResult]]:
    out: dict[str, list[SampleResult]] = defaultdict(list)
    for r in results:
        out[r.task_id].append(r)
    return {tid: sorted(rs, key=lambda r: r.sample) for tid, rs in sorted(out.items())}


def per_task_metrics(rs: Sequence[SampleResult], ks: Sequence[int]) -> dict[str, float]:
    n, c = len(rs), sum(r.resolved for r in rs)
    out = {"n": n, "c": c, "avg@1": c / n}
    for k in ks:
        if k <= n:
            out[f"pass@{k}"] = pass_at_k(n, c, k)
            out[f"pass^{k}"] = pass_hat_k(n, c, k)
            out[f"best_of_{k}"] = best_of_k([r.resolved for r in rs], [r.selector_score for r in rs], k)
    return out


def _with_ci(values: list[float], n_boot: int, alpha: float, seed: int) -> dict[str, float]:
    lo, hi = bootstrap_ci(values, n_boot=n_boot, alpha=alpha, seed=seed)
    return {"mean": float(np.mean(values)), "ci_low": lo, "ci_high": hi}


def _accuracy(per_task: dict[str, dict[str, float]], ks, n_boot, alpha, seed) -> dict[str, Any]:
    min_n = min(m["n"] for m in per_task.values())
    keys = ["avg@1"] + [f"{name}{k}" for k in ks if k <= min_n for name in ("pass@", "pass^", "best_of_")]
    return {key: _with_ci([m[key] for m in per_task.values()], n_boot, alpha, seed) for key in keys}


def summarize(results: Sequence[SampleResult], *, ks: Sequence[int] = (1, 2, 4, 8),
              pricing: PricingConfig | None = None, n_boot: int = 2000, alpha: float = 0.05,
              seed: int = 0) -> dict[str, Any]:
    """Accuracy (avg@1, pass@k, pass^k, best-of-k, each with a bootstrap CI over tasks), the same per
    category, and efficiency: tokens, turns, tool calls, wall time and cost per sample and per task.
    k values above the smallest per-task sample count are left out (pass@k needs n >= k)."""
    if not results:
        raise ValueError("summarize: no results")
    pricing = pricing or PricingConfig()
    tasks = by_task(results)
    per_task = {tid: per_task_metrics(rs, ks) for tid, rs in tasks.items()}
    category = {tid: rs[0].category for tid, rs in tasks.items()}
    by_cat: dict[str, dict[str, dict]] = defaultdict(dict)
    for tid, m in per_task.items():
        by_cat[category[tid]][tid] = m
    costs = [cost_usd(r.input_tokens, r.completion_tokens, input_per_m=pricing.input_per_m,
                      output_per_m=pricing.output_per_m) for r in results]
    cost_per_task = [float(np.mean([costs[i] for i, r in enumerate(results) if r.task_id == tid])) for tid in tasks]

    def stat(attr):
        values = [float(getattr(r, attr)) for r in results]
        return {"median": median(values), "mean": float(np.mean(values)), "total": float(np.sum(values))}

    return {
        "tasks": len(tasks), "samples_per_task": min(m["n"] for m in per_task.values()),
        "episodes": len(results),
        "accuracy": _accuracy(per_task, ks, n_boot, alpha, seed),
        "categories": {cat: {"tasks": len(m), **{k: v["mean"] for k, v in
                                                   _accuracy(m, ks, n_boot, alpha, seed).items()}}
                       for cat, m in sorted(by_cat.items())},
        "efficiency": {
            "completion_tokens": stat("completion_tokens"), "input_tokens": stat("input_tokens"),
            "tool_output_tokens": stat("tool_output_tokens"), "turns": stat("turns"),
            "tool_calls": stat("tool_calls"), "wall_s": stat("wall_s"), "grade_s": stat("grade_s"),
            "tokens_estimated": any(r.tokens_estimated for r in results),
        },
        "cost_usd": {"median_per_task": median(cost_per_task), "mean_per_episode": float(np.mean(costs)),
                     "total": float(np.sum(costs)), "input_per_m": pricing.input_per_m,
                     "output_per_m": pricing.output_per_m},
        "statuses": dict(sorted(Counter(r.status for r in results).items())),
        "finish_reasons": dict(sorted(Counter(r.finish_reason for r in results).items())),
        "errors": sum(r.status == "error" for r in results),
        "per_task": per_task,
    }


def paired_difference(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], keys: Sequence[str],
                      *, categories: dict[str, str] | None = None, n_boot: int = 2000, alpha: float = 0.05,
                      seed: int = 0) -> dict[str, Any]:
    """`after - before` on the same tasks, for each metric in `keys` (per-task values, as `summarize`'s
    `per_task`): the means, the mean paired difference and its percentile-bootstrap interval over tasks
    (resampling tasks keeps each task's before and after together, so task difficulty cancels out). With
    `categories` (task id -> category) also per category. `significant`: the interval lies above zero."""
    if set(before) != set(after):
        only = sorted(set(before) ^ set(after))[:5]
        raise ValueError(f"paired_difference needs the same tasks before and after; these differ: {only}")
    if not before:
        raise ValueError("paired_difference: no tasks")
    for key in keys:
        missing = [t for t in before if key not in before[t] or key not in after[t]]
        if missing:
            raise ValueError(f"paired_difference: metric {key!r} missing for tasks {missing[:5]}")

    def compare(tids: list[str]) -> dict[str, Any]:
        out: dict[str, Any] = {"tasks": len(tids)}
        for key in keys:
            b = np.array([before[t][key] for t in tids], np.float64)
            a = np.array([after[t][key] for t in tids], np.float64)
            lo, hi = bootstrap_ci(a - b, n_boot=n_boot, alpha=alpha, seed=seed)
            out[key] = {"before": float(b.mean()), "after": float(a.mean()), "diff": float((a - b).mean()),
                        "ci_low": lo, "ci_high": hi, "significant": lo > 0.0}
        return out

    tids = sorted(before)
    result: dict[str, Any] = {"all": compare(tids), "alpha": alpha, "bootstrap_samples": n_boot}
    if categories:
        cats = sorted({categories[t] for t in tids})
        result["categories"] = {c: compare([t for t in tids if categories[t] == c]) for c in cats}
    return result
