"""`ImageContainer`: one fresh bubblewrap container of an unpacked container image (c2jax.rl.sandbox.oci), for
commands run in the image itself, without a workspace or the Sandbox contract (`BwrapSandbox(..., image=...)` has
those).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from c2jax.rl.sandbox.bwrap import find_bwrap
from c2jax.rl.sandbox.layers import RootLayer, overlay_supported
from c2jax.rl.sandbox.oci import DEFAULT_ENV, Image, ImageError


@dataclass(frozen=True)
class ExecResult:
    """What one `ImageContainer.exec` returned."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False


class ImageContainer:
    """One fresh container of an unpacked image: a private copy-on-write layer over its root filesystem
    (`RootLayer`), entered with bubblewrap as uid 0 in a user namespace (so package managers that expect root
    work; apt also needs `APT::Sandbox::User "root"`, as its `_apt` user does not exist in the namespace), with its
    own /proc, /dev and /tmp, and no network unless `network`. The image's tree is never written. `close()` drops
    the layer. `BwrapSandbox(..., image=...)` is the same root behind the Sandbox contract (workspace, file
    tools, diffs)."""

    def __init__(self, image: Image, state_dir: str | os.PathLike, *, network: bool = False,
                 env: dict[str, str] | None = None, workdir: str | None = None, mode: str | None = None):
        self.image, self.network = image, network
        self.env = {**DEFAULT_ENV, **image.config.env, **(env or {})}
        self.workdir = workdir or image.config.workdir or "/"
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="container-", dir=state_dir))
        self.mode = mode or ("overlay" if overlay_supported(state_dir) else "copy")
        try:
            self._layer = RootLayer(image.rootfs, self.dir / "root", self.mode)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.root = self._layer.root
        (self.root / self.workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)

    def argv(self, command: str) -> list[str]:
        argv = [find_bwrap(), "--unshare-all", "--die-with-parent", "--new-session", "--uid", "0", "--gid", "0",
                "--bind", str(self.root), "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
                "--chdir", self.workdir, "--clearenv"]
        if self.network:
            argv += ["--share-net", "--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
        for key, value in self.env.items():
            argv += ["--setenv", key, value]
        shell = "/bin/sh"
        if not (self.root / "bin" / "sh").exists() and not (self.root / "bin").is_symlink():
            raise ImageError(f"image {self.image.digest}: no /bin/sh to run commands with")
        return argv + ["--", shell, "-c", command]

    def exec(self, command: str, *, timeout_s: float = 60.0) -> ExecResult:
        try:
            proc = subprocess.run(self.argv(command), capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            return ExecResult(-9, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                              else (e.stdout or ""), "timed out", timed_out=True)
        return ExecResult(proc.returncode, proc.stdout, proc.stderr)

    def close(self) -> None:
        self._layer.remove()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
