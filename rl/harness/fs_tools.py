"""Read-only tools: read_file, list_dir, glob, grep.

read_file and list_dir go through the sandbox's file methods. glob and grep walk the tree under
`Sandbox.host_path()` in Python, which is much faster than a process per call; because that tree is a
host directory, the walk never follows a symlink and never reads a file whose real path leaves the
workspace (a policy could otherwise plant `ln -s /etc/shadow x` and grep the host's file).
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path

from c2jax.rl.harness.registry import Tool, ToolContext, ToolError
from c2jax.rl.sandbox.base import WORKSPACE, SandboxPathError
from c2jax.rl.sandbox.hostfs import normalize

MAX_LINE_CHARS = 2000  # read_file cuts longer lines (minified files would flood the context)
SKIP_DIRS = {".git", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", "node_modules", ".venv"}
MAX_GREP_FILE_BYTES = 2 * 1024**2


def workspace_rel(path: str, workdir: str = WORKSPACE) -> str:
    """Normalises a model-given path to workspace-relative POSIX form. Relative paths are relative to the
    sandbox's working directory `workdir` (where the workspace is mounted: /workspace, or a Harbor task's
    `[environment].workdir` such as /app); an absolute path inside it (`/app/x.py`) is accepted."""
    if not isinstance(path, str) or not path.strip():
        raise SandboxPathError("path must be a non-empty string")
    path = path.strip()
    if path.startswith("/"):
        absolute = posixpath.normpath(path)
        if absolute.startswith("//"):
            absolute = absolute[1:]
        root = workdir.rstrip("/") or "/"
        if absolute == root:
            return "."
        if not absolute.startswith(root + "/"):
            raise SandboxPathError(f"{path!r} is outside the workspace; use a path relative to {workdir} "
                                   f"(or an absolute path under {workdir})")
        path = absolute[len(root) + 1:]
    return normalize(path)


def _rel(ctx: ToolContext, path: str) -> str:
    return workspace_rel(path, ctx.workdir)


def host_target(ctx: ToolContext, rel: str) -> tuple[Path, Path]:
    """(real host root, real host path of `rel`), refusing anything whose real path leaves the root."""
    root = ctx.sandbox.host_path().resolve()
    target = (root / rel).resolve()
    if target != root and root not in target.parents:
        raise SandboxPathError(f"{rel!r} resolves outside the workspace")
    return root, target


def _inside(root: Path, path: Path) -> bool:
    real = path.resolve()
    return real == root or root in real.parents


def walk_files(root: Path, start: Path):
    """Yields (workspace-relative path, host path) of regular files under `start`, sorted, no symlink
    directories followed, symlinked files kept only if they point inside the workspace."""
    if start.is_file():
        if _inside(root, start):
            yield start.relative_to(root).as_posix(), start
        return
    for dirpath, dirnames, filenames in os.walk(start, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            full = Path(dirpath, name)
            if full.is_symlink() and not _inside(root, full):
                continue
            if full.is_file():
                yield full.relative_to(root).as_posix(), full


def glob_to_regex(pattern: str) -> re.Pattern:
    """`**` spans directories, `*` and `?` stay inside one path component, `[...]` is a class."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out.append(re.escape(c))
                i += 1
            else:
                body = pattern[i + 1:end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z")


def glob_matcher(pattern: str):
    """A pattern without '/' matches a file name at any depth (like ripgrep's --glob)."""
    if pattern.startswith("/") or ".." in pattern.split("/"):
        raise ToolError(f"glob pattern {pattern!r} must be relative and must not contain '..'")
    regex = glob_to_regex(pattern)
    if "/" not in pattern:
        return lambda rel: regex.match(posixpath.basename(rel)) is not None
    return lambda rel: regex.match(rel) is not None


def read_file(ctx: ToolContext, path: str, offset: int, limit: int) -> str:
    rel = _rel(ctx, path)
    if ctx.sandbox.is_dir(rel):
        raise ToolError(f"{rel} is a directory; use list_dir")
    if not ctx.sandbox.exists(rel):
        raise ToolError(f"{rel} does not exist")
    data = ctx.sandbox.read_bytes(rel)
    if b"\0" in data[:8192]:
        raise ToolError(f"{rel} is a binary file ({len(data)} bytes)")
    lines = data.decode("utf-8", errors="replace").splitlines()
    if not lines:
        return f"{rel} is empty"
    if offset > len(lines):
        raise ToolError(f"offset {offset} is past the end of {rel} ({len(lines)} lines)")
    chunk = lines[offset - 1:offset - 1 + limit]
    last = offset + len(chunk) - 1
    body = []
    for number, line in enumerate(chunk, start=offset):
        if len(line) > MAX_LINE_CHARS:
            line = line[:MAX_LINE_CHARS] + f"... [line cut, {len(line)} characters]"
        body.append(f"{number:6d}\t{line}")
    more = f"; {len(lines) - last} more lines, continue with offset={last + 1}" if last < len(lines) else ""
    return f"{rel}: lines {offset}-{last} of {len(lines)}{more}\n" + "\n".join(body)


def list_dir(ctx: ToolContext, path: str, depth: int) -> str:
    rel = _rel(ctx, path)
    if not ctx.sandbox.is_dir(rel):
        raise ToolError(f"{rel} is not a directory" if ctx.sandbox.exists(rel) else f"{rel} does not exist")
    lines: list[str] = []
    limit = 500

    def visit(dir_rel: str, level: int) -> None:
        for name in ctx.sandbox.list_dir(dir_rel):
            if len(lines) >= limit:
                return
            lines.append("  " * level + name)
            if name.endswith("/") and level + 1 < depth and name[:-1] not in SKIP_DIRS:
                visit(posixpath.join(dir_rel, name[:-1]) if dir_rel != "." else name[:-1], level + 1)

    visit(rel, 0)
    if not lines:
        return f"{rel}/ is empty"
    cut = f"\n... listing stopped at {limit} entries" if len(lines) >= limit else ""
    return f"{rel}/\n" + "\n".join("  " + line for line in lines) + cut


def _remote(ctx: ToolContext, name: str, arguments: dict) -> str | None:
    """glob / grep on a sandbox whose tree is not on this machine (`RemoteSandbox` of the RL system has a
    `search` method): the environment worker holding it runs the same function next to the tree
    (`run_search`). None for local sandboxes."""
    search = getattr(ctx.sandbox, "search", None)
    if search is None:
        return None
    error, output = search(name, arguments, ctx.workdir)
    if error == "path":
        raise SandboxPathError(output)
    if error:
        raise ToolError(output)
    return output


def run_search(sandbox, name: str, arguments: dict, workdir: str) -> tuple[str, str]:
    """("", output) of glob or grep on `sandbox` (a sandbox with a host tree), or ("path" | "tool", message)
    for a refused path or another mistake of the model: the environment-worker side of `_remote`."""
    from c2jax.rl.harness.registry import ToolContext

    functions = {"glob": glob_files, "grep": grep}
    if name not in functions:
        raise ValueError(f"run_search runs glob or grep, not {name!r}")
    try:
        return "", functions[name](ToolContext(sandbox, workdir=workdir), **arguments)
    except SandboxPathError as e:
        return "path", str(e)
    except ToolError as e:
        return "tool", str(e)


def glob_files(ctx: ToolContext, pattern: str, path: str) -> str:
    remote = _remote(ctx, "glob", {"pattern": pattern, "path": path})
    if remote is not None:
        return remote
    rel = _rel(ctx, path)
    match = glob_matcher(pattern)
    root, start = host_target(ctx, rel)
    if not start.exists():
        raise ToolError(f"{rel} does not exist")
    hits, limit = [], 500
    for file_rel, _ in walk_files(root, start):
        inner = posixpath.relpath(file_rel, rel) if rel != "." else file_rel
        if match(inner):
            hits.append(file_rel)
            if len(hits) > limit:
                break
    if not hits:
        return f"no files match {pattern!r} under {rel}"
    cut = f"\n... more than {limit} matches, narrow the pattern" if len(hits) > limit else ""
    return "\n".join(hits[:limit]) + cut


def grep(ctx: ToolContext, pattern: str, path: str, include: str | None, case_insensitive: bool,
         max_results: int) -> str:
    try:
        regex = re.compile(pattern, re.IGNORECASE if case_insensitive else 0)
    except re.error as e:
        raise ToolError(f"invalid regular expression {pattern!r}: {e}") from None
    remote = _remote(ctx, "grep", {"pattern": pattern, "path": path, "include": include,
                                   "case_insensitive": case_insensitive, "max_results": max_results})
    if remote is not None:
        return remote
    rel = _rel(ctx, path)
    match = glob_matcher(include) if include else None
    root, start = host_target(ctx, rel)
    if not start.exists():
        raise ToolError(f"{rel} does not exist")
    hits: list[str] = []
    files_with_hits = 0
    for file_rel, full in walk_files(root, start):
        if match is not None and not match(file_rel):
            continue
        try:
            if full.stat().st_size > MAX_GREP_FILE_BYTES:
                continue
            data = full.read_bytes()
        except OSError:
            continue
        if b"\0" in data[:8192]:
            continue
        found = False
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
            if regex.search(line):
                found = True
                hits.append(f"{file_rel}:{number}:{line[:300]}")
                if len(hits) >= max_results:
                    return "\n".join(hits) + f"\n... stopped at max_results={max_results}"
        files_with_hits += found
    if not hits:
        return f"no matches for {pattern!r} under {rel}"
    return "\n".join(hits) + f"\n({len(hits)} matches in {files_with_hits} files)"


_PATH = {"type": "string", "description": "Path relative to the working directory (or absolute inside it)."}

FS_TOOLS = [
    Tool("read_file", "Read a text file. Lines are numbered from 1; read long files in windows.",
         {"type": "object", "additionalProperties": False, "required": ["path"],
          "properties": {"path": _PATH,
                         "offset": {"type": "integer", "minimum": 1, "default": 1,
                                    "description": "First line to show (1-based)."},
                         "limit": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 250,
                                   "description": "Number of lines to show."}}},
         read_file),
    Tool("list_dir", "List a directory; subdirectories end with '/'.",
         {"type": "object", "additionalProperties": False, "required": [],
          "properties": {"path": {**_PATH, "default": "."},
                         "depth": {"type": "integer", "minimum": 1, "maximum": 5, "default": 1}}},
         list_dir),
    Tool("glob", "Find files by glob pattern ('**' spans directories; a pattern without '/' matches names "
         "at any depth).",
         {"type": "object", "additionalProperties": False, "required": ["pattern"],
          "properties": {"pattern": {"type": "string", "minLength": 1},
                         "path": {**_PATH, "default": "."}}},
         glob_files),
    Tool("grep", "Search file contents with a Python regular expression; prints path:line:text.",
         {"type": "object", "additionalProperties": False, "required": ["pattern"],
          "properties": {"pattern": {"type": "string", "minLength": 1},
                         "path": {**_PATH, "default": "."},
                         "include": {"type": ["string", "null"], "default": None,
                                     "description": "Only search files matching this glob, e.g. '*.py'."},
                         "case_insensitive": {"type": "boolean", "default": False},
                         "max_results": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}}},
         grep),
]
