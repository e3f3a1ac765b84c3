"""Workspace layers: a sealed base snapshot (read-only lower layer) plus one private upper per sandbox.

`BaseSnapshot` is made once per task repository: the repo copied without its `.git`, sealed as a
one-commit git repo (gitseal). It is never written afterwards; its `.git` is the pristine history the
host diffs against.

A sandbox's workspace is either
- `overlay`: an overlayfs mounted on the host (lowerdir = the snapshot, upperdir/workdir private to
  the sandbox), then bind-mounted into bwrap. Creating one is a mkdir plus one mount(2), so start-up
  does not depend on repository size, and the host sees the merged tree directly (for `host_path`,
  file tools and diffs). Needs CAP_SYS_ADMIN on the host (we run as root here and on CI).
- `copy`: a `cp -a --reflink=auto` of the snapshot (instant on btrfs/xfs, a real copy on ext4); used
  when the host cannot mount overlayfs. Copies are private, so the snapshot is never mutated either.
`RootLayer` is the same kind of private writable layer over an unpacked container image's root filesystem
(c2jax.rl.sandbox.oci), for sandboxes and containers that run in the image.
bwrap's own `--overlay` is not used: it mounts inside the sandbox's namespace, so the host could not see
the merged tree without re-implementing overlay lookup (whiteouts, opaque dirs) on the upper dir.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from c2jax.rl.sandbox import gitseal
from c2jax.rl.sandbox.base import SandboxError

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_MNT_DETACH = 2


def _mount_overlay(lower: Path, upper: Path, work: Path, target: Path) -> None:
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}".encode()
    if _libc.mount(b"overlay", str(target).encode(), b"overlay", 0, opts) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount overlay on {target}: {os.strerror(err)}")


def unmount(target: Path) -> None:
    if _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not mounted; ENOENT: gone
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


class BaseSnapshot:
    """The sealed, read-only base tree of one task repository (`tree/`, with its one-commit `.git`)."""

    def __init__(self, repo_dir: str | os.PathLike, state_dir: Path):
        src = Path(repo_dir)
        if not src.is_dir():
            raise SandboxError(f"repository directory {str(src)!r} does not exist or is not a directory")
        self.repo_dir = src
        self.dir = Path(tempfile.mkdtemp(prefix="base-", dir=state_dir))
        self.tree = self.dir / "tree"
        gitseal.copy_tree(src, self.tree, skip_git=True)
        self.base_sha = gitseal.seal(self.tree)
        self.git_dir = self.tree / ".git"
        self._refs = 0
        self._lock = threading.Lock()

    def retain(self) -> BaseSnapshot:
        with self._lock:
            if self._refs < 0:
                raise SandboxError(f"base snapshot of {str(self.repo_dir)!r} was already removed")
            self._refs += 1
        return self

    def release(self) -> None:
        """Drops one reference; the last one removes the snapshot from disk."""
        with self._lock:
            self._refs -= 1
            if self._refs > 0:
                return
            self._refs = -1
        shutil.rmtree(self.dir, ignore_errors=True)


_overlay_ok: bool | None = None


def overlay_supported(state_dir: Path) -> bool:
    """Whether this host lets us mount overlayfs (probed once per process)."""
    global _overlay_ok
    if _overlay_ok is None:
        probe = Path(tempfile.mkdtemp(prefix="probe-", dir=state_dir))
        dirs = [probe / n for n in ("l", "u", "w", "m")]
        for d in dirs:
            d.mkdir()
        try:
            _mount_overlay(*dirs)
            unmount(dirs[3])
            _overlay_ok = True
        except OSError:
            _overlay_ok = False
        shutil.rmtree(probe, ignore_errors=True)
    return _overlay_ok


class Workspace:
    """One sandbox's private writable layer over a snapshot; `merged` is the tree commands see."""

    def __init__(self, snapshot: BaseSnapshot, sandbox_dir: Path, *, mode: str,
                 copy_from: Workspace | None = None):
        self.snapshot, self.mode = snapshot, mode
        self.merged = sandbox_dir / "ws"
        self.merged.mkdir()
        if mode == "overlay":
            self.upper, self.work = sandbox_dir / "upper", sandbox_dir / "work"
            self.work.mkdir()
            if copy_from is None:
                self.upper.mkdir()
            else:  # the upper holds every change, whiteouts and opaque-dir xattrs included
                _cp(copy_from.upper, self.upper)
            _mount_overlay(snapshot.tree, self.upper, self.work, self.merged)
        elif mode == "copy":
            self.merged.rmdir()
            _cp(copy_from.merged if copy_from else snapshot.tree, self.merged)
        else:
            raise SandboxError(f"unknown workspace mode {mode!r}; expected 'overlay' or 'copy'")

    def remove(self) -> None:
        if self.mode == "overlay":
            unmount(self.merged)


def _cp(src: Path, dst: Path) -> None:
    proc = subprocess.run(["cp", "-a", "--reflink=auto", str(src), str(dst)], capture_output=True)
    if proc.returncode != 0:
        raise SandboxError(f"copying {src} failed: {proc.stderr.decode(errors='replace').strip()}")


class RootLayer:
    """A private writable root over an unpacked image's tree `lower` (`Image.rootfs`, never written): an
    overlayfs mount where the host allows it, else a `cp -a --reflink=auto` copy. `root` is the tree a
    container sees as /."""

    def __init__(self, lower: Path, directory: Path, mode: str = "overlay"):
        self.dir, self.mode = Path(directory), mode
        self.root = self.dir / "merged"
        self.dir.mkdir(parents=True)
        if mode == "overlay":
            for d in ("upper", "work", "merged"):
                (self.dir / d).mkdir()
            _mount_overlay(Path(lower), self.dir / "upper", self.dir / "work", self.root)
        elif mode == "copy":
            subprocess.run(["cp", "-a", "--reflink=auto", str(lower), str(self.root)], check=True)
        else:
            raise ValueError(f"mode must be 'overlay' or 'copy', got {mode!r}")
        self._mounted = mode == "overlay"

    def remove(self) -> None:
        if self._mounted:
            unmount(self.root)
            self._mounted = False
        shutil.rmtree(self.dir, ignore_errors=True)
