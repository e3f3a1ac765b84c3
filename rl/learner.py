"""The RL learner step: one Adam update on all parameters from a packed batch of sampled tokens.

`make_rl_step(graphdef, tx, cfg)` returns `rl_step(state, batch) -> (state, metrics)`, jitted with the
state donated. The batch rows are split into `cfg.micro_batches` chunks that a `lax.scan` runs in turn,
accumulating gradients; the aggregation denominator is computed from the whole batch's masks first, so
the accumulated gradient is the full-batch gradient (not a mean of per-chunk means).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from c2jax.config import MeshConfig
from c2jax.mesh import activation_rules, jit_sharded
from c2jax.models.transformer import Transformer
from c2jax.rl.advantages import zero_variance_fraction
from c2jax.rl.batch import RLBatch
from c2jax.rl.config import RLConfig
from c2jax.rl.kl import kl_estimate
from c2jax.rl.losses import aggregation_weights, policy_token_loss
from c2jax.rl.replay import logprob_mismatch, replay_override_fraction
from c2jax.train.step import update_router_bias


class RLState(NamedTuple):
    step: jnp.ndarray  # optimizer steps taken = the learner's policy version
    params: nnx.State
    model_state: nnx.State  # router biases
    opt_state: optax.OptState
    ref_params: nnx.State | None  # reference policy for KL (None when kl.coef == 0)


def make_optimizer(cfg: RLConfig) -> optax.GradientTransformation:
    """Adam(W) on every parameter (Composer 2 sec. 4.2: "Adam, full-parameter"), global-norm clipped, with an
    optional linear warmup (`warmup_steps`; a constant rate otherwise, so the optimizer state keeps its layout)."""
    lr = cfg.learning_rate if not cfg.warmup_steps else optax.linear_schedule(
        cfg.learning_rate / (cfg.warmup_steps + 1), cfg.learning_rate, cfg.warmup_steps)
    adam = optax.adamw(lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                       weight_decay=cfg.weight_decay)
    return adam if cfg.max_grad_norm is None else optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adam)


def init_rl_state(model: Transformer, tx: optax.GradientTransformation, cfg: RLConfig):
    """(graphdef, RLState) from a model; the reference policy starts as a copy of the initial parameters."""
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
    ref = jax.tree.map(jnp.copy, params) if cfg.kl.coef > 0 else None
    return graphdef, RLState(jnp.zeros((), jnp.int32), params, model_state, tx.init(params), ref)


def _check(batch: RLBatch, micro_batches: int):
    rows, seq = batch.input_ids.shape
    for name in ("targets", "loss_mask", "positions", "segment_ids", "sequence_ids", "advantages",
                 "behavior_logprobs", "policy_versions"):
        if getattr(batch, name).shape != (rows, seq):
            raise ValueError(f"batch.{name} has shape {getattr(batch, name).shape}, expected {(rows, seq)}")
    if batch.replay_ids is not None and batch.replay_ids.shape[:2] != (rows, seq):
        raise ValueError(f"batch.replay_ids has shape {batch.replay_ids.shape}, expected ({rows}, {seq}, L, k)")
    if rows % micro_batches:
        raise ValueError(f"{rows} batch rows do not split into micro_batches={micro_batches}")


def _token_logprobs(model: Transformer, mb: RLBatch, want_logits: bool):
    replay = None if mb.replay_ids is None else jnp.moveaxis(mb.replay_ids, 2, 0)
    out = model(mb.input_ids, positions=mb.positions, segment_ids=mb.segment_ids, replay_ids=replay,
                return_mtp=False)
    targets = jnp.where(mb.loss_mask, mb.targets, 0)
    # logp(target) = -CE through the fused head + CE backward; the logits are only formed for entropy
    logp = -model.token_losses(out.hidden, targets)
    entropy = None
    if want_logits:
        logq = jax.nn.log_softmax(out.logits, axis=-1)
        entropy = -jnp.sum(jnp.exp(logq) * logq, axis=-1)
    return logp, entropy, out


def make_rl_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, cfg: RLConfig, *,
                 mesh: Mesh | None = None, mesh_config: MeshConfig | None = None, state_shardings=None):
    """With `mesh`, the step is sharded like the pretraining step (c2jax.mesh.jit_sharded): explicit
    state shardings (those of the state passed in, `jax.tree.map(lambda x: x.sharding, state)`), the
    state donated, and the logical activation rules installed, so MoE layers run expert-parallel and
    attention context-parallel when the mesh has those axes. The batch may arrive unsharded."""
    lcfg, kcfg = cfg.loss, cfg.kl
    use_kl = kcfg.coef > 0
    want_entropy = cfg.compute_entropy or lcfg.entropy_coef > 0

    def loss_fn(params, model_state, ref_params, mb, weights, denom, num_sequences):
        model = nnx.merge(graphdef, params, model_state)
        logp, entropy, out = _token_logprobs(model, mb, want_entropy)
        mask = mb.loss_mask
        adv = jnp.where(mask, mb.advantages, 0.0)
        kl_tok = jnp.zeros_like(logp)
        if use_kl:
            ref_logp, _, _ = _token_logprobs(nnx.merge(graphdef, ref_params, model_state), mb, False)
            kl_tok = jnp.where(mask, kl_estimate(logp, jax.lax.stop_gradient(ref_logp), kcfg.estimator), 0.0)
            if kcfg.placement == "reward":
                seg = jnp.where(mask, mb.sequence_ids, num_sequences).reshape(-1)
                seq_kl = jax.ops.segment_sum(jax.lax.stop_gradient(kl_tok).reshape(-1), seg,
                                             num_segments=num_sequences + 1)
                adv = jnp.where(mask, adv - kcfg.coef * jnp.take(seq_kl, seg).reshape(adv.shape), 0.0)
        tok = policy_token_loss(logp, mb.behavior_logprobs, adv, mask, mb.sequence_ids, num_sequences, lcfg)
        per_token = tok.loss
        if use_kl and kcfg.placement == "loss":
            per_token = per_token + kcfg.coef * kl_tok
        if lcfg.entropy_coef > 0:
            per_token = per_token - lcfg.entropy_coef * jnp.where(mask, entropy, 0.0)
        numerator = jnp.sum(jnp.where(mask, weights * per_token, 0.0))
        aux = {
            "logp": jax.lax.stop_gradient(logp),
            "entropy": jnp.zeros_like(logp) if entropy is None else jax.lax.stop_gradient(entropy),
            "clipped": tok.clipped, "ratio": tok.ratio, "is_weight": tok.is_weight,
            "kl": jax.lax.stop_gradient(kl_tok), "policy_num": jnp.sum(jnp.where(mask, weights * tok.loss, 0.0)),
            "counts": out.expert_counts,
            "used_ids": None if out.expert_ids is None else jnp.moveaxis(out.expert_ids, 0, 2),
        }
        return numerator / denom, aux

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def rl_step(state: RLState, batch: RLBatch):
        _check(batch, cfg.micro_batches)
        rows, seq = batch.input_ids.shape
        num_sequences = rows * seq  # a static upper bound on distinct sequence ids
        mask = batch.loss_mask.astype(bool)
        weights, denom = aggregation_weights(mask, batch.sequence_ids, num_sequences, lcfg.aggregation,
                                             lcfg.constant_normalizer)
        m = cfg.micro_batches
        chunk = lambda a: None if a is None else a.reshape(m, rows // m, *a.shape[1:])  # noqa: E731
        per_row = batch._replace(group_rewards=None)
        xs = (jax.tree.map(chunk, per_row), chunk(weights))

        def body(grads, x):
            mb, w = x
            (loss, aux), g = grad_fn(state.params, state.model_state, state.ref_params, mb, w, denom,
                                     num_sequences)
            return jax.tree.map(jnp.add, grads, g), (loss, aux)

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, (losses, aux) = jax.lax.scan(body, zeros, xs)
        counts = aux.pop("counts")
        policy_loss = aux.pop("policy_num").sum() / denom
        aux = jax.tree.map(lambda a: a.reshape(rows, *a.shape[2:]), aux)  # [m, rows/m, ...] -> [rows, ...]
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        model_state = state.model_state
        if counts is not None and cfg.router_bias_rate > 0:
            model_state = update_router_bias(model_state, counts.sum(0), cfg.router_bias_rate)
        ref = state.ref_params
        if ref is not None and kcfg.refresh_every > 0:
            refresh = (state.step + 1) % kcfg.refresh_every == 0
            ref = jax.tree.map(lambda p, r: jnp.where(refresh, p, r), params, ref)
        metrics = _metrics(state, batch, mask, aux, losses, grads, denom)
        metrics["policy_loss"] = policy_loss
        return RLState(state.step + 1, params, model_state, opt_state, ref), metrics

    if mesh is None:
        return jax.jit(rl_step, donate_argnums=0)
    if state_shardings is None:
        raise ValueError("make_rl_step(mesh=...) needs state_shardings (jax.tree.map(lambda x: x.sharding, state))")
    return jit_sharded(rl_step, mesh, activation_rules(mesh_config), state_shardings, None)


def _masked_mean(x, mask):
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(mask.sum(), 1)


def _metrics(state, batch, mask, aux, losses, grads, denom):
    tokens = mask.sum()
    ratio = jnp.where(mask, aux["ratio"], 1.0)
    staleness = jnp.where(mask, state.step - batch.policy_versions, 0)
    metrics = {
        "loss": losses.sum(),
        "entropy": _masked_mean(aux["entropy"], mask),
        "clip_fraction": _masked_mean(aux["clipped"].astype(jnp.float32), mask),
        "kl": _masked_mean(aux["kl"], mask),
        "ratio/mean": _masked_mean(ratio, mask),
        "ratio/max": jnp.max(jnp.where(mask, ratio, -jnp.inf)),
        "ratio/min": jnp.min(jnp.where(mask, ratio, jnp.inf)),
        "is_weight/mean": _masked_mean(aux["is_weight"], mask),
        "staleness/mean": _masked_mean(staleness.astype(jnp.float32), mask),
        "staleness/max": jnp.max(staleness),
        "advantage/mean": _masked_mean(batch.advantages, mask),
        "tokens_trained": tokens,
        "loss_denominator": denom,
        "grad_norm": optax.tree.norm(grads),
        "policy_version": state.step,
    }
    metrics.update(logprob_mismatch(aux["logp"], batch.behavior_logprobs, mask))
    if batch.replay_ids is not None and aux.get("used_ids") is not None:
        # a sequence's last token feeds no loss (nothing after it attends to it) and the sampler never ran
        # it as an input, so it has no recorded experts: leave it out
        real = batch.sequence_ids >= 0
        feeds_next = jnp.concatenate(
            [(batch.sequence_ids[:, 1:] == batch.sequence_ids[:, :-1]) & real[:, 1:], jnp.zeros_like(real[:, :1])], 1)
        metrics["replay/override_fraction"] = replay_override_fraction(aux["used_ids"], batch.replay_ids,
                                                                       real & feeds_next)
    if batch.group_rewards is not None:
        metrics["zero_variance_group_fraction"] = zero_variance_fraction(batch.group_rewards)
    return metrics
