"""Ablation 06 (Composer 2 sec. 6): NVFP4 with the spec's per-tensor FP32 scale vs Composer's per-token scales.

1. Batch variance. A fixed probe sequence sits in many random batches; the MoE fprop's NVFP4 quantization of
   the batch (c2jax.kernels.qlinear.fprop, x along K) decides the probe's output. Per tensor, the global amax of the
   batch sets every token's encode scale, so the other sequences change the probe's codes and output; per token,
   nothing outside the token does. Measured: how often and how much the probe's output changes, how many of its
   quantized inputs change, and its error against the full-precision product.
2. Training stability: ablation 09's tiny MoE trained with each NVFP4-forward recipe (MXFP8 backward) vs BF16.
    python -m experiments.ablations.06_nvfp4_scales.run [--quick] [--out DIR]
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
RECIPES = {"per_tensor": "nvfp4_per_tensor_fwd+mxfp8_bwd", "per_token": "nvfp4_per_token_fwd+mxfp8_bwd"}


def _ablation09():
    return importlib.import_module("experiments.ablations.09_mxfp8_vs_bf16.run")


def make_data(bv: dict):
    """probe [S, K], batches [n, B, S, K] whose sequence 0 is the probe, weight [K, N] (float32 numpy)."""
    rng = np.random.default_rng(int(bv["seed"]))
    n, b, s, k = int(bv["batches"]), int(bv["sequences"]), int(bv["seq_len"]), int(bv["d_in"])
    probe = rng.standard_normal((s, k)).astype(np.float32)
    scale = 10.0 ** rng.uniform(-1, 1, (n, b - 1, 1, 1))
    others = rng.standard_normal((n, b - 1, s, k)) * scale
    has_outlier = rng.random((n, b - 1)) < float(bv["outlier_prob"])
    channel = rng.integers(0, k, (n, b - 1))
    i, j = np.nonzero(has_outlier)
    others[i, j, :, channel[i, j]] *= float(bv["outlier_scale"])
    batches = np.concatenate([np.broadcast_to(probe, (n, 1, s, k)), others], axis=1).astype(np.float32)
    w = (rng.standard_normal((k, int(bv["d_out"]))) / np.sqrt(k)).astype(np.float32)
    return probe, batches, w


def probe_outputs(recipe: str, batches: jnp.ndarray, w: jnp.ndarray):
    """For every batch: the probe's (sequence 0's) fprop output [n, S, N] and its dequantized NVFP4 input
    [n, S, K], quantized as part of the whole batch."""
    r = qlinear.get_recipe(recipe)

    @jax.jit
    @jax.vmap
    def run(xb):
        b, s, k = xb.shape
        flat = xb.reshape(b * s, k)
        y = qlinear.fprop(flat, w, r)[0]
        return y[:s], qlinear.fake_quantize(flat, -1, r.forward)[0][:s]

    return run(batches)


def batch_variance(bv: dict) -> tuple[dict, dict]:
    probe, batches, w = make_data(bv)
    exact = probe @ w
    norm = float(np.linalg.norm(exact))
    batch_amax = np.abs(batches).max(axis=(1, 2, 3))
    amax_ratio = batch_amax / np.abs(probe).max()
    stats, per_batch = {}, {"amax_ratio": amax_ratio.tolist()}
    for scaling, recipe in RECIPES.items():
        y, xq = (np.asarray(a) for a in probe_outputs(recipe, jnp.asarray(batches), jnp.asarray(w)))
        y_alone, xq_alone = (np.asarray(a)[0] for a in probe_outputs(recipe, jnp.asarray(probe[None, None]),
                                                                    jnp.asarray(w)))
        err = np.linalg.norm(y - exact, axis=(1, 2)) / norm
        blocks = xq.reshape(*xq.shape[:-1], -1, 16)
        zero_blocks = (np.abs(blocks).max(-1) == 0).mean(axis=(1, 2))  # probe blocks flushed to 0 (d_b = 0)
        order = np.argsort(amax_ratio)
        quartiles = [float(err[q].mean()) for q in np.array_split(order, 4)]
        stats[scaling] = {
            "recipe": recipe,
            "batches_where_probe_output_changed": float(np.mean([not np.array_equal(a, y_alone) for a in y])),
            "probe_inputs_changed_fraction": float((xq != xq_alone[None]).mean()),
            "probe_output_relative_std": float(y.std(0).mean() / np.sqrt((exact**2).mean())),
            "probe_relative_error_alone": float(np.linalg.norm(y_alone - exact) / norm),
            "probe_relative_error_mean": float(err.mean()),
            "probe_relative_error_max": float(err.max()),
            "probe_relative_error_by_amax_ratio_quartile": quartiles,
            "probe_zero_block_fraction_mean": float(zero_blocks.mean()),
        }
        per_batch[scaling] = {"probe_relative_error": err.tolist()}
    stats["batch_amax_over_probe_amax"] = {"median": float(np.median(amax_ratio)), "max": float(amax_ratio.max()),
                                           "quartile_edges": np.quantile(amax_ratio, [0.25, 0.5, 0.75]).tolist()}
    return stats, per_batch


def amax_ratio_sweep(bv: dict) -> dict:
    """The probe next to one Gaussian sequence rescaled so its amax is r x the probe's: the probe's output error
    and the share of its 16-element blocks flushed to zero (E4M3 block scale underflow), per r."""
    probe, _, w = make_data(bv)
    rng = np.random.default_rng(int(bv["seed"]) + 1)
    other = rng.standard_normal(probe.shape).astype(np.float32)
    ratios = 10.0 ** (np.arange(0, 2 * int(bv["max_log10_ratio"]) + 1) / 2)
    batches = np.stack([np.stack([probe, other * np.float32(r * np.abs(probe).max() / np.abs(other).max())])
                        for r in ratios])
    exact = probe @ w
    out = {"ratio": ratios.tolist()}
    for scaling, recipe in RECIPES.items():
        y, xq = (np.asarray(a) for a in probe_outputs(recipe, jnp.asarray(batches), jnp.asarray(w)))
        blocks = xq.reshape(len(ratios), -1, 16)
        err = np.linalg.norm(y - exact, axis=(1, 2)) / np.linalg.norm(exact)
        out[scaling] = {"probe_relative_error": err.tolist(),
                        "probe_zero_block_fraction": (np.abs(blocks).max(-1) == 0).mean(1).tolist()}
    return out


def training(train: dict) -> tuple[dict, dict]:
    run09 = _ablation09()
    raw = yaml.safe_load((run09.HERE / "config.yaml").read_text()) | train
    curves = run09.run_recipes(raw, train["recipes"])
    return curves, run09.summarize(raw, curves)


def main(argv: list[str] | None = None) -> dict:
    args, raw = ablation_args(argv, __doc__, HERE,
                                "32 batches, no training run"
                                " (each training recipe is a ~10 s compile; for tests)")
    if args.quick:
        raw = raw | {"batch_variance": raw["batch_variance"] | {"batches": 32}, "train": None}
    stats, per_batch = batch_variance(raw["batch_variance"])
    sweep = amax_ratio_sweep(raw["batch_variance"])
    curves, train_summary = training(raw["train"]) if raw["train"] else ({}, {})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"git_commit": git_commit(), "config": raw, "batch_variance": stats, "per_batch": per_batch,
              "amax_ratio_sweep": sweep,
              "training": train_summary,
              "curves": {r: {k: v.tolist() for k, v in c.items()} for r, c in curves.items()}}
    write_result(out, result, args.machine)
    with SummaryWriter(str(out / "tb")) as tb:
        for scaling in RECIPES:
            for i, e in enumerate(per_batch[scaling]["probe_relative_error"]):
                tb.add_scalar(f"batch_variance/probe_relative_error/{scaling}", e, i)
        for recipe, c in curves.items():
            for j, seed in enumerate(raw["train"]["seeds"]):
                for i, loss in enumerate(c["loss"][j]):
                    tb.add_scalar(f"loss/{recipe}/seed{seed}", float(loss), i)
    plot(out / "nvfp4_scales.png", per_batch, sweep, curves)
    for scaling in RECIPES:
        s = stats[scaling]
        print(f"{scaling:10s} probe output changed in {s['batches_where_probe_output_changed']:.0%} of batches, "
              f"inputs changed {s['probe_inputs_changed_fraction']:.3f}, rel err {s['probe_relative_error_mean']:.4f} "
              f"(alone {s['probe_relative_error_alone']:.4f}, max {s['probe_relative_error_max']:.4f})")
    for i, r in enumerate(sweep["ratio"]):
        print(f"amax ratio {r:9.3g}: probe rel err per tensor {sweep['per_tensor']['probe_relative_error'][i]:.4f} "
              f"(zero blocks {sweep['per_tensor']['probe_zero_block_fraction'][i]:.2f}), per token "
              f"{sweep['per_token']['probe_relative_error'][i]:.4f}")
    for recipe, s in train_summary.items():
        print(f"{recipe:32s} final {s['final_loss_mean']:.4f} +- {s['final_loss_std']:.4f} "
              f"gap vs bf16 {s['vs_bf16']['gap_mean']:+.4f}, skipped {s['skipped_steps']}")
    return result


def plot(path: Path, per_batch: dict, sweep: dict, curves: dict) -> None:
    fig, axes = plt.subplots(1, 3 if curves else 2, figsize=(15 if curves else 10, 3.8), squeeze=False)
    ax = axes[0, 0]
    for n, scaling in enumerate(RECIPES):
        ax.plot(per_batch["amax_ratio"], per_batch[scaling]["probe_relative_error"], ".", color=f"C{n}",
                label=scaling, alpha=0.7)
    ax.set_xscale("log")
    ax.set_xlabel("batch amax / probe amax")
    ax.set_title("probe output error vs full precision")
    ax.legend()
    ax = axes[0, 1]
    for n, scaling in enumerate(RECIPES):
        ax.plot(sweep["ratio"], sweep[scaling]["probe_relative_error"], "o-", color=f"C{n}", label=scaling)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("amax of the other sequence / probe amax")
    ax.set_title("probe output error, two-sequence batch")
    ax.legend()
    if curves:
        ax = axes[0, 2]
        for n, (recipe, c) in enumerate(curves.items()):
            for j, run in enumerate(c["loss"]):
                ax.plot(run, color=f"C{n}", lw=0.8, alpha=0.7, label=recipe if j == 0 else None)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title("tiny MoE training loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
