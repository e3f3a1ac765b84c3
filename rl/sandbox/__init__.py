"""Sandboxes: one isolated, private copy of a task repository per episode (see docs/sandbox.md).

`SandboxPool().acquire(repo_dir)` is the normal entry point (a `BwrapSandbox`); `LocalSandbox` has no
isolation and exists for unit tests only.
"""

from c2jax.rl.sandbox.base import WORKSPACE, ExecResult, Limits, Sandbox, SandboxError, SandboxPathError
from c2jax.rl.sandbox.bwrap import BwrapSandbox, find_bwrap
from c2jax.rl.sandbox.layers import BaseSnapshot
from c2jax.rl.sandbox.local import LocalSandbox
from c2jax.rl.sandbox.pool import SandboxPool

__all__ = ["WORKSPACE", "BaseSnapshot", "BwrapSandbox", "ExecResult", "Limits", "LocalSandbox", "Sandbox",
           "SandboxError", "SandboxPathError", "SandboxPool", "find_bwrap"]
