"""Unified-diff helpers: split a patch by file, recognise test files, count the lines a patch changes."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

_DIFF_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)")
_TEST_DIRS = {"tests", "test", "testing"}
# pytest configuration a patch could use to deselect or rewrite tests (addopts, plugins)
_TEST_CONFIG = {"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "tests.py"}


def is_test_path(path: str) -> bool:
    """True for files the grader resets to the base version: tests, conftest.py, pytest config."""
    p = PurePosixPath(path)
    name = p.name
    return (any(part in _TEST_DIRS for part in p.parts[:-1]) or name in _TEST_CONFIG
            or (name.startswith("test_") and name.endswith(".py")) or name.endswith("_test.py"))


def split_patch(patch: str) -> list[tuple[str, str]]:
    """(path, section) per file of a `git diff`-style patch; `path` is the post-image path (the
    pre-image for deletions). Text before the first header is dropped."""
    sections: list[tuple[str, list[str]]] = []
    for line in patch.splitlines(keepends=True):
        m = _DIFF_HEADER.match(line)
        if m:
            sections.append((m.group(2), [line]))
        elif line.startswith("--- ") and (not sections or _section_has_hunks(sections[-1][1])):
            # a plain `diff -u` patch with no git headers: a new section starts at each --- line
            sections.append(("", [line]))
        elif sections:
            sections[-1][1].append(line)
            if not sections[-1][0] and line.startswith("+++ "):
                target = line[4:].split("\t")[0].strip()
                sections[-1] = (target[2:] if target.startswith("b/") else target, sections[-1][1])
    return [(path, "".join(lines)) for path, lines in sections if path]


def _section_has_hunks(lines: list[str]) -> bool:
    return any(line.startswith("@@") for line in lines)


def drop_test_files(patch: str) -> tuple[str, list[str]]:
    """The patch without its sections for test files, and the paths dropped."""
    kept, dropped = [], []
    for path, section in split_patch(patch):
        (dropped if is_test_path(path) else kept).append((path, section))
    return "".join(section for _, section in kept), [path for path, _ in dropped]


def patch_size(patch: str) -> tuple[int, int]:
    """(lines added + removed, files touched) of a unified diff."""
    lines = sum(1 for line in patch.splitlines()
                if (line.startswith("+") and not line.startswith("+++"))
                or (line.startswith("-") and not line.startswith("---")))
    return lines, len(split_patch(patch))


def make_patch(before: dict[str, str], after: dict[str, str]) -> str:
    """A `git apply`-able patch turning the files `before` into `after` (path -> text; a path missing
    on one side is a creation or deletion)."""
    import difflib

    out = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        header = [f"diff --git a/{path} b/{path}\n"]
        if old is None:
            header.append("new file mode 100644\n")
        elif new is None:
            header.append("deleted file mode 100644\n")
        body = list(difflib.unified_diff(
            _lines(old), _lines(new), "/dev/null" if old is None else f"a/{path}",
            "/dev/null" if new is None else f"b/{path}"))
        out.append("".join(header + body))
    return "".join(out)


def _lines(text: str | None) -> list[str]:
    if text is None:
        return []
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n\\ No newline at end of file\n"
    return lines
