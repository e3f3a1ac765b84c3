"""`RLSystemConfig`: one typed, frozen config for an RL run (model, learner, sampler, environment, the
async system, weight sync, curriculum, eval, checkpoints, Ray): `c2jax.config.load(RLSystemConfig, yaml,
overrides)` reads it (`model: {preset: NAME}` included) and `c2jax.config.save` writes the resolved one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from c2jax.config import ConfigError, MeshConfig
from c2jax.models.config import ModelConfig
from c2jax.models.inference.engine import EngineConfig
from c2jax.rl.config import RLConfig
from c2jax.rl.harness.episode import EpisodeConfig


@dataclass(frozen=True)
class SystemConfig:
    mode: Literal["async", "sync"] = "async"  # sync: generate a whole batch, then train (the ablation baseline)
    steps: int = 20  # learner steps
    group_size: int = 4  # G rollouts per prompt
    groups_per_step: int = 4  # groups in one packed batch
    max_staleness: int = 2  # a trained token's version >= learner version - max_staleness
    stale_policy: Literal["drop", "requeue"] = "drop"  # what happens to a group past the bound
    num_rollout_workers: int = 2
    # groups one rollout worker runs at once: their requests share the engine's slots (continuous batching),
    # so one group's environment time (tools, grading) overlaps the others' decoding
    groups_per_worker: int = 2
    num_env_workers: int = 1
    seq_len: int = 64  # packed row length
    min_rows: int = 4  # batches are padded to at least this many rows (and powers of two beyond): few compiles
    call_timeout_s: float = 120.0  # every remote call that is waited on
    group_timeout_s: float = 600.0  # a group not back by then is abandoned and re-queued
    max_group_retries: int = 2  # re-dispatches of a group whose worker died or timed out
    max_episode_retries: int = 1  # re-runs of an episode whose environment call failed
    # this many groups in a row with every episode failed (or lost) end the run with the last error: a setting
    # that fails every episode (a prompt longer than engine.max_len, a broken tool) stops at once instead of
    # dispatching forever; 0: never
    max_failed_groups_in_row: int = 8
    max_restarts: int = 3  # Ray actor restarts
    in_flight_updates: bool = True  # swap weights between decode chunks; False: only between groups
    recompute_cache: bool = True  # on an in-flight swap, re-prefill live sequences under the new weights
    # router replay (report sec. 5): the learner routes every token to the experts the sampler used. Takes
    # effect where there is something to replay: an MoE model on the real sampler and learner
    # (RLSystemConfig.router_replay); false: the learner routes itself
    router_replay: bool = True

    def __post_init__(self):
        for name in ("steps", "group_size", "groups_per_step", "num_rollout_workers", "groups_per_worker",
                     "num_env_workers", "seq_len", "min_rows"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"system.{name} must be positive, got {getattr(self, name)}")
        if self.max_staleness < 0 or self.max_group_retries < 0 or self.max_episode_retries < 0 \
                or self.max_failed_groups_in_row < 0:
            raise ConfigError("system.max_staleness, max_group_retries, max_episode_retries, "
                              "max_failed_groups_in_row must be >= 0")


@dataclass(frozen=True)
class WeightSyncConfig:
    full_every: int = 25  # a full packet every N steps resets the delta chain
    compression: Literal["zlib", "lzma", "none"] = "zlib"
    level: int = 1
    # also publish every packet to shared storage for samplers outside the Ray cluster
    # (c2jax.rl.system.packet_store): a directory path, file:///path, or an fsspec URL (memory://, s3://, ...);
    # "" = Ray object store only
    publish_dir: str = ""
    # pruning: the store keeps every packet from the keep_full-th newest full packet on
    keep_full: int = 2

    def __post_init__(self):
        if self.full_every <= 0:
            raise ConfigError(f"weight_sync.full_every must be positive, got {self.full_every}")
        if self.keep_full < 1:
            raise ConfigError(f"weight_sync.keep_full must be >= 1, got {self.keep_full}")


SPLITS = ("hash", "train", "held_out", "metadata")


@dataclass(frozen=True)
class LadderSourceConfig:
    """A generated ladder (rl/tasks/ladder.py) written as task directories under the run dir: train tasks from
    the run's seed, held-out tasks from seed + 1000 (their ids end in -heldout), train tasks identical to a
    held-out one left out."""

    rungs: tuple[str, ...] = ("answer",)
    per_rung: int = 8
    lookup_keys: int = 2


@dataclass(frozen=True)
class TaskSourceConfig:
    """One source of an `env.kind: suite` run: a path (a directory of task directories of any layout c2jax eval
    loads: ours, Harbor, Terminal-Bench 1, a pinned c2bench directory; or a SWE-bench `.json`/`.jsonl` file
    with `repos` or an image store) or a generated `ladder`; its sampling `weight` among the sources; the
    `category` its tasks are reported under ("" = each task's own category); and how its tasks split into
    train and held-out:
    `hash`: a task is held out when sha256(seed-free task id) falls below `held_out_fraction` (deterministic,
    disjoint, stable when tasks are added); `train` / `held_out`: every task; `metadata`: the task's own
    split field (`c2jax tasks build` writes train / eval; eval is held out). `held_out_ids`: a file of task ids
    (one per line) held out instead of the hash."""

    path: str = ""
    ladder: LadderSourceConfig | None = None
    name: str = ""  # how logs name the source; "" = the path's last component (or "ladder")
    weight: float = 1.0
    category: str = ""
    split: Literal["hash", "train", "held_out", "metadata"] = "hash"
    held_out_fraction: float = 0.2
    held_out_ids: str = ""
    categories: tuple[str, ...] = ()  # keep only tasks of these categories (the task's own); () = all
    max_tasks: int = 0  # keep the first N train tasks (by id); 0 = all
    repos: str = ""  # SWE-bench: a directory holding each instance's repository (one per instance_id)
    image_store: str = ""  # SWE-bench: the image store holding instance images ("" = $C2JAX_IMAGE_STORE)

    def __post_init__(self):
        if bool(self.path) == (self.ladder is not None):
            raise ConfigError("a task source needs exactly one of path (task dirs, c2bench dir, SWE-bench file) "
                              "and ladder (a generated ladder)")
        if not self.weight > 0:
            raise ConfigError(f"task source {self.label}: weight must be > 0, got {self.weight}")
        if not 0.0 <= self.held_out_fraction < 1.0:
            raise ConfigError(f"task source {self.label}: held_out_fraction must be in [0, 1), got "
                              f"{self.held_out_fraction}")
        if self.max_tasks < 0:
            raise ConfigError(f"task source {self.label}: max_tasks must be >= 0, got {self.max_tasks}")
        if self.ladder is not None and self.split != "hash":
            raise ConfigError(f"task source {self.label}: a ladder source splits itself (held-out tasks from "
                              "seed + 1000); leave split unset")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return "ladder" if self.ladder is not None else (Path(self.path).name or self.path)


@dataclass(frozen=True)
class EnvConfig:
    """`target`: single-turn, reward = fraction of generated tokens equal to `target_token` (a learnable
    signal for tiny models; `delay_s` emulates sandbox/grader latency). `ladder`: agentic episodes on the
    task ladder (rl/tasks/ladder.py) through the harness, tools and grader in sandboxes. `text`: single-turn
    text tasks from JSONL files (`{"id", "prompt", "reference"}` per line), the prompt rendered as a user
    message with the chat template or as raw text (`text_template`); the answer is compared with `reference`
    (`text_match`). `tokenizer` picks the chat tokenizer of the `ladder` and `text` environments."""

    kind: Literal["target", "ladder", "text", "suite"] = "target"
    # suite: the task sources (TaskSourceConfig); `ladder` is the suite of one generated ladder source
    sources: tuple[TaskSourceConfig, ...] = ()
    # suite: how task directories reach environment workers: `path`, the sources' paths (the same machine, or
    # storage every node mounts at the same path; a worker that cannot see one fails at start naming it);
    # `ship`, each task directory packed once into the Ray object store and unpacked per environment worker
    task_transfer: Literal["path", "ship"] = "path"
    # the chat tokenizer of `ladder` and `text` (prompts, tool results, grading, the eval checkpoint agent):
    # "" = the byte-level tokenizer (256 byte tokens + the chat special tokens, 264 ids); otherwise a Hugging
    # Face `tokenizers` JSON file (tokenizer.json) or a directory holding one, e.g. a trained BPE; or
    # "ladder-actions": one token per tool call of the echo / lookup rungs, environment text cut to the words
    # that carry the task (rl/system/envs.py ladder_action_tokenizer; 69 ids). The chat
    # special tokens are added when missing; model.vocab_size must cover the result (checked at start)
    tokenizer: str = ""
    num_prompts: int = 64
    eval_prompts: int = 8  # held out (different seed); ladder: the first of the held-out tasks, rungs alternating
    prompt_len: int = 4
    gen_len: int = 8
    target_token: int = 3
    delay_s: float = 0.0
    # spread of the emulated latency: each grade sleeps delay_s * exp(delay_sigma * z), z ~ N(0, 1), i.e. a
    # log-normal with median delay_s, like test suites whose run times span orders of magnitude; 0: constant
    delay_sigma: float = 0.0
    temperature: float = 1.0
    # text: train prompts from text_tasks, held-out eval prompts from text_eval_tasks (the first eval_prompts);
    # `prefix`: reward = longest common prefix of answer and reference / the longer one's length (1 only for
    # an exact answer; partial credit for a right start), `exact`: 1 or 0. gen_len caps the answer's tokens.
    text_tasks: str = ""
    text_eval_tasks: str = ""
    text_match: Literal["prefix", "exact"] = "prefix"
    # `chat`: the prompt is one user message, the answer the assistant turn; `raw`: the prompt's bytes alone and
    # the answer continues them (a completion task, as in pretraining); either way the answer ends at <|im_end|>
    text_template: Literal["chat", "raw"] = "chat"
    # ladder
    rungs: tuple[str, ...] = ("answer",)
    per_rung: int = 8
    lookup_keys: int = 2  # keys per `lookup` settings file (1: read and copy the value; more: find the key too)
    # grade each (task, final diff) once per environment worker and reuse the verdict: sound when the hidden
    # tests are deterministic (the ladder's are), and RL samples often end on the same diff (a converging
    # policy, a small answer space); off for suites with flaky or time-dependent tests
    cache_verdicts: bool = False
    sandbox: Literal["bwrap", "local", "docker", "podman", "auto"] = "bwrap"  # engines: image tasks only
    # tasks whose task.toml permits the public internet share the host's network (bwrap --share-net);
    # off: every task runs offline (docs/sandbox.md, "Network")
    allow_network: bool = False
    prompt_level: Literal["terse", "issue", "full"] = "terse"
    episode: EpisodeConfig = field(default_factory=lambda: EpisodeConfig(
        max_turns=2, max_model_tokens=64, max_new_tokens_per_turn=32, max_context_tokens=4096,
        wall_clock_s=120.0))

    def __post_init__(self):
        if self.delay_s < 0 or self.delay_sigma < 0:
            raise ConfigError(f"env.delay_s and env.delay_sigma must be >= 0, got {self.delay_s}, {self.delay_sigma}")
        if self.kind == "suite" and not self.sources:
            raise ConfigError("env.kind=suite needs env.sources: a list of {path: DIR or SWE-bench file} or "
                              "{ladder: {rungs, per_rung}} entries")
        if self.sources and self.kind != "suite":
            raise ConfigError(f"env.sources is set but env.kind={self.kind}; set env.kind=suite")
        labels = [s.label for s in self.sources]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"env.sources: two sources share a name {sorted(labels)}; give each a distinct `name`")
        if self.kind == "text" and not (self.text_tasks and self.text_eval_tasks):
            raise ConfigError("env.kind=text needs env.text_tasks and env.text_eval_tasks (JSONL files of "
                              '{"id", "prompt", "reference"})')


HARDNESS = ("tokens", "turns", "thinking_tokens")


@dataclass(frozen=True)
class CurriculumStage:
    """From learner step `start_step` on, upsample by `by` with `strength` (0: uniform over live tasks)."""

    start_step: int = 0
    by: Literal["turns", "tokens", "thinking_tokens"] = "tokens"
    strength: float = 1.0

    def __post_init__(self):
        if self.start_step < 0 or self.strength < 0:
            raise ConfigError(f"curriculum stage: start_step and strength must be >= 0, got {self.start_step}, "
                              f"{self.strength}")


@dataclass(frozen=True)
class DifficultyFilterConfig:
    """The online pass-rate filter: a task whose solve rate over its last `window` groups (at least
    `min_groups` of them) is <= `low` or >= `high` stops being sampled; with probability `reprobe_rate` a
    dispatch re-probes a filtered task instead, so a task the policy now partly solves (or forgot) comes back.
    A sample is solved when its verdict >= eval.success_threshold."""

    enabled: bool = False
    window: int = 4
    min_groups: int = 2
    low: float = 0.0
    high: float = 1.0
    reprobe_rate: float = 0.05

    def __post_init__(self):
        if self.window < 1 or not 1 <= self.min_groups <= self.window:
            raise ConfigError(f"curriculum.filter: need window >= 1 and 1 <= min_groups <= window, got "
                              f"{self.window}, {self.min_groups}")
        if not 0.0 <= self.low < self.high <= 1.0:
            raise ConfigError(f"curriculum.filter: need 0 <= low < high <= 1, got {self.low}, {self.high}")
        if not 0.0 <= self.reprobe_rate <= 1.0:
            raise ConfigError(f"curriculum.filter.reprobe_rate must be in [0, 1], got {self.reprobe_rate}")


@dataclass(frozen=True)
class CurriculumConfig:
    enabled: bool = True
    by: Literal["turns", "tokens", "thinking_tokens"] = "tokens"  # hardness signal of recent rollouts (the report's)
    window: int = 8  # recent groups remembered per prompt
    strength: float = 1.0  # weight = (1 + hardness / mean hardness) ** strength
    skip_zero_variance: bool = False  # drop groups whose G rewards are equal (they carry no gradient)
    # the report's later-stage upsampling: from each stage's start_step on, its `by` and `strength` replace the
    # ones above (which hold until the first stage starts); () = one stage
    stages: tuple[CurriculumStage, ...] = ()
    filter: DifficultyFilterConfig = field(default_factory=DifficultyFilterConfig)

    def __post_init__(self):
        if self.window < 1 or self.strength < 0:
            raise ConfigError(f"curriculum: need window >= 1 and strength >= 0, got {self.window}, {self.strength}")
        starts = [s.start_step for s in self.stages]
        if starts != sorted(set(starts)):
            raise ConfigError(f"curriculum.stages: start_step must increase strictly, got {starts}")

    def stage(self, step: int) -> tuple[str, float]:
        """(by, strength) in force at learner step `step`."""
        by, strength = self.by, self.strength
        for s in self.stages:
            if step >= s.start_step:
                by, strength = s.by, s.strength
        return by, strength


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0  # learner steps between online evals; 0: off
    k: int = 4  # samples per held-out prompt: avg@1, pass@K and best-of-K (c2jax.rl.eval.metrics)
    success_threshold: float = 1.0  # a sample succeeds (is "resolved") when its reward >= this


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 10
    keep_last: int = 2


@dataclass(frozen=True)
class RayConfig:
    address: str = ""  # "" = start an embedded local Ray; "auto" or host:port = join a cluster
    num_cpus: int = 2  # local Ray only
    rollout_cpus: float = 0.25  # logical CPUs per rollout worker / evaluator, so several fit on a laptop
    learner_cpus: float = 0.5
    env_cpus: float = 0.1
    learner_gpus: float = 0.0
    rollout_gpus: float = 0.0


@dataclass(frozen=True)
class LearnerConfig:
    """The learner as a group of `num_processes` Ray actors, one per host (a placement group of one bundle of
    `ray.learner_cpus` / `ray.learner_gpus` each), joined by `jax.distributed` into one job: the same jitted
    rl_step on one global mesh (`mesh`, which must span every process's devices), each process fed its rows
    of every batch, each encoding the weight delta of the shards it owns; samplers assemble full weights
    from the shard packets (c2jax.rl.system.weight_sync.ShardedDeltaDecoder). 1: one actor, as before."""

    num_processes: int = 1
    # Ray placement strategy of the group's bundles: SPREAD / STRICT_SPREAD put one process per node on a
    # real cluster; PACK (and SPREAD, when there is one node) also run on one machine, as in the tests
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK"] = "SPREAD"
    # CPU-only runs: >0 gives every learner process this many fake CPU devices
    # (--xla_force_host_platform_device_count, JAX_PLATFORMS=cpu); 0 leaves the node's devices as they are
    cpu_devices_per_process: int = 0
    # jax.distributed: a process silent this long is declared dead (the others abort); joining timeout
    heartbeat_timeout_s: int = 30
    initialization_timeout_s: int = 300
    # a group whose process died (a jax.distributed process cannot rejoin alone) is torn down and rebuilt
    # this many times in one run: the new group restores the newest checkpoint, samplers rewind to its
    # weights, and every graded group not trained at or before that step is trained again; 0: the run stops
    max_group_restarts: int = 2

    def __post_init__(self):
        if self.max_group_restarts < 0:
            raise ConfigError(f"learner.max_group_restarts must be >= 0, got {self.max_group_restarts}")
        if self.num_processes < 1:
            raise ConfigError(f"learner.num_processes must be >= 1, got {self.num_processes}")
        if self.cpu_devices_per_process < 0:
            raise ConfigError(f"learner.cpu_devices_per_process must be >= 0, got {self.cpu_devices_per_process}")
        if self.heartbeat_timeout_s <= 0 or self.initialization_timeout_s <= 0:
            raise ConfigError("learner.heartbeat_timeout_s and learner.initialization_timeout_s must be > 0")


@dataclass(frozen=True)
class BackendConfig:
    """`rl`/`engine`: the real learner (c2jax.rl.learner.rl_step) and sampler (InferenceEngine). `fake`: NumPy
    stand-ins (a categorical policy trained by REINFORCE) for fast tests of the system itself."""

    learner: Literal["rl", "fake"] = "rl"
    policy: Literal["engine", "fake"] = "engine"
    fake_vocab: int = 16
    fake_frozen_params: int = 4096  # parameters the fake learner never changes (delta-compression realism)


@dataclass(frozen=True)
class RLSystemConfig:
    name: str = "rl"
    seed: int = 0
    output_dir: str = "runs/rl"
    resume: bool = True  # pick up the run dir's learner checkpoint and persisted groups
    model: ModelConfig = field(default_factory=ModelConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    # the learner's device mesh (c2jax.config.MeshConfig, as in pretraining: data / fsdp / expert / context /
    # tensor, one axis may be -1); one device (the default) runs rl_step unsharded
    mesh: MeshConfig = field(default_factory=MeshConfig)
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(slots=8, max_len=256, chunk_steps=4))
    env: EnvConfig = field(default_factory=EnvConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    # Start from these weights instead of a random init: a Hugging Face DeepseekV3 checkpoint directory
    # (config.json + safetensors) or a c2jax pretraining run directory (config.yaml + checkpoints/, newest
    # step). Its architecture must equal `model`'s (execution fields such as moe_impl/dtype are the run's).
    # The learner loads it (and the KL reference is a copy); samplers get it with the version-0 full packet.
    init_from: str | None = None
    log_every: int = 1
    dashboard: bool = True  # live rich dashboard when stdout is a TTY

    def __post_init__(self):
        n = self.learner.num_processes
        if n > 1:
            if self.backend.learner != "rl":
                raise ConfigError(f"learner.num_processes={n} needs backend.learner=rl (the fake learner is one "
                                  "NumPy process)")
            if -1 not in self.mesh.shape and self.mesh.num_devices == 1:
                raise ConfigError(f"learner.num_processes={n}: the mesh must span every learner process's devices; "
                                  "set one mesh axis to -1 (e.g. mesh.fsdp=-1)")

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @property
    def router_replay(self) -> bool:
        """Whether rollouts record the sampler's experts and batches replay them: `system.router_replay`,
        for an MoE model (`model.num_moe_layers > 0`) on the real sampler (engine) and learner (rl)."""
        return (self.system.router_replay and self.model.num_moe_layers > 0 and self.backend.policy == "engine"
                and self.backend.learner == "rl")

