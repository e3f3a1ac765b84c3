"""The sandbox contract every backend implements (bubblewrap, and the unisolated LocalSandbox for tests).

A sandbox is one episode's private copy of a task repository. Everything the agent or a grader does
to it goes through this interface: `exec` runs a shell command inside it, and the file methods read
and write workspace files by workspace-relative POSIX path. Paths that leave the workspace (absolute
paths, `..` escapes, symlinks pointing outside) raise `SandboxPathError`; tool code turns that into a
tool error for the model.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path

WORKSPACE = "/workspace"  # where the repository appears to commands run inside a sandbox


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, backend missing, already closed)."""


class SandboxPathError(ValueError):
    """A path names something outside the workspace, or is not a valid workspace path."""


@dataclass(frozen=True)
class ExecResult:
    exit_code: int  # the command's status; -signal if killed by a signal; 124 if timed out
    stdout: str  # decoded as UTF-8 with errors="replace", capped (head + marker + tail)
    stderr: str
    timed_out: bool  # the wall timeout fired and the whole process group was killed
    truncated: bool  # stdout or stderr was cut to the output cap
    wall_s: float


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 30.0  # per-command wall clock
    output_bytes: int = 64 * 1024  # per stream; head and tail halves are kept
    memory_bytes: int = 2 * 1024**3  # address space / cgroup memory cap
    max_processes: int = 256
    file_size_bytes: int = 256 * 1024**2
    tmp_bytes: int = 256 * 1024**2  # size of the private tmpfs /tmp
    # Added by the sandbox owner (defaults keep the contract above unchanged):
    output_kill_bytes: int = 64 * 1024**2  # a command printing more than this (per stream) is killed
    max_open_files: int = 1024
    cpus: float | None = None  # CPU quota in cores (a cgroup cpu controller); None = no cap


class Sandbox(abc.ABC):
    """One isolated workspace. Use as a context manager; `close` removes all its private state.

    `workdir` is where commands inside see the workspace (and start): `/workspace` unless the backend
    mounts it elsewhere (a Harbor task's `[environment].workdir`). File methods take paths relative to it.
    `network` is True when commands share the host's network (off unless asked for; bwrap only).
    """

    limits: Limits
    workdir: str = WORKSPACE
    network: bool = False

    @abc.abstractmethod
    def exec(self, command: str, *, timeout_s: float | None = None, cwd: str = ".",
             env: dict[str, str] | None = None, stdin: str | None = None) -> ExecResult:
        """Runs `command` with /bin/sh -c inside the sandbox, in workspace-relative `cwd`."""

    @abc.abstractmethod
    def read_bytes(self, path: str) -> bytes: ...

    @abc.abstractmethod
    def write_bytes(self, path: str, data: bytes) -> None:
        """Creates parent directories as needed."""

    @abc.abstractmethod
    def remove(self, path: str) -> None: ...

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def is_dir(self, path: str) -> bool: ...

    @abc.abstractmethod
    def list_dir(self, path: str = ".") -> list[str]:
        """Names in a workspace directory, sorted; directories carry a trailing '/'."""

    @abc.abstractmethod
    def host_path(self) -> Path:
        """A host directory whose tree is the workspace's current state (read it, do not write it)."""

    @abc.abstractmethod
    def diff(self) -> str:
        """The workspace's changes against the task's base commit, as a `git diff` patch."""

    @abc.abstractmethod
    def fork(self) -> Sandbox:
        """A new, independent sandbox starting from this one's current workspace state."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def upload_dir(self, source: str | Path, target: str) -> Path:
        """Copies host directory `source` to absolute path `target` inside the sandbox (Harbor's
        `upload_dir`: /solution, /tests, /logs); later commands see it read-write. Returns the host
        directory holding the copy. Backends that cannot place files outside the workspace refuse."""
        raise SandboxError(f"{type(self).__name__} cannot place {str(source)!r} at {target!r}: only the "
                           "workspace exists in it (use the bwrap backend)")

    def read_text(self, path: str) -> str:
        return self.read_bytes(path).decode("utf-8", errors="replace")

    def write_text(self, path: str, text: str) -> None:
        self.write_bytes(path, text.encode("utf-8"))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
