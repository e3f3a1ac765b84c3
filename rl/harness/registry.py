"""Tools as JSON-schema functions, strict argument checking, and the registry that runs them.

A tool never raises into the episode loop for something the model did wrong: bad arguments, a path
outside the workspace, a missing file or a non-unique edit all come back as a `ToolResult` with
`is_error=True` and a message that says what to fix. Only a broken sandbox (`SandboxError`)
propagates, because that is an infrastructure failure, not a policy mistake. Arguments are checked
more strictly than a production harness would (Composer 2 report §6.2: stricter tool-argument checks
make the model more precise): unknown keys, missing keys and wrong JSON types are all refused, and an
integer is not accepted where a string is expected or vice versa.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from c2jax.rl.sandbox.base import WORKSPACE, Sandbox, SandboxPathError


class ToolError(Exception):
    """Raised inside a tool function for a mistake the model made; becomes an error observation."""


def _is_strict_int(_checker, value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_strict_number(_checker, value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# jsonschema's default checker accepts 1.0 as an "integer"; tools slice with these, so refuse it.
_TYPE_CHECKER = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many(
    {"integer": _is_strict_int, "number": _is_strict_number})
_StrictValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=_TYPE_CHECKER)


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for. `error` is set when the call itself could not be parsed."""

    id: str
    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name or "", "arguments": json.dumps(self.arguments or {})}}


@dataclass(frozen=True)
class ToolResult:
    tool_call_id: str
    name: str | None
    output: str
    is_error: bool
    wall_s: float
    submitted: bool = False  # the call was a successful `submit`


@dataclass
class ToolContext:
    """What a tool may touch: the sandbox, plus the episode state tools share (edited files)."""

    sandbox: Sandbox
    workdir: str = WORKSPACE  # where the workspace is inside the sandbox; model paths are relative to it
    max_output_chars: int = 20_000
    max_command_timeout_s: float = 120.0
    default_command_timeout_s: float = 30.0
    deadline: float | None = None  # time.monotonic() at which the episode's wall budget runs out
    edited_files: set[str] = field(default_factory=set)
    submitted: bool = False
    submit_message: str | None = None

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


ToolFn = Callable[..., str]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema of type "object"; every tool sets additionalProperties: false
    fn: ToolFn  # fn(ctx, **arguments) -> output text; raises ToolError for model mistakes

    def __post_init__(self):
        _StrictValidator.check_schema(self.parameters)
        if self.parameters.get("type") != "object" or self.parameters.get("additionalProperties") is not False:
            raise ValueError(f"tool {self.name!r}: parameters must be an object schema with "
                             "additionalProperties: false")

    def openai_schema(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def validate_arguments(tool: Tool, arguments: Any) -> tuple[dict | None, str | None]:
    """Checks `arguments` against the tool's schema; returns (arguments with defaults filled, error)."""
    if not isinstance(arguments, dict):
        return None, f"arguments must be a JSON object, got {type(arguments).__name__}"
    errors = sorted(_StrictValidator(tool.parameters).iter_errors(arguments), key=lambda e: list(e.path))
    if errors:
        lines = []
        for err in errors:
            where = "/".join(str(p) for p in err.path)
            lines.append(f"argument {where!r}: {err.message}" if where else err.message)
        return None, "; ".join(lines)
    filled = dict(arguments)
    for key, prop in tool.parameters.get("properties", {}).items():
        if key not in filled and "default" in prop:
            filled[key] = prop["default"]
    return filled, None


def cap_output(text: str, max_chars: int) -> str:
    """Keeps the head and tail of an over-long observation, with a marker saying how much was cut."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n... [{cut} characters omitted] ...\n{text[-half:]}"


class ToolRegistry:
    """The tools available in one environment, and the single entry point that runs a call."""

    def __init__(self, tools: Iterable[Tool]):
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self._tools:
                raise ValueError(f"duplicate tool name {tool.name!r}")
            self._tools[tool.name] = tool

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def without(self, *names: str) -> ToolRegistry:
        """A registry with some tools removed (the report removes tools per environment)."""
        missing = [n for n in names if n not in self._tools]
        if missing:
            raise KeyError(f"unknown tools {missing}; have {self.names}")
        return ToolRegistry(t for n, t in self._tools.items() if n not in names)

    def openai_schemas(self) -> list[dict]:
        """The tools in OpenAI function-calling format, for an API `tools=` field or a system prompt."""
        return [t.openai_schema() for t in self._tools.values()]

    def execute(self, call: ToolCall, ctx: ToolContext) -> ToolResult:
        start = time.perf_counter()

        def result(output: str, is_error: bool, submitted: bool = False) -> ToolResult:
            text = f"Error: {output}" if is_error else output
            return ToolResult(call.id, call.name, cap_output(text, ctx.max_output_chars), is_error,
                              time.perf_counter() - start, submitted)

        if call.error is not None:
            return result(call.error, True)
        if ctx.submitted:
            return result("not run: the task was already submitted earlier in this turn", True)
        tool = self._tools.get(call.name or "")
        if tool is None:
            return result(f"unknown tool {call.name!r}; available tools: {', '.join(self.names)}", True)
        arguments, error = validate_arguments(tool, call.arguments)
        if error is not None:
            return result(f"invalid arguments for {tool.name}: {error}", True)
        was_submitted = ctx.submitted
        try:
            output = tool.fn(ctx, **arguments)
        except ToolError as e:
            return result(str(e), True)
        except SandboxPathError as e:
            return result(f"path refused: {e}", True)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
            return result(f"{type(e).__name__}: {e}", True)
        return result(output, False, submitted=ctx.submitted and not was_submitted)
