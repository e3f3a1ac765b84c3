"""An agent behind any OpenAI-compatible /v1/chat/completions endpoint (vLLM, SGLang, a hosted API).

Message-level: the server applies its own chat template, so there are no token ids or loss masks and
its trajectories are for evaluation and task validation, not for RL training. Tool schemas travel in
the request's `tools` field; tool calls come back structured, and arguments that are not a JSON
object become tool errors for the model like any malformed call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from c2jax.rl.harness.agents import AgentContext, AgentTurn
from c2jax.rl.harness.registry import ToolCall


def _api_messages(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id")}
        if m["role"] == "assistant" and not m.get("tool_calls"):
            m.pop("tool_calls", None)
        out.append(m)
    return out


def _parse_call(call_id: str, name: str, raw_arguments: str | None) -> ToolCall:
    try:
        arguments = json.loads(raw_arguments or "{}")
    except json.JSONDecodeError as e:
        return ToolCall(call_id, name, None, f"malformed tool call: arguments are not valid JSON ({e.msg})")
    if not isinstance(arguments, dict):
        return ToolCall(call_id, name, None,
                        f"malformed tool call: arguments must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(call_id, name, arguments)


@dataclass
class OpenAIAgent:
    model: str
    base_url: str = "http://localhost:8000/v1"
    api_key: str = "EMPTY"  # local servers ignore it; pass a real key for a hosted API
    temperature: float = 1.0
    timeout_s: float = 600.0
    max_retries: int = 2
    extra_body: dict = field(default_factory=dict)  # server-specific fields (e.g. top_k for vLLM)
    name: str = "openai"
    renderer: None = None
    tools_in_system_prompt: bool = False

    def __post_init__(self):
        from openai import OpenAI  # the dev extra; imported here so the harness works without it

        self._client = OpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.timeout_s,
                              max_retries=self.max_retries)

    def act(self, context: AgentContext, *, max_new_tokens: int, seed: int, call_id_prefix: str,
            summary: bool) -> AgentTurn:
        kwargs = {"tools": context.tools.openai_schemas()} if not summary else {}
        resp = self._client.chat.completions.create(
            model=self.model, messages=_api_messages(context.messages), max_tokens=max_new_tokens,
            temperature=self.temperature, seed=seed, extra_body=self.extra_body or None, **kwargs)
        choice = resp.choices[0]
        msg = choice.message
        calls = []
        for i, c in enumerate(msg.tool_calls or []):
            call_id = c.id or f"{call_id_prefix}_{i}"
            calls.append(_parse_call(call_id, c.function.name, c.function.arguments))
        usage = resp.usage
        return AgentTurn(
            msg.content or "", [] if summary else calls,
            finish_reason={"stop": "stop", "tool_calls": "stop", "length": "length"}.get(choice.finish_reason),
            num_new_tokens=usage.completion_tokens if usage else 0,
            context_tokens=usage.total_tokens if usage else None)
