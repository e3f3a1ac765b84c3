"""Sealed git history: a workspace is a fresh one-commit repository, and `diff` is taken against it.

The task repository's own history (if any) is dropped, so the answer cannot be mined from it: the
workspace's `.git` holds exactly one commit of the base tree, no remotes, no reflog, no hooks.

The host computes diffs with a *pristine* copy of that git directory kept outside the workspace and a
throwaway index and object store, with all configuration ignored: the agent can rewrite the
workspace's `.git` freely (e.g. plant `core.fsmonitor` to run a command), and nothing it writes there
is ever read or executed by the host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from c2jax.rl.sandbox.base import SandboxError

_IDENTITY = {
    "GIT_AUTHOR_NAME": "c2jax", "GIT_AUTHOR_EMAIL": "c2jax@localhost",
    "GIT_COMMITTER_NAME": "c2jax", "GIT_COMMITTER_EMAIL": "c2jax@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}
# Host-side git must not read any config the agent could have influenced, nor run anything.
_SAFE_FLAGS = ["-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-c", "core.autocrlf=false",
               "-c", "core.quotepath=false", "-c", "diff.external=", "-c", "core.logAllRefUpdates=false"]


def _env(**extra: str) -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null", "LC_ALL": "C", **_IDENTITY}
    env.update(extra)
    return env


def _git(args: list[str], *, env: dict[str, str], cwd: Path | None = None) -> str:
    proc = subprocess.run(["git", *_SAFE_FLAGS, *args], cwd=cwd, env=env, capture_output=True)
    if proc.returncode != 0:
        raise SandboxError(f"git {' '.join(args[:2])} failed: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout.decode("utf-8", errors="replace")


def copy_tree(src: Path, dst: Path, *, skip_git: bool) -> None:
    """Copies `src` to the new directory `dst` (symlinks copied as links, never followed)."""
    ignore = shutil.ignore_patterns(".git") if skip_git else None
    shutil.copytree(src, dst, symlinks=True, ignore=ignore)


def seal(tree: Path) -> str:
    """Turns `tree` into a fresh single-commit git repository; returns the commit's sha."""
    if (tree / ".git").exists() or (tree / ".git").is_symlink():
        shutil.rmtree(tree / ".git") if (tree / ".git").is_dir() else (tree / ".git").unlink()
    env = _env()
    _git(["init", "-q", "-b", "main", "--template=", str(tree)], env=env)
    _git(["config", "core.logAllRefUpdates", "false"], env=env, cwd=tree)
    _git(["add", "-A"], env=env, cwd=tree)
    _git(["commit", "-q", "--allow-empty", "--no-verify", "-m", "base"], env=env, cwd=tree)
    shutil.rmtree(tree / ".git" / "logs", ignore_errors=True)
    return _git(["rev-parse", "HEAD"], env=env, cwd=tree).strip()


def diff(pristine_git_dir: Path, work_tree: Path, base_sha: str) -> str:
    """`git diff` of `work_tree` against `base_sha`, new and deleted files included (binary-safe)."""
    with tempfile.TemporaryDirectory(prefix="c2jax-diff-") as tmp:
        objects = os.path.join(tmp, "objects")
        os.mkdir(objects)
        env = _env(GIT_DIR=str(pristine_git_dir), GIT_WORK_TREE=str(work_tree),
                   GIT_INDEX_FILE=os.path.join(tmp, "index"), GIT_OBJECT_DIRECTORY=objects,
                   GIT_ALTERNATE_OBJECT_DIRECTORIES=str(pristine_git_dir / "objects"))
        _git(["read-tree", base_sha], env=env, cwd=work_tree)
        _git(["add", "-A", "--", "."], env=env, cwd=work_tree)
        return _git(["diff", "--cached", "--binary", "--no-color", "--no-ext-diff", base_sha, "--"],
                    env=env, cwd=work_tree)
