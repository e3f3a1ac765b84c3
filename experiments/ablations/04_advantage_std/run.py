"""Ablation 04 (Composer 2 sec. 4.2): group advantages with and without division by the group's std.

Each run trains the same random-init tiny MoE with `rl_step` (REINFORCE, Dr. GRPO constant normaliser,
router replay) on a task whose reward is correctness plus a small task-irrelevant term; the only
difference between the two arms is `AdvantageConfig.std_normalize`. Logged per step: mean correctness,
and the mean |advantage| that groups with no correctness spread receive (pure noise being trained on).
    python -m experiments.ablations.04_advantage_std.run [--quick] [--out DIR]
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from tensorboardX import SummaryWriter

from c2jax.models.config import preset
from c2jax.models.transformer import init
from c2jax.rl.advantages import group_advantages
from c2jax.rl.config import AdvantageConfig, LossConfig, RLConfig
from c2jax.rl.learner import init_rl_state, make_optimizer, make_rl_step
from c2jax.rl.toy import make_full_forward_sampler, single_turn_batch
from experiments.ablations.provenance import ablation_args, git_commit, write_result

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


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
        _COMPILED[std_normalize] = make_rl_step(graphdef, tx, rl_cfg), make_full_forward_sampler(graphdef, p, gen)
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
        batch = single_turn_batch(ids, logps, experts, adv.reshape(-1), p, it)
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
    args, raw = ablation_args(argv, __doc__, HERE, "one seed, a few steps (for tests)")
    if args.quick:
        raw = raw | {"steps": 3, "seeds": [0], "group_size": 4}
    runs = [train(raw, arm, int(seed)) for seed in raw["seeds"] for arm in (False, True)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"git_commit": git_commit(), "config": raw, "summary": summarize(runs), "runs": runs}
    write_result(out, result, args.machine)
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
