"""Optax optimizers and LR schedules for pretraining: AdamW (Composer 2's choice) and Muon (Kimi's)."""

from __future__ import annotations

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from c2jax.train.config import OptimizerConfig

# Muon orthogonalises hidden-layer matrices; embeddings, the LM head, norms and biases use AdamW
# (Jordan et al. 2024; Kimi K2 / Moonlight do the same).
_ADAM_ONLY = ("embed_tokens", "lm_head")


def lr_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """warmup-stable-decay (Hu et al. 2024, MiniCPM): linear warmup to lr, constant, then the last
    `decay_fraction` of the steps linear to lr * min_lr_ratio; or warmup + cosine to the same floor."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, max(warmup, 1)),
                                     optax.constant_schedule(cfg.lr)], [warmup])
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(warmup, 1), max(total_steps, warmup + 1), floor)
    decay = max(int(round(total_steps * cfg.decay_fraction)), 1)
    stable = max(total_steps - warmup - decay, 0)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.lr, max(warmup, 1)), optax.constant_schedule(cfg.lr),
         optax.linear_schedule(cfg.lr, floor, decay)],
        [warmup, warmup + stable],
    )


def _muon_dims(params):
    """MuonDimensionNumbers for every >=2-D hidden matrix (leading dims of stacked layers/experts are
    batch dims: contract the second-to-last, output the last), None (-> AdamW) for the rest."""

    def dims(path, leaf):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if leaf.ndim < 2 or any(n in _ADAM_ONLY for n in names):
            return None
        return MuonDimensionNumbers(reduction_axis=leaf.ndim - 2, output_axis=leaf.ndim - 1)

    return jax.tree_util.tree_map_with_path(dims, params)


def _decay_mask(params):
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = lr_schedule(cfg, total_steps)
    if cfg.name == "adamw":
        core = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                           mask=_decay_mask)
    else:
        core = optax.contrib.muon(
            schedule, beta=cfg.muon_beta, weight_decay=cfg.weight_decay, weight_decay_mask=_decay_mask,
            adam_b1=cfg.b1, adam_b2=cfg.b2, eps=cfg.eps, muon_weight_dimension_numbers=_muon_dims,
            consistent_rms=0.2,  # match AdamW's update RMS (Moonlight, Liu et al. 2025)
        )
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), core) if cfg.grad_clip > 0 else core
    return tx, schedule
