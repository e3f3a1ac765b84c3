"""The evaluation config: a typed frozen dataclass, read with `c2jax.config.load(EvalConfig, yaml,
overrides)` like every c2jax config. Example: experiments/configs/eval_small.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field

from c2jax.config import ConfigError
from c2jax.rl.harness.episode import EpisodeConfig

AGENT_KINDS = ("scripted", "openai", "checkpoint")
SCRIPTED_MODES = ("oracle", "noop", "nop")  # nop: Harbor's name for noop
SELECTORS = ("visible_tests", "model_score", "none")


@dataclass(frozen=True)
class AgentConfig:
    """Which agent runs the episodes. `target` is the checkpoint run directory (checkpoint), the base
    URL (openai), or the scripted mode: "oracle" replays each task's reference, "noop" (or "nop") does nothing."""

    kind: str = "scripted"
    target: str = "oracle"
    model: str = "default"  # openai: the served model name; otherwise the label in reports
    api_key_env: str = "OPENAI_API_KEY"  # openai: read the key from this variable (never from the config)
    temperature: float = 1.0
    step: int = -1  # checkpoint: which step to load (-1 = the newest); also the x value of training plots

    def __post_init__(self):
        if self.kind not in AGENT_KINDS:
            raise ConfigError(f"agent.kind must be one of {AGENT_KINDS}, got {self.kind!r}")
        if self.kind == "scripted" and self.target not in SCRIPTED_MODES:
            raise ConfigError(f"agent.target for a scripted agent must be one of {SCRIPTED_MODES}, "
                              f"got {self.target!r}")
        if self.kind != "scripted" and not self.target:
            raise ConfigError(f"agent.target: a {self.kind} agent needs a "
                              f"{'run directory' if self.kind == 'checkpoint' else 'base URL'}")


@dataclass(frozen=True)
class PricingConfig:
    """Dollars per million tokens. Defaults: Composer 2 Standard ($0.50 in / $2.50 out, report §1)."""

    input_per_m: float = 0.50
    output_per_m: float = 2.50

    def __post_init__(self):
        if self.input_per_m < 0 or self.output_per_m < 0:
            raise ConfigError(f"pricing must be non-negative, got {self.input_per_m} / {self.output_per_m}")


@dataclass(frozen=True)
class EvalConfig:
    suite: str = ""  # task-suite directory, SWE-bench .json/.jsonl instances, or "humaneval[:N]"
    repos: str = ""  # SWE-bench instances: directory holding one checked-out repository per instance_id
    # SWE-bench instances without --repos: the image store holding each instance's container image
    # ("" = $C2JAX_IMAGE_STORE)
    image_store: str = ""
    out: str = "runs/eval/run"
    label: str = ""  # name of this run in reports (default: agent kind + target)
    samples: int = 1  # K: episodes per task
    ks: tuple[int, ...] = (1, 2, 4, 8)  # pass@k / pass^k / best-of-k reported for each k <= samples
    concurrency: int = 2  # tasks run at once (threads; each episode has its own sandbox)
    # "bwrap", "local" (no isolation: trusted agents and tests only), or for container-image tasks "docker" /
    # "podman" (that engine) / "auto" (an engine that runs, else bwrap); other tasks always use bwrap
    sandbox: str = "bwrap"
    # tasks whose task.toml permits the public internet share the host's network; off: all run offline,
    # and the report lists the tasks that permit more than they got (docs/sandbox.md, "Network")
    allow_network: bool = False
    prompt_level: str = "issue"  # terse | issue | full (tasks without that level use instruction.md)
    categories: tuple[str, ...] = ()  # only tasks of these categories (empty: all)
    split: str = ""  # only tasks whose metadata.split is this (empty: all)
    selector: str = "visible_tests"  # best-of-K selector: visible_tests | model_score | none
    visible_test_timeout_s: float = 120.0
    grade_timeout_s: float = 0.0  # 0: the task's own timeout
    seed: int = 0
    bootstrap_samples: int = 2000
    ci_alpha: float = 0.05
    agent: AgentConfig = field(default_factory=AgentConfig)
    pricing: PricingConfig = field(default_factory=PricingConfig)
    episode: EpisodeConfig = field(default_factory=lambda: EpisodeConfig(max_turns=30, wall_clock_s=900.0))

    def __post_init__(self):
        if self.samples < 1:
            raise ConfigError(f"samples must be >= 1, got {self.samples}")
        if self.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {self.concurrency}")
        from c2jax.rl.tasks.build import SANDBOX_KINDS

        if self.sandbox not in SANDBOX_KINDS:
            raise ConfigError(f"sandbox must be one of {', '.join(SANDBOX_KINDS)}, got {self.sandbox!r}")
        if self.prompt_level not in ("terse", "issue", "full"):
            raise ConfigError(f"prompt_level must be terse, issue or full, got {self.prompt_level!r}")
        if self.selector not in SELECTORS:
            raise ConfigError(f"selector must be one of {SELECTORS}, got {self.selector!r}")
        if any(k < 1 for k in self.ks):
            raise ConfigError(f"ks must be positive, got {self.ks}")

    @property
    def run_label(self) -> str:
        if self.label:
            return self.label
        if self.agent.kind == "scripted":
            return f"scripted-{self.agent.target}"
        return f"{self.agent.kind}:{self.agent.model if self.agent.kind == 'openai' else self.agent.target}"

