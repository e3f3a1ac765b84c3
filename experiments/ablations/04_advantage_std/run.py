"""Ablation 04 (Composer 2 sec. 4.2): group advantages with and without division by the group's std.

Each run trains the same random-init tiny MoE with `rl_step` (REINFORCE, Dr. GRPO constant normaliser,
router replay) on a task whose reward is correctness plus a small task-irrelevant term; the only
difference between the two arms is `AdvantageConfig.std_normalize`. Logged per step: mean correctness,
and the mean |advantage| that groups with no correctness spread receive (pure noise being trained on).
    python -m experiments.ablations.04_advantage_std.run [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import yaml
from flax import nnx
from tensorboardX import SummaryWriter

from experiments.ablations.provenance import git_commit
from models.config import preset
from models.transformer import init
from rl.advantages import group_advantages
from rl.batch import RLBatch, replay_from_model
from rl.config import AdvantageConfig, LossConfig, RLConfig
from rl.learner import init_rl_state, make_optimizer, make_rl_step

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def make_sampler(graphdef, prompt_len: int, gen: int):
    """Temperature-1 ancestral sampling (full forward per token; sequences are a few tokens long):
    tokens, the behaviour logprob of each sampled token, and the experts every position used."""

    @jax.jit
    def sample(params, model_state, prompts, key):
        model = nnx.merge(graphdef, params, model_state)
        n, total = prompts.shape[0], prompt_len + gen
        ids = jnp.zeros((n, total), jnp.int32).at[:, :prompt_len].set(prompts)

        def body(t, carry):
            ids, logps, key = carry
            logits = jax.lax.dynamic_index_in_dim(model(ids, return_mtp=False).logits, t - 1, 1, False)
            key, sub = jax.random.split(key)
            tok = jax.random.categorical(sub, logits)
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], -1)[:, 0]
            return ids.at[:, t].set(tok), logps.at[:, t].set(logp), key

        ids, logps, _ = jax.lax.fori_loop(prompt_len, total, body, (ids, jnp.zeros((n, total)), key))
        return ids, logps, model(ids, return_mtp=False).expert_ids

    return sample


def rl_batch(ids, logps, experts, advantages, prompt_len: int, version: int) -> RLBatch:
    n, total = ids.shape
    loss_mask = np.zeros((n, total), bool)
    loss_mask[:, prompt_len - 1:total - 1] = True  # position t predicts the sampled token t + 1
    return RLBatch(
        input_ids=ids, targets=np.concatenate([ids[:, 1:], np.zeros((n, 1), ids.dtype)], 1), loss_mask=loss_mask,
        positions=np.broadcast_to(np.arange(total), (n, total)).astype(np.int32),
        segment_ids=np.ones((n, total), np.int32),
        sequence_ids=np.broadcast_to(np.arange(n)[:, None], (n, total)).astype(np.int32),
        advantages=np.where(loss_mask, advantages[:, None], 0.0).astype(np.float32),
        behavior_logprobs=np.concatenate([logps[:, 1:], np.zeros((n, 1))], 1).astype(np.float32),
        policy_versions=np.full((n, total), version, np.int32), replay_ids=replay_from_model(experts))


def train(raw: dict, std_normalize: bool, seed: int) -> dict:
    cfg = preset(raw["model"]["preset"]).replace(**{k: v for k, v in raw["model"].items() if k != "preset"})
    p, gen, groups, g = int(raw["prompt_len"]), int(raw["gen"]), int(raw["groups"]), int(raw["group_size"])
    rl_cfg = RLConfig(learning_rate=float(raw["learning_rate"]),
                      advantage=AdvantageConfig(std_normalize=std_normalize),
                      loss=LossConfig(constant_normalizer=float(groups * g * gen)))
    tx = make_optimizer(rl_cfg)
    graphdef, state = init_rl_state(init(cfg, seed), tx, rl_cfg)
    # one compiled step and sampler per arm: the graph is the same for every seed
    if std_normalize not in _COMPILED:
        _COMPILED[std_normalize] = make_rl_step(graphdef, tx, rl_cfg), make_sampler(graphdef, p, gen)
    step, sample = _COMPILED[std_normalize]
    key = jax.random.key(seed)
    noise = np.random.default_rng(seed)
    correctness, noise_adv = [], []
    for it in range(int(raw["steps"])):
        key, k_prompt, k_sample = jax.random.split(key, 3)
        prompts = jnp.repeat(jax.random.randint(k_prompt, (groups, p), 0, cfg.vocab_size), g, axis=0)
        ids, logps, experts = (np.asarray(a) for a in sample(state.params, state.model_state, prompts, k_sample))
        correct = (ids[:, p:] == int(raw["target"])).mean(-1).reshape(groups, g)
        rewards = correct + float(raw["noise_scale"]) * noise.standard_normal(correct.shape)
        adv = np.asarray(group_advantages(jnp.asarray(rewards), rl_cfg.advantage))
        flat = correct.max(-1) == correct.min(-1)  # no correctness signal in the group
        correctness.append(float(correct.mean()))
        noise_adv.append(float(np.abs(adv[flat]).mean()) if flat.any() else None)
        batch = rl_batch(ids, logps, experts, adv.reshape(-1), p, it)
        state, _ = step(state, jax.tree.map(jnp.asarray, batch))
    return {"std_normalize": std_normalize, "seed": seed, "correctness": correctness,
            "noise_group_abs_advantage": noise_adv}


_COMPILED: dict = {}


def summarize(runs: list[dict], last: int = 5) -> dict:
    out = {}
    for arm in (False, True):
        mine = [r for r in runs if r["std_normalize"] == arm]
        finals = [float(np.mean(r["correctness"][-last:])) for r in mine]
        curves = np.array([r["correctness"] for r in mine])
        out["std_on" if arm else "std_off"] = {
            "final_correctness_mean": float(np.mean(finals)), "final_correctness_per_seed": finals,
            "area_under_curve": float(curves.mean()),
            "noise_group_abs_advantage": float(np.mean(
                [a for r in mine for a in r["noise_group_abs_advantage"] if a is not None])),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(HERE / "config.yaml"))
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--quick", action="store_true", help="one seed, a few steps (for tests)")
    args = ap.parse_args(argv)
    raw = yaml.safe_load(Path(args.config).read_text())
    if args.quick:
        raw = raw | {"steps": 3, "seeds": [0], "group_size": 4}
    runs = [train(raw, arm, int(seed)) for seed in raw["seeds"] for arm in (False, True)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"git_commit": git_commit(), "config": raw, "summary": summarize(runs), "runs": runs}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    with SummaryWriter(str(out / "tb")) as tb:
        for r in runs:
            tag = f"{'std_on' if r['std_normalize'] else 'std_off'}/seed{r['seed']}"
            for i, (c, a) in enumerate(zip(r["correctness"], r["noise_group_abs_advantage"])):
                tb.add_scalar(f"correctness/{tag}", c, i)
                if a is not None:
                    tb.add_scalar(f"noise_group_abs_advantage/{tag}", a, i)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for r in runs:
        color = "C1" if r["std_normalize"] else "C0"
        label = ("std on" if r["std_normalize"] else "std off") if r["seed"] == raw["seeds"][0] else None
        axes[0].plot(r["correctness"], color=color, label=label, alpha=0.8)
        steps = [i for i, a in enumerate(r["noise_group_abs_advantage"]) if a is not None]
        axes[1].plot(steps, [r["noise_group_abs_advantage"][i] for i in steps], ".", color=color, label=label)
    axes[0].set_title("correctness (fraction of target tokens)")
    axes[1].set_title("mean |A| in groups without correctness spread")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "advantage_std.png", dpi=80)
    plt.close(fig)
    for arm, s in result["summary"].items():
        print(f"{arm}: final correctness {s['final_correctness_mean']:.3f} {s['final_correctness_per_seed']}, "
              f"mean |A| on no-signal groups {s['noise_group_abs_advantage']:.3f}")
    return result


if __name__ == "__main__":
    main()
