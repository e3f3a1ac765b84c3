"""Ablation 05 (Composer 2 Fig. 6): the concave length-penalty curves C_{k,q}(x) for several (k, q), and
what concavity does to the price of one more tool call as a trajectory grows.

    python -m experiments.ablations.05_length_penalty.run [--quick] [--out DIR]
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
from tensorboardX import SummaryWriter

from c2jax.rl.config import LengthPenaltyConfig
from c2jax.rl.length_penalty import concave_length_cost
from experiments.ablations.provenance import ablation_args, git_commit, write_result

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def measure(cfg: dict, points: int) -> dict:
    xs = np.linspace(0.0, float(cfg["max_effort"]), points)
    tool_call = LengthPenaltyConfig().tool_calls
    curves = []
    for k, q in cfg["curves"]:
        ys = concave_length_cost(xs, float(k), float(q))
        marginal = {str(x0): float(concave_length_cost(float(x0) + tool_call, k, q)
                                   - concave_length_cost(float(x0), k, q)) for x0 in cfg["marginal_at"]}
        first, last = marginal[str(cfg["marginal_at"][0])], marginal[str(cfg["marginal_at"][-1])]
        curves.append({"k": k, "q": q, "x": xs.tolist(), "cost": ys.tolist(),
                       "cost_at_max": float(ys[-1]), "tool_call_marginal_cost": marginal,
                       "marginal_ratio_last_vs_first": last / first})
    return {"tool_call_effort": tool_call, "curves": curves}


def main(argv: list[str] | None = None) -> dict:
    args, cfg = ablation_args(argv, __doc__, HERE, "few points (for tests)")
    points = 20 if args.quick else int(cfg["points"])
    result = {"git_commit": git_commit(), "config": cfg | {"points": points}} | measure(cfg, points)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out, result, args.machine)
    with SummaryWriter(str(out / "tb")) as tb:
        for c in result["curves"]:
            for i in range(0, points, max(1, points // 40)):
                tb.add_scalar(f"cost/k={c['k']:g},q={c['q']:g}", c["cost"][i], int(c["x"][i]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in result["curves"]:
        ax.plot(c["x"], c["cost"], label=f"k={c['k']:g}, q={c['q']:g}")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("effort x (weighted tokens, tool calls, turns)")
    ax.set_ylabel("C_{k,q}(x)")
    ax.set_title("Composer 2 length penalty (Fig. 6)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "length_penalty.png", dpi=80)
    plt.close(fig)
    return result


if __name__ == "__main__":
    main()
