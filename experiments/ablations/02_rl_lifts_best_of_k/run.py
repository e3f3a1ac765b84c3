"""Ablation 02 (Composer 2 sec. 7): does RL trade best-of-K for average accuracy? Online evaluation of an
asynchronous RL run (rl/system) on held-out prompts: avg@1, pass@K and best-of-K (selector: the sample's
mean sampled-token logprob) every few learner steps, K samples per prompt.
    python -m experiments.ablations.02_rl_lifts_best_of_k.run [--quick] [--out DIR]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import matplotlib
from tensorboardX import SummaryWriter

from c2jax.rl.system.config import load_system_config
from c2jax.rl.system.reconciler import run_system
from experiments.ablations.provenance import ablation_args, git_commit

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> dict:
    args, raw = ablation_args(argv, __doc__, HERE, "4 steps, K=2 (for tests)")
    if args.quick:
        raw = raw | {"steps": 4, "eval_every": 2, "k": 2, "eval_prompts": 4}
    with tempfile.TemporaryDirectory() as runs:
        cfg = load_system_config(None, [*raw["overrides"], f"system.steps={raw['steps']}",
                                        f"eval.every={raw['eval_every']}", f"eval.k={raw['k']}",
                                        f"eval.success_threshold={raw['success_threshold']}",
                                        f"env.eval_prompts={raw['eval_prompts']}", f"seed={raw['seed']}",
                                        f"output_dir={runs}", "name=ablation02"])
        from c2jax.rl.system.cluster import shutdown_ray

        try:
            out = run_system(cfg)
        finally:
            shutdown_ray()
    k = int(raw["k"])
    evals = [{key: (float(v) if isinstance(v, float) else v) for key, v in row.items()} for row in out["eval"]]
    train = [{"step": r["step"], "reward": r["reward/mean"]} for r in out["history"]]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"git_commit": git_commit(), "config": raw, "eval": evals, "train": train}
    (out_dir / "results.json").write_text(json.dumps(result, indent=2))
    with SummaryWriter(str(out_dir / "tb")) as tb:
        for row in evals:
            for key in ("avg@1", f"pass@{k}", f"best_of_{k}"):
                tb.add_scalar(f"eval/{key}", row[key], row["step"])
        for row in train:
            tb.add_scalar("train/reward", row["reward"], row["step"])
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    steps = [r["step"] for r in evals]
    for key, style in (("avg@1", "o-"), (f"best_of_{k}", "s-"), (f"pass@{k}", "^--")):
        ax.plot(steps, [r[key] for r in evals], style, label=key)
    ax.set_xlabel("learner step")
    ax.set_ylabel("held-out success rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "rl_lifts_best_of_k.png", dpi=80)
    plt.close(fig)
    for row in evals:
        print(f"step {row['step']:3d}: avg@1 {row['avg@1']:.3f}  best-of-{k} {row[f'best_of_{k}']:.3f}  "
              f"pass@{k} {row[f'pass@{k}']:.3f}")
    return result


if __name__ == "__main__":
    main()
