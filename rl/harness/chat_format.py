"""The chat format: ChatML turns, tool calls as JSON inside <tool_call> blocks, tool results inside
<tool_response> blocks, and the parser that reads tool calls back out of sampled text.

    <|im_start|>system\n{system prompt, with the tool schemas}<|im_end|>\n
    <|im_start|>user\n{task}<|im_end|>\n
    <|im_start|>assistant\n{text}<tool_call>\n{"name": "read_file", "arguments": {...}}\n</tool_call><|im_end|>\n
    <|im_start|>tool\n<tool_response>\n{output}\n</tool_response><|im_end|>\n
    <|im_start|>assistant\n...

Several <tool_call> blocks in one assistant turn are several calls, run in order; each gets its own
tool message, in the same order.

Thinking. An assistant turn may open with a thinking block before its visible text and tool calls:

    <|im_start|>assistant\n<think>{reasoning}</think>{text}<tool_call>...</tool_call><|im_end|>\n

The block is leading: only whitespace may precede `<think>` (a `<think>` later in the turn is ordinary
text, as in the Qwen3 / DeepSeek-R1 reasoning parsers; a file written through a tool may contain the
string). It ends at the first `</think>`, or, never closed, at the end of the turn. `parse_assistant_text`
returns it as `ParsedAssistant.thinking` (None without a block) and parses tool calls only from what
follows it: a <tool_call> inside the thinking is not run (thinking is not acting). The sampled tokens of
the block (`thinking_span`: from the `<think>` id through the `</think>` id, or to the end of the turn,
a final stop token excluded) are what the harness counts as thinking tokens (`Step.num_thinking_tokens`).
A `<think>` the model spelled out of ordinary tokens instead of the special id is still parsed as
thinking, but not counted.

How a previous turn's thinking is kept in the context: the RL path works on token ids, and a turn's
sampled ids stay in the segment's transcript exactly as sampled, thinking included (nothing is
re-rendered, so nothing is dropped or re-tokenized). In the message history the thinking travels as the
assistant message's `reasoning_content` field (the content is the visible text only), and the text
renderer (`message_body`, `render_messages_text`: display and SFT data) puts a `reasoning_content` that
is present (not None) back as a leading `<think>\n{reasoning}\n</think>\n` block, so SFT data keeps the
turn as the model would sample it and parsing the rendering gives the same thinking, text and calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, Tokenizer

from c2jax.rl.harness.registry import ToolCall, ToolRegistry

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CHAT_SPECIAL_TOKENS = (IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN,
                       TOOL_RESPONSE_CLOSE, THINK_OPEN, THINK_CLOSE)
ROLES = ("system", "user", "assistant", "tool")


def add_chat_special_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """Adds the chat format's special tokens (a no-op for those already present); returns their ids.

    Note this grows the vocabulary when tokens are new: a model's embedding table must cover
    `tokenizer.get_vocab_size()` afterwards.
    """
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIAL_TOKENS])
    ids = {t: tokenizer.token_to_id(t) for t in CHAT_SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer did not accept special tokens {missing}")
    return ids


def render_tool_call(name: str, arguments: dict) -> str:
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n" \
           f"{TOOL_CALL_CLOSE}"


def message_body(message: dict) -> str:
    """The text between `<|im_start|>{role}\\n` and `<|im_end|>` for one OpenAI-style message."""
    role = message["role"]
    if role not in ROLES:
        raise ValueError(f"unknown message role {role!r}; expected one of {ROLES}")
    content = message.get("content") or ""
    if role == "tool":
        return f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"
    if role == "assistant":
        calls = [render_tool_call(c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"))
                 for c in message.get("tool_calls") or []]
        reasoning = message.get("reasoning_content")
        thinking = "" if reasoning is None else render_thinking(reasoning)
        return thinking + content + "".join(calls)
    return content


def render_thinking(reasoning: str) -> str:
    """A leading thinking block, as `message_body` renders an assistant message's `reasoning_content`."""
    return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n"


def render_messages_text(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The whole conversation as text (for display and SFT data; the RL path works on token ids)."""
    text = "".join(f"{IM_START}{m['role']}\n{message_body(m)}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


@dataclass(frozen=True)
class ParsedAssistant:
    content: str  # the visible text: thinking block and tool-call blocks removed
    tool_calls: list[ToolCall]  # in order; malformed blocks are calls with `error` set; none from the thinking
    thinking: str | None = None  # the leading <think> block's text (stripped); None when the turn has none


def split_thinking(text: str) -> tuple[str | None, str]:
    """(thinking, rest) of an assistant turn's text: the leading `<think>...</think>` block's text, stripped,
    and what follows `</think>`; an unclosed block is thinking to the end (rest ""). (None, text) when the
    turn does not open with a thinking block (only whitespace may precede `<think>`)."""
    head = text.lstrip()
    if not head.startswith(THINK_OPEN):
        return None, text
    body = head[len(THINK_OPEN):]
    end = body.find(THINK_CLOSE)
    if end < 0:
        return body.strip(), ""
    return body[:end].strip(), body[end + len(THINK_CLOSE):]


def thinking_span(ids: Sequence[int], think_open_id: int, think_close_id: int, *, stop_ids: Sequence[int] = (),
                  decode: Callable[[list[int]], str] | None = None) -> tuple[int, int] | None:
    """[start, end) of the sampled ids of a turn's leading thinking block: from the `<think>` id through the
    first `</think>` id after it, inclusive; never closed, to the end of the turn, a last id in `stop_ids`
    (the `<|im_end|>` the sampler stopped on) excluded. None without a block. The block is leading when the
    ids before `<think>` decode (with `decode`) to whitespace only; without `decode`, `<think>` must be the
    first id. The same rule as `split_thinking`, on ids."""
    ids = list(ids)
    if think_open_id not in ids:
        return None
    start = ids.index(think_open_id)
    if start and (decode is None or decode(ids[:start]).strip()):
        return None
    try:
        end = ids.index(think_close_id, start + 1) + 1
    except ValueError:
        end = len(ids) - 1 if len(ids) > start + 1 and ids[-1] in stop_ids else len(ids)
    return start, end


_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def _parse_block(body: str, call_id: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(call_id, None, None, f"malformed tool call, not valid JSON ({e.msg} at char {e.pos}); "
                        'write {"name": ..., "arguments": {...}} inside <tool_call></tool_call>')
    if not isinstance(obj, dict) or set(obj) - {"name", "arguments"} or not isinstance(obj.get("name"), str):
        return ToolCall(call_id, None, None, 'malformed tool call: expected exactly {"name": <string>, '
                        '"arguments": <object>}')
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCall(call_id, obj["name"], None,
                        f"malformed tool call: arguments must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(call_id, obj["name"], arguments)


def parse_assistant_text(text: str, id_prefix: str) -> ParsedAssistant:
    """Splits sampled assistant text into the leading thinking block, prose and tool calls; ids are
    `{id_prefix}_{i}`. Tool calls are read only after the thinking block (`split_thinking`)."""
    if text.endswith(IM_END):
        text = text[: -len(IM_END)]
    thinking, text = split_thinking(text)
    calls, pieces, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        pieces.append(text[pos:m.start()])
        calls.append(_parse_block(m.group(1).strip(), f"{id_prefix}_{len(calls)}"))
        pos = m.end()
    rest = text[pos:]
    if TOOL_CALL_OPEN in rest:  # an unclosed block, e.g. generation hit max_new_tokens mid-call
        cut = rest.index(TOOL_CALL_OPEN)
        pieces.append(rest[:cut])
        calls.append(ToolCall(f"{id_prefix}_{len(calls)}", None, None,
                              f"malformed tool call: {TOOL_CALL_OPEN} was never closed with {TOOL_CALL_CLOSE}"))
    else:
        pieces.append(rest)
    return ParsedAssistant("".join(pieces).strip(), calls, thinking)


DEFAULT_SYSTEM = (
    "You are a coding agent working in a repository at {workdir}. Use the tools to inspect and change "
    "the code and to run commands; there is no network. Make the smallest correct change that completes "
    "the task, check it, then call submit."
)
WORKDIR_FIELD = "{workdir}"
NETWORK_NOTE = ("Network: this task allows internet access, and commands share the host's network "
                "(tool descriptions saying there is no network do not apply).")
_LITERAL_WORKSPACE = re.compile(r"/workspace(?![\w.-])")


def instructions_for(instructions: str, workdir: str = "/workspace", network: bool = False) -> str:
    """The system instructions for a sandbox whose workspace is at `workdir`: `{workdir}` is filled in,
    and where the workdir is not /workspace, instructions written for /workspace (a literal
    `/workspace` path) are pointed at the real one, so the prompt never names a directory that does not
    exist. A sandbox sharing the host's network gets `NETWORK_NOTE` appended."""
    text = instructions.replace(WORKDIR_FIELD, workdir)
    if workdir != "/workspace":
        text = _LITERAL_WORKSPACE.sub(workdir, text)
    return f"{text}\n\n{NETWORK_NOTE}" if network else text


TOOL_SCHEMA_MODES = ("full", "signatures")


def tool_signatures(registry: ToolRegistry) -> str:
    """One line per tool, `name(required, optional?)`: the compact listing for small models whose context
    cannot hold the JSON schemas (10 tools: ~4.7k bytes of schemas against ~0.3k here). Arguments are
    still validated against the full schemas."""
    lines = []
    for schema in registry.openai_schemas():
        fn = schema["function"]
        params = fn.get("parameters", {})
        required = params.get("required", [])
        args = [a if a in required else f"{a}?" for a in params.get("properties", {})]
        lines.append(f"{fn['name']}({', '.join(args)})")
    return "\n".join(lines)


def build_system_prompt(registry: ToolRegistry, instructions: str = DEFAULT_SYSTEM,
                        include_tool_schemas: bool = True, tool_schemas: str = "full", *,
                        workdir: str = "/workspace", network: bool = False) -> str:
    """The system prompt; token-level agents need the tools in it (`tool_schemas="full"`: JSON schemas,
    `"signatures"`: one line per tool), API agents get them as `tools=`. `workdir` and `network` describe
    the sandbox (`instructions_for`)."""
    if tool_schemas not in TOOL_SCHEMA_MODES:
        raise ValueError(f"tool_schemas must be one of {TOOL_SCHEMA_MODES}, got {tool_schemas!r}")
    instructions = instructions_for(instructions, workdir, network)
    if not include_tool_schemas:
        return instructions
    if tool_schemas == "signatures":
        return (f"{instructions}\n\n# Tools\n<tools>\n{tool_signatures(registry)}\n</tools>\n"
                f"Call a tool as {render_tool_call('read_file', {'path': 'README.md'})}\n"
                "A turn without tool calls ends the episode.")
    schemas = "\n".join(json.dumps(s, ensure_ascii=False) for s in registry.openai_schemas())
    return (f"{instructions}\n\n# Tools\n\nYou may call one or more tools in a turn. The tools, as JSON "
            f"schemas:\n<tools>\n{schemas}\n</tools>\n\nFor each call write a JSON object with the tool name "
            f"and its arguments inside {TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} tags:\n"
            f"{render_tool_call('read_file', {'path': 'README.md'})}\n"
            "A turn without tool calls ends the episode.")
