"""Section `rl_step`: one RL learner step (c2jax.rl.learner) on a batch the model itself sampled, with the
sampler's experts replayed: tokens/s, and that the learner routed through exactly those experts."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from c2jax.models.config import preset
from c2jax.models.transformer import forward, init
from c2jax.rl.batch import RLBatch, replay_from_model
from c2jax.rl.config import RLConfig
from c2jax.rl.learner import init_rl_state, make_optimizer, make_rl_step
from experiments.bench.gpu_check.sections.context import DRY_MODEL, Context, timed_steps

KEPT_METRICS = ("loss", "grad_norm", "replay/override_fraction", "mismatch/abs_mean", "entropy", "tokens_trained")


def run(ctx: Context) -> None:
    name = ctx.size("medium", "tiny")
    rows, seq = ctx.size((4, 2048), (2, 16))
    cfg = preset(name).replace(num_nextn_predict_layers=0, dtype="bfloat16", **ctx.size({}, DRY_MODEL))
    rl_cfg = RLConfig(learning_rate=1e-6)
    ctx.set("setup", {"preset": name, "rows": rows, "seq": seq, "dtype": "bfloat16 compute, float32 params",
                      "rl_config": "RLConfig defaults (REINFORCE, constant normaliser, Adam, clip 1.0)"})
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, seq + 1)).astype(np.int32)
    ctx.sub("step", rl_step, ctx, cfg, rl_cfg, tokens, need_s=ctx.size(20, 2))


def sampled(graphdef, state, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the sampler hands the learner for `tokens`: (behaviour log-probs of each next token, the experts
    each token was routed to, as replay ids)."""
    sample = jax.jit(lambda s, ids: forward(graphdef, s, ids, return_mtp=False))
    out = sample(state, jnp.asarray(tokens[:, :-1]))
    logp = jax.nn.log_softmax(out.logits, -1)
    behavior = np.asarray(jnp.take_along_axis(logp, jnp.asarray(tokens[:, 1:])[..., None], -1)[..., 0])
    return behavior, replay_from_model(out.expert_ids).astype(np.int32)


def rl_batch(tokens: np.ndarray, behavior: np.ndarray, replay: np.ndarray) -> RLBatch:
    """One unpacked sequence per row, every token trained, advantages spread over [-1, 1] by row."""
    rows, seq = tokens.shape[0], tokens.shape[1] - 1
    return RLBatch(
        input_ids=tokens[:, :-1], targets=tokens[:, 1:], loss_mask=np.ones((rows, seq), bool),
        positions=np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
        segment_ids=np.ones((rows, seq), np.int32),
        sequence_ids=np.broadcast_to(np.arange(rows, dtype=np.int32)[:, None], (rows, seq)).copy(),
        advantages=np.broadcast_to(np.linspace(-1, 1, rows, dtype=np.float32)[:, None], (rows, seq)).copy(),
        behavior_logprobs=behavior.astype(np.float32), policy_versions=np.zeros((rows, seq), np.int32),
        replay_ids=replay)


def rl_step(ctx: Context, cfg, rl_cfg: RLConfig, tokens: np.ndarray) -> dict:
    rows, seq = tokens.shape[0], tokens.shape[1] - 1
    graphdef, state = nnx.split(init(cfg, seed=0))
    t0 = time.perf_counter()  # the sampler's compile and forward, not the model's initialisation
    behavior, replay = sampled(graphdef, state, tokens)
    sampler_s = time.perf_counter() - t0
    tx = make_optimizer(rl_cfg)
    graphdef, rl_state = init_rl_state(init(cfg, seed=0), tx, rl_cfg)
    step = make_rl_step(graphdef, tx, rl_cfg)
    batch = jax.tree.map(jnp.asarray, rl_batch(tokens, behavior, replay))
    rl_state, metrics, first_s, times = timed_steps(step, rl_state, batch, ctx.size(2, 1))
    m = {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}
    override = m.get("replay/override_fraction")
    finite = math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
    ctx.check("RL step loss and gradient norm finite", finite,
              f"loss {m['loss']:.4g}, grad norm {m['grad_norm']:.4g}")
    ctx.check("RL step router replay: the learner used the sampler's experts", override == 0.0,
              f"replay/override_fraction {override}")
    step_s = min(times)
    ctx.headline(f"{rows * seq / step_s:,.0f} tok/s, override {override}")
    return {"sampler_forward_s": sampler_s, "first_step_s": first_s, "step_s": step_s,
            "tokens_per_s": rows * seq / step_s, "metrics": {k: m[k] for k in KEPT_METRICS if k in m}}
