"""Ablation 10 (Composer 2 sec. 5): asynchronous vs synchronous RL throughput at bounded staleness.

For each emulated environment latency, one synchronous run (generate a whole batch, then train) and one
asynchronous run per staleness bound, all with the same components, model and CPU budget; rates are over
the steady state (the first max_staleness + 2 steps, start-up and compilation, are left out).
    python -m experiments.ablations.10_async_vs_sync.run [--quick] [--out DIR]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import matplotlib
from tensorboardX import SummaryWriter

from experiments.ablations.provenance import ablation_args, git_commit, write_result
from experiments.bench.async_vs_sync import measure

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> dict:
    args, raw = ablation_args(argv, __doc__, HERE, "one latency, one bound, few steps")
    if args.quick:
        raw = raw | {"steps": 5, "env_delay_s": [0.05], "env_delay_sigma": [0.0], "max_staleness": [1],
                     "overrides": ["model.hidden_size=64"]}
    from c2jax.rl.system.cluster import init_ray, shutdown_ray

    init_ray(num_cpus=int(raw["num_cpus"]))
    rows = []
    try:
        with tempfile.TemporaryDirectory() as runs:
            for delay in raw["env_delay_s"]:
                for sigma in raw["env_delay_sigma"]:
                    bounds = [int(b) for b in raw["max_staleness"]]
                    # the sync baseline uses the smallest warm-up of the async arms it is compared with
                    for mode, bound in [("sync", min(bounds)), *(("async", b) for b in bounds)]:
                        row = measure(mode, int(raw["steps"]), float(delay), bound, Path(runs),
                                      list(raw.get("overrides", [])), bound + 2, float(sigma))
                        rows.append({"env_delay_s": float(delay), "max_staleness": bound if mode == "async" else 0,
                                     **row})
                        print(f"delay {delay:.2f}s sigma {sigma:g} {mode:5s} bound {bound}: "
                              f"{row['samples_per_s']:.1f} samples/s, learner busy {row['learner_busy']:.2f}, "
                              f"staleness mean {row['staleness_mean']:.2f}", flush=True)
    finally:
        shutdown_ray()
    for row in rows:
        sync = next(r for r in rows if r["env_delay_s"] == row["env_delay_s"] and r["mode"] == "sync"
                    and r["delay_sigma"] == row["delay_sigma"])
        row["speedup_over_sync"] = row["samples_per_s"] / sync["samples_per_s"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"git_commit": git_commit(), "config": raw, "rows": rows}
    write_result(out, result, args.machine)
    with SummaryWriter(str(out / "tb")) as tb:
        for row in rows:
            tag = f"delay{row['env_delay_s']}_sigma{row['delay_sigma']:g}"
            tb.add_scalar(f"samples_per_s/{tag}", row["samples_per_s"], row["max_staleness"])
            tb.add_scalar(f"learner_busy/{tag}", row["learner_busy"], row["max_staleness"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for delay in raw["env_delay_s"]:
        for sigma in raw["env_delay_sigma"]:
            mine = [r for r in rows if r["env_delay_s"] == float(delay) and r["delay_sigma"] == float(sigma)]
            label = f"env {delay}s/rollout, sigma {sigma:g}"
            axes[0].plot([r["max_staleness"] for r in mine], [r["samples_per_s"] for r in mine], "o-", label=label)
            axes[1].plot([r["max_staleness"] for r in mine], [r["learner_busy"] for r in mine], "o-", label=label)
    axes[0].set_title("samples/s (staleness 0 = sync)")
    axes[1].set_title("learner busy fraction")
    for ax in axes:
        ax.set_xlabel("max staleness (versions)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "async_vs_sync.png", dpi=80)
    plt.close(fig)
    return result


if __name__ == "__main__":
    main()
