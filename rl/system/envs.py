"""Environments: the prompt sets, the episode runners (on rollout workers) and what environment workers
execute (sandbox operations, grading).

`target` (single turn): prompts are random token ids; reward = fraction of generated tokens equal to
`target_token`, graded on an environment worker after `delay_s` (emulated sandbox/grader latency; with
`delay_sigma`, log-normal around it).
`text` (single turn): prompts and references from JSONL files, rendered as one user message with the chat
template (or as raw text, a completion task); the decoded answer (up to <|im_end|>) is compared with the
reference on an environment worker.
`ladder` (agentic): the rl/tasks ladder, run through the harness episode loop with the sampler as the
agent; every tool call runs in a sandbox held by an environment worker (`RemoteSandbox` forwards the
Sandbox interface), and the final diff is graded there in a fresh sandbox by c2jax.rl.tasks.grading.grade.
Episode sandboxes open through `open_task_sandbox`, as in `c2jax eval`: a task's task.toml workdir, env,
limits, network policy (`env.allow_network`), Harbor's /logs and `[agent].timeout_sec` apply in training
exactly as in evaluation, and the tools and system prompt name the task's working directory.
`text` and `ladder` tokenize with `chat_tokenizer(env.tokenizer)`: the byte tokenizer, or a trained one.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from c2jax.rl.sandbox.base import Sandbox, SandboxError
from c2jax.rl.system.config import EnvConfig
from c2jax.rl.system.groups import Rollout, sequence


# ---------------------------------------------------------------------------------------- prompt sets
def target_prompts(cfg: EnvConfig, vocab: int, seed: int, held_out: bool = False) -> dict[str, list[int]]:
    n = cfg.eval_prompts if held_out else cfg.num_prompts
    rng = np.random.default_rng([seed, 1 if held_out else 0])
    tag = "eval" if held_out else "train"
    return {f"{tag}-{i:04d}": [int(t) for t in rng.integers(0, vocab, cfg.prompt_len)] for i in range(n)}


def load_text_tasks(path: str | Path) -> list[dict]:
    """`{"id", "prompt", "reference"}` per JSONL line; ids must be unique."""
    import json

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text task file {path} does not exist")
    tasks, seen = [], set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        missing = [k for k in ("id", "prompt", "reference") if not isinstance(rec.get(k), str)]
        if missing:
            raise ValueError(f"{path}:{n}: needs string fields {missing}")
        if rec["id"] in seen:
            raise ValueError(f"{path}:{n}: duplicate task id {rec['id']!r}")
        seen.add(rec["id"])
        tasks.append(rec)
    if not tasks:
        raise ValueError(f"text task file {path} holds no tasks")
    return tasks


def text_prompts(tasks: list[dict], renderer, template: str = "chat") -> dict[str, list[int]]:
    """Each task's prompt as the policy sees it: `chat`, one user message then the assistant header; `raw`,
    the prompt text's tokens alone (chat markers in it are plain characters)."""
    if template == "chat":
        return {t["id"]: renderer.render_prompt([{"role": "user", "content": t["prompt"]}]) for t in tasks}
    if template == "raw":
        return {t["id"]: renderer.encode_env(t["prompt"]) for t in tasks}
    raise ValueError(f"unknown text template {template!r}; expected chat or raw")


def text_reward(answer: str, reference: str, match: str = "prefix") -> float:
    """`exact`: 1.0 iff answer == reference. `prefix`: the longest common prefix over the longer string's
    length, so only the exact answer scores 1, a right start earns partial credit, and trailing junk costs."""
    if match == "exact":
        return float(answer == reference)
    if match != "prefix":
        raise ValueError(f"unknown text match {match!r}; expected prefix or exact")
    longest = max(len(answer), len(reference))
    if longest == 0:
        return 1.0
    n = 0
    for a, b in zip(answer, reference):
        if a != b:
            break
        n += 1
    return n / longest


HELDOUT_SUFFIX = "-heldout"


def ladder_splits(cfg: EnvConfig, directory: Path, seed: int) -> tuple[dict[str, Path], dict[str, Path]]:
    """(train, held-out): task id -> task directory, the held-out set the ladder built from seed + 1000 (its ids end
    in HELDOUT_SUFFIX, so no id names a task of both splits). The
    train set leaves out tasks identical to a held-out one (same prompt and files: small rungs such as `echo`
    or one-key `lookup` draw from a few hundred tasks), so the held-out eval never scores a task trained on."""
    from c2jax.rl.tasks.ladder import build_ladder, task_content
    from c2jax.rl.tasks.task import load_task

    def build(split: str, split_seed: int) -> list[Path]:
        return build_ladder(directory / split, seed=split_seed, per_rung=cfg.per_rung, rungs=cfg.rungs,
                            lookup_keys=cfg.lookup_keys)

    held = build("eval", seed + 1000)
    seen = {task_content(load_task(p)) for p in held}
    train = {p.name: p for p in build("train", seed) if task_content(load_task(p)) not in seen}
    # both splits number their tasks from 000, so the held-out ids carry a suffix: the environment host maps id ->
    # directory for both, and a shared id once graded train episodes against the held-out task's hidden tests.
    # Held-out tasks alternate between rungs (echo-000, lookup-000, echo-001, ...), so the first env.eval_prompts
    # of them cover every rung evenly
    held = sorted(held, key=lambda p: (int(p.name.rsplit("-", 1)[1]), cfg.rungs.index(p.name.split("-")[1])))
    return train, {f"{p.name}{HELDOUT_SUFFIX}": p for p in held}


def byte_tokenizer():
    """Byte-level tokenizer (256 byte tokens, no merges) plus the chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from c2jax.rl.harness import add_chat_special_tokens

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator([], trainers.BpeTrainer(vocab_size=len(alphabet), initial_alphabet=alphabet,
                                                    show_progress=False))
    add_chat_special_tokens(tok)
    return tok


LADDER_ACTIONS = "ladder-actions"  # the env.tokenizer value that selects ladder_action_tokenizer()


def ladder_action_tokenizer():
    """An action-level chat tokenizer for the `echo` and `lookup` ladder rungs, small enough that a model of a
    few thousand parameters learns agentic RL from scratch in CI (env.tokenizer=ladder-actions).

    Every tool call these rungs need is one token: reading settings.ini, and writing each of the 16 answer
    values to answer.txt. Environment text keeps only the words that carry a task's information (senders,
    keys, values, "value of"): everything else (the system prompt, role names, tool output framing) is dropped
    by the pre-tokenizer, so an episode is a few dozen tokens and an observation is, e.g., `grove navy` for
    the settings line `grove = navy`. The model still acts through the real harness, tools, sandbox and
    hidden-test grader; only the encoding of text into tokens is coarse. Sampled words that are not tool calls
    decode to plain text (a turn without a tool call ends the episode)."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

    from c2jax.rl.harness import add_chat_special_tokens
    from c2jax.rl.harness.chat_format import render_tool_call
    from c2jax.rl.tasks.ladder import closed_vocabulary

    words, values = closed_vocabulary()
    words = [*words, "value", "of", "write"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    keep = "|".join(words)
    # removed: any other word, punctuation and whitespace (Oniguruma regex: a word not in `keep`)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(rf"\b(?!(?:{keep})\b)\w+\b|[^\w\s]+|\s+"), behavior="removed")
    add_chat_special_tokens(tok)
    calls = [render_tool_call("read_file", {"path": "settings.ini"})]
    calls += [render_tool_call("write_file", {"path": "answer.txt", "content": f"{v}\n"}) for v in values]
    tok.add_tokens([AddedToken(c, normalized=False) for c in calls])
    return tok


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json that `env.tokenizer` names: the file itself, or `tokenizer.json` in a directory."""
    path = Path(spec).expanduser()
    return path / "tokenizer.json" if path.is_dir() else path


def tokenizer_name(spec: str = "") -> str:
    """How errors name the chat tokenizer `env.tokenizer=spec` selects."""
    if spec == LADDER_ACTIONS:
        return f"the ladder action tokenizer (env.tokenizer={LADDER_ACTIONS})"
    return "the byte tokenizer" if not spec else f"the tokenizer {tokenizer_file(spec)} (env.tokenizer)"


def chat_tokenizer(spec: str = ""):
    """The chat tokenizer `env.tokenizer` selects: "" = `byte_tokenizer()`; "ladder-actions" =
    `ladder_action_tokenizer()`; otherwise a Hugging Face
    `tokenizers` JSON file or a directory holding tokenizer.json, with the chat special tokens added (a no-op
    for those already present). A missing or unreadable file is a ValueError naming env.tokenizer and the
    path. Each call returns a new Tokenizer (adding the chat tokens mutates it)."""
    from tokenizers import Tokenizer

    from c2jax.rl.harness import add_chat_special_tokens

    if not spec:
        return byte_tokenizer()
    if spec == LADDER_ACTIONS:
        return ladder_action_tokenizer()
    path = tokenizer_file(spec)
    if not path.is_file():
        raise ValueError(f"env.tokenizer: {path} is not readable (no such file); expected a Hugging Face "
                         "tokenizer.json or a directory holding one")
    try:
        tok = Tokenizer.from_file(str(path))
        add_chat_special_tokens(tok)
    except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception on a bad file
        raise ValueError(f"env.tokenizer: cannot load {path} as a Hugging Face tokenizer.json "
                         f"({type(e).__name__}: {e})") from None
    return tok


# ------------------------------------------------------------------------------ environment-worker side
class EnvironmentHost:
    """What an environment worker runs: grading and, for agentic tasks, the episode sandboxes."""

    def __init__(self, cfg: EnvConfig, tasks: dict | None = None):
        self.cfg = cfg
        # ladder / suite: task id -> Task (or its directory, or a shipped one: rl/system/suite.ship_tasks);
        # text: task id -> reference answer
        self.task_dirs = dict(tasks or {}) if cfg.kind in ("ladder", "suite") else {}
        self.references = dict(tasks or {}) if cfg.kind == "text" else {}
        self._shipped = None
        self._renderer = None
        self._tasks: dict = {}
        self._sandboxes: dict[str, Sandbox] = {}
        self._next = 0
        self._delay_rng = np.random.default_rng(0)
        self._delay_lock = threading.Lock()
        self._sandbox_lock = threading.Lock()
        self._verdicts: dict[tuple[str, str], tuple[float, dict]] = {}  # env.cache_verdicts
        self.verdict_cache_hits = 0

    def grade_target(self, tokens: list[int]) -> float:
        self._sleep_delay()
        tokens = np.asarray(tokens)
        return float((tokens == self.cfg.target_token).mean()) if tokens.size else 0.0

    def _sleep_delay(self) -> None:
        if self.cfg.delay_s:
            with self._delay_lock:  # graded from several threads (max_concurrency)
                z = float(self._delay_rng.standard_normal()) if self.cfg.delay_sigma else 0.0
            time.sleep(self.cfg.delay_s * math.exp(self.cfg.delay_sigma * z))

    def grade_text(self, task_id: str, tokens: list[int]) -> float:
        """The answer is the decoded tokens up to the first <|im_end|>."""
        from c2jax.rl.harness import ChatRenderer

        if task_id not in self.references:
            raise KeyError(f"unknown text task {task_id!r}")
        self._sleep_delay()
        if self._renderer is None:
            self._renderer = ChatRenderer(chat_tokenizer(self.cfg.tokenizer))
        end = self._renderer.im_end_id
        tokens = list(tokens)
        answer = self._renderer.decode(tokens[:tokens.index(end)] if end in tokens else tokens)
        return text_reward(answer, self.references[task_id], self.cfg.text_match)

    def _task(self, task_id: str):
        from c2jax.rl.tasks.task import load_task

        if task_id not in self._tasks:
            if task_id not in self.task_dirs:
                raise KeyError(f"unknown task {task_id!r}")
            entry = self.task_dirs[task_id]
            if isinstance(entry, tuple) and entry and entry[0] == "shipped":
                from c2jax.rl.system.suite import ShippedTasks

                with self._sandbox_lock:
                    if self._shipped is None:
                        self._shipped = ShippedTasks()
                self._tasks[task_id] = self._shipped.load(task_id, entry[1], entry[2])
            elif isinstance(entry, (str, Path)):
                self._tasks[task_id] = load_task(entry)
            else:  # a Task the driver loaded (its paths must be visible here: env.task_transfer=path)
                self._tasks[task_id] = entry
        return self._tasks[task_id]

    def check_tasks(self) -> dict:
        """What this worker sees of its tasks: {"host", "missing": paths it cannot see (task_transfer=path on
        a node without the shared storage)}."""
        import socket

        from c2jax.rl.system.suite import unseen_paths

        return {"host": socket.gethostname(), "pid": os.getpid(), "missing": unseen_paths(self.task_dirs)[:5],
                "tasks": len(self.task_dirs)}

    def _factory(self):
        from c2jax.rl.tasks.build import sandbox_factory

        return sandbox_factory(self.cfg.sandbox, allow_network=self.cfg.allow_network)

    def open_sandbox(self, task_id: str) -> dict:
        """Opens the agent-phase sandbox of `task_id` the way the eval runner does (`open_task_sandbox`:
        the task's workdir, env, limits, network and, for Harbor tasks, /logs) and returns what the
        rollout side needs: {"sid", "workdir", "network", "agent_timeout_s"}."""
        from c2jax.rl.tasks.harbor import open_task_sandbox

        task = self._task(task_id)
        if not task.supported:
            raise SandboxError(f"task {task_id} is unsupported: {task.unsupported_reason}")
        from c2jax.rl.sandbox.oci import ImageError
        from c2jax.rl.tasks.image_build import ImageBuildError

        try:
            sandbox, _logs = open_task_sandbox(self._factory(), task, "agent")
        except (ImageError, ImageBuildError) as e:  # they name the image's path; say which task it is too
            raise type(e)(f"task {task_id}: {e}") from e
        with self._sandbox_lock:  # environment workers serve concurrent calls
            self._next += 1
            sid = f"sb{self._next}"
            self._sandboxes[sid] = sandbox
        env = task.environment
        return {"sid": sid, "workdir": sandbox.workdir, "network": bool(sandbox.network),
                "agent_timeout_s": env.agent_timeout_s if env is not None else None,
                "kind": environment_kind(task, sandbox)}

    def sandbox_call(self, sid: str, method: str, args: tuple, kwargs: dict):
        if sid not in self._sandboxes:
            raise SandboxError(f"sandbox {sid} is gone (the environment worker restarted?)")
        return getattr(self._sandboxes[sid], method)(*args, **kwargs)

    def sandbox_search(self, sid: str, name: str, arguments: dict, workdir: str) -> tuple[str, str]:
        """The glob / grep tools run here, next to the sandbox's tree (`fs_tools.run_search`)."""
        from c2jax.rl.harness.fs_tools import run_search

        if sid not in self._sandboxes:
            raise SandboxError(f"sandbox {sid} is gone (the environment worker restarted?)")
        return run_search(self._sandboxes[sid], name, arguments, workdir)

    def close_sandbox(self, sid: str) -> None:
        sandbox = self._sandboxes.pop(sid, None)
        if sandbox is not None:
            sandbox.close()

    def grade_patch(self, task_id: str, patch: str) -> tuple[float, dict]:
        from c2jax.rl.tasks.grading import grade

        key = (task_id, hashlib.sha256(patch.encode()).hexdigest()) if self.cfg.cache_verdicts else None
        if key in self._verdicts:
            self.verdict_cache_hits += 1
            reward, info = self._verdicts[key]
            return reward, {**info, "cached": True}
        result = grade(self._task(task_id), patch, self._factory())
        out = float(result.reward), {"status": result.status}
        # only the tests' own verdicts: an environment failure or a timeout is graded again next time
        if key is not None and result.status in ("resolved", "unresolved", "patch_failed"):
            self._verdicts[key] = out
        return out


def environment_kind(task, sandbox) -> str:
    """How an episode's environment was made, for logs and per-kind counts: `bwrap` / `local` over a task
    repository, `oci-image` / `dockerfile` (a saved image, a Dockerfile built over a store image) in bwrap over the
    image's rootfs, or `engine:NAME` (a Docker / Podman container)."""
    env = task.environment
    name = type(sandbox).__name__
    if name == "EngineSandbox":
        engine = getattr(sandbox, "engine", None)
        return f"engine:{getattr(engine, 'name', 'docker')}"
    if env is not None and env.dockerfile is not None:
        return "dockerfile"
    if env is not None and env.image is not None:
        return "oci-image"
    return {"BwrapSandbox": "bwrap", "LocalSandbox": "local"}.get(name, name)


# ---------------------------------------------------------------------------------- rollout-worker side
class RemoteSandbox(Sandbox):
    """The Sandbox interface, each call forwarded to an environment worker (with a timeout)."""

    def __init__(self, call: Callable, task_id: str):
        self._call = call  # call(method_name, *args) -> result, raising on timeout / a dead worker
        opened = call("open_sandbox", task_id)
        self.sid = opened["sid"]
        self.workdir: str = opened["workdir"]  # where the task's workspace is inside the sandbox
        self.network: bool = opened["network"]
        self.agent_timeout_s: float | None = opened["agent_timeout_s"]  # the task's [agent].timeout_sec
        self.kind: str = opened.get("kind", "")  # environment_kind on the environment worker

    def _fwd(self, method, *args, **kwargs):
        return self._call("sandbox_call", self.sid, method, args, kwargs)

    def exec(self, command, *, timeout_s=None, cwd=".", env=None, stdin=None):
        return self._fwd("exec", command, timeout_s=timeout_s, cwd=cwd, env=env, stdin=stdin)

    def read_bytes(self, path):
        return self._fwd("read_bytes", path)

    def write_bytes(self, path, data):
        return self._fwd("write_bytes", path, data)

    def remove(self, path):
        return self._fwd("remove", path)

    def exists(self, path):
        return self._fwd("exists", path)

    def is_dir(self, path):
        return self._fwd("is_dir", path)

    def list_dir(self, path="."):
        return self._fwd("list_dir", path)

    def host_path(self):
        raise SandboxError("a remote sandbox has no host path on the rollout worker")

    def search(self, name: str, arguments: dict, workdir: str) -> tuple[str, str]:
        """glob / grep run on the environment worker, which has the tree (`fs_tools._remote`)."""
        return self._call("sandbox_search", self.sid, name, arguments, workdir)

    def diff(self):
        return self._fwd("diff")

    def fork(self):
        raise SandboxError("remote sandboxes do not fork")

    def close(self):
        try:
            self._call("close_sandbox", self.sid)
        except Exception:  # noqa: BLE001 -- a dead environment worker took the sandbox with it
            pass


def run_target_group(generate, env_call, prompt: list[int], cfg: EnvConfig, group_size: int, seed: int,
                     max_retries: int, replay: bool = False, *, task_id: str | None = None,
                     stop_ids: tuple[int, ...] = ()) -> list[Rollout]:
    """G samples of one single-turn prompt in one batched generate call, each graded on an environment
    worker: by `grade_target(tokens)`, or with `task_id` by `grade_text(task_id, tokens)` (the text kind,
    which stops at `stop_ids`). With `replay`, each sequence records the sampler's experts per token."""
    from c2jax.models.inference.engine import Request
    from c2jax.rl.harness.replay import single_turn_replay

    requests = [Request(list(prompt), cfg.gen_len, tuple(stop_ids), (), cfg.temperature, 1.0, 0, seed * 7919 + i)
                for i in range(group_size)]
    grader = ("grade_text", task_id) if task_id is not None else ("grade_target",)
    results = generate(requests)

    def graded(res) -> tuple[float, str | None, int]:
        reward, error, attempts = 0.0, None, 0
        while attempts <= max_retries:
            attempts += 1
            try:
                return float(env_call(*grader, list(res.token_ids))), None, attempts
            except Exception as e:  # noqa: BLE001 -- worker died or timed out: retry, then record
                error = f"grading failed ({type(e).__name__}): {e}"
        return reward, error, attempts

    with ThreadPoolExecutor(max_workers=len(results), thread_name_prefix="grade") as pool:
        grades = list(pool.map(graded, results))  # the G samples are graded concurrently, as sandboxes would be
    rollouts = []
    for res, (reward, error, attempts) in zip(results, grades):
        n_p, n = len(prompt), len(res.token_ids)
        experts = None
        if replay:
            if res.prompt_expert_ids is None or res.expert_ids is None:
                raise ValueError("router replay is on but the sampler returned no expert ids (a dense model?)")
            experts = single_turn_replay(res.prompt_expert_ids, res.expert_ids, n)
        seq = sequence(list(prompt) + list(res.token_ids), [0] * n_p + [1] * n, [0.0] * n_p + list(res.logprobs),
                       [-1] * n_p + list(res.policy_versions), experts)
        rollouts.append(Rollout([seq], reward, res.finish_reason, error, 1, n, attempts))
    return rollouts


def episode_effort(traj) -> dict[str, float]:
    """The effort counts of Composer 2's length penalty (rl/length_penalty.EFFORT_FIELDS) for one agentic episode:
    tokens sampled inside <think> blocks (`thinking_tokens`), the other tokens sampled in turns that called tools
    (`tool_call_tokens`) and in turns that did not (`final_message_tokens`), tokens the environment
    inserted after the first prompt (`tool_output_tokens`: tool results and their chat markup), tool calls, turns."""
    inserted = sum(len(seg.token_ids) - seg.num_prompt_tokens - sum(seg.loss_mask) for seg in traj.segments
                   if seg.token_ids)

    def visible(s) -> int:  # a turn's sampled tokens outside its <think> block
        return s.num_new_tokens - getattr(s, "num_thinking_tokens", 0)

    return {"thinking_tokens": float(sum(getattr(s, "num_thinking_tokens", 0) for s in traj.steps)),
            "tool_call_tokens": float(sum(visible(s) for s in traj.steps if s.tool_calls)),
            "final_message_tokens": float(sum(visible(s) for s in traj.steps if not s.tool_calls)),
            "tool_output_tokens": float(max(0, inserted)), "tool_calls": float(traj.num_tool_calls),
            "turns": float(traj.num_turns)}


def shaped_reward(correctness: float, traj, reward_cfg) -> tuple[float, float]:
    """RLConfig.reward applied to an agentic episode: (w_c * correctness - length penalty + auxiliary terms, the
    length penalty subtracted) (rl/rewards.compute_reward); (the verdict, 0) when nothing shapes it (the default)."""
    from c2jax.rl.rewards import compute_reward

    if reward_cfg is None or (reward_cfg.length_penalty.scale == 0 and not reward_cfg.auxiliary
                              and reward_cfg.correctness_weight == 1.0):
        return correctness, 0.0
    reward, parts = compute_reward({"correctness": correctness, **episode_effort(traj)}, reward_cfg)
    return float(reward), float(parts["length_penalty"])


def run_ladder_episode(policy, renderer, env_call, task_id: str, instruction: str, cfg: EnvConfig,
                       seed: int, max_retries: int, replay: bool = False, reward_cfg=None) -> Rollout:
    """One agentic episode; an episode whose environment failed is re-run up to max_retries times. With
    `replay`, each segment's sequence carries the harness's per-token replay record. `reward_cfg`
    (RLConfig.reward) shapes the reward; the rollout keeps the tests' verdict as `correctness`."""
    from c2jax.rl.harness import EpisodeTask, SamplerAgent, default_registry, run_episode
    from c2jax.rl.harness.episode import with_agent_timeout

    error, kind = None, ""
    for attempt in range(1, max_retries + 2):
        sandbox = None
        try:
            sandbox = RemoteSandbox(env_call, task_id)
            kind = sandbox.kind
            agent = SamplerAgent(policy, renderer, temperature=cfg.temperature)

            def reward_fn(_sandbox, traj):
                return env_call("grade_patch", task_id, traj.final_diff)

            # the task's [agent].timeout_sec bounds the episode as in c2jax eval (runner.task_episode_config)
            episode = with_agent_timeout(cfg.episode, sandbox.agent_timeout_s)
            traj = run_episode(agent, sandbox, EpisodeTask(task_id, instruction), default_registry(), episode,
                               seed=seed, reward_fn=reward_fn)
        except Exception:  # noqa: BLE001
            error = traceback.format_exc()
            continue
        finally:
            if sandbox is not None:
                sandbox.close()
        if traj.reward is None:  # the episode errored (sandbox, grader): run it again
            error = traj.error or f"episode ended with {traj.finish_reason} and no reward"
            continue
        if replay and any(s.token_ids and s.replay_ids is None for s in traj.segments):
            raise ValueError("router replay is on but the sampler returned no expert ids (a dense model?)")
        seqs = [sequence(s.token_ids, s.loss_mask, s.logprobs, s.policy_versions, s.replay_ids if replay else None)
                for s in traj.segments if s.token_ids]
        verdict = float(traj.reward)
        reward, penalty = shaped_reward(verdict, traj, reward_cfg)
        thinking = int(sum(getattr(s, "num_thinking_tokens", 0) for s in traj.steps))
        return Rollout(seqs, reward, traj.finish_reason, None, traj.num_turns, traj.num_model_tokens, attempt,
                       correctness=verdict, length_penalty=penalty, thinking_tokens=thinking, env_kind=kind)
    return Rollout([], 0.0, "error", error, 0, 0, max_retries + 1, env_kind=kind)
