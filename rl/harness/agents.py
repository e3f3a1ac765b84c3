"""Agents behind one interface: a token-level policy (the c2jax sampler), and a scripted agent that
replays a solution. The OpenAI-compatible HTTP agent is in `openai_agent.py`.

The episode loop owns the context (messages and, for token-level agents, the token transcript) and
asks the agent for one assistant turn at a time. Token-level agents return the exact sampled ids; the
loop appends them to the transcript unchanged, thinking block included (`chat_format`: a turn's
leading `<think>...</think>` is kept out of the content, its tool calls are not run, and its sampled
tokens are counted in `AgentTurn.num_thinking_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from c2jax.rl.harness.chat_format import THINK_CLOSE, THINK_OPEN, parse_assistant_text, thinking_span
from c2jax.rl.harness.registry import ToolCall, ToolRegistry
from c2jax.rl.harness.renderer import ChatRenderer, TokenTranscript


@dataclass
class AgentContext:
    """What an agent sees for its next turn."""

    messages: list[dict]  # OpenAI-format messages of the current segment
    tokens: TokenTranscript | None  # the segment's token transcript, ending in an assistant header
    tools: ToolRegistry


@dataclass
class AgentTurn:
    content: str
    tool_calls: list[ToolCall]
    token_ids: list[int] | None = None  # exactly as sampled, stop token included when finish is "stop"
    logprobs: list[float] | None = None
    policy_versions: list[int] | None = None
    expert_ids: np.ndarray | None = None  # [len(token_ids), moe_layers, k]; row j produced token j
    finish_reason: str | None = None  # "stop" | "length"
    num_new_tokens: int = 0
    context_tokens: int | None = None  # message-level agents: prompt + completion tokens the API reported
    prompt_expert_ids: np.ndarray | None = None  # [len(prompt), moe_layers, k]: the prefill's experts
    thinking: str | None = None  # the turn's leading thinking block (chat_format.split_thinking); None if none
    num_thinking_tokens: int = 0  # sampled ids of that block (chat_format.thinking_span); 0 for message-level


class Agent(Protocol):
    name: str
    renderer: ChatRenderer | None  # set for token-level agents; None means message-level
    tools_in_system_prompt: bool  # False when tool schemas travel out of band (an API's `tools=`)

    def act(self, context: AgentContext, *, max_new_tokens: int, seed: int, call_id_prefix: str,
            summary: bool) -> AgentTurn:
        """One assistant turn. `summary` is True for the self-summary turn (tool calls are not run)."""
        ...


class GenerateResult(Protocol):
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    expert_ids: np.ndarray | None
    finish_reason: str
    # optional: prompt_expert_ids [len(prompt), moe_layers, k], the experts of the prompt's prefill


@runtime_checkable
class TokenPolicy(Protocol):
    """What the inference engine implements: token ids in, sampled token ids out.

    `token_ids` include the stop token when `finish_reason == "stop"`. `logprobs[i]` is the sampler's
    log-probability of `token_ids[i]` (at the sampling temperature) and `policy_versions[i]` the weight
    version that sampled it; with in-flight weight updates one turn may span versions.
    """

    def generate_tokens(self, prompt_ids: list[int], *, max_new_tokens: int, stop_token_ids: list[int],
                        temperature: float, seed: int) -> GenerateResult: ...


class SamplerAgent:
    """Adapts a `TokenPolicy` to the agent interface, keeping token-in/token-out."""

    tools_in_system_prompt = True

    def __init__(self, policy: TokenPolicy, renderer: ChatRenderer, *, temperature: float = 1.0,
                 extra_stop_token_ids: Sequence[int] = (), name: str = "sampler"):
        if not isinstance(policy, TokenPolicy):
            raise TypeError(f"{type(policy).__name__} has no generate_tokens method")
        self.policy, self.renderer, self.temperature, self.name = policy, renderer, temperature, name
        self.stop_token_ids = [renderer.im_end_id, *extra_stop_token_ids]

    def act(self, context: AgentContext, *, max_new_tokens: int, seed: int, call_id_prefix: str,
            summary: bool) -> AgentTurn:
        if context.tokens is None:
            raise ValueError("SamplerAgent needs the token transcript; the episode loop builds it from renderer")
        res = self.policy.generate_tokens(list(context.tokens.token_ids), max_new_tokens=max_new_tokens,
                                          stop_token_ids=self.stop_token_ids, temperature=self.temperature,
                                          seed=seed)
        ids = [int(t) for t in res.token_ids]
        if len(ids) > max_new_tokens:
            raise ValueError(f"policy returned {len(ids)} tokens for max_new_tokens={max_new_tokens}")
        if res.finish_reason not in ("stop", "length"):
            raise ValueError(f"policy finish_reason must be 'stop' or 'length', got {res.finish_reason!r}")
        experts = None if res.expert_ids is None else np.asarray(res.expert_ids)
        if experts is not None and experts.shape[0] != len(ids):
            raise ValueError(f"expert_ids has {experts.shape[0]} rows for {len(ids)} sampled tokens")
        prompt_experts = getattr(res, "prompt_expert_ids", None)
        if prompt_experts is not None:
            prompt_experts = np.asarray(prompt_experts)
            if prompt_experts.shape[0] != len(context.tokens):
                raise ValueError(f"prompt_expert_ids has {prompt_experts.shape[0]} rows for a prompt of "
                                 f"{len(context.tokens)} tokens")
        text = self.renderer.decode(ids)
        parsed = parse_assistant_text(text, call_id_prefix)
        special = self.renderer.special_ids
        span = thinking_span(ids, special[THINK_OPEN], special[THINK_CLOSE], stop_ids=self.stop_token_ids,
                             decode=self.renderer.decode)
        return AgentTurn(parsed.content, [] if summary else parsed.tool_calls, ids, [float(x) for x in res.logprobs],
                         [int(v) for v in res.policy_versions], experts, res.finish_reason, len(ids),
                         prompt_expert_ids=prompt_experts, thinking=parsed.thinking,
                         num_thinking_tokens=0 if span is None else span[1] - span[0])


@dataclass(frozen=True)
class ScriptedTurn:
    calls: list[dict]  # each {"name": str, "arguments": dict}
    content: str = ""


@dataclass
class ScriptedAgent:
    """Replays a fixed list of turns through the tools (validates tasks; drives harness tests).

    Each turn is a `ScriptedTurn` or a plain list of {"name", "arguments"} dicts. After the script
    runs out the agent sends a turn without tool calls, which ends the episode.
    """

    turns: list[Any]
    summary_text: str = "Summary: following the scripted solution."
    name: str = "scripted"
    renderer: ChatRenderer | None = None
    tools_in_system_prompt: bool = False
    _next: int = field(default=0, init=False)

    def act(self, context: AgentContext, *, max_new_tokens: int, seed: int, call_id_prefix: str,
            summary: bool) -> AgentTurn:
        if summary:
            return AgentTurn(self.summary_text, [])
        if self._next >= len(self.turns):
            return AgentTurn("The scripted solution is complete.", [])
        turn = self.turns[self._next]
        self._next += 1
        if not isinstance(turn, ScriptedTurn):
            turn = ScriptedTurn(list(turn))
        calls = []
        for i, c in enumerate(turn.calls):
            if not isinstance(c, dict) or "name" not in c:
                raise ValueError(f"scripted turn {self._next - 1}, call {i}: expected a dict with 'name', got {c!r}")
            calls.append(ToolCall(f"{call_id_prefix}_{i}", c["name"], c.get("arguments", {})))
        return AgentTurn(turn.content, calls)
