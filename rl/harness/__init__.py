"""The agent harness: Cursor-like tools, the token-level chat format, agents, and the episode loop.

See docs/harness.md.
"""

from c2jax.rl.harness.agents import (
    Agent,
    AgentContext,
    AgentTurn,
    GenerateResult,
    SamplerAgent,
    ScriptedAgent,
    ScriptedTurn,
    TokenPolicy,
)
from c2jax.rl.harness.chat_format import add_chat_special_tokens, build_system_prompt, parse_assistant_text
from c2jax.rl.harness.episode import EpisodeConfig, EpisodeTask, run_episode
from c2jax.rl.harness.openai_agent import OpenAIAgent
from c2jax.rl.harness.registry import Tool, ToolCall, ToolContext, ToolError, ToolRegistry, ToolResult
from c2jax.rl.harness.renderer import ChatRenderer, TokenTranscript
from c2jax.rl.harness.tools import default_registry
from c2jax.rl.harness.trajectory import Trajectory, TrajectoryWriter, read_trajectories

__all__ = [
    "Agent", "AgentContext", "AgentTurn", "ChatRenderer", "EpisodeConfig", "EpisodeTask", "GenerateResult",
    "OpenAIAgent", "SamplerAgent", "ScriptedAgent", "ScriptedTurn", "TokenPolicy", "TokenTranscript", "Tool",
    "ToolCall", "ToolContext", "ToolError", "ToolRegistry", "ToolResult", "Trajectory", "TrajectoryWriter",
    "add_chat_special_tokens", "build_system_prompt", "default_registry", "parse_assistant_text",
    "read_trajectories", "run_episode",
]
