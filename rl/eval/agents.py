"""Agent factories for the runner: `factory(task, sample) -> Agent`, one fresh agent per episode.

  scripted oracle   replays the task's reference through the tools (write the patch, `git apply` it,
                    submit; an eager-editing question is answered with its reference answer): it must
                    score 100% on a valid suite, which makes it the suite's end-to-end check. On a
                    Harbor task it is Harbor's oracle: solution/ uploaded to /solution before the
                    episode, solve.sh run from the working directory (rl/tasks/harbor.py).
  scripted noop     (or `nop`, Harbor's name) submits without doing anything: must score 0% (the base
                    repository fails).
  openai URL        `c2jax.rl.harness.OpenAIAgent` against any OpenAI-compatible endpoint.
  checkpoint PATH   a c2jax pretraining or RL run directory (config.yaml + checkpoints/), served by one
                    `InferenceEngine` behind a lock and sampled through `SamplerAgent`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from c2jax.rl.eval.config import AgentConfig
from c2jax.rl.harness.agents import Agent, ScriptedAgent
from c2jax.rl.sandbox.base import Sandbox
from c2jax.rl.tasks.grading import apply_patch
from c2jax.rl.tasks.harbor import solve_command, upload_solution
from c2jax.rl.tasks.task import Task

AgentFactory = Callable[[Task, int], Agent]
_REF = ".c2jax-reference.patch"
_SOLVE = ".c2jax-solve.sh"
_ORACLE_TIMEOUT_S = 3600.0  # asked of the tool, which caps it at the episode's max_command_timeout_s


def oracle_turns(task: Task) -> list[list[dict]]:
    """Tool calls that reproduce the task's reference solution."""
    def call(name, **arguments):
        return {"name": name, "arguments": arguments}

    if task.metadata.get("behaviour") == "eager_editing":
        return [[call("submit", message=str(task.metadata.get("reference_answer", "")))]]
    if task.harbor and task.solution_script is not None:
        # one command for the whole of solve.sh: bounded by the agent's timeout, as in Harbor
        timeout = (task.environment.agent_timeout_s if task.environment else None) or _ORACLE_TIMEOUT_S
        return [[call("run_terminal_cmd", command=solve_command(task), timeout=timeout)],
                [call("submit", message="Ran the solution.")]]
    if task.solution_patch:
        return [[call("write_file", path=_REF, content=task.solution_patch)],
                [call("run_terminal_cmd", command=f"git apply --whitespace=nowarn {_REF}; rm -f {_REF}")],
                [call("submit", message="Applied the fix.")]]
    if task.solution_script:
        return [[call("write_file", path=_SOLVE, content=task.solution_script)],
                [call("run_terminal_cmd", command=f"bash {_SOLVE}; rm -f {_SOLVE}")],
                [call("submit", message="Ran the solution.")]]
    raise ValueError(f"task {task.id} has no reference solution (solution/*.patch or solve.sh) for the "
                     "scripted oracle")


@dataclass
class HarborOracle(ScriptedAgent):
    """The oracle on a Harbor task: `setup` uploads solution/ to /solution before the episode starts
    (Harbor's OracleAgent), so the turns only run solve.sh. Other agents never see /solution."""

    task: Task | None = None

    def setup(self, sandbox: Sandbox) -> None:
        upload_solution(sandbox, self.task)


@dataclass
class ImagePatchOracle(ScriptedAgent):
    """The oracle on a task whose environment is a container image (a SWE-bench instance image): such images
    need not have git or patch, so `setup` applies the reference patch the way the grader applies any patch
    (the environment's git or patch, else the host's git on the workspace tree); the turns only submit."""

    task: Task | None = None

    def setup(self, sandbox: Sandbox) -> None:
        ok, err = apply_patch(sandbox, self.task.solution_patch, ".c2jax-oracle")
        sandbox.exec("rm -rf .c2jax-oracle", timeout_s=60)
        if not ok:
            raise RuntimeError(f"task {self.task.id}: the reference patch does not apply: {err}")


def _oracle(task: Task) -> Agent:
    if task.harbor and task.solution_script is not None:
        return HarborOracle(oracle_turns(task), name="scripted-oracle", task=task)
    if task.solution_patch and task.environment is not None and task.environment.in_image:
        return ImagePatchOracle([[{"name": "submit", "arguments": {"message": "Applied the fix."}}]],
                                name="scripted-oracle", task=task)
    return ScriptedAgent(oracle_turns(task), name="scripted-oracle")


def scripted_factory(mode: str = "oracle") -> AgentFactory:
    if mode == "oracle":
        return lambda task, sample: _oracle(task)
    if mode in ("noop", "nop"):
        return lambda task, sample: ScriptedAgent([[{"name": "submit", "arguments": {"message": "Done."}}]],
                                                  name="scripted-noop")
    raise ValueError(f"scripted agent mode must be 'oracle', 'noop' or 'nop', got {mode!r}")


def openai_factory(cfg: AgentConfig) -> AgentFactory:
    from c2jax.rl.harness.openai_agent import OpenAIAgent

    if not cfg.target.startswith(("http://", "https://")):
        raise ValueError(f"openai agent: {cfg.target!r} is not an http(s) base URL (e.g. http://localhost:8000/v1)")
    key = os.environ.get(cfg.api_key_env, "EMPTY")
    return lambda task, sample: OpenAIAgent(cfg.model, base_url=cfg.target, api_key=key,
                                            temperature=cfg.temperature, name=f"openai:{cfg.model}")


class LockedPolicy:
    """A `TokenPolicy` shared by concurrent episodes: the engine is single-threaded, so calls take turns.
    (Continuous batching across episodes would go through c2jax.models.inference.server.EngineWorker.)"""

    def __init__(self, engine):
        self.engine = engine
        self._lock = threading.Lock()

    def generate_tokens(self, prompt_ids, *, max_new_tokens, stop_token_ids, temperature, seed):
        with self._lock:
            return self.engine.generate_tokens(prompt_ids, max_new_tokens=max_new_tokens,
                                               stop_token_ids=stop_token_ids, temperature=temperature, seed=seed)


def load_checkpoint_engine(run_dir: str | Path, *, step: int = -1, max_len: int = 8192):
    """(engine, tokenizer, step) from a pretraining run directory: its resolved config.yaml names the
    model and tokenizer; the params of `step` (newest when -1) are restored from checkpoints/."""
    import jax
    from flax import nnx

    from c2jax.config import load, load_yaml
    from c2jax.data.tokenizer import load_tokenizer
    from c2jax.models.inference import EngineConfig, InferenceEngine
    from c2jax.models.moe_dispatch import resolve_loaded_moe_kernel
    from c2jax.models.transformer import init
    from c2jax.train.checkpoint import Checkpointer
    from c2jax.train.config import PretrainConfig
    from c2jax.train.loop import phase_model_config
    from c2jax.train.optim import make_optimizer
    from c2jax.train.step import init_train_state

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "checkpoints").is_dir():
        raise ValueError(f"checkpoint agent: {run_dir} is not a c2jax run directory (needs config.yaml and "
                         "checkpoints/)")
    data = load_yaml(run_dir / "config.yaml")
    if isinstance(data, dict) and "rl" in data and "system" in data:
        return _load_rl_run_engine(run_dir, data, step=step, max_len=max_len)
    cfg = load(PretrainConfig, data)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    steps = ckpt.steps()
    if not steps:
        raise ValueError(f"checkpoint agent: {run_dir / 'checkpoints'} holds no checkpoint")
    chosen = steps[-1] if step < 0 else step
    if chosen not in steps:
        raise ValueError(f"checkpoint agent: step {step} not in {run_dir / 'checkpoints'} (has {steps})")
    tx, _ = make_optimizer(cfg.optimizer, cfg.total_steps)
    # shapes only: the restore fills every leaf, so the random init is never materialized
    abstract = jax.eval_shape(lambda: init_train_state(init(cfg.model, seed=cfg.seed), tx, seed=cfg.seed)[1])
    state, meta = ckpt.restore(chosen, abstract)
    ckpt.close()
    # the model of the phase the checkpoint was written in (a long-context phase's YaRN scaling included), with the
    # MoE kernel of this device where the run's was another's
    phase = cfg.phases[min(int(meta.get("phase", 0)), len(cfg.phases) - 1)]
    model_cfg = resolve_loaded_moe_kernel(phase_model_config(cfg, phase), f"checkpoint agent {run_dir}")
    graphdef = nnx.split(nnx.eval_shape(lambda: init(model_cfg, seed=cfg.seed)), nnx.Param, ...)[0]
    merged = nnx.merge(graphdef, state.params, state.model_state)
    tokenizer = load_tokenizer(cfg.data["tokenizer"])
    engine = InferenceEngine.from_model(merged, config=EngineConfig(max_len=max_len), version=chosen,
                                        detokenize=lambda ids: tokenizer.decode(ids))
    return engine, tokenizer, chosen


def _load_rl_run_engine(run_dir: Path, data: dict, *, step: int, max_len: int):
    """(engine, tokenizer, version) from a c2jax RL run (`c2jax rl`, the demo's RL stage): the learner's
    newest Orbax checkpoint, restored as the learner restores it, and the RL system's chat tokenizer."""
    import dataclasses

    from c2jax.config import load
    from c2jax.models.inference import EngineConfig, InferenceEngine
    from c2jax.models.moe_dispatch import resolve_loaded_moe_kernel
    from c2jax.rl.system.backends import restore_learner_model
    from c2jax.rl.system.config import RLSystemConfig
    from c2jax.rl.system.envs import chat_tokenizer

    cfg = load(RLSystemConfig, data)
    cfg = dataclasses.replace(cfg, model=resolve_loaded_moe_kernel(cfg.model, f"checkpoint agent {run_dir}"))
    if cfg.backend.learner != "rl":
        raise ValueError(f"checkpoint agent: {run_dir} ran the {cfg.backend.learner!r} learner, which has no model")
    try:  # the run's env.tokenizer (bytes or a trained one), loaded before the checkpoint is restored
        tokenizer = chat_tokenizer(cfg.env.tokenizer)
    except ValueError as e:
        raise ValueError(f"checkpoint agent: RL run {run_dir}: {e}") from None
    try:
        model, version = restore_learner_model(cfg, run_dir)
    except ValueError as e:
        raise ValueError(f"checkpoint agent: {e}") from None
    if step >= 0 and step != version:
        raise ValueError(f"checkpoint agent: an RL run restores its newest checkpoint ({version}); step {step} "
                         "was asked")
    engine = InferenceEngine.from_model(model, config=EngineConfig(max_len=max_len), version=version,
                                        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    return engine, tokenizer, version


def checkpoint_factory(cfg: AgentConfig) -> AgentFactory:
    from c2jax.rl.harness import ChatRenderer, SamplerAgent, add_chat_special_tokens

    engine, data_tokenizer, step = load_checkpoint_engine(cfg.target, step=cfg.step)
    # the chat renderer works on a Hugging Face `tokenizers.Tokenizer` (token-in/token-out with special
    # tokens); c2jax's HF wrapper holds one, the bytes and tiktoken tokenizers have none
    from tokenizers import Tokenizer

    tokenizer = data_tokenizer if isinstance(data_tokenizer, Tokenizer) else getattr(data_tokenizer, "_tok", None)
    if tokenizer is None:
        raise ValueError(f"checkpoint agent: the run's tokenizer {data_tokenizer.name!r} is not a Hugging Face "
                         "tokenizer.json; the chat renderer needs one (train with data.tokenizer=PATH/tokenizer.json)")
    add_chat_special_tokens(tokenizer)
    if tokenizer.get_vocab_size() > engine.cfg.vocab_size:
        raise ValueError(f"checkpoint agent: the tokenizer with chat tokens has {tokenizer.get_vocab_size()} "
                         f"ids but the model's vocabulary is {engine.cfg.vocab_size}; train with the chat "
                         "special tokens in the vocabulary")
    policy, renderer = LockedPolicy(engine), ChatRenderer(tokenizer)
    return lambda task, sample: SamplerAgent(policy, renderer, temperature=cfg.temperature,
                                             name=f"checkpoint@{step}")


def make_factory(cfg: AgentConfig) -> AgentFactory:
    """The agent factory an AgentConfig names; errors name the unknown kind."""
    if cfg.kind == "scripted":
        return scripted_factory(cfg.target)
    if cfg.kind == "openai":
        return openai_factory(cfg)
    if cfg.kind == "checkpoint":
        return checkpoint_factory(cfg)
    raise ValueError(f"unknown agent kind {cfg.kind!r}; expected scripted, openai or checkpoint")
