"""Ablation 03 (Composer 2 Fig. 4): bias and variance of the k1/k2/k3 KL estimators against the true KL.

q = N(0, 1) samples x; p = N(mu, 1) is the reference; KL(q || p) = mu^2 / 2 in closed form.
    python -m experiments.ablations.03_kl_estimators.run [--quick] [--out DIR]
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import matplotlib
import numpy as np
from tensorboardX import SummaryWriter

from c2jax.rl.kl import kl_estimate
from experiments.ablations.provenance import ablation_args, git_commit, write_result

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def gaussian_logpdf(x: np.ndarray, mean: float) -> np.ndarray:
    return -0.5 * (x - mean) ** 2 - 0.5 * np.log(2 * np.pi)


def measure(mus: list[float], samples: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for mu in mus:
        x = rng.standard_normal(samples)
        logq, logp = gaussian_logpdf(x, 0.0), gaussian_logpdf(x, mu)
        true_kl = mu**2 / 2
        row = {"mu": mu, "true_kl": true_kl}
        for est in ("k1", "k2", "k3"):
            k = np.asarray(kl_estimate(jnp.asarray(logq), jnp.asarray(logp), est), dtype=np.float64)
            row[est] = {"mean": float(k.mean()), "bias": float(k.mean() - true_kl),
                        "relative_bias": float((k.mean() - true_kl) / true_kl), "std": float(k.std()),
                        "relative_std": float(k.std() / true_kl)}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    args, cfg = ablation_args(argv, __doc__, HERE, "few samples (for tests)")
    samples = 2000 if args.quick else int(cfg["samples"])
    rows = measure([float(m) for m in cfg["mus"]], samples, int(cfg["seed"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"git_commit": git_commit(), "config": cfg | {"samples": samples}, "rows": rows}
    write_result(out, result, args.machine)
    with SummaryWriter(str(out / "tb")) as tb:
        for i, row in enumerate(rows):
            for est in ("k1", "k2", "k3"):
                tb.add_scalar(f"relative_bias/{est}", row[est]["relative_bias"], i)
                tb.add_scalar(f"relative_std/{est}", row[est]["relative_std"], i)
    kls = [r["true_kl"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for est in ("k1", "k2", "k3"):
        axes[0].plot(kls, [r[est]["relative_bias"] for r in rows], "o-", label=est)
        axes[1].plot(kls, [r[est]["relative_std"] for r in rows], "o-", label=est)
    for ax, title in zip(axes, ("relative bias (E[k]-KL)/KL", "relative std std(k)/KL")):
        ax.set_xscale("log")
        ax.set_xlabel("true KL")
        ax.set_title(title)
        ax.legend()
    axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(out / "kl_estimators.png", dpi=80)
    plt.close(fig)
    return result


if __name__ == "__main__":
    main()
