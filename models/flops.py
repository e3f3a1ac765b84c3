"""Parameter counts and training FLOPs per token, from abstract shapes only (nothing is allocated)."""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from c2jax.models.config import ModelConfig
from c2jax.models.transformer import abstract_state


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every trainable parameter
    active: int  # parameters touched per token (routed experts: top-k of E)
    embedding: int  # input embedding table (a lookup, no matmul FLOPs)
    mtp: int  # multi-token-prediction modules (included in total and active)


def param_counts(cfg: ModelConfig) -> ParamCounts:
    _, state = abstract_state(cfg)
    routed_fraction = cfg.num_experts_per_tok / cfg.n_routed_experts
    total = active = embedding = mtp = 0
    for path, var in nnx.to_flat_state(nnx.filter_state(state, nnx.Param)):
        size = var.get_value().size
        # routed expert weights are the only ones with both an 'experts' and an 'expert_mlp' axis
        axes = var.get_metadata().get("logical_axes", ())
        routed = "experts" in axes and "expert_mlp" in axes
        total += size
        active += round(size * routed_fraction) if routed else size
        if path[0] == "embed_tokens":
            embedding += size
        if path[0] == "mtp":
            mtp += size
    return ParamCounts(total, active, embedding, mtp)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, layers: int) -> float:
    """Forward FLOPs of q.k and p.v per token under a causal mask: on average (S + 1) / 2 keys."""
    keys = (seq_len + 1) / 2
    per_layer = 2 * keys * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.value_head_dim)
    return per_layer * layers


def training_flops_per_token(cfg: ModelConfig, seq_len: int, include_mtp: bool = True) -> float:
    """Useful training FLOPs per token: 3 x forward (forward + 2x for backward), Kaplan et al. 2020.

    Forward = 2 x active matmul parameters (the embedding lookup is free; a tied head is counted once
    as the head) + causal attention scores. Capacity padding of the MoE dispatch is not counted: MFU
    measures useful work.
    """
    counts = param_counts(cfg)
    # an untied embedding table is a lookup; a tied one is the head, counted once as a matmul
    matmul_params = counts.active if cfg.tie_word_embeddings else counts.active - counts.embedding
    if not include_mtp:
        matmul_params -= counts.mtp
    layers = cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if include_mtp else 0)
    mtp_heads = cfg.num_nextn_predict_layers if include_mtp else 0
    head = mtp_heads * cfg.hidden_size * cfg.vocab_size  # MTP modules reuse the head: count its use
    forward = 2 * (matmul_params + head) + attention_flops_per_token(cfg, seq_len, layers)
    return 3 * forward
