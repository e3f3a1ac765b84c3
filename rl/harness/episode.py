"""The episode loop: turns, budgets, self-summarization, and the trajectory record.

One episode is a chain of segments. A segment starts from a fresh context (system prompt + task, plus
the latest summary after the first) and grows by assistant turns and tool results. When a segment's
context reaches `summary_trigger_tokens`, the model is asked to summarize (Composer 2 report §4.5 and
Cursor's self-summarization post): the summary turn is sampled and trained on like any other turn,
the segment ends, and the next one starts from the summary. The reward is set once on the trajectory,
so every segment of the chain shares it.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from c2jax.rl.harness.agents import Agent, AgentContext, AgentTurn
from c2jax.rl.harness.chat_format import DEFAULT_SYSTEM, build_system_prompt
from c2jax.rl.harness.registry import ToolCall, ToolContext, ToolRegistry
from c2jax.rl.harness.renderer import TokenTranscript
from c2jax.rl.harness.replay import ReplayRecorder
from c2jax.rl.harness.trajectory import Observation, Segment, Step, Trajectory, TrajectoryWriter
from c2jax.rl.sandbox.base import WORKSPACE, Sandbox

SUMMARY_PROMPT = (
    "Your context is nearly full. Summarize the conversation so far so that you can continue the task "
    "from the summary alone: the goal, what you found, which files you changed and how, what remains to "
    "do, and any facts you will need. Do not call tools in this turn."
)


def continuation_prompt(instruction: str, summary: str, num_summaries: int) -> str:
    return (f"{instruction}\n\n---\nYou have summarized your progress {num_summaries} time(s); the "
            f"conversation before your latest summary is gone. Your latest summary:\n\n{summary}")


@dataclass(frozen=True)
class EpisodeConfig:
    max_turns: int = 50
    max_model_tokens: int = 65_536  # sampled tokens over all segments
    max_new_tokens_per_turn: int = 4096
    max_context_tokens: int = 32_768  # per segment, prompt + everything appended (token-level agents)
    summary_trigger_tokens: int | None = None  # None disables self-summarization
    max_summaries: int = 4
    summary_max_new_tokens: int = 1024
    wall_clock_s: float = 1800.0
    max_tool_calls_per_turn: int = 32
    max_output_chars: int = 20_000  # per tool observation; head and tail kept
    default_command_timeout_s: float = 30.0
    max_command_timeout_s: float = 120.0
    end_on_no_tool_calls: bool = True  # a turn without tool calls is the final message
    temperature: float = 1.0
    system_instructions: str = DEFAULT_SYSTEM
    # how token-level agents see the tools: "full" JSON schemas, or "signatures" (one line per tool) for
    # small models with short contexts
    tool_schemas: str = "full"

    def __post_init__(self):
        for name in ("max_turns", "max_model_tokens", "max_new_tokens_per_turn", "max_context_tokens",
                     "summary_max_new_tokens", "max_tool_calls_per_turn", "max_output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EpisodeConfig.{name} must be positive, got {getattr(self, name)}")
        if self.tool_schemas not in ("full", "signatures"):
            raise ValueError(f"EpisodeConfig.tool_schemas must be 'full' or 'signatures', got {self.tool_schemas!r}")
        if self.wall_clock_s <= 0:
            raise ValueError(f"EpisodeConfig.wall_clock_s must be positive, got {self.wall_clock_s}")
        trig = self.summary_trigger_tokens
        if trig is not None and not 0 < trig <= self.max_context_tokens - self.summary_max_new_tokens:
            raise ValueError(f"EpisodeConfig.summary_trigger_tokens={trig} must be in (0, max_context_tokens - "
                             f"summary_max_new_tokens] = (0, {self.max_context_tokens - self.summary_max_new_tokens}]"
                             " so the summary fits in the context")


def with_agent_timeout(base: EpisodeConfig, timeout_s: float | None) -> EpisodeConfig:
    """`base` under a task's agent timeout (Harbor's `[agent].timeout_sec`): the episode's wall clock and,
    as in Harbor (no per-command cap below the agent's budget), the longest a single command may run.
    None leaves `base` as it is."""
    if timeout_s is None:
        return base
    return dataclasses.replace(base, wall_clock_s=timeout_s, max_command_timeout_s=timeout_s,
                               default_command_timeout_s=min(base.default_command_timeout_s, timeout_s))


@dataclass(frozen=True)
class EpisodeTask:
    task_id: str
    instruction: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class _SegmentState:
    record: Segment
    tokens: TokenTranscript | None
    experts: list[np.ndarray | None] = field(default_factory=list)
    replay: ReplayRecorder = field(default_factory=ReplayRecorder)
    api_context_tokens: int = 0

    def context_len(self) -> int:
        return len(self.tokens) if self.tokens is not None else self.api_context_tokens

    def finish(self, end_reason: str) -> Segment:
        rec = self.record
        rec.end_reason = end_reason
        if self.tokens is not None:
            rec.token_ids, rec.loss_mask = self.tokens.token_ids, self.tokens.loss_mask
            rec.logprobs, rec.policy_versions = self.tokens.logprobs, self.tokens.policy_versions
            if self.experts and all(e is not None for e in self.experts):
                rec.expert_ids = np.concatenate(self.experts, axis=0)
            rec.replay_ids = self.replay.array(len(self.tokens))
        return rec


class _Finished(Exception):
    def __init__(self, reason: str):
        self.reason = reason


def run_episode(agent: Agent, sandbox: Sandbox, task: EpisodeTask, tools: ToolRegistry,
                config: EpisodeConfig = EpisodeConfig(), *, seed: int = 0, reward_fn=None,
                writer: TrajectoryWriter | None = None, trajectory_id: str | None = None,
                metadata: dict | None = None) -> Trajectory:
    """Runs one episode to completion and returns (and, with `writer`, appends) its trajectory.

    `reward_fn(sandbox, trajectory) -> float | (float, dict)` grades the final state; without it the
    reward stays None for a later grader. Agent and sandbox failures end the episode with
    finish_reason "error" and the traceback in `error`; the record is still written.
    """
    t0 = time.monotonic()
    workdir = getattr(sandbox, "workdir", WORKSPACE)
    ctx = ToolContext(sandbox, workdir=workdir, max_output_chars=config.max_output_chars,
                      max_command_timeout_s=config.max_command_timeout_s,
                      default_command_timeout_s=config.default_command_timeout_s,
                      deadline=t0 + config.wall_clock_s)
    traj = Trajectory(trajectory_id or uuid.uuid4().hex, task.task_id, agent.name,
                      metadata={**task.metadata, **(metadata or {}), "seed": seed})
    network = bool(getattr(sandbox, "network", False))
    system = build_system_prompt(tools, config.system_instructions, agent.tools_in_system_prompt,
                                 config.tool_schemas, workdir=workdir, network=network)
    totals = {"model_s": 0.0, "tool_s": 0.0, "summary_s": 0.0}
    generated = 0

    def new_segment(user_text: str) -> _SegmentState:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user_text}]
        tokens = None
        if agent.renderer is not None:
            tokens = TokenTranscript()
            for m in messages:
                tokens.extend_env(agent.renderer.render_message(m))
        return _SegmentState(Segment(len(traj.segments), list(messages), num_prompt_tokens=len(tokens or [])),
                             tokens)

    def add_env_message(seg: _SegmentState, message: dict) -> None:
        seg.record.messages.append(message)
        if seg.tokens is not None:
            seg.tokens.extend_env(agent.renderer.render_message(message))

    def sample(seg: _SegmentState, turn: int, max_new: int, summary: bool) -> tuple[AgentTurn, float]:
        nonlocal generated
        if seg.tokens is not None:
            seg.tokens.extend_env(agent.renderer.header("assistant"))
        start = time.monotonic()
        out = agent.act(AgentContext(seg.record.messages, seg.tokens, tools), max_new_tokens=max_new,
                        seed=seed * 1_000_003 + turn, call_id_prefix=f"call_{turn}", summary=summary)
        model_s = time.monotonic() - start
        if seg.tokens is not None:
            if out.token_ids is None:
                raise ValueError(f"agent {agent.name!r} has a renderer but returned no token ids")
            seg.replay.record_turn(len(seg.tokens), out.prompt_expert_ids, out.expert_ids, len(out.token_ids))
            seg.tokens.extend_model(out.token_ids, out.logprobs, out.policy_versions)
            seg.tokens.extend_env(agent.renderer.close_assistant(out.token_ids, out.finish_reason == "stop"))
            seg.experts.append(out.expert_ids)
        elif out.context_tokens is not None:
            seg.api_context_tokens = out.context_tokens
        generated += out.num_new_tokens
        message = {"role": "assistant", "content": out.content}
        if out.thinking is not None:  # kept for the text renderer (SFT data); the transcript keeps the ids
            message["reasoning_content"] = out.thinking
        if out.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in out.tool_calls]
        seg.record.messages.append(message)
        return out, model_s

    def make_step(seg, turn, kind, out: AgentTurn, model_s, observations, tool_s) -> Step:
        calls = [{"id": c.id, "name": c.name, "arguments": c.arguments, "error": c.error} for c in out.tool_calls]
        return Step(seg.record.index, turn, kind, out.content, calls, observations, out.num_new_tokens,
                    out.finish_reason, model_s, tool_s, sorted(set(out.policy_versions or [])),
                    out.num_thinking_tokens)

    def run_calls(calls: list[ToolCall]) -> list[Observation]:
        observations = []
        for i, call in enumerate(calls):
            if i >= config.max_tool_calls_per_turn:
                call = ToolCall(call.id, call.name, call.arguments,
                                f"not run: more than {config.max_tool_calls_per_turn} tool calls in one turn")
            r = tools.execute(call, ctx)
            observations.append(Observation(r.tool_call_id, r.name, r.output, r.is_error, r.wall_s))
        return observations

    # A segment is summarized only after it grew by at least one turn, so a prompt that is already past
    # the trigger cannot loop on summaries.
    def room_left(seg: _SegmentState) -> int:
        if seg.tokens is None:  # message-level: the API enforces its own context limit
            return config.max_new_tokens_per_turn
        return config.max_context_tokens - len(seg.tokens) - agent.renderer.turn_overhead()

    def reserved(seg: _SegmentState) -> int:
        """Tokens kept free after tool output: the summary request and the summary itself while the episode
        may still summarize (otherwise a tool output that overshoots the trigger leaves no room for it),
        else one more assistant turn's header."""
        overhead = agent.renderer.turn_overhead()
        if config.summary_trigger_tokens is None or traj.num_summaries >= config.max_summaries:
            return overhead
        request = len(agent.renderer.render_message({"role": "user", "content": SUMMARY_PROMPT}))
        return request + overhead + config.summary_max_new_tokens

    def fit_observation(seg: _SegmentState, message: dict) -> dict:
        """`message` with its output cut (head kept, a marker appended) so the segment's transcript stays
        within max_context_tokens minus what `reserved` keeps free; token-level agents only."""
        if seg.tokens is None:
            return message
        limit = config.max_context_tokens - reserved(seg) - len(seg.tokens)
        if len(agent.renderer.render_message(message)) <= limit:
            return message
        text, lo, hi = message["content"], 0, len(message["content"])

        def cut(n: int) -> dict:
            return {**message, "content": text[:n] + f"\n[... output cut at {n} of {len(text)} characters: the "
                                                       "context is full ...]"}
        while lo < hi:  # the longest head that fits (token counts grow with the kept characters)
            mid = (lo + hi + 1) // 2
            if len(agent.renderer.render_message(cut(mid))) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return cut(lo)

    seg = new_segment(task.instruction)
    turn = 0
    try:
        while True:
            if turn >= config.max_turns:
                raise _Finished("max_turns")
            if time.monotonic() >= ctx.deadline:
                raise _Finished("wall_clock")
            budget = config.max_model_tokens - generated
            if budget <= 0:
                raise _Finished("max_tokens")
            trig = config.summary_trigger_tokens
            if trig is not None and seg.tokens is not None:  # summarize at the latest while the summary fits
                trig = min(trig, config.max_context_tokens - reserved(seg))
            grown = any(s.segment == seg.record.index and s.kind == "act" for s in traj.steps[-1:])
            if (trig is not None and grown and seg.context_len() >= trig
                    and traj.num_summaries < config.max_summaries):
                add_env_message(seg, {"role": "user", "content": SUMMARY_PROMPT})
                max_new = min(config.summary_max_new_tokens, budget, room_left(seg))
                if max_new <= 0:
                    raise _Finished("context_full")
                out, model_s = sample(seg, turn, max_new, summary=True)
                totals["summary_s"] += model_s
                traj.steps.append(make_step(seg, turn, "summary", out, model_s, [], 0.0))
                traj.segments.append(seg.finish("summarized"))
                traj.num_summaries += 1
                seg = new_segment(continuation_prompt(task.instruction, out.content, traj.num_summaries))
                turn += 1
                continue
            room = room_left(seg)
            if room <= 0:
                raise _Finished("context_full")
            max_new = min(config.max_new_tokens_per_turn, budget, room)
            out, model_s = sample(seg, turn, max_new, summary=False)
            totals["model_s"] += model_s
            t_tools = time.monotonic()
            observations = run_calls(out.tool_calls)
            tool_s = time.monotonic() - t_tools
            totals["tool_s"] += tool_s
            for obs in observations:
                add_env_message(seg, fit_observation(seg, {"role": "tool", "tool_call_id": obs.tool_call_id,
                                                           "name": obs.name, "content": obs.output}))
            traj.steps.append(make_step(seg, turn, "act", out, model_s, observations, tool_s))
            turn += 1
            if ctx.submitted:
                raise _Finished("submitted")
            if not out.tool_calls:
                if config.end_on_no_tool_calls:
                    raise _Finished("final_message")
                add_env_message(seg, {"role": "user", "content": "Continue with a tool call, or call submit."})
    except _Finished as f:
        traj.finish_reason = f.reason
    except Exception:  # noqa: BLE001 -- any agent/sandbox failure ends this episode, never the run
        traj.finish_reason = "error"
        traj.error = traceback.format_exc()
    traj.segments.append(seg.finish(traj.finish_reason))
    if ctx.submit_message is not None:
        traj.metadata["submit_message"] = ctx.submit_message
    _finalize(traj, sandbox, reward_fn)
    traj.timings = {"total_s": time.monotonic() - t0, **totals}
    if writer is not None:
        writer.write(traj)
    return traj


def _finalize(traj: Trajectory, sandbox: Sandbox, reward_fn) -> None:
    try:
        traj.final_diff = sandbox.diff()
    except Exception:  # noqa: BLE001
        traj.error = (traj.error or "") + "final diff failed:\n" + traceback.format_exc()
        return
    if reward_fn is None or traj.finish_reason == "error":
        return
    try:
        graded = reward_fn(sandbox, traj)
    except Exception:  # noqa: BLE001
        traj.error = "grading failed:\n" + traceback.format_exc()
        return
    reward, info = graded if isinstance(graded, tuple) else (graded, {})
    traj.reward, traj.reward_info = float(reward), dict(info)
