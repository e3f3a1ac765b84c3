"""The decoder: embeddings, dense then MoE layers (each a scanned stack), final norm, LM head, and optional
multi-token-prediction modules (DeepSeek-V3 sec. 2.2). DeepSeek-V3 / Kimi-K2-shaped by default; MLA or GQA
attention and every router by ModelConfig (docs/models.md); a dense model is all dense layers.

The module is a container. `forward(graphdef, state, ...)` is the pure function that jitted training and
sampling code calls; `Transformer.__call__` is the same thing for interactive use.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from c2jax.models.attention import AttentionMask, make_attention
from c2jax.models.blockwise_attention import KERNEL_RESIDUAL_NAMES
from c2jax.models.config import ModelConfig
from c2jax.models.context_parallel import (
    ContextParallelMask,
    balanced_order,
    context_parallel_size,
    inverse_order,
)
from c2jax.models.layers import MLP, RMSNorm, dense, lm_head_loss, loss_chunk_tokens, param
from c2jax.models.logical import constrain
from c2jax.models.moe import MoE
from c2jax.models.rope import rope_tables


class ModelOutput(NamedTuple):
    logits: jnp.ndarray  # [B, S, V] float32
    hidden: jnp.ndarray  # [B, S, d] final hidden state before the output norm
    expert_ids: jnp.ndarray | None  # [L_moe, B, S, k] selected experts per MoE layer (router replay)
    expert_counts: jnp.ndarray | None  # [L_moe, E] tokens per expert per MoE layer (bias update)
    router_logits: jnp.ndarray | None  # [L_moe, B, S, E] float32 (z-loss, diagnostics)
    mtp_logits: jnp.ndarray | None  # [D, B, S, V]: depth j predicts token t + 1 + j from position t
    # [D, B, S, d]: what the head sees for mtp_logits (each module's output after its own norm), so losses
    # can apply the head in chunks (c2jax.train.losses.mtp_self_distillation_chunked)
    mtp_hidden: jnp.ndarray | None = None


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + Attn(norm(x)), then + FFN(norm(.)), FFN dense SwiGLU or MoE."""

    def __init__(self, cfg: ModelConfig, moe: bool, rngs: nnx.Rngs, stack: int | None = None):
        self.is_moe = moe
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg, rngs, stack)
        self.self_attn = make_attention(cfg, rngs, stack)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg, rngs, stack)
        self.mlp = MoE(cfg, rngs, stack) if moe else MLP(cfg, cfg.intermediate_size, rngs, stack, bias=cfg.mlp_bias)

    def __call__(self, x, cos, sin, mask, replay_ids=None):
        h = x + checkpoint_name(self.self_attn(self.input_layernorm(x), cos, sin, mask), "attn_out")
        h = constrain(h, ("batch", "seq", "embed"))
        if self.is_moe:
            ffn, routing = self.mlp(self.post_attention_layernorm(h), replay_ids)
        else:
            ffn, routing = self.mlp(self.post_attention_layernorm(h)), None
        out = constrain(h + checkpoint_name(ffn, "ffn_out"), ("batch", "seq", "embed"))
        return out, routing


class MTPModule(nnx.Module):
    """h'_j = Block(W [RMSNorm(Emb(t_{i+j})); RMSNorm(h_{j-1})]); embedding and head shared with the trunk."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, stack: int):
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg, rngs, stack)
        self.hnorm = RMSNorm(d, cfg, rngs, stack)
        self.eh_proj = param(rngs, (2 * d, d), ("mtp_in", "embed"), cfg=cfg, stack=stack)
        self.block = DecoderLayer(cfg, True, rngs, stack)
        self.norm = RMSNorm(d, cfg, rngs, stack)


_REMAT = {
    "full": lambda: jax.checkpoint_policies.nothing_saveable,
    "dots": lambda: jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": lambda: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attn_out": lambda: jax.checkpoint_policies.save_only_these_names("attn_out", "ffn_out"),
    # "full", except the blockwise attention kernel's output and log-sum-exp ([B, H, S, Dv] + [B, H, S] per
    # layer): the backward then recomputes the layer without re-running the attention forward, the dominant
    # cost at long S (docs/attention.md). Other backends (dense, cuDNN) name nothing: for them this is "full".
    "save_attn_kernel": lambda: jax.checkpoint_policies.save_only_these_names(*KERNEL_RESIDUAL_NAMES),
}


@jax.custom_vjp
def _unstack(a):
    """tuple(a[i] for i in range(len(a))), whose gradient is one stack of the per-layer gradients.
    Autodiff of the slices would instead pad every layer's gradient to the full [L, ...] shape and add
    the pads (measured on XLA:CPU: ~L x the stacked parameter size of extra traffic per step)."""
    return tuple(a[i] for i in range(a.shape[0]))


_unstack.defvjp(lambda a: (_unstack(a), None), lambda _, cts: (jnp.stack(cts),))


def _run_stack(cfg: ModelConfig, stack: nnx.Module, num: int, x, cos, sin, mask, replay_ids):
    """Apply `num` stacked layers (leading axis 'layers' on every leaf) in order."""
    graphdef, state = nnx.split(stack)

    def body(h, xs):
        layer_state, replay = xs
        h, routing = nnx.merge(graphdef, layer_state)(h, cos, sin, mask, replay)
        if routing is None:
            return h, None
        return h, (routing.expert_ids, routing.counts, routing.logits)

    if cfg.remat_policy != "none":
        body = jax.checkpoint(body, policy=_REMAT[cfg.remat_policy](), prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
        return jax.lax.scan(body, x, (state, replay_ids))
    outs = []
    per_layer = jax.tree.map(_unstack, state)
    for i in range(num):
        layer = jax.tree.map(lambda a, i=i: a[i], per_layer, is_leaf=lambda a: isinstance(a, tuple))
        x, out = body(x, (layer, None if replay_ids is None else replay_ids[i]))
        outs.append(out)
    stacked = None if outs[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *outs)
    return x, stacked


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, v = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = param(rngs, (v, d), ("vocab", "embed"), cfg=cfg)
        self.dense_layers = DecoderLayer(cfg, False, rngs, cfg.num_dense_layers) if cfg.num_dense_layers else None
        self.moe_layers = DecoderLayer(cfg, True, rngs, cfg.num_moe_layers) if cfg.num_moe_layers else None
        self.norm = RMSNorm(d, cfg, rngs)
        self.lm_head = None if cfg.tie_word_embeddings else param(rngs, (d, v), ("embed", "vocab"), cfg=cfg)
        depth = cfg.num_nextn_predict_layers
        self.mtp = MTPModule(cfg, rngs, depth) if depth else None

    def head_weight(self):
        """[d, V]: the LM head, or the transposed embedding table when tied."""
        return self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]

    def logits(self, h, norm: RMSNorm | None = None):
        """Output head: the trunk's final norm, or an MTP module's own norm, then the shared LM head."""
        h = (self.norm if norm is None else norm)(h)
        w = self.head_weight()
        out = dense(h, w, preferred_element_type=jnp.float32)
        return constrain(out, ("batch", "seq", "vocab"))

    def token_losses(self, hidden, labels, norm: RMSNorm | None = None, *, with_lse: bool = False):
        """Per-token cross-entropy [B, S] of the output head on `hidden` (pre-norm, like ModelOutput.hidden)
        against `labels` [B, S] (with `with_lse`, also the logits' log-sum-exp [B, S], for the z-loss).
        Equals softmax_cross_entropy(self.logits(hidden), labels), but head and loss share one hand-written
        backward (c2jax.models.layers.lm_head_loss), about twice as fast on XLA:CPU as autodiff through the
        logits, and long sequences go through in chunks of `cfg.loss_chunk_tokens` tokens, so the [B*S, V]
        logits never exist at once; under jit, unused `ModelOutput.logits` are dead code and cost nothing."""
        h = (self.norm if norm is None else norm)(hidden)
        w = self.head_weight()
        batch, seq, d = h.shape
        chunk = loss_chunk_tokens(self.cfg.loss_chunk_tokens, self.cfg.vocab_size)
        loss, lse = lm_head_loss(h.reshape(batch * seq, d), w, labels.reshape(-1), chunk)
        if with_lse:
            return loss.reshape(batch, seq), lse.reshape(batch, seq)
        return loss.reshape(batch, seq)

    def embed(self, ids):
        x = jnp.take(self.embed_tokens[...], ids, axis=0).astype(jnp.dtype(self.cfg.dtype))
        return constrain(x, ("batch", "seq", "embed"))

    def __call__(self, input_ids, positions=None, segment_ids=None, replay_ids=None,
                 return_mtp: bool = True) -> ModelOutput:
        """input_ids [B, S]; positions [B, S] (default 0..S-1; restart per document when packing);
        segment_ids [B, S] (attention never crosses documents); replay_ids [L_moe, B, S, k]."""
        cfg = self.cfg
        batch, seq = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
        cp = context_parallel_size()
        order = inverse = None
        if cp > 1:
            # run every layer in the balanced context-parallel order; outputs are un-permuted below
            order = balanced_order(seq, cp)
            inverse = inverse_order(order)
            positions = positions[:, order]
            segment_ids = None if segment_ids is None else segment_ids[:, order]
            replay_ids = None if replay_ids is None else replay_ids[:, :, order]
            mask = ContextParallelMask(segment_ids, jnp.asarray(order, jnp.int32))
        else:
            mask = AttentionMask(segment_ids)
        cos, sin = rope_tables(cfg, positions)
        x = self.embed(input_ids if order is None else input_ids[:, order])
        if self.dense_layers is not None:
            x, _ = _run_stack(cfg, self.dense_layers, cfg.num_dense_layers, x, cos, sin, mask, None)
        expert_ids = counts = router_logits = None
        if self.moe_layers is not None:
            if replay_ids is not None and replay_ids.shape[0] != cfg.num_moe_layers:
                raise ValueError(f"replay_ids has {replay_ids.shape[0]} layers, model has {cfg.num_moe_layers}")
            x, (expert_ids, counts, router_logits) = _run_stack(
                cfg, self.moe_layers, cfg.num_moe_layers, x, cos, sin, mask, replay_ids)
            expert_ids = expert_ids.reshape(cfg.num_moe_layers, batch, seq, -1)
            router_logits = router_logits.reshape(cfg.num_moe_layers, batch, seq, -1)
            if inverse is not None:
                expert_ids, router_logits = expert_ids[:, :, inverse], router_logits[:, :, inverse]
        mtp_logits = mtp_hidden = None
        if self.mtp is not None and return_mtp:
            mtp_hidden = self._mtp(input_ids, x, cos, sin, mask, order)
            mtp_hidden = mtp_hidden if inverse is None else mtp_hidden[:, :, inverse]
            mtp_logits = dense(mtp_hidden, self.head_weight(), preferred_element_type=jnp.float32)
            mtp_logits = constrain(mtp_logits, (None, "batch", "seq", "vocab"))
        if inverse is not None:
            x = constrain(x[:, inverse], ("batch", "seq", "embed"))
        return ModelOutput(self.logits(x), x, expert_ids, counts, router_logits, mtp_logits, mtp_hidden)

    def _mtp(self, input_ids, h, cos, sin, mask, order=None):
        """[D, B, S, d]: each MTP module's output after its own norm (the head's input for that depth).
        h: the trunk's final hidden state before its output norm. Module j is fed the representation the
        head sees: the trunk's output after the final norm (j = 0), module j-1's output after its own norm
        (j > 0). This is what transformers' MtpModel and Megatron-LM do (and vLLM/SGLang for j = 0), i.e. the
        semantics the released DeepSeek-V3 MTP weights are served with."""
        graphdef, state = nnx.split(self.mtp)
        seq = input_ids.shape[1]
        outs = []
        h = self.norm(h)
        for j in range(self.cfg.num_nextn_predict_layers):
            module = nnx.merge(graphdef, jax.tree.map(lambda a, j=j: a[j], state))
            # position t combines h_{j}(t) with the embedding of token t + j + 1; the tail has none
            shifted = jnp.where(jnp.arange(seq) < seq - j - 1, jnp.roll(input_ids, -(j + 1), axis=1), 0)
            shifted = shifted if order is None else shifted[:, order]  # h and masks are in CP order
            e = module.enorm(self.embed(shifted))
            x = jnp.concatenate([e, module.hnorm(h)], axis=-1)
            x = dense(x, module.eh_proj[...])
            block = lambda x, module=module: module.block(x, cos, sin, mask)[0]
            if self.cfg.remat_policy != "none":  # the same policy as the trunk's layers
                block = jax.checkpoint(block, policy=_REMAT[self.cfg.remat_policy]())
            out = block(x)
            h = module.norm(out)
            outs.append(h)
        return jnp.stack(outs)


def init(cfg: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(cfg, nnx.Rngs(params=seed))


def abstract_state(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Shapes, dtypes and logical axes of every variable, without allocating (jax.eval_shape)."""
    model = nnx.eval_shape(lambda: init(cfg))
    return nnx.split(model)


def forward(graphdef: nnx.GraphDef, state: nnx.State, input_ids, **kwargs) -> ModelOutput:
    """Pure function of the split model state; this is what jitted code calls."""
    return nnx.merge(graphdef, state)(input_ids, **kwargs)
