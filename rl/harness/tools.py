"""The default Cursor-like tool set."""

from __future__ import annotations

from c2jax.rl.harness.edit_tools import EDIT_TOOLS
from c2jax.rl.harness.fs_tools import FS_TOOLS
from c2jax.rl.harness.registry import ToolRegistry


def default_registry() -> ToolRegistry:
    """read_file, list_dir, glob, grep, edit_file, write_file, delete_file, read_lints, run_terminal_cmd,
    submit. Use `.without(...)` to drop tools for an environment."""
    return ToolRegistry([*FS_TOOLS, *EDIT_TOOLS])
