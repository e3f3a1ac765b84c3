"""Reward composition: grader correctness - length penalty + weighted auxiliary behaviour rewards.

Composer 2 (sec. 4.2) adds auxiliary rewards "as bad habits appear"; each is a function of a trajectory
summary dict (plain counts the harness fills in) and is logged separately, weighted or not.

Summary keys read here (missing keys count 0): correctness (grader score in [0, 1]); the effort counts of
rl/length_penalty.EFFORT_FIELDS; todos_created, todos_completed; tool_calls, tool_call_errors;
cot_comment_lines (lines of pasted chain-of-thought found in code comments); terminal_tool_calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from c2jax.rl.config import RewardConfig
from c2jax.rl.length_penalty import length_penalty

AuxiliaryReward = Callable[[Mapping[str, float]], float]
AUXILIARY_REWARDS: dict[str, AuxiliaryReward] = {}


def register_auxiliary(name: str):
    """Decorator: make `fn(summary) -> float` available as `reward.auxiliary.<name>` in config."""
    def wrap(fn: AuxiliaryReward) -> AuxiliaryReward:
        if name in AUXILIARY_REWARDS:
            raise ValueError(f"auxiliary reward {name!r} is already registered")
        AUXILIARY_REWARDS[name] = fn
        return fn
    return wrap


def _count(summary: Mapping[str, float], key: str) -> float:
    value = float(summary.get(key, 0))
    if value < 0:
        raise ValueError(f"trajectory summary field {key!r} must be >= 0, got {value}")
    return value


@register_auxiliary("unfinished_todos")
def unfinished_todos(summary):
    """-(fraction of created to-do items left unfinished); 0 when none were created."""
    created = _count(summary, "todos_created")
    return -max(created - _count(summary, "todos_completed"), 0.0) / created if created else 0.0


@register_auxiliary("tool_call_errors")
def tool_call_errors(summary):
    """-(fraction of tool calls that returned an error)."""
    calls = _count(summary, "tool_calls")
    return -min(_count(summary, "tool_call_errors"), calls) / calls if calls else 0.0


@register_auxiliary("cot_in_comments")
def cot_in_comments(summary):
    """-1 if chain-of-thought was pasted into code comments (Composer 2 observed "long chains of thought
    left in code comments"), else 0."""
    return -1.0 if _count(summary, "cot_comment_lines") > 0 else 0.0


@register_auxiliary("terminal_only")
def terminal_only(summary, min_calls: int = 3):
    """-1 for "collapse to using the terminal tool only": at least `min_calls` tool calls, all terminal."""
    calls = _count(summary, "tool_calls")
    return -1.0 if calls >= min_calls and _count(summary, "terminal_tool_calls") >= calls else 0.0


def compute_reward(summary: Mapping[str, float], cfg: RewardConfig) -> tuple[float, dict[str, float]]:
    """R = w_c * correctness - length_penalty + sum_a w_a * aux_a(summary). Returns (R, components) where
    components holds every term unweighted ('correctness', 'length_penalty', 'aux/<name>') for logging. The
    penalty's `resolved` gate is applied here (one episode's verdict); `mixed_groups` and `anneal_steps` need the
    group and the policy version (rl/system/groups.Group.gate_length_penalty)."""
    unknown = set(cfg.auxiliary) - set(AUXILIARY_REWARDS)
    if unknown:
        raise ValueError(f"unknown auxiliary reward(s) {sorted(unknown)}; known: {sorted(AUXILIARY_REWARDS)}")
    correctness = float(summary.get("correctness", 0.0))
    penalty = length_penalty(summary, cfg.length_penalty)
    if cfg.length_penalty.gate == "resolved" and correctness < cfg.length_penalty.resolved_at:
        penalty = 0.0
    components = {"correctness": correctness, "length_penalty": penalty}
    total = cfg.correctness_weight * correctness - penalty
    for name, weight in cfg.auxiliary.items():
        value = float(AUXILIARY_REWARDS[name](summary))
        components[f"aux/{name}"] = value
        total += weight * value
    return total, components
