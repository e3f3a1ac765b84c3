"""The pure, jitted pretraining step over the split model state.

`TrainState` holds trainable parameters, non-trainable model state (router biases), the optimizer
state and an RNG key explicitly, so the optimizer can never touch the router bias (it only sees
`params`). A batch is a dict of [B, S] arrays `input_ids, targets, segment_ids, positions, loss_mask`
(the c2jax.data schema), or [A, B, S] for A micro-batches of gradient accumulation.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from c2jax.models.layers import loss_chunk_tokens
from c2jax.models.moe_routing import load_balancing_loss
from c2jax.models.transformer import Transformer
from c2jax.train.losses import (
    expert_load_stats,
    masked_ce_sum,
    mtp_distill_weights,
    mtp_self_distillation_chunked,
    z_loss_sum,
)

BATCH_KEYS = ("input_ids", "targets", "segment_ids", "positions", "loss_mask")


class TrainState(NamedTuple):
    step: jnp.ndarray
    params: nnx.State  # nnx.Param leaves only
    model_state: nnx.State  # everything else (RouterBias)
    opt_state: optax.OptState
    rng: jnp.ndarray | None = None  # raw key data (uint32), so checkpoints hold a plain array


def init_train_state(model: Transformer, tx: optax.GradientTransformation, seed: int = 0):
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
    rng = jax.random.key_data(jax.random.key(seed))
    return graphdef, TrainState(jnp.zeros((), jnp.int32), params, model_state, tx.init(params), rng)


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


def as_batch(batch) -> dict[str, jnp.ndarray]:
    """Accept the legacy `tokens [B, S + 1]` array (no packing, every target trained) or a batch dict."""
    if isinstance(batch, dict):
        missing = [k for k in BATCH_KEYS if k not in batch]
        if missing:
            raise ValueError(f"batch is missing {missing}; expected keys {BATCH_KEYS}")
        return {k: batch[k] for k in BATCH_KEYS}
    tokens = jnp.asarray(batch)
    inputs = tokens[..., :-1]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[-1], dtype=jnp.int32), inputs.shape)
    return {"input_ids": inputs, "targets": tokens[..., 1:], "segment_ids": jnp.ones_like(inputs),
            "positions": positions, "loss_mask": jnp.ones(inputs.shape, jnp.float32)}


def _all_finite(tree) -> jnp.ndarray:
    leaves = jax.tree.leaves(tree)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


HOST_MEMORY = "pinned_host"


def offload_shardings(shardings):
    """The same shardings in host memory: for TrainState.opt_state, Adam moments kept off the accelerator
    between steps (make_train_step moves them in for the update and back out; `c2jax plan --offload-optimizer`
    plans it)."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY) if isinstance(s, NamedSharding) else s, shardings)


def _offloaded_optimizer(state_shardings) -> bool:
    if state_shardings is None:
        return False
    kinds = {getattr(s, "memory_kind", None) for s in jax.tree.leaves(state_shardings.opt_state)}
    return HOST_MEMORY in kinds


def _to_memory(tree, shardings, kind: str):
    """Move every leaf whose sharding lives in host memory to memory `kind` (inside jit: a transfer)."""
    def one(x, s):
        if getattr(s, "memory_kind", None) != HOST_MEMORY:
            return x
        return jax.device_put(x, s.with_memory_kind(kind))
    return jax.tree.map(one, tree, shardings)


def make_train_step(graphdef, tx: optax.GradientTransformation, router_bias_rate: float = 0.0, *,
                    z_loss: float = 0.0, mtp_weight: float = 0.0, train_mtp: bool = False, router_aux_loss: float = 0.0,
                    state_shardings=None, batch_sharding=None, donate: bool = False, mesh=None, rules=None):
    """train_step(state, batch) -> (state, metrics).

    loss = sum_t m_t CE_t / sum_t m_t  +  z_loss * sum_t m_t lse_t^2 / sum_t m_t
           + mtp_weight * sum_{j,t} w_jt KL_jt / sum_{j,t} w_jt           (if train_mtp)
           + router_aux_loss * load-balancing loss                     (MoE models; mean over micro-batches)

    All sums run over every micro-batch (a `lax.scan` when the batch is [A, B, S]), so accumulation is
    exact. A step whose loss or gradients are not finite leaves the state unchanged (metrics["skipped"]).
    The router-bias sign update runs after the optimizer step on the step's global expert counts.
    """

    def sums_fn(params, model_state, mb):
        model = nnx.merge(graphdef, params, model_state)
        out = model(mb["input_ids"], positions=mb["positions"], segment_ids=mb["segment_ids"],
                    return_mtp=train_mtp)
        # the fused head + loss: the [B, S, V] logits are not materialised for CE's backward
        token_ce, lse = model.token_losses(out.hidden, mb["targets"], with_lse=True)
        ce_sum, tokens = masked_ce_sum(token_ce, mb["loss_mask"])
        sums = {"ce": ce_sum, "tokens": tokens}
        if z_loss > 0:
            sums["z"] = z_loss_sum(lse, mb["loss_mask"])
        if train_mtp and out.mtp_hidden is not None:
            chunk = loss_chunk_tokens(model.cfg.loss_chunk_tokens, model.cfg.vocab_size)
            sums["mtp_kl"], sums["mtp_w"], sums["mtp_agree"] = mtp_self_distillation_chunked(
                model.head_weight(), model.norm(out.hidden), out.mtp_hidden, mb["segment_ids"], mb["loss_mask"],
                chunk)
        if out.expert_counts is not None:
            sums["counts"] = out.expert_counts.astype(jnp.float32)
            if router_aux_loss > 0:  # a per-micro-batch statistic (it is not additive over tokens)
                sums["aux"] = load_balancing_loss(model.cfg, out.router_logits, out.expert_ids,
                                                  mb["segment_ids"] != 0)
        return sums

    def objective(params, model_state, mb, norm):
        sums = sums_fn(params, model_state, mb)
        total = (sums["ce"] + z_loss * sums.get("z", 0.0)) / norm["tokens"]
        if "aux" in sums:
            total = total + router_aux_loss * sums["aux"] / norm["micro"]
        if "mtp_kl" in sums:
            total = total + mtp_weight * sums["mtp_kl"] / norm["mtp_w"]
        return total, sums

    def normalisers(params, micro):
        """Global token and MTP-weight counts: they depend on the data only, so compute them first."""
        tokens = jnp.sum(micro["loss_mask"].astype(jnp.float32))
        norm = {"tokens": jnp.maximum(tokens, 1.0), "micro": jnp.float32(micro["loss_mask"].shape[0])}
        if train_mtp and "mtp" in params:
            depth = jax.tree.leaves(params["mtp"])[0].shape[0]
            w = sum(jnp.sum(jax.vmap(lambda s, m, k=k: mtp_distill_weights(s, m, k))(
                micro["segment_ids"], micro["loss_mask"])) for k in range(1, depth + 1))
            norm["mtp_w"] = jnp.maximum(w, 1.0)
        return norm

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    offloaded = _offloaded_optimizer(state_shardings)

    def train_step(state: TrainState, batch):
        if offloaded:  # Adam moments live in host memory between steps: bring them in for the update
            state = state._replace(opt_state=_to_memory(state.opt_state, state_shardings.opt_state, "device"))
        batch = as_batch(batch)
        micro = batch if batch["input_ids"].ndim == 3 else jax.tree.map(lambda x: x[None], batch)
        norm = normalisers(state.params, micro)

        def accumulate(carry, mb):
            (_, sums), grads = grad_fn(state.params, state.model_state, mb, norm)
            return jax.tree.map(jnp.add, carry, (grads, sums)), None

        zero_grads = jax.tree.map(jnp.zeros_like, state.params)
        zero_sums = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(
            sums_fn, state.params, state.model_state, jax.tree.map(lambda x: x[0], micro)))
        (grads, sums), _ = jax.lax.scan(accumulate, (zero_grads, zero_sums), micro)

        ce = sums["ce"] / norm["tokens"]
        loss = ce + z_loss * sums.get("z", 0.0) / norm["tokens"]
        metrics = {"ce_loss": ce, "tokens": sums["tokens"], "grad_norm": optax.tree.norm(grads)}
        if z_loss > 0:
            metrics["z_loss"] = sums["z"] / norm["tokens"]
        if "aux" in sums:
            metrics["router_aux_loss"] = sums["aux"] / norm["micro"]
            loss = loss + router_aux_loss * metrics["router_aux_loss"]
        if "mtp_kl" in sums:
            metrics["mtp_loss"] = sums["mtp_kl"] / norm["mtp_w"]
            metrics["mtp_acceptance"] = sums["mtp_agree"] / norm["mtp_w"]
            loss = loss + mtp_weight * metrics["mtp_loss"]
        metrics["loss"] = loss
        finite = jnp.isfinite(loss) & _all_finite(grads)

        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        model_state = state.model_state
        counts = sums.get("counts")
        if counts is not None:
            if router_bias_rate > 0:
                model_state = update_router_bias(model_state, counts, router_bias_rate)
            metrics.update(expert_load_stats(counts))
            metrics["max_expert_load"] = metrics["expert_max_over_mean"].max()
            bias = model_state["moe_layers"]["mlp"]["e_score_correction_bias"].get_value()
            metrics["router_bias_norm"] = jnp.linalg.norm(bias.astype(jnp.float32))

        new = TrainState(state.step + 1, params, model_state, opt_state, state.rng)
        # a non-finite step is skipped: every array of the state keeps its old value
        kept = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
        if offloaded:
            kept = kept._replace(opt_state=_to_memory(kept.opt_state, state_shardings.opt_state, "pinned_host"))
        metrics["skipped"] = 1 - finite.astype(jnp.int32)
        return kept, metrics

    if mesh is not None:
        # activation rules installed while tracing: MoE layers go expert-parallel and attention
        # context-parallel when the mesh has those axes (c2jax/mesh.py, docs/parallelism.md)
        from c2jax.models.logical import logical_rules

        plain_step = train_step

        def train_step(state, batch):
            with logical_rules(mesh, rules):
                return plain_step(state, batch)
    if state_shardings is not None:
        return jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                       out_shardings=(state_shardings, None), donate_argnums=(0,) if donate else ())
    return jax.jit(train_step, donate_argnums=(0,) if donate else ())

