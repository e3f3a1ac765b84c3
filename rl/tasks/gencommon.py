"""What the sdist generators share: running a repository's tests in a sandbox, and turning a (broken
repo, fixed files, test outcome) triple into a task with hidden tests."""

from __future__ import annotations

import dataclasses
import secrets
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from c2jax.rl.tasks.grading import SandboxFactory
from c2jax.rl.tasks.patches import is_test_path, make_patch, patch_size
from c2jax.rl.tasks.results import PASSED, ReportError, parse_junit
from c2jax.rl.tasks.task import Task, write_task


def run_tests(repo: Path, sandbox_factory: SandboxFactory, *, edits: dict[str, str | bytes | None] | None = None,
              tests: tuple[str, ...] = (), python: str = sys.executable, timeout_s: float = 300.0
              ) -> dict[str, str] | None:
    """Per-test statuses of `repo` with `edits` (path -> new text, None deletes) applied; None if the
    run timed out or produced no report."""
    with sandbox_factory(repo) as sb:
        for rel, text in (edits or {}).items():
            if text is None:
                sb.remove(rel)
            elif isinstance(text, bytes):
                sb.write_bytes(rel, text)
            else:
                sb.write_text(rel, text)
        junit = f".c2jax-gen-{secrets.token_hex(6)}.xml"
        # a test file that cannot import a removed name fails to collect; the other files still run, so
        # their tests count as PASS_TO_PASS instead of the whole session being interrupted
        cmd = (f"{shlex.quote(python)} -m pytest -p no:cacheprovider -o junit_family=xunit1 --rootdir=. -q "
               "--continue-on-collection-errors "
               f"--junitxml={junit} " + " ".join(shlex.quote(t) for t in tests))
        res = sb.exec(cmd, timeout_s=timeout_s,
                      env={"PATH": f"{Path(python).parent}:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1",
                           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
        if res.timed_out or not sb.exists(junit):
            return None
        try:
            return parse_junit(sb.read_bytes(junit))
        except ReportError:
            return None


def split_outcome(baseline: dict[str, str], broken: dict[str, str]) -> tuple[list[str], list[str]]:
    """(FAIL_TO_PASS, PASS_TO_PASS): tests passing on the clean repo that fail / still pass when broken."""
    passing = sorted(t for t, s in baseline.items() if s == PASSED)
    return [t for t in passing if broken.get(t) != PASSED], [t for t in passing if broken.get(t) == PASSED]


def emit_task(task: Task, clean_repo: Path, broken: dict[str, str | None], f2p: list[str], p2p: list[str],
              out_dir: Path) -> Path:
    """Writes the task: the agent's repo is `clean_repo` with `broken` applied and the test files that
    hold FAIL_TO_PASS tests removed; those files become the hidden overlay; the reference patch
    restores the clean sources."""
    hidden_files = sorted({t.split("::")[0] for t in f2p})
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        shutil.copytree(clean_repo, repo, symlinks=True)
        before, after = {}, {}
        for rel, text in broken.items():
            original = (clean_repo / rel).read_text() if (clean_repo / rel).exists() else None
            before[rel], after[rel] = text, original
            if text is None:
                (repo / rel).unlink()
            else:
                (repo / rel).write_text(text)
        overlay = {}
        for rel in hidden_files:
            overlay[rel] = (clean_repo / rel).read_bytes()
            (repo / rel).unlink(missing_ok=True)
        patch = make_patch({k: v for k, v in before.items() if v is not None},
                           {k: v for k, v in after.items() if v is not None})
        assert not any(is_test_path(p) for p in broken), "generators must not edit test files"
        lines, files = patch_size(patch)
        task = dataclasses.replace(task, repo_dir=repo, fail_to_pass=tuple(f2p), pass_to_pass=tuple(p2p),
                                   solution_patch=patch, lines_changed=lines, files_changed=files)
        return write_task(task, out_dir, overlay=overlay)


def package_modules(repo: Path, package: str) -> list[str]:
    """Repository paths of the package's non-test Python modules, sorted."""
    root = repo / package
    if (repo / f"{package}.py").is_file():
        return [f"{package}.py"]
    if not root.is_dir():
        raise FileNotFoundError(f"package {package!r} not found in {repo}")
    return sorted(p.relative_to(repo).as_posix() for p in root.rglob("*.py")
                  if not is_test_path(p.relative_to(repo).as_posix()))
