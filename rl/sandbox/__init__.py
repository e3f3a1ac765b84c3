"""Sandboxes: one isolated, private copy of a task repository per episode (see docs/sandbox.md).

`SandboxPool().acquire(repo_dir)` is the normal entry point (a `BwrapSandbox`); `LocalSandbox` has no
isolation and exists for unit tests only.
"""

from rl.sandbox.base import WORKSPACE, ExecResult, Limits, Sandbox, SandboxError, SandboxPathError
from rl.sandbox.bwrap import BwrapSandbox, find_bwrap
from rl.sandbox.layers import BaseSnapshot
from rl.sandbox.local import LocalSandbox
from rl.sandbox.pool import SandboxPool

__all__ = ["WORKSPACE", "BaseSnapshot", "BwrapSandbox", "ExecResult", "Limits", "LocalSandbox", "Sandbox",
           "SandboxError", "SandboxPathError", "SandboxPool", "find_bwrap"]
