"""Reports of a run: results.json, summary.md, PNG plots, and SWE-bench predictions / report files.

Plots (matplotlib, Agg backend, no display needed):
  pareto.png    accuracy (avg@1) against median completion tokens per episode, one point per agent or
                checkpoint, with the Pareto frontier (the Composer 2 report's efficiency view, §7 / Fig. 11)
  training.png  avg@1 and best-of-K over training steps (report Fig. 5: both should rise under RL)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from c2jax.rl.eval.runner import EvalResults
from c2jax.rl.eval.store import SampleResult
from c2jax.rl.eval.summary import by_task


# ------------------------------------------------------------------------------------------ files
def write_results(out_dir: str | Path, results: EvalResults, summary: dict[str, Any]) -> Path:
    path = Path(out_dir) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"label": results.label, "step": results.step, "samples": results.samples,
                                "config": results.config, "summary": summary}, indent=1))
    return path


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def network_markdown(restricted: dict[str, str]) -> str:
    """The tasks that ran with less network than their task.toml permits, one line each."""
    lines = [f"{len(restricted)} task(s) permit network access they did not get (allow_network; "
             "docs/sandbox.md):", ""]
    lines += [f"- `{tid}`: {note}" for tid, note in sorted(restricted.items())]
    return "\n".join(lines)


def summary_markdown(label: str, summary: dict[str, Any], suite_stats_md: str | None = None,
                     network_restricted: dict[str, str] | None = None) -> str:
    acc = summary["accuracy"]
    lines = [f"# Eval: {label}", "",
             f"{summary['tasks']} tasks x {summary['samples_per_task']} samples = {summary['episodes']} episodes; "
             f"errors: {summary['errors']}.", "",
             "| metric | % | 95% CI (bootstrap over tasks) |", "|---|---|---|"]
    for key, v in acc.items():
        lines.append(f"| {key} | {_pct(v['mean'])} | {_pct(v['ci_low'])} - {_pct(v['ci_high'])} |")
    cats = summary["categories"]
    metric_keys = [k for k in acc if k == "avg@1" or k.startswith("pass@") or k.startswith("best_of_")]
    lines += ["", "## By category", "", "| category | tasks | " + " | ".join(metric_keys) + " |",
              "|---|---|" + "---|" * len(metric_keys)]
    for cat, m in cats.items():
        lines.append(f"| {cat} | {m['tasks']} | " + " | ".join(_pct(m[k]) for k in metric_keys) + " |")
    eff = summary["efficiency"]
    lines += ["", "## Efficiency (per episode)", "", "| quantity | median | mean | total |", "|---|---|---|---|"]
    for key in ("completion_tokens", "input_tokens", "tool_output_tokens", "turns", "tool_calls", "wall_s",
                "grade_s"):
        s = eff[key]
        lines.append(f"| {key} | {s['median']:.4g} | {s['mean']:.4g} | {s['total']:.4g} |")
    if eff["tokens_estimated"]:
        lines.append("\nSome token counts are estimates (characters / 4): the agent reported none.")
    c = summary["cost_usd"]
    lines += ["", f"Cost at ${c['input_per_m']:g} / ${c['output_per_m']:g} per M input / output tokens: median "
              f"${c['median_per_task']:.4f} per task, ${c['total']:.4f} in total.", "",
              "Grader statuses: " + ", ".join(f"{k} {v}" for k, v in summary["statuses"].items()) + ".",
              "Episode ends: " + ", ".join(f"{k or '-'} {v}" for k, v in summary["finish_reasons"].items()) + "."]
    if network_restricted:
        lines += ["", "## Network", "", network_markdown(network_restricted)]
    if suite_stats_md:
        lines += ["", "## Suite", "", suite_stats_md]
    return "\n".join(lines) + "\n"


def selected_sample(rs: list[SampleResult]) -> SampleResult:
    """The sample a best-of-K selector submits: highest selector score, the lowest index among ties."""
    return max(rs, key=lambda r: (r.selector_score, -r.sample))


def write_swebench_files(out_dir: str | Path, results: EvalResults, model: str) -> tuple[Path, Path]:
    """predictions.jsonl (SWE-bench's {instance_id, model_name_or_path, model_patch}, the selected sample
    per instance) and swebench_report.json (SWE-bench's run report over those predictions)."""
    from c2jax.rl.tasks.grading import GradeResult
    from c2jax.rl.tasks.swebench import write_predictions, write_report

    out_dir = Path(out_dir)
    chosen = {tid: selected_sample(rs) for tid, rs in by_task(results.results).items()}
    preds = write_predictions(out_dir / "predictions.jsonl",
                              [(tid, r.patch or None) for tid, r in chosen.items()], model)
    graded = {}
    fields = set(GradeResult.__dataclass_fields__)
    for tid, r in chosen.items():
        g = r.grade if "status" in r.grade else {"task_id": tid, "status": r.status, "reason": r.error or ""}
        graded[tid] = (GradeResult(**{k: v for k, v in g.items() if k in fields}), r.patch or None)
    report = write_report(out_dir / "swebench_report.json", graded, model)
    return preds, report


# ------------------------------------------------------------------------------------------ plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (tokens, accuracy) not dominated by another (fewer or equal tokens and
    higher or equal accuracy, one strictly), sorted by tokens."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((x2 <= x and y2 >= y) and (x2 < x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def plot_pareto(runs: list[dict[str, Any]], path: str | Path) -> Path:
    """`runs`: [{label, accuracy, median_completion_tokens}] -> accuracy vs median completion tokens."""
    if not runs:
        raise ValueError("plot_pareto: no runs")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2), dpi=120)
    xs = [r["median_completion_tokens"] for r in runs]
    ys = [100 * r["accuracy"] for r in runs]
    ax.scatter(xs, ys, s=40, zorder=3)
    for r, x, y in zip(runs, xs, ys):
        ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    front = pareto_front(list(zip(xs, ys)))
    if len(front) > 1:
        ax.plot([xs[i] for i in front], [ys[i] for i in front], "--", color="gray", zorder=2, label="Pareto front")
        ax.legend(fontsize=8)
    ax.set_xlabel("median completion tokens per episode")
    ax.set_ylabel("accuracy, avg@1 (%)")
    ax.set_title("Accuracy vs cost")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_training(points: list[dict[str, Any]], path: str | Path, *, k: int | None = None) -> Path:
    """`points`: [{step, avg@1, best_of_k (optional)}] -> avg@1 and best-of-K over training steps."""
    if not points:
        raise ValueError("plot_training: no points")
    plt = _pyplot()
    points = sorted(points, key=lambda p: p["step"])
    fig, ax = plt.subplots(figsize=(6, 4.2), dpi=120)
    steps = [p["step"] for p in points]
    ax.plot(steps, [100 * p["avg@1"] for p in points], "o-", label="avg@1")
    best = [p for p in points if p.get("best_of_k") is not None]
    if best:
        ax.plot([p["step"] for p in best], [100 * p["best_of_k"] for p in best], "s-",
                label=f"best-of-{k}" if k else "best-of-K")
    ax.set_xlabel("training step")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Accuracy over training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def run_point(results_json: dict[str, Any]) -> dict[str, Any]:
    """What the comparison plots need from one run's results.json."""
    s = results_json["summary"]
    best_keys = sorted((k for k in s["accuracy"] if k.startswith("best_of_")), key=lambda k: int(k.split("_")[-1]))
    best = best_keys[-1] if best_keys else None
    return {"label": results_json["label"], "step": results_json.get("step"),
            "accuracy": s["accuracy"]["avg@1"]["mean"], "avg@1": s["accuracy"]["avg@1"]["mean"],
            "median_completion_tokens": s["efficiency"]["completion_tokens"]["median"],
            "best_of_k": s["accuracy"][best]["mean"] if best else None,
            "k": int(best.split("_")[-1]) if best else None}


def write_plots(out_dir: str | Path, run_jsons: list[dict[str, Any]]) -> list[Path]:
    """pareto.png over all runs; training.png over the runs that carry a training step."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    points = [run_point(r) for r in run_jsons]
    written = [plot_pareto(points, out_dir / "pareto.png")]
    stepped = [p for p in points if p["step"] is not None]
    if stepped:
        ks = {p["k"] for p in stepped if p["k"]}
        written.append(plot_training(stepped, out_dir / "training.png", k=max(ks) if ks else None))
    return written


def write_report(out_dir: str | Path, results: EvalResults, summary: dict[str, Any], *,
                 suite_stats_md: str | None = None, swebench: bool = True) -> list[Path]:
    """Every file of one run's report; returns their paths."""
    out_dir = Path(out_dir)
    res_json = write_results(out_dir, results, summary)
    md = out_dir / "summary.md"
    md.write_text(summary_markdown(results.label, summary, suite_stats_md,
                                   results.config.get("network_restricted")))
    paths = [res_json, md, *write_plots(out_dir, [json.loads(res_json.read_text())])]
    if swebench:
        paths += list(write_swebench_files(out_dir, results, results.label))
    return paths
