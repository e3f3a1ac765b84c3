"""Ablation 02 (Composer 2 sec. 7): does RL trade best-of-K for average accuracy? Online evaluation of an
asynchronous RL run (rl/system) on held-out prompts: avg@1, pass@K and best-of-K (selector: the sample's
mean sampled-token logprob) every few learner steps, K samples per prompt, with 95% bootstrap intervals over
prompts and the paired difference from step 0.

Variants (`variant:` in the config):
  ladder (config.yaml, default): the demo's SFT coding agent on held-out multi-turn ladder tasks (echo, lookup),
      graded by their hidden tests in sandboxes; the demo's data, pretraining and CPT + SFT stages run first,
      or `sft_from:` names a finished `make demo` run (with the same settings and seed) whose SFT start is reused.
  target (target.yaml): the single-turn "emit the target token" task on a random-init tiny MoE (fast).

    python -m experiments.ablations.02_rl_lifts_best_of_k.run [--config FILE] [--quick] [--out DIR]
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import matplotlib
from tensorboardX import SummaryWriter

from c2jax.config import load
from c2jax.rl.system.config import RLSystemConfig
from c2jax.rl.system.reconciler import run_system
from experiments.ablations.provenance import ablation_args, git_commit, write_result

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def run_target(raw: dict, quick: bool) -> dict:
    """The RL system on the target task, configured by `overrides`; returns run_system's summary."""
    if quick:
        raw = raw | {"steps": 4, "eval_every": 2, "k": 2, "eval_prompts": 4}
    with tempfile.TemporaryDirectory() as runs:
        cfg = load(RLSystemConfig, None, [*raw["overrides"], f"system.steps={raw['steps']}",
                                          f"eval.every={raw['eval_every']}", f"eval.k={raw['k']}",
                                          f"eval.success_threshold={raw['success_threshold']}",
                                          f"env.eval_prompts={raw['eval_prompts']}", f"seed={raw['seed']}",
                                          f"output_dir={runs}", "name=ablation02"])
        from c2jax.rl.system.cluster import shutdown_ray

        try:
            return run_system(cfg)
        finally:
            shutdown_ray()


def run_ladder(raw: dict, quick: bool, work: Path) -> tuple[dict, dict]:
    """The demo's stages up to its SFT model (experiments.demo.pipeline, in `work`), then the RL system with the
    demo's RL settings and the online evaluator on `eval_prompts` held-out tasks. (run_system summary, demo cfg)"""
    from c2jax.rl.system.cluster import shutdown_ray
    from c2jax.rl.system.config import EvalConfig as OnlineEval
    from experiments.demo import pipeline as demo

    if quick:
        raw = raw | {"steps": 2, "eval_every": 1, "k": 2, "eval_prompts": 2}
    values = (demo.DemoConfig.quick_defaults() if quick else {}) | dict(raw.get("demo") or {})
    sft_from = str(raw.get("sft_from") or "").replace("{seed}", str(int(raw["seed"])))
    cfg = demo.DemoConfig(**(values | {"out": str(work), "seed": int(raw["seed"]), "rl_steps": int(raw["steps"]),
                                       "sft_from": sft_from}))
    demo.prepare_out(work)
    if sft_from:  # the same SFT start a finished demo run made (refused if it differs in a non-RL setting)
        cpt = demo.reused_sft_start(cfg, work)["cpt"]
    else:
        data = demo.stage_data(cfg, work)
        base = demo.stage_base(cfg, work, data)
        cpt = demo.stage_cpt(cfg, work, data, base)
    model_cfg = demo.load_hf_model(cpt["hf"]).cfg
    rcfg = demo.rl_config(cfg, work, model_cfg, cpt["hf"])
    rcfg = dataclasses.replace(rcfg, eval=OnlineEval(every=int(raw["eval_every"]), k=int(raw["k"])),
                               env=dataclasses.replace(rcfg.env, eval_prompts=int(raw["eval_prompts"]),
                                                       per_rung=max(rcfg.env.per_rung, int(raw["eval_prompts"]))))
    try:
        return run_system(rcfg), dataclasses.asdict(cfg)
    finally:
        shutdown_ray()


def with_intervals(evals: list[dict], k: int, seed: int) -> list[dict]:
    """Each eval row gets a 95% percentile-bootstrap interval over prompts for avg@1, best-of-j and pass@j (every
    j the evaluator reported, K included) and, from the second row on, the paired difference from the first
    (step-0) row, prompt by prompt."""
    from c2jax.rl.eval.metrics import bootstrap_ci
    from c2jax.rl.eval.summary import paired_difference

    metrics = next((next(iter(r["per_prompt"].values())) for r in evals if r.get("per_prompt")), {})
    # best-of-j / pass@j for every j the evaluator reported (K and the powers of two below it)
    keys = ["avg@1", *sorted((m for m in metrics if m.startswith(("best_of_", "pass@"))),
                             key=lambda m: (m.startswith("pass@"), int(m.split("_")[-1].split("@")[-1])))]
    keys = keys if len(keys) > 1 else ["avg@1", f"best_of_{k}"]
    rows = []
    for row in evals:
        per = row.get("per_prompt")
        # per_prompt stays (64 prompts x a few metrics): seed studies bootstrap over seeds and prompts from it
        out = dict(row)
        if per:
            for key in keys:
                lo, hi = bootstrap_ci([m[key] for m in per.values()], seed=seed)
                out[f"{key}/ci"] = [lo, hi]
            if rows and evals[0].get("per_prompt"):
                diff = paired_difference(evals[0]["per_prompt"], per, keys, n_boot=2000, seed=seed)["all"]
                out["vs_step0"] = {key: diff[key] for key in keys}
        rows.append(out)
    return rows


def main(argv: list[str] | None = None) -> dict:
    args, raw = ablation_args(argv, __doc__, HERE, "a few steps, K=2, tiny settings (for tests)")
    variant = raw.get("variant", "target")
    if variant not in ("ladder", "target"):
        raise ValueError(f"variant must be ladder or target, got {variant!r} ({args.config})")
    out_dir = Path(args.out)
    if out_dir == HERE / "results":
        out_dir = out_dir / variant
    out_dir.mkdir(parents=True, exist_ok=True)
    demo_cfg = None
    if variant == "target":
        out = run_target(raw, args.quick)
    else:
        out, demo_cfg = run_ladder(raw, args.quick, out_dir / "runs" / "demo")  # gitignored under results/
    k = int(raw["k"]) if not args.quick else 2
    # the headline best-of-K (the evaluator also reports every power of two below k from the same samples)
    hk = min(int(raw.get("best_of", k)), k)
    evals = with_intervals([{key: (float(v) if isinstance(v, float) else v) for key, v in row.items()}
                            for row in out["eval"]], k, int(raw["seed"]))
    train = [{"step": r["step"], "reward": r["reward/mean"]} for r in out["history"]]
    result = {"git_commit": git_commit(), "variant": variant, "config": raw, "demo_config": demo_cfg,
              "eval": evals, "train": train, "wall_s": out.get("wall_s")}
    write_result(out_dir, result, args.machine)
    with SummaryWriter(str(out_dir / "tb")) as tb:
        for row in evals:
            for key in sorted({"avg@1", f"pass@{hk}", f"best_of_{hk}", f"pass@{k}", f"best_of_{k}"}):
                tb.add_scalar(f"eval/{key}", row[key], row["step"])
        for row in train:
            tb.add_scalar("train/reward", row["reward"], row["step"])
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    steps = [r["step"] for r in evals]
    for key, style in (("avg@1", "o-"), (f"best_of_{hk}", "s-"), (f"pass@{hk}", "^--")):
        (line,) = ax.plot(steps, [r[key] for r in evals], style, label=key)
        if all(f"{key}/ci" in r for r in evals):  # 95% bootstrap band over prompts
            ax.fill_between(steps, [r[f"{key}/ci"][0] for r in evals], [r[f"{key}/ci"][1] for r in evals],
                            color=line.get_color(), alpha=0.15)
    ax.set_xlabel("learner step")
    ax.set_ylabel("held-out success rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "rl_lifts_best_of_k.png", dpi=80)
    plt.close(fig)
    shown = list(dict.fromkeys(["avg@1", f"best_of_{hk}", f"pass@{hk}", f"best_of_{k}", f"pass@{k}"]))
    for row in evals:
        ci = {key: (f" [{row[f'{key}/ci'][0]:.3f}, {row[f'{key}/ci'][1]:.3f}]" if f"{key}/ci" in row else "")
              for key in shown}
        line = f"step {row['step']:3d}: " + "  ".join(f"{key} {row[key]:.3f}{ci[key]}" for key in shown)
        if "vs_step0" in row:
            line += "  vs step 0: " + ", ".join(f"{key} {d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
                                                for key, d in row["vs_step0"].items() if key in shown)
        print(line)
    return result


if __name__ == "__main__":
    main()
