"""Ablation 07 (Composer 2 sec. 6): IEEE vs approximate-reciprocal division in the quantizers.

1. Quantizer: for several activation distributions and each format, the fraction of elements whose quantized
   value differs between division="ieee" (x / s) and "approx" (x * fl(1 / s)), and each mode's error against
   full precision. MX scales are powers of two (1 / s exact): the report says the choice should not matter there.
2. Training: ablation 09's tiny MoE trained with the same seeds and batches under both modes, for an NVFP4-forward
   recipe and for MXFP8; how far the loss curves of the two modes drift apart.
    python -m experiments.ablations.07_division.run [--quick] [--out DIR]
"""

from __future__ import annotations

import importlib
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import yaml
from tensorboardX import SummaryWriter

from c2jax.kernels import qlinear
from experiments.ablations.provenance import ablation_args, git_commit, write_result

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
SPECS = {
    "nvfp4_per_token": qlinear.QuantSpec("nvfp4", scaling="per_token"),
    "nvfp4_per_tensor": qlinear.QuantSpec("nvfp4", scaling="per_tensor"),
    "mxfp8_e4m3": qlinear.QuantSpec("mxfp8"),
    "fp8_deepseek": qlinear.QuantSpec("fp8_deepseek"),
}


def activations(name: str, rows: int, d: int, rng: np.random.Generator) -> np.ndarray:
    """`name` from gaussian, student_t3, per_token_scaled; a "_bf16" suffix rounds the values to bfloat16."""
    if name.endswith("_bf16"):
        return activations(name.removesuffix("_bf16"), rows, d, rng).astype(jnp.bfloat16).astype(np.float32)
    if name == "gaussian":
        x = rng.standard_normal((rows, d))
    elif name == "student_t3":
        x = rng.standard_t(3, (rows, d))
    elif name == "per_token_scaled":
        x = rng.standard_normal((rows, d)) * 10.0 ** rng.uniform(-2, 2, (rows, 1))
    else:
        raise ValueError(f"unknown distribution {name!r}")
    return x.astype(np.float32)


def quantize_both(x: jnp.ndarray, fmt: str):
    """(dequantized x under ieee, under approx), quantized along the last axis."""
    spec = SPECS[fmt]
    fq = jax.jit(lambda v, s: qlinear.fake_quantize(v, -1, s)[0], static_argnums=1)
    return (fq(x, qlinear.QuantSpec(**{**spec.__dict__, "division": d})) for d in ("ieee", "approx"))


def quantizer_stats(q: dict) -> dict:
    rng = np.random.default_rng(int(q["seed"]))
    out = {}
    for dist in q["distributions"]:
        x = activations(dist, int(q["rows"]), int(q["d"]), rng)
        norm = np.linalg.norm(x)
        for fmt in q["formats"]:
            ieee, approx = (np.asarray(a) for a in quantize_both(jnp.asarray(x), fmt))
            differ = ieee != approx
            out[f"{dist}/{fmt}"] = {
                "distribution": dist, "format": fmt,
                "elements_differing_fraction": float(differ.mean()),
                "rows_with_a_difference_fraction": float(differ.any(-1).mean()),
                "relative_error_ieee": float(np.linalg.norm(ieee - x) / norm),
                "relative_error_approx": float(np.linalg.norm(approx - x) / norm),
                "relative_difference_between_modes": float(np.linalg.norm(ieee - approx) / norm),
            }
    return out


def training(train: dict) -> tuple[dict, dict]:
    run09 = importlib.import_module("experiments.ablations.09_mxfp8_vs_bf16.run")
    raw = yaml.safe_load((run09.HERE / "config.yaml").read_text())
    raw = raw | train | {"model": raw["model"] | train.get("model_overrides", {})}
    curves = {d: run09.run_recipes(raw, train["recipes"], division=d) for d in ("ieee", "approx")}
    window = int(train["final_window"])
    summary = {}
    for recipe in train["recipes"]:
        a, b = curves["ieee"][recipe]["loss"], curves["approx"][recipe]["loss"]
        diff = np.abs(a - b)
        differs = (diff > 0).any(0)
        summary[recipe] = {
            "identical_curves": bool(np.array_equal(a, b)),
            "first_step_that_differs": int(np.argmax(differs)) if differs.any() else None,
            "max_abs_loss_difference": float(diff.max()),
            "mean_abs_loss_difference_final_window": float(diff[:, -window:].mean()),
            "final_loss_ieee_per_seed": a[:, -window:].mean(1).tolist(),
            "final_loss_approx_per_seed": b[:, -window:].mean(1).tolist(),
            "skipped_steps": {"ieee": int(curves["ieee"][recipe]["skipped"].sum()),
                              "approx": int(curves["approx"][recipe]["skipped"].sum())},
        }
    return curves, summary


def main(argv: list[str] | None = None) -> dict:
    args, raw = ablation_args(argv, __doc__, HERE,
                                "256 rows, 2 distributions, no training run"
                                " (a ~10 s compile per recipe; for tests)")
    if args.quick:
        raw = raw | {"quantizer": raw["quantizer"] | {"rows": 256, "distributions": ["gaussian", "gaussian_bf16"]},
                     "train": None}
    stats = quantizer_stats(raw["quantizer"])
    curves, train_summary = training(raw["train"]) if raw["train"] else ({}, {})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"git_commit": git_commit(), "config": raw, "quantizer": stats, "training": train_summary,
              "curves": {d: {r: {k: v.tolist() for k, v in c.items()} for r, c in cs.items()}
                         for d, cs in curves.items()}}
    write_result(out, result, args.machine)
    with SummaryWriter(str(out / "tb")) as tb:
        for key, s in stats.items():
            tb.add_scalar(f"quantizer/elements_differing_fraction/{key}", s["elements_differing_fraction"], 0)
        for division, cs in curves.items():
            for recipe, c in cs.items():
                for j, seed in enumerate(raw["train"]["seeds"]):
                    for i, loss in enumerate(c["loss"][j]):
                        tb.add_scalar(f"loss/{recipe}/{division}/seed{seed}", float(loss), i)
    plot(out / "division.png", stats, curves)
    for key, s in stats.items():
        print(f"{key:36s} differing {s['elements_differing_fraction']:.2e}  rel err ieee "
              f"{s['relative_error_ieee']:.5f} approx {s['relative_error_approx']:.5f}")
    for recipe, s in train_summary.items():
        print(f"{recipe:32s} identical={s['identical_curves']} first differing step {s['first_step_that_differs']} "
              f"max |dloss| {s['max_abs_loss_difference']:.2e}")
    return result


def plot(path: Path, stats: dict, curves: dict) -> None:
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(11 if curves else 6, 3.8), squeeze=False)
    ax = axes[0, 0]
    keys = list(stats)
    ax.barh(range(len(keys)), [max(stats[k]["elements_differing_fraction"], 1e-7) for k in keys])
    ax.set_yticks(range(len(keys)), keys, fontsize=6)
    ax.set_xscale("log")
    ax.set_title("elements whose code differs, ieee vs approx\n(1e-7 drawn for exactly 0)", fontsize=9)
    if curves:
        ax = axes[0, 1]
        for n, recipe in enumerate(curves["ieee"]):
            diff = np.abs(curves["ieee"][recipe]["loss"] - curves["approx"][recipe]["loss"])
            for j, run in enumerate(diff):
                ax.plot(np.maximum(run, 1e-9), color=f"C{n}", lw=0.8, label=recipe if j == 0 else None)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title("|loss(ieee) - loss(approx)| (1e-9 drawn for exactly 0)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
