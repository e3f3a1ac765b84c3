"""Host-side file operations on a workspace directory that never touch anything outside it.

Paths are workspace-relative POSIX strings. A path is refused (`SandboxPathError`) when it is absolute,
climbs out with `..`, or resolves through a symlink to somewhere outside the workspace. Every open is
re-checked after the fact through /proc/self/fd, and writes create files with O_NOFOLLOW relative to
a verified parent directory fd, so a command racing the check (swapping a directory for a symlink)
cannot redirect a host-side write outside the workspace.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
from pathlib import Path

from c2jax.rl.sandbox.base import Sandbox, SandboxError, SandboxPathError


def normalize(path: str) -> str:
    """The canonical workspace-relative form of `path` ('.' for the root), or SandboxPathError."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise SandboxPathError(f"invalid workspace path {path!r}: expected a non-empty relative path")
    if path.startswith("/"):
        raise SandboxPathError(f"absolute path {path!r} refused: paths are relative to the workspace")
    norm = posixpath.normpath(path)
    if norm == ".." or norm.startswith("../"):
        raise SandboxPathError(f"path {path!r} leaves the workspace")
    return norm


class HostWorkspace:
    """The file methods of `Sandbox`, over a host directory `root` that holds the workspace tree."""

    def __init__(self, root: Path):
        self.root = Path(os.path.realpath(root))

    def _inside(self, real: str) -> bool:
        root = str(self.root)
        return real == root or real.startswith(root + "/")

    def resolve(self, path: str) -> Path:
        """The host path `path` names, with symlinks resolved; refused if that is outside."""
        norm = normalize(path)
        real = os.path.realpath(os.path.join(self.root, norm))
        if not self._inside(real):
            raise SandboxPathError(f"path {path!r} resolves outside the workspace (through a symlink)")
        return Path(real)

    def _check_fd(self, fd: int, path: str) -> None:
        real = os.readlink(f"/proc/self/fd/{fd}")
        if not self._inside(real):
            os.close(fd)
            raise SandboxPathError(f"path {path!r} moved outside the workspace while being opened")

    def _open_dir(self, real: Path, path: str) -> int:
        try:
            fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except NotADirectoryError:
            raise NotADirectoryError(f"not a directory in the workspace: {path!r}") from None
        self._check_fd(fd, path)
        return fd

    def _parent_fd(self, path: str, *, create: bool) -> tuple[int, str]:
        """A verified fd of `path`'s parent directory (created if `create`), and the final name."""
        norm = normalize(path)
        if norm == ".":
            raise SandboxPathError("the workspace root itself cannot be written or removed")
        parent, name = posixpath.split(norm)
        fd = self._open_dir(self.root, path)
        try:
            for part in [p for p in parent.split("/") if p]:
                try:
                    nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise FileNotFoundError(f"no such directory in the workspace: {parent!r}") from None
                    os.mkdir(part, 0o755, dir_fd=fd)
                    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                    nxt = os.open(part, flags, dir_fd=fd)
                os.close(fd)
                fd = nxt
                self._check_fd(fd, path)  # a symlinked component is fine only while it stays inside
        except BaseException:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
            raise
        return fd, name

    def read_bytes(self, path: str) -> bytes:
        real = self.resolve(path)
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        self._check_fd(fd, path)
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(f"is a directory: {path!r}")
            if not stat.S_ISREG(mode):
                raise SandboxPathError(f"not a regular file: {path!r}")
            return f.read()

    def write_bytes(self, path: str, data: bytes) -> None:
        # Follow a final symlink that stays inside (the write lands on its target), like the shell would.
        target = self.resolve(path).relative_to(self.root).as_posix() if self.exists(path) else path
        fd, name = self._parent_fd(target, create=True)
        try:
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                          0o644, dir_fd=fd)
        finally:
            os.close(fd)
        with os.fdopen(out, "wb") as f:
            f.write(data)

    def remove(self, path: str) -> None:
        """Removes a file, a symlink (not its target) or a whole directory tree."""
        norm = normalize(path)
        parent = posixpath.dirname(norm) or "."
        self.resolve(parent)
        fd, name = self._parent_fd(norm, create=False)
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            raise FileNotFoundError(f"no such file in the workspace: {path!r}") from None
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return self.resolve(path).exists()

    def is_dir(self, path: str) -> bool:
        return self.resolve(path).is_dir()

    def list_dir(self, path: str = ".") -> list[str]:
        fd = self._open_dir(self.resolve(path), path)
        try:
            with os.scandir(fd) as it:
                names = [e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in it]
        finally:
            os.close(fd)
        return sorted(names)


class HostWorkspaceSandbox(Sandbox):
    """The file methods of a `Sandbox` whose workspace tree is a host directory (`self._ws`).

    Subclasses set `self._ws` and `self._closed` and implement exec, diff, fork and close."""

    _ws: HostWorkspace
    _closed: bool

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("sandbox is closed")

    def read_bytes(self, path: str) -> bytes:
        self._check_open()
        return self._ws.read_bytes(path)

    def write_bytes(self, path: str, data: bytes) -> None:
        self._check_open()
        self._ws.write_bytes(path, data)

    def remove(self, path: str) -> None:
        self._check_open()
        self._ws.remove(path)

    def exists(self, path: str) -> bool:
        self._check_open()
        return self._ws.exists(path)

    def is_dir(self, path: str) -> bool:
        self._check_open()
        return self._ws.is_dir(path)

    def list_dir(self, path: str = ".") -> list[str]:
        self._check_open()
        return self._ws.list_dir(path)

    def host_path(self) -> Path:
        self._check_open()
        return self._ws.root
