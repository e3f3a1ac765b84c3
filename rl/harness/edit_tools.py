"""Tools that change the workspace or check it: edit_file, write_file, delete_file, read_lints,
run_terminal_cmd, submit."""

from __future__ import annotations

import ast
import difflib
import json
import tomllib

import yaml

from c2jax.rl.harness.fs_tools import workspace_rel
from c2jax.rl.harness.registry import Tool, ToolContext, ToolError

DIFF_SNIPPET_LINES = 60


def diff_snippet(path: str, before: str, after: str) -> str:
    lines = list(difflib.unified_diff(before.splitlines(), after.splitlines(), f"a/{path}", f"b/{path}",
                                      n=3, lineterm=""))
    if len(lines) > DIFF_SNIPPET_LINES:
        lines = lines[:DIFF_SNIPPET_LINES] + [f"... diff cut, {len(lines) - DIFF_SNIPPET_LINES} more lines"]
    return "\n".join(lines)


def lint_source(path: str, text: str) -> str | None:
    """A syntax check by file type; returns a one-line problem description or None if it parses."""
    try:
        if path.endswith(".py"):
            ast.parse(text, filename=path)
        elif path.endswith(".json"):
            json.loads(text)
        elif path.endswith(".toml"):
            tomllib.loads(text)
        elif path.endswith((".yaml", ".yml")):
            yaml.safe_load(text)
    except SyntaxError as e:
        return f"{path}:{e.lineno}:{e.offset}: SyntaxError: {e.msg}"
    except json.JSONDecodeError as e:
        return f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}"
    except tomllib.TOMLDecodeError as e:
        return f"{path}: invalid TOML: {e}"
    except yaml.YAMLError as e:
        return f"{path}: invalid YAML: {str(e).splitlines()[0]}"
    return None


def _lint_note(path: str, text: str) -> str:
    # SWE-agent's guardrail: say at once when an edit breaks the syntax, so the model fixes it now.
    problem = lint_source(path, text)
    return f"\nWarning: the file no longer parses: {problem}" if problem else ""


def _read_text(ctx: ToolContext, rel: str) -> str:
    if ctx.sandbox.is_dir(rel):
        raise ToolError(f"{rel} is a directory")
    if not ctx.sandbox.exists(rel):
        raise ToolError(f"{rel} does not exist; use write_file to create it")
    data = ctx.sandbox.read_bytes(rel)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{rel} is not UTF-8 text; edit it with run_terminal_cmd") from None


def edit_file(ctx: ToolContext, path: str, old_string: str, new_string: str, replace_all: bool) -> str:
    rel = workspace_rel(path, ctx.workdir)
    if old_string == "":
        raise ToolError("old_string is empty; use write_file to create or overwrite a file")
    if old_string == new_string:
        raise ToolError("old_string and new_string are identical; nothing to change")
    before = _read_text(ctx, rel)
    count = before.count(old_string)
    if count == 0:
        raise ToolError(f"old_string was not found in {rel}; read the file and copy the text exactly, "
                        "including whitespace")
    if count > 1 and not replace_all:
        raise ToolError(f"old_string occurs {count} times in {rel}; include more surrounding lines to make "
                        "it unique, or set replace_all to true")
    after = before.replace(old_string, new_string) if replace_all else before.replace(old_string, new_string, 1)
    ctx.sandbox.write_text(rel, after)
    ctx.edited_files.add(rel)
    what = f"{count} replacements" if replace_all else "1 replacement"
    return f"Edited {rel} ({what}).\n{diff_snippet(rel, before, after)}{_lint_note(rel, after)}"


def write_file(ctx: ToolContext, path: str, content: str) -> str:
    rel = workspace_rel(path, ctx.workdir)
    if ctx.sandbox.is_dir(rel):
        raise ToolError(f"{rel} is a directory")
    existed = ctx.sandbox.exists(rel)
    ctx.sandbox.write_text(rel, content)
    ctx.edited_files.add(rel)
    verb = "Overwrote" if existed else "Created"
    return f"{verb} {rel} ({len(content.splitlines())} lines).{_lint_note(rel, content)}"


def delete_file(ctx: ToolContext, path: str) -> str:
    rel = workspace_rel(path, ctx.workdir)
    if rel == ".":
        raise ToolError("refusing to delete the workspace root")
    if ctx.sandbox.is_dir(rel):
        raise ToolError(f"{rel} is a directory; delete_file removes single files")
    if not ctx.sandbox.exists(rel):
        raise ToolError(f"{rel} does not exist")
    ctx.sandbox.remove(rel)
    ctx.edited_files.discard(rel)
    return f"Deleted {rel}."


def read_lints(ctx: ToolContext, paths: list[str] | None) -> str:
    targets = sorted(ctx.edited_files) if paths is None else [workspace_rel(p, ctx.workdir) for p in paths]
    if not targets:
        return "No files were edited in this episode, and no paths were given."
    problems, checked = [], 0
    for rel in targets:
        if not ctx.sandbox.exists(rel) or ctx.sandbox.is_dir(rel):
            problems.append(f"{rel}: not a file")
            continue
        checked += 1
        problem = lint_source(rel, ctx.sandbox.read_text(rel))
        if problem:
            problems.append(problem)
    if not problems:
        return f"No lint errors in {checked} file(s): {', '.join(targets)}"
    return "\n".join(problems)


def run_terminal_cmd(ctx: ToolContext, command: str, timeout: float | None) -> str:
    timeout_s = min(float(timeout) if timeout is not None else ctx.default_command_timeout_s,
                    ctx.max_command_timeout_s)
    remaining = ctx.remaining_s()
    if remaining is not None:
        if remaining <= 0:
            raise ToolError("the episode's wall-clock budget is spent; the command was not run")
        timeout_s = min(timeout_s, remaining)
    res = ctx.sandbox.exec(command, timeout_s=timeout_s)
    parts = [f"exit code: {res.exit_code}" + (f" (timed out after {timeout_s:g} s)" if res.timed_out else "")]
    if res.stdout:
        parts.append(f"stdout:\n{res.stdout.rstrip()}")
    if res.stderr:
        parts.append(f"stderr:\n{res.stderr.rstrip()}")
    if not res.stdout and not res.stderr:
        parts.append("(the command printed nothing)")
    return "\n".join(parts)


def submit(ctx: ToolContext, message: str) -> str:
    ctx.submitted = True
    ctx.submit_message = message
    return "Submitted. The episode ends after this turn."


_PATH = {"type": "string"}

EDIT_TOOLS = [
    Tool("edit_file", "Replace old_string with new_string in a file. old_string must match exactly once "
         "unless replace_all is true. Returns a diff of the change.",
         {"type": "object", "additionalProperties": False, "required": ["path", "old_string", "new_string"],
          "properties": {"path": _PATH, "old_string": {"type": "string"}, "new_string": {"type": "string"},
                         "replace_all": {"type": "boolean", "default": False}}},
         edit_file),
    Tool("write_file", "Create a file or overwrite it with the given content.",
         {"type": "object", "additionalProperties": False, "required": ["path", "content"],
          "properties": {"path": _PATH, "content": {"type": "string"}}},
         write_file),
    Tool("delete_file", "Delete one file.",
         {"type": "object", "additionalProperties": False, "required": ["path"], "properties": {"path": _PATH}},
         delete_file),
    Tool("read_lints", "Syntax-check files (.py, .json, .toml, .yaml). Without paths, checks every file "
         "edited in this episode.",
         {"type": "object", "additionalProperties": False, "required": [],
          "properties": {"paths": {"type": ["array", "null"], "items": {"type": "string"}, "default": None}}},
         read_lints),
    Tool("run_terminal_cmd", "Run a shell command (/bin/sh -c) in the workspace. Each command starts a fresh "
         "shell; no state carries over. There is no network.",
         {"type": "object", "additionalProperties": False, "required": ["command"],
          "properties": {"command": {"type": "string", "minLength": 1},
                         "timeout": {"type": ["number", "null"], "exclusiveMinimum": 0, "default": None,
                                     "description": "Seconds; capped by the environment."}}},
         run_terminal_cmd),
    Tool("submit", "Finish the task. Call this once the change is complete.",
         {"type": "object", "additionalProperties": False, "required": [],
          "properties": {"message": {"type": "string", "default": "",
                                     "description": "A short note on what was changed."}}},
         submit),
]
