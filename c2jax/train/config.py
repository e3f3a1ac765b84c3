"""`PretrainConfig`: one typed config for a continued-pretraining run (model, mesh, data, optimizer,
phases, checkpoints, eval, logging); `c2jax.config.load(PretrainConfig, yaml, overrides)` reads it and
`c2jax.config.save` writes the resolved one, as for every c2jax config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from c2jax.config import ConfigError, DistributedConfig, MeshConfig, from_dict
from c2jax.data.config import DataConfig
from c2jax.models.config import ModelConfig, RopeScaling


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # final LR = lr * min_lr_ratio
    schedule: Literal["wsd", "cosine", "constant"] = "wsd"
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # WSD: the last fraction of the steps decays linearly to min LR
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    muon_beta: float = 0.95
    # keep the optimizer state (Adam moments) in host memory between steps (c2jax.train.step.offload_shardings):
    # 8 bytes per parameter off the accelerator, for a host <-> device copy of them every step
    offload: bool = False

    def __post_init__(self):
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.decay_fraction <= 1:
            raise ConfigError("lr must be > 0, min_lr_ratio and decay_fraction in [0, 1]")
        if self.warmup_steps < 0 or self.grad_clip < 0:
            raise ConfigError("warmup_steps and grad_clip must be >= 0")


@dataclass(frozen=True)
class LossConfig:
    z_loss: float = 0.0  # weight of PaLM's z-loss, mean over tokens of logsumexp(LM-head logits)^2
    mtp_weight: float = 0.1  # weight of the MTP self-distillation KL
    router_bias_rate: float = 1e-3  # DeepSeek-V3's gamma; 0 disables the bias update
    # weight of the auxiliary load-balancing loss (models.moe_routing.load_balancing_loss): what Qwen3-MoE
    # (router_aux_loss_coef 1e-3) and DeepSeek-V2 train with instead of V3's bias; 0 disables it
    router_aux_loss: float = 0.0


@dataclass(frozen=True)
class PhaseConfig:
    """One stage of the run. `seq_len`/`batch_size` of 0 keep the data config's value."""

    name: str
    steps: int
    seq_len: int = 0
    batch_size: int = 0
    grad_accum: int = 1  # micro-batches per optimizer step
    rope_scaling: RopeScaling | None = None  # e.g. YaRN for a long-context phase
    data: str | None = None  # YAML file of a DataConfig to use in this phase (e.g. SFT data)
    loss_mask: Literal["all", "completion"] | None = None  # None: the data config's
    train_mtp: bool | None = None  # None: train MTP iff step >= mtp_init_step
    reset_optimizer: bool = False  # fresh optimizer moments when the phase starts (the LR schedule continues)
    eval_every: int | None = None  # held-out eval cadence in this phase (global steps); None: eval.every

    def __post_init__(self):
        if self.steps <= 0 or self.grad_accum <= 0 or self.seq_len < 0 or self.batch_size < 0:
            raise ConfigError(f"phase {self.name}: steps and grad_accum must be > 0, seq_len/batch_size >= 0")
        if self.eval_every is not None and self.eval_every < 0:
            raise ConfigError(f"phase {self.name}: eval_every must be >= 0 (0: no eval), got {self.eval_every}")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # save every N steps (and at every phase boundary and at the end)
    keep_last: int = 3
    keep_every: int = 0  # also keep every M-th step forever; 0: none
    async_save: bool = True


@dataclass(frozen=True)
class EvalConfig:
    every: int = 100
    batches: int = 4  # batches per source per eval
    codebase: str | None = None  # directory of code for the rolling-window NLL metric
    codebase_languages: tuple[str, ...] = ()  # c2jax.data.source_tree language tags; empty: all known
    codebase_window: int = 256
    codebase_max_tokens: int = 65536


@dataclass(frozen=True)
class PretrainConfig:
    name: str = "cpt"
    seed: int = 0
    output_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # multi-process: c2jax/distributed.py
    data: dict[str, Any] = field(default_factory=dict)  # a c2jax.data DataConfig, validated there
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    phases: tuple[PhaseConfig, ...] = (PhaseConfig(name="main", steps=100),)
    mtp_init_step: int = 0  # MTP modules are (re)initialised from scratch here and trained after
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    init_from_hf: str | None = None  # a DeepseekV3-format directory to start from
    export_hf: bool = False  # write <run>/hf at the end
    log_every: int = 10
    max_bad_steps: int = 3  # consecutive NaN/Inf steps before rolling back to the last checkpoint
    progress: bool = True

    def __post_init__(self):
        if not self.phases:
            raise ConfigError("phases: at least one phase is required")
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            raise ConfigError(f"phases: names must be unique, got {names}")
        from_dict(DataConfig, self.data, "data")  # so a typo in `data` is an error (and a suggestion) at load

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    def phase_at(self, step: int) -> tuple[int, PhaseConfig, int]:
        """(index, phase, first step of that phase) for global step `step` (0-based)."""
        start = 0
        for i, phase in enumerate(self.phases):
            if step < start + phase.steps:
                return i, phase, start
            start += phase.steps
        return len(self.phases) - 1, self.phases[-1], start - self.phases[-1].steps
