"""The trajectory record: one JSON object per episode, appended to a JSONL file and fsynced.

An episode is a chain of segments (one per context; self-summarization starts a new one). Each
segment keeps its own messages and, for token-level agents, its own token ids, loss mask, sampler
logprobs, policy versions and routed experts. The reward lives on the trajectory, so every segment
of the chain trains with the same reward (Composer 2 report §4.5).
"""

from __future__ import annotations

import base64
import copy
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA = "c2jax.trajectory/1"


def encode_array(a: np.ndarray | None) -> dict | None:
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    return {"dtype": str(a.dtype), "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def decode_array(d: dict | None) -> np.ndarray | None:
    if d is None:
        return None
    return np.frombuffer(base64.b64decode(d["b64"]), dtype=d["dtype"]).reshape(d["shape"]).copy()


@dataclass
class Observation:
    tool_call_id: str
    name: str | None
    output: str
    is_error: bool
    wall_s: float


@dataclass
class Step:
    """One assistant turn and what the environment answered."""

    segment: int
    turn: int
    kind: str  # "act" or "summary"
    content: str  # assistant prose, thinking block and tool-call blocks removed
    tool_calls: list[dict]  # {"id", "name", "arguments", "error"}
    observations: list[Observation]
    num_new_tokens: int
    finish_reason: str | None  # the sampler's: "stop" | "length"; None for message-level agents
    model_s: float
    tool_s: float
    policy_versions: list[int] = field(default_factory=list)  # distinct versions that sampled this turn
    # sampled tokens of the turn's leading <think> block, <think> through </think> (chat_format.thinking_span);
    # part of num_new_tokens. 0 for message-level agents and in records written before the field existed
    num_thinking_tokens: int = 0


@dataclass
class Segment:
    index: int
    messages: list[dict] = field(default_factory=list)  # OpenAI format; assistant text as sampled
    token_ids: list[int] = field(default_factory=list)  # empty for message-level agents
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    expert_ids: np.ndarray | None = None  # [num sampled tokens, moe_layers, k], in sampled order
    num_prompt_tokens: int = 0  # length of the initial prompt (system + task [+ summary])
    end_reason: str = ""  # "summarized" or the episode's finish reason for the last segment
    # [len(token_ids), moe_layers, k] int32, aligned with token_ids: the experts the sampler routed each
    # token to when it ran it as an input (c2jax.rl.harness.replay); -1 rows for tokens it never ran (the tail)
    replay_ids: np.ndarray | None = None

    def to_dict(self) -> dict:
        d = asdict(self) | {"expert_ids": encode_array(self.expert_ids), "replay_ids": encode_array(self.replay_ids)}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Segment:
        return cls(**(d | {"expert_ids": decode_array(d.get("expert_ids")),
                           "replay_ids": decode_array(d.get("replay_ids"))}))


@dataclass(frozen=True)
class TrainingSample:
    """One segment as a learner sequence; all samples of a trajectory carry its reward."""

    trajectory_id: str
    segment_index: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    expert_ids: np.ndarray | None
    reward: float
    replay_ids: np.ndarray | None = None  # [len(token_ids), moe_layers, k]; see Segment.replay_ids


@dataclass
class Trajectory:
    trajectory_id: str
    task_id: str
    agent: str
    finish_reason: str = ""  # submitted | final_message | max_turns | max_tokens | wall_clock | context_full | error
    error: str | None = None
    reward: float | None = None
    reward_info: dict = field(default_factory=dict)
    final_diff: str = ""
    segments: list[Segment] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    num_summaries: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # total_s, model_s, tool_s, summary_s
    metadata: dict[str, Any] = field(default_factory=dict)
    schema: str = SCHEMA

    @property
    def num_turns(self) -> int:
        return sum(1 for s in self.steps if s.kind == "act")

    @property
    def num_tool_calls(self) -> int:
        return sum(len(s.tool_calls) for s in self.steps)

    @property
    def num_model_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.steps)

    @property
    def num_thinking_tokens(self) -> int:
        return sum(s.num_thinking_tokens for s in self.steps)

    def training_samples(self) -> list[TrainingSample]:
        if self.reward is None:
            raise ValueError(f"trajectory {self.trajectory_id} has no reward yet; grade it first")
        return [TrainingSample(self.trajectory_id, s.index, s.token_ids, s.loss_mask, s.logprobs,
                               s.policy_versions, s.expert_ids, float(self.reward), s.replay_ids)
                for s in self.segments if s.token_ids]

    def to_dict(self) -> dict:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)
             if f.name not in ("segments", "steps")}
        d["segments"] = [s.to_dict() for s in self.segments]
        d["steps"] = [asdict(s) for s in self.steps]
        d["summary"] = {"turns": self.num_turns, "tool_calls": self.num_tool_calls,
                        "model_tokens": self.num_model_tokens, "thinking_tokens": self.num_thinking_tokens}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"unknown trajectory schema {d.get('schema')!r}; expected {SCHEMA!r}")
        d = {k: v for k, v in d.items() if k != "summary"}
        segments = [Segment.from_dict(s) for s in d.pop("segments")]
        steps = [Step(**(s | {"observations": [Observation(**o) for o in s["observations"]]}))
                 for s in d.pop("steps")]
        return cls(**d, segments=segments, steps=steps)


class TrajectoryWriter:
    """Appends trajectories to a JSONL file, one line each, flushed and fsynced before returning, so a
    crash loses at most the line being written (which `read_trajectories` then skips)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def write(self, trajectory: Trajectory) -> None:
        self._file.write(json.dumps(trajectory.to_dict(), ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_trajectories(path: str | os.PathLike, *, strict: bool = False) -> list[Trajectory]:
    """Reads a JSONL file; a torn last line (a crash mid-write) is skipped unless `strict`."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if strict or number != len(lines):
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            continue
        out.append(Trajectory.from_dict(obj))
    return out
