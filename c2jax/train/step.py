"""A pure, jitted next-token training step over the split model state.

`TrainState` holds trainable parameters, non-trainable model state (router biases) and the optimizer
state explicitly, so the optimizer can never touch the router bias (it only sees `params`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.transformer import Transformer


class TrainState(NamedTuple):
    step: jnp.ndarray
    params: nnx.State  # nnx.Param leaves only
    model_state: nnx.State  # everything else (RouterBias)
    opt_state: optax.OptState


def init_train_state(model: Transformer, tx: optax.GradientTransformation):
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
    return graphdef, TrainState(jnp.zeros((), jnp.int32), params, model_state, tx.init(params))


def update_router_bias(model_state: nnx.State, counts: jnp.ndarray, rate: float) -> nnx.State:
    """Aux-loss-free balancing (DeepSeek-V3 sec. 2.1.2): b_e += rate * sign(mean load - load_e).

    `counts` [L_moe, E] are the global per-expert token counts of this step (a jnp reduction over the
    whole batch, so under sharding they are already summed across devices).
    """
    model_state = jax.tree.map(lambda x: x, model_state)  # new Variables: the caller's state is untouched
    bias = model_state["moe_layers"]["mlp"]["e_score_correction_bias"]
    load = counts.astype(jnp.float32)
    step = rate * jnp.sign(load.mean(-1, keepdims=True) - load)
    bias.set_value(bias.get_value() + step)
    return model_state


def make_train_step(graphdef, tx: optax.GradientTransformation, router_bias_rate: float = 0.0):
    """train_step(state, tokens [B, S+1]) -> (state, metrics): next-token CE on tokens[:, 1:], then
    (if router_bias_rate > 0) the sign-rule router-bias update, outside the optimizer."""

    def loss_fn(params, model_state, tokens):
        model = nnx.merge(graphdef, params, model_state)
        out = model(tokens[:, :-1], return_mtp=False)
        # the fused head + loss: the [B, S, V] logits are never materialised for the backward
        loss = model.token_losses(out.hidden, tokens[:, 1:]).mean()
        return loss, out.expert_counts

    @jax.jit
    def train_step(state: TrainState, tokens):
        (loss, counts), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, state.model_state, tokens)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        model_state = state.model_state
        if counts is not None and router_bias_rate > 0:
            model_state = update_router_bias(model_state, counts, router_bias_rate)
        if counts is not None:
            load = counts / jnp.maximum(counts.sum(-1, keepdims=True), 1)
            metrics["max_expert_load"] = load.max() * counts.shape[-1]  # 1.0 = perfectly balanced
        return TrainState(state.step + 1, params, model_state, opt_state), metrics

    return train_step
