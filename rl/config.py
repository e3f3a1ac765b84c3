"""Typed, frozen hyperparameters of the RL learner; read with `c2jax.config.load(RLConfig, ...)`.

Defaults follow Composer 2 (report sec. 4): Dr. GRPO advantages (group mean, no std, no length
normalisation), a REINFORCE token-sum loss over a constant normaliser, k1 KL in the reward, no overlong
masking, router replay on. See docs/rl_learner.md for the reasoning behind each default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from c2jax.models.config import ConfigError

PolicyLoss = Literal["reinforce", "ppo", "gspo", "cispo"]
Aggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"]


@dataclass(frozen=True)
class AdvantageConfig:
    baseline: Literal["group_mean", "rloo", "none"] = "group_mean"
    # Off (Dr. GRPO): dividing by the group std up-weights groups whose rewards barely differ.
    std_normalize: bool = False
    # Off (Dr. GRPO): GRPO's 1/|o_i| per-sequence weight biases the gradient toward long wrong answers.
    length_normalize: bool = False
    eps: float = 1e-6


@dataclass(frozen=True)
class LossConfig:
    policy_loss: PolicyLoss = "reinforce"
    aggregation: Aggregation = "constant"
    # the Dr. GRPO constant T_norm (e.g. group size x generation budget); used by aggregation="constant"
    constant_normalizer: float = 1024.0
    # PPO / CISPO ratio clip; DAPO clip-higher is clip_high=0.28 with clip_low=0.2
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None  # PPO dual clip c (e.g. 3.0): bounds the loss of A < 0 tokens by -c A
    gspo_clip: float = 3e-4  # GSPO clips the sequence ratio with a much smaller eps
    # the ratio's denominator: the sampler's behaviour logprobs, or the learner's own (detached) logprobs
    ratio_reference: Literal["behavior", "proximal"] = "behavior"
    # trainer/sampler importance correction w = sg(pi_prox / mu): truncated (TIS) or masked (MIS)
    importance_correction: Literal["none", "tis", "mis"] = "none"
    is_cap: float = 2.0  # TIS: w = min(w, cap); MIS: w kept iff is_low <= w <= cap
    is_low: float = 0.5
    entropy_coef: float = 0.0

    def __post_init__(self):
        if self.constant_normalizer <= 0:
            raise ConfigError(f"constant_normalizer must be positive, got {self.constant_normalizer}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ConfigError(f"clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.importance_correction != "none" and self.policy_loss != "reinforce" \
                and self.ratio_reference == "behavior":
            raise ConfigError("importance_correction with ratio_reference='behavior' corrects for the sampler "
                              "twice; use ratio_reference='proximal' (decoupled PPO) or policy_loss='reinforce'")
        if not 0 <= self.is_low <= 1 <= self.is_cap:
            raise ConfigError(f"need 0 <= is_low <= 1 <= is_cap, got {self.is_low}, {self.is_cap}")


@dataclass(frozen=True)
class KLConfig:
    coef: float = 0.0  # beta; 0 disables the reference forward pass entirely
    estimator: Literal["k1", "k2", "k3"] = "k1"
    # "reward": beta * sg(sum_t k_t) is subtracted from the sequence's advantage (how k1 regularises);
    # "loss": beta * k_t is added to the per-token loss (k1 there has a zero-mean gradient, see rl/kl.py)
    placement: Literal["reward", "loss"] = "reward"
    # 0: the reference is the starting checkpoint; N > 0: it is reset to the current policy every N steps
    refresh_every: int = 0

    def __post_init__(self):
        if self.coef < 0 or self.refresh_every < 0:
            raise ConfigError(f"kl.coef and kl.refresh_every must be >= 0, got {self.coef}, {self.refresh_every}")


PENALTY_GATES = ("always", "resolved", "mixed_groups")


@dataclass(frozen=True)
class LengthPenaltyConfig:
    """x = sum_c weight_c * count_c; penalty = scale * C_{k,q}(x) (rl/length_penalty.py)."""

    scale: float = 0.0
    k: float = 1e-3
    q: float = 0.5
    thinking_tokens: float = 1.0
    tool_call_tokens: float = 1.0
    tool_output_tokens: float = 0.25
    final_message_tokens: float = 1.0
    tool_calls: float = 50.0
    turns: float = 50.0
    # which episodes pay it. The report's penalty buys efficiency on tasks the agent solves; in an all-fail group an
    # ungated penalty is the whole advantage, and at a low solve rate most groups are all-fail (measured in
    # experiments/ablations/12_rl_from_weak_start: `resolved` lifted the weakest start, `always` did not):
    #   always        every episode (the report's formula as written)
    #   resolved      only episodes whose verdict >= resolved_at (efficiency among successes)
    #   mixed_groups  only in groups whose verdicts differ (all-fail / all-pass groups get the bare verdict)
    gate: str = "always"
    resolved_at: float = 1.0
    # linear ramp of `scale` from 0 over this many policy versions from the run's start (0: full scale at once)
    anneal_steps: int = 0

    def __post_init__(self):
        if self.k <= 0 or self.q < 0 or self.scale < 0:
            raise ConfigError(f"length penalty needs k > 0, q >= 0, scale >= 0; got {self.k}, {self.q}, {self.scale}")
        if self.gate not in PENALTY_GATES:
            raise ConfigError(f"length_penalty.gate must be one of {', '.join(PENALTY_GATES)}, got {self.gate!r}")
        if self.anneal_steps < 0:
            raise ConfigError(f"length_penalty.anneal_steps must be >= 0, got {self.anneal_steps}")


@dataclass(frozen=True)
class RewardConfig:
    correctness_weight: float = 1.0
    length_penalty: LengthPenaltyConfig = field(default_factory=LengthPenaltyConfig)
    # name -> weight of each auxiliary reward in rl/rewards.py AUXILIARY_REWARDS (weight 0 = logged only)
    auxiliary: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RLConfig:
    learning_rate: float = 1e-6
    # linear warmup from 0 over this many optimizer steps (0: constant). Adam's first steps move every parameter by
    # ~learning_rate whatever its gradient's size (the bias-corrected m/sqrt(v) is sign(g) at step 1), so on a
    # noisy RL gradient the first updates are the largest and least informed; a warmup damps them
    warmup_steps: int = 0
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    micro_batches: int = 1  # rows of the packed batch are split into this many gradient-accumulation chunks
    compute_entropy: bool = True  # needs the [B, S, V] logits of each micro-batch (logged, not trained)
    router_bias_rate: float = 0.0  # aux-loss-free bias update during RL (the report does not say; off)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

    def __post_init__(self):
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate must be positive, got {self.learning_rate}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be a non-negative integer, got {self.warmup_steps!r}")
        if not isinstance(self.micro_batches, int) or self.micro_batches <= 0:
            raise ConfigError(f"micro_batches must be a positive integer, got {self.micro_batches!r}")
