"""The eval runner: every (task, sample) is one episode in its own sandbox, graded in a fresh one.

    results = evaluate(tasks, agent_factory, samples=4, config=cfg, out_dir="runs/eval/x")

Jobs run on a thread pool (`config.concurrency`; episodes spend their time in sandbox subprocesses or
in the inference engine, not in Python). Each finished job is appended to `out_dir/samples.jsonl` by
the worker itself before it reports back, so an interrupt or a crash never loses a finished result, and
a rerun with the same `out_dir` only runs the pairs that are missing. Without `out_dir` nothing touches
the disk (online evaluation from the RL loop).

Per job: run the episode (c2jax.rl.harness.run_episode) with the agent `agent_factory(task, sample)`; score
the final state for the best-of-K selector while the episode sandbox is still open; take the diff;
grade it with c2jax.rl.tasks.grade in a fresh sandbox (or with the behaviour grader, rl/eval/behaviour.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from c2jax.rl.eval.agents import AgentFactory
from c2jax.rl.eval.behaviour import check_rules, episode_config_for, grade_eager_editing
from c2jax.rl.eval.config import EvalConfig
from c2jax.rl.eval.store import ResultStore, SampleResult, check_run_manifest
from c2jax.rl.eval.suite import fingerprint
from c2jax.rl.harness.episode import EpisodeConfig, EpisodeTask, run_episode, with_agent_timeout
from c2jax.rl.harness.tools import default_registry
from c2jax.rl.harness.trajectory import Trajectory, TrajectoryWriter
from c2jax.rl.sandbox.base import Sandbox
from c2jax.rl.tasks.build import sandbox_factory as make_sandbox_factory
from c2jax.rl.tasks.grading import SandboxFactory, grade
from c2jax.rl.tasks.harbor import open_task_sandbox
from c2jax.rl.tasks.task import Task

# Scorer for best-of-K: (task, trajectory, episode sandbox) -> float, higher is better.
Scorer = Callable[[Task, Trajectory, Sandbox], float]
_SUMMARY = re.compile(r"(\d+) (passed|failed|error|errors)\b")


@dataclass
class EvalResults:
    label: str
    samples: int
    tasks: dict[str, str]  # task id -> category
    results: list[SampleResult]
    config: dict[str, Any] = field(default_factory=dict)
    step: int | None = None  # training step of the evaluated policy, for plots over training

    def summary(self, cfg: EvalConfig | None = None) -> dict[str, Any]:
        from c2jax.rl.eval.summary import summarize

        cfg = cfg or EvalConfig()
        return summarize(self.results, ks=cfg.ks, pricing=cfg.pricing, n_boot=cfg.bootstrap_samples,
                         alpha=cfg.ci_alpha, seed=cfg.seed)


# --------------------------------------------------------------------------------------- scoring
def visible_tests_score(task: Task, sandbox: Sandbox, *, python: str = sys.executable,
                        timeout_s: float = 120.0) -> float:
    """Fraction of the repository's visible tests (the task's test paths present in the workspace)
    that pass in the episode's final state; 0.0 when there are none. Only a selector signal: the grade
    itself never reads a log."""
    targets = [t for t in task.test_files if sandbox.exists(t)]
    if not targets:
        return 0.0
    cmd = (f"{shlex.quote(python)} -m pytest -q -p no:cacheprovider --no-header -o addopts= "
           + " ".join(shlex.quote(t) for t in targets))
    r = sandbox.exec(cmd, timeout_s=timeout_s, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    counts = {"passed": 0, "failed": 0}
    for n, word in _SUMMARY.findall(r.stdout.splitlines()[-1] if r.stdout.strip() else ""):
        counts["passed" if word == "passed" else "failed"] += int(n)
    total = counts["passed"] + counts["failed"]
    return counts["passed"] / total if total else 0.0


def model_score(traj: Trajectory) -> float:
    """Mean log-probability of the sampled tokens (a model-confidence selector); 0.0 for message-level
    agents, which report no logprobs."""
    lps = [lp for s in traj.segments for lp, m in zip(s.logprobs, s.loss_mask) if m]
    return float(sum(lps) / len(lps)) if lps else 0.0


# --------------------------------------------------------------------------------------- tokens
def _estimate(text: str) -> int:
    return math.ceil(len(text) / 4)


def token_counts(traj: Trajectory, encode: Callable[[str], list[int]] | None) -> dict[str, Any]:
    """completion / input / tool-output / thinking tokens of an episode. Token-level agents give exact counts
    from the transcript (input = the context length before each sampled turn, summed; thinking = the sampled
    tokens of the turns' leading <think> blocks, part of completion); for message-level agents that report
    none, counts are characters / 4 and flagged as estimates (their thinking count is 0: no token ids)."""
    estimated = False
    completion = 0
    for step in traj.steps:
        if step.num_new_tokens:
            completion += step.num_new_tokens
        elif step.content or step.tool_calls:
            completion += _estimate(step.content + json.dumps(step.tool_calls))
            estimated = True
    tool_out = 0
    for step in traj.steps:
        for obs in step.observations:
            tool_out += len(encode(obs.output)) if encode else _estimate(obs.output)
    estimated = estimated or (encode is None and tool_out > 0)
    input_tokens = 0
    for seg in traj.segments:
        if seg.token_ids:
            mask = seg.loss_mask
            input_tokens += sum(i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1]))
        else:
            chars = 0
            for m in seg.messages:
                if m.get("role") == "assistant":
                    input_tokens += _estimate_chars(chars)
                chars += len(str(m.get("content") or "")) + len(json.dumps(m.get("tool_calls") or []))
            estimated = True
    return {"completion_tokens": completion, "tool_output_tokens": tool_out, "input_tokens": input_tokens,
            "tokens_estimated": estimated, "thinking_tokens": traj.num_thinking_tokens}


def _sample_fields(counts: dict[str, Any]) -> dict[str, Any]:
    """The counts SampleResult has fields for."""
    names = {f.name for f in dataclasses.fields(SampleResult)}
    return {k: v for k, v in counts.items() if k in names}


def _estimate_chars(chars: int) -> int:
    return math.ceil(chars / 4)


def final_message(traj: Trajectory) -> str:
    if traj.metadata.get("submit_message"):
        return str(traj.metadata["submit_message"])
    acts = [s for s in traj.steps if s.kind == "act"]
    return acts[-1].content if acts else ""


def network_notes(tasks: Sequence[Task], allow_network: bool) -> dict[str, str]:
    """task id -> why it ran with less network than its task.toml permits (offline, or an allowlist not
    enforced), for the tasks that did; see `TaskEnvironment.network_note`."""
    notes = {}
    for task in tasks:
        note = task.environment.network_note(allow_network) if task.environment is not None else None
        if note is not None:
            notes[task.id] = note
    return notes


# --------------------------------------------------------------------------------------- one job
def task_episode_config(task: Task, base: EpisodeConfig) -> EpisodeConfig:
    """`[agent].timeout_sec` is the episode's wall clock and, as in Harbor (no per-command cap below
    the agent's budget), the longest a single command may run."""
    return with_agent_timeout(base, task.environment.agent_timeout_s if task.environment is not None else None)


def run_sample(task: Task, sample: int, agent_factory: AgentFactory, cfg: EvalConfig,
               factory: SandboxFactory, *, scorer: Scorer | None = None,
               on_trajectory: Callable[[Trajectory], None] | None = None) -> SampleResult:
    """One episode of `task`, scored for the selector and graded. Agent and sandbox failures become a
    result with status "error" (the run goes on); exceptions from `agent_factory` itself propagate."""
    t0 = time.perf_counter()
    agent = agent_factory(task, sample)
    encode = agent.renderer.encode_env if getattr(agent, "renderer", None) is not None else None
    episode_cfg = task_episode_config(task, episode_config_for(task, cfg.episode))
    selector = 0.0
    try:
        sandbox, _ = open_task_sandbox(factory, task, "agent")
        with sandbox:
            setup = getattr(agent, "setup", None)
            if callable(setup):  # Harbor's agent setup, e.g. the oracle's /solution upload
                setup(sandbox)
            traj = run_episode(agent, sandbox, EpisodeTask(task.id, task.prompt(cfg.prompt_level),
                                                           {"category": task.category}),
                               default_registry(), episode_cfg, seed=cfg.seed * 7919 + sample,
                               metadata={"sample": sample})
            if traj.finish_reason != "error":
                if scorer is not None:
                    selector = float(scorer(task, traj, sandbox))
                elif cfg.samples > 1 and cfg.selector == "visible_tests":
                    selector = visible_tests_score(task, sandbox, timeout_s=cfg.visible_test_timeout_s)
                elif cfg.selector == "model_score":
                    selector = model_score(traj)
    except Exception:  # noqa: BLE001 -- the sandbox could not start: an infrastructure error for this sample
        return SampleResult(task.id, sample, task.category, False, "error", error=traceback.format_exc(),
                            wall_s=time.perf_counter() - t0)
    episode_s = time.perf_counter() - t0
    if on_trajectory is not None:
        on_trajectory(traj)
    message = final_message(traj)
    t_grade = time.perf_counter()
    try:
        resolved, status, reward, details = _grade(task, traj, message, cfg, factory)
    except Exception:  # noqa: BLE001
        resolved, status, reward, details = False, "error", 0.0, {"traceback": traceback.format_exc()}
    grade_s = time.perf_counter() - t_grade
    return SampleResult(
        task.id, sample, task.category, resolved, status, reward=reward, finish_reason=traj.finish_reason,
        error=traj.error, patch=traj.final_diff, final_message=message, selector_score=selector,
        **_sample_fields(token_counts(traj, encode)), turns=traj.num_turns, tool_calls=traj.num_tool_calls,
        wall_s=time.perf_counter() - t0, episode_s=episode_s, grade_s=grade_s,
        model_s=traj.timings.get("model_s", 0.0), tool_s=traj.timings.get("tool_s", 0.0), grade=details)


def _grade(task: Task, traj: Trajectory, message: str, cfg: EvalConfig,
           factory: SandboxFactory) -> tuple[bool, str, float, dict]:
    behaviour = task.metadata.get("behaviour")
    if traj.finish_reason == "error" and not traj.final_diff:
        return False, "error", 0.0, {"reason": "episode failed before any change"}
    if behaviour == "eager_editing":
        ok, details = grade_eager_editing(traj.final_diff, message, str(task.metadata["expected_answer"]))
        return ok, "resolved" if ok else "unresolved", float(ok), details
    result = grade(task, traj.final_diff or None, factory, timeout_s=cfg.grade_timeout_s or None)
    details = result.to_dict()
    resolved = result.resolved
    if behaviour == "instruction_following":
        violations = check_rules(traj.final_diff, task.metadata)
        details["rule_violations"] = violations
        resolved = resolved and not violations
    status = "resolved" if resolved else ("unresolved" if result.status == "resolved" else result.status)
    return resolved, status, float(resolved), details


# --------------------------------------------------------------------------------------- the run
def evaluate(tasks: Sequence[Task], agent_factory: AgentFactory, samples: int | None = None, *,
             config: EvalConfig | None = None, sandbox_factory: SandboxFactory | None = None,
             out_dir: str | Path | None = None, label: str | None = None, step: int | None = None,
             scorer: Scorer | None = None, progress: bool = True, retry_errors: bool = False) -> EvalResults:
    """Runs `samples` episodes of every task and returns all results (including those a previous run in
    `out_dir` already finished). The plain entry point for online evaluation from the RL system."""

    cfg = config or EvalConfig()
    if samples is not None:
        cfg = dataclasses.replace(cfg, samples=samples)
    tasks = list(tasks)
    if not tasks:
        raise ValueError("evaluate: no tasks")
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"evaluate: duplicate task ids {sorted({i for i in ids if ids.count(i) > 1})}")
    unsupported = [t.id for t in tasks if not t.supported]
    tasks = [t for t in tasks if t.supported]
    factory = sandbox_factory or make_sandbox_factory(cfg.sandbox, allow_network=cfg.allow_network)
    allow_network = bool(getattr(factory, "allow_network", False))
    if cfg.allow_network and not allow_network:
        raise ValueError("config.allow_network is true but the sandbox_factory passed does not allow the network; "
                         "build it with c2jax.rl.tasks.build.sandbox_factory(kind, allow_network=True)")
    offline = network_notes(tasks, allow_network)
    label = label or cfg.run_label
    store = traj_writer = None
    previous: dict[tuple[str, int], SampleResult] = {}
    if out_dir is not None:
        out = Path(out_dir)
        check_run_manifest(out, {"label": label, "suite_fingerprint": fingerprint(tasks), "samples": cfg.samples,
                                 "unsupported": unsupported, "step": step, "network_restricted": offline})
        store = ResultStore(out / "samples.jsonl")
        for r in store.read():  # the last record of a pair wins (a retried error replaces the first)
            previous[r.key] = r
        if retry_errors:
            previous = {k: r for k, r in previous.items() if r.status != "error"}
        traj_writer = TrajectoryWriter(out / "trajectories.jsonl")
    valid = {t.id for t in tasks}
    previous = {k: r for k, r in previous.items() if k[0] in valid and k[1] < cfg.samples}
    jobs = [(t, s) for s in range(cfg.samples) for t in tasks if (t.id, s) not in previous]
    results = dict(previous)
    traj_lock = threading.Lock()

    def keep_trajectory(traj: Trajectory) -> None:
        if traj_writer is not None:
            with traj_lock:
                traj_writer.write(traj)

    def job(task: Task, sample: int) -> SampleResult:
        result = run_sample(task, sample, agent_factory, cfg, factory, scorer=scorer, on_trajectory=keep_trajectory)
        if store is not None:
            store.append(result)  # persisted before the job counts as done
        return result

    bar = None
    if progress:
        from c2jax.progress import progress

        bar = progress(len(tasks) * cfg.samples, initial=len(previous), desc=f"eval {label}", unit="ep")
    pool = ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="eval")
    pending: set = set()
    try:
        queue = iter(jobs)
        # keep at most `concurrency` jobs in flight, so an interrupt leaves nothing half-queued
        for task, sample in queue:
            pending.add(pool.submit(job, task, sample))
            if len(pending) >= cfg.concurrency:
                break
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                r = fut.result()  # re-raises a failure of agent_factory (or an interrupt) in the caller
                results[r.key] = r
                if bar is not None:
                    bar.update()
                    solved = sum(x.resolved for x in results.values())
                    bar.set_postfix_str(f"resolved {solved}/{len(results)}")
                nxt = next(queue, None)
                if nxt is not None:
                    pending.add(pool.submit(job, *nxt))
    finally:
        for fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()
        if traj_writer is not None:
            traj_writer.close()
    ordered = sorted(results.values(), key=lambda r: (r.task_id, r.sample))
    return EvalResults(label, cfg.samples, {t.id: t.category for t in tasks}, ordered,
                       config={"prompt_level": cfg.prompt_level, "selector": cfg.selector,
                               "unsupported": unsupported, "allow_network": allow_network,
                               "network_restricted": offline}, step=step)
