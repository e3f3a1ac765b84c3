"""Ablation 08 (Composer 2 sec. 5): router replay on vs off, trainer/sampler logprob mismatch.

The sampler runs the policy with bf16 compute (as inference engines do); the trainer runs the same
weights in fp32. Tiny numeric differences flip near-tied top-k choices, and a flipped expert changes the
token's logprob far more than rounding does. With router replay the trainer uses the experts the sampler
used (`replay_ids`), so only rounding remains. Measured at several points of a short pretraining run
(a trained router is sharper, so it flips less) on the deterministic Markov source.
    python -m experiments.ablations.08_router_replay.run [--quick] [--out DIR]
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from flax import nnx
from tensorboardX import SummaryWriter

from c2jax.models.config import ModelConfig, preset
from c2jax.models.transformer import init
from c2jax.rl.replay import logprob_mismatch, replay_override_fraction
from c2jax.train.step import init_train_state, make_train_step
from c2jax.train.synthetic import MarkovSource
from experiments.ablations.provenance import ablation_args, git_commit, write_result

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def model_config(section: dict) -> ModelConfig:
    """A preset with field overrides; ModelConfig validates them (and names a bad field)."""
    section = dict(section)
    return preset(section.pop("preset", "tiny")).replace(**section)


@functools.cache
def _graphdef(cfg: ModelConfig):
    return nnx.split(nnx.eval_shape(lambda: init(cfg, 0)), nnx.Param, ...)[0]


def token_logprobs(cfg: ModelConfig, params, model_state, batch, replay_ids=None):
    """log p(target) on every position, and the experts each MoE layer used [L, B, S, k]."""
    model = nnx.merge(_graphdef(cfg), params, model_state)
    out = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                replay_ids=replay_ids, return_mtp=False)
    logp = jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0], out.expert_ids


def _replayed_logprobs(cfg: ModelConfig, params, model_state, batch, replay_ids):
    return token_logprobs(cfg, params, model_state, batch, replay_ids)


def measure(cfg: ModelConfig, sampler_dtype: str, filter_ratios, params, model_state, batches) -> dict:
    sampler_cfg = cfg.replace(dtype=sampler_dtype)
    sampler = jax.jit(lambda p, s, b: token_logprobs(sampler_cfg, p, s, b))
    trainers = {ratio: jax.jit(functools.partial(_replayed_logprobs, cfg.replace(router_replay_filter_ratio=ratio)))
                for ratio in filter_ratios}
    free = jax.jit(lambda p, s, b: token_logprobs(cfg, p, s, b))
    diffs = {"off": []} | {f"on_filter{r}": [] for r in filter_ratios}
    flips, overrides = [], {r: [] for r in filter_ratios}
    for batch in batches:
        batch = jax.tree.map(jnp.asarray, batch)
        mask = batch["loss_mask"] > 0
        mu, sampler_ids = sampler(params, model_state, batch)
        own, trainer_ids = free(params, model_state, batch)
        diffs["off"].append(np.asarray(own - mu)[np.asarray(mask)])
        used = jnp.moveaxis(trainer_ids, 0, 2)
        flips.append(float(replay_override_fraction(used, jnp.moveaxis(sampler_ids, 0, 2), mask)))
        for ratio, trainer in trainers.items():
            logp, ids = trainer(params, model_state, batch, sampler_ids)
            diffs[f"on_filter{ratio}"].append(np.asarray(logp - mu)[np.asarray(mask)])
            overrides[ratio].append(float(replay_override_fraction(
                jnp.moveaxis(ids, 0, 2), jnp.moveaxis(sampler_ids, 0, 2), mask)))
    row = {"routing_disagreement": float(np.mean(flips))}
    for name, parts in diffs.items():
        d = np.concatenate(parts)
        check = {k: float(v) for k, v in logprob_mismatch(jnp.asarray(d), jnp.zeros_like(d),
                                                          jnp.ones(d.shape, bool)).items()}
        row[f"replay_{name}"] = {"abs_mean": float(np.abs(d).mean()), "abs_p99": float(np.percentile(np.abs(d), 99)),
                                 "abs_max": float(np.abs(d).max()), "kl_k3": check["mismatch/kl_k3"],
                                 "tokens": int(d.size)}
    for ratio in filter_ratios:
        row[f"replay_on_filter{ratio}"]["filter_override_fraction"] = float(np.mean(overrides[ratio]))
    return row


def main(argv: list[str] | None = None) -> dict:
    args, raw = ablation_args(argv, __doc__, HERE, "two checkpoints, two eval batches (for tests)")
    if args.quick:
        raw = raw | {"train_steps": [0, 2], "eval_batches": 1, "batch_size": 4, "seq_len": 64}
    cfg = model_config(raw["model"])
    seed = int(raw["seed"])
    tx = optax.adamw(float(raw["learning_rate"]))
    graphdef, state = init_train_state(init(cfg, seed), tx, seed)
    step = make_train_step(graphdef, tx, router_bias_rate=1e-3)
    source = MarkovSource(cfg.vocab_size, int(raw["seq_len"]), int(raw["batch_size"]), seed=seed)
    held_out = MarkovSource(cfg.vocab_size, int(raw["seq_len"]), int(raw["batch_size"]), seed=seed, stream=1)
    eval_batches = [next(held_out) for _ in range(int(raw["eval_batches"]))]
    rows, done, losses = [], 0, []
    for target in sorted(int(s) for s in raw["train_steps"]):
        while done < target:
            state, metrics = step(state, jax.tree.map(jnp.asarray, next(source)))
            losses.append(float(metrics["loss"]))
            done += 1
        row = measure(cfg, raw["sampler_dtype"], [float(r) for r in raw["filter_ratios"]],
                      state.params, state.model_state, eval_batches)
        rows.append({"train_steps": done, "train_loss": losses[-1] if losses else None} | row)
        print(f"step {done:4d}: routing disagreement {row['routing_disagreement']:.4f}  "
              f"|d| mean off {row['replay_off']['abs_mean']:.2e} on {row['replay_on_filter0.0']['abs_mean']:.2e}  "
              f"p99 off {row['replay_off']['abs_p99']:.2e} on {row['replay_on_filter0.0']['abs_p99']:.2e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"git_commit": git_commit(), "config": raw, "rows": rows}
    write_result(out, result, args.machine)
    write_tensorboard(out / "tb", rows)
    plot(out / "router_replay.png", rows)
    return result


def write_tensorboard(path: Path, rows: list[dict]) -> None:
    with SummaryWriter(str(path)) as tb:
        for row in rows:
            s = row["train_steps"]
            tb.add_scalar("routing_disagreement", row["routing_disagreement"], s)
            for key, val in row.items():
                if key.startswith("replay_"):
                    tb.add_scalar(f"{key}/abs_mean", val["abs_mean"], s)
                    tb.add_scalar(f"{key}/abs_p99", val["abs_p99"], s)


def plot(path: Path, rows: list[dict]) -> None:
    steps = [r["train_steps"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for key in [k for k in rows[0] if k.startswith("replay_")]:
        for ax, stat in zip(axes, ("abs_mean", "abs_p99")):
            ax.plot(steps, [r[key][stat] for r in rows], "o-", label=key.replace("replay_", "replay "))
    for ax, title in zip(axes, ("mean |log pi_trainer - log mu|", "p99 |log pi_trainer - log mu|")):
        ax.set_yscale("log")
        ax.set_xlabel("pretraining steps")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
