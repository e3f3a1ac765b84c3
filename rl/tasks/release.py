"""Release-diff tasks: version N's source, the changelog lines N+1 added as the prompt, and N+1's
tests of the changed behaviour as hidden tests. The reference is the real, human-written source diff
N -> N+1 of the package's modules.

FAIL_TO_PASS: tests of N+1 that pass on N+1 and fail on N's source; PASS_TO_PASS: those passing on
both. N+1's test files are the hidden overlay (the agent sees N's versions).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path

from c2jax.rl.tasks.gencommon import package_modules, run_tests
from c2jax.rl.tasks.grading import SandboxFactory
from c2jax.rl.tasks.patches import is_test_path, make_patch, patch_size
from c2jax.rl.tasks.results import PASSED
from c2jax.rl.tasks.task import Task, write_task

_CHANGELOG_NAMES = ("CHANGES", "CHANGELOG", "HISTORY", "NEWS", "RELEASE")


def changelog_added(old: Path, new: Path) -> list[str]:
    """Non-blank lines N+1's changelog adds to N's (files named CHANGES*, CHANGELOG*, HISTORY*...)."""
    added = []
    for path in sorted(new.rglob("*")):
        rel = path.relative_to(new)
        if not path.is_file() or not rel.name.upper().startswith(_CHANGELOG_NAMES):
            continue
        before = (old / rel).read_text(errors="replace").splitlines() if (old / rel).is_file() else []
        after = path.read_text(errors="replace").splitlines()
        for line in difflib.ndiff(before, after):
            text = line[2:].strip()
            if line.startswith("+ ") and text and not set(text) <= set("=-~*#^"):
                added.append(text)
    return added


def _is_heading(line: str, version: str) -> bool:
    """A changelog line that names the release rather than a change: a markdown / rst heading, a line
    with the version number, or "Version X released DATE"."""
    text = line.strip().lstrip("#").strip()
    return (line.lstrip().startswith("#") or (version and version in line)
            or bool(re.match(r"(version|release)\b", text, re.I)) or bool(re.fullmatch(r"[\d\s.\-/()]+", text)))


def _bullet(line: str) -> str:
    return re.sub(r"^\s*[-*+]\s+", "", line)


def _tests_of(repo: Path) -> dict[str, bytes]:
    return {p.relative_to(repo).as_posix(): p.read_bytes() for p in sorted(repo.rglob("*"))
            if p.is_file() and is_test_path(p.relative_to(repo).as_posix()) and "__pycache__" not in p.parts}


def build_release_task(task: Task, old: Path, new: Path, package: str, factory: SandboxFactory, out_dir: Path,
                       *, tests: tuple[str, ...] = (), timeout_s: float = 300.0) -> Path | None:
    """Writes the release task for `old` -> `new` (unpacked repositories), or returns None when no
    test of `new` fails on `old`'s source."""
    new_tests = _tests_of(new)
    on_new = run_tests(new, factory, tests=tests, timeout_s=timeout_s)
    old_tests = _tests_of(old)
    # only what changed is written over N (bytes: test data need not be UTF-8)
    changed = {k: v for k, v in new_tests.items() if old_tests.get(k) != v}
    on_old = run_tests(old, factory, edits=changed, tests=tests, timeout_s=timeout_s)
    if on_new is None or on_old is None:
        return None
    passing = sorted(t for t, s in on_new.items() if s == PASSED)
    f2p = [t for t in passing if on_old.get(t) != PASSED]
    p2p = [t for t in passing if on_old.get(t) == PASSED]
    if not f2p:
        return None
    mods = sorted(set(package_modules(old, package)) | set(package_modules(new, package)))
    before = {m: (old / m).read_text() for m in mods if (old / m).is_file()}
    after = {m: (new / m).read_text() for m in mods if (new / m).is_file()}
    patch = make_patch(before, after)
    lines, files = patch_size(patch)
    version = str(task.metadata.get("new_version", ""))
    notes = [n for n in changelog_added(old, new) if not _is_heading(n, version)]
    shown = ", ".join(f"`{t}`" for t in f2p[:3]) + (f" and {len(f2p) - 3} more" if len(f2p) > 3 else "")
    prompts = {"terse": _bullet(notes[0]) if notes else f"update {package} to its next release",
               "issue": f"Implement these changes from {package}'s {version or 'next'} changelog:\n\n"
                        + "\n".join(notes[:20]) if notes else
               f"Bring {package} to its next release's behaviour.",
               "full": ("Changelog of the next release:\n\n" + "\n".join(notes) + "\n\n" if notes else "")
               + f"The tests {shown} must pass without breaking the others."}
    task = dataclasses.replace(
        task, repo_dir=old, instruction=prompts["issue"], prompts=prompts, category="release",
        difficulty="hard" if files > 1 or lines > 40 else "medium", fail_to_pass=tuple(f2p),
        pass_to_pass=tuple(p2p), test_files=tests, solution_patch=patch, lines_changed=lines,
        files_changed=files)
    # all of N+1's test files, since F2P and P2P were measured with all of them in place
    return write_task(task, out_dir, overlay=new_tests)
