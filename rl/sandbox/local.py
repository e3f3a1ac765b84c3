"""`LocalSandbox`: a private temp copy of a repository, with NO isolation. For unit tests only.

Commands run directly on the host as the calling user, with the workspace copy as the working
directory: they can read and write anything that user can, use the network, and so on. It exists so
harness and grader tests can run where bubblewrap is unavailable, and refuses to construct unless
`allow_unisolated=True` is passed, so it is never picked up by accident for untrusted code.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from c2jax.rl.sandbox import gitseal
from c2jax.rl.sandbox.base import WORKSPACE, ExecResult, Limits, SandboxError
from c2jax.rl.sandbox.hostfs import HostWorkspace, HostWorkspaceSandbox, normalize
from c2jax.rl.sandbox.procs import run_captured


class LocalSandbox(HostWorkspaceSandbox):
    """Unisolated sandbox: `repo_dir` copied to a temp dir and sealed as a one-commit git repo.

    Layout of the private temp dir: `base.git/` (pristine git dir used for diffs) and `workspace/`.
    `$C2JAX_WORKSPACE` is set for commands; note that unlike `BwrapSandbox` the workspace is *not* at
    `/workspace` here, so commands must use relative paths.
    """

    def __init__(self, repo_dir: str | os.PathLike, *, allow_unisolated: bool = False,
                 limits: Limits | None = None, workdir: str = WORKSPACE, env: dict[str, str] | None = None,
                 network: bool = False, _fork_of: LocalSandbox | None = None):
        if allow_unisolated is not True:
            raise SandboxError(
                "LocalSandbox runs commands on the host with NO isolation (network, host files, other "
                "episodes are all reachable); it is for unit tests only. Pass allow_unisolated=True to "
                "use it anyway, or use BwrapSandbox / SandboxPool for untrusted code.")
        if workdir != WORKSPACE:
            raise SandboxError(f"LocalSandbox cannot place the workspace at workdir {workdir!r} (it runs in a "
                               "host temp dir); use the bwrap backend")
        self.limits = limits if limits is not None else Limits()
        self.network = network  # recorded only: commands run on the host, whose network is always reachable
        self._env = dict(env or {})
        self._root = Path(tempfile.mkdtemp(prefix="c2jax-local-"))
        self._closed = False
        try:
            ws = self._root / "workspace"
            if _fork_of is not None:
                gitseal.copy_tree(_fork_of._ws.root, ws, skip_git=False)
                gitseal.copy_tree(_fork_of._root / "base.git", self._root / "base.git", skip_git=False)
                self._base_sha = _fork_of._base_sha
            else:
                src = Path(repo_dir)
                if not src.is_dir():
                    raise SandboxError(f"repository directory {str(src)!r} does not exist or is not a dir")
                gitseal.copy_tree(src, ws, skip_git=True)
                self._base_sha = gitseal.seal(ws)
                shutil.copytree(ws / ".git", self._root / "base.git", symlinks=True)
        except BaseException:
            shutil.rmtree(self._root, ignore_errors=True)
            raise
        self._ws = HostWorkspace(ws)
        self._repo_dir = Path(repo_dir)

    def exec(self, command: str, *, timeout_s: float | None = None, cwd: str = ".",
             env: dict[str, str] | None = None, stdin: str | None = None) -> ExecResult:
        self._check_open()
        workdir = self._ws.resolve(normalize(cwd))
        if not workdir.is_dir():
            raise SandboxError(f"cwd {cwd!r} is not a directory in the workspace")
        full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self._root),
                    "LANG": "C.UTF-8", "C2JAX_WORKSPACE": str(self._ws.root), "PYTHONDONTWRITEBYTECODE": "1",
                    **self._env, **(env or {})}
        return run_captured(["/bin/sh", "-c", command], limits=self.limits,
                            timeout_s=self.limits.timeout_s if timeout_s is None else timeout_s,
                            cwd=str(workdir), env=full_env, stdin=stdin)

    def diff(self) -> str:
        self._check_open()
        return gitseal.diff(self._root / "base.git", self._ws.root, self._base_sha)

    def fork(self) -> LocalSandbox:
        self._check_open()
        return LocalSandbox(self._repo_dir, allow_unisolated=True, limits=self.limits, env=self._env,
                            network=self.network, _fork_of=self)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            shutil.rmtree(self._root, ignore_errors=True)

    def __repr__(self) -> str:
        return f"LocalSandbox({str(self._repo_dir)!r}, workspace={str(self._ws.root)!r}, unisolated)"

