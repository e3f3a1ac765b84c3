"""`EnvironmentPool`: what every episode of one environment shares, prepared once per worker process.

`BackendFactory` (c2jax.rl.tasks.build) used to prepare a task's environment from scratch on every call, i.e.
for every episode and every grade: the OCI image's manifest and config read and verified again (`load_image`),
the Dockerfile's build context hashed again (`build_image`: the bytes of every file COPY reads), and the
workspace's base snapshot copied and sealed again (`BaseSnapshot`: a copy of the repository, or of what the image
holds at the working directory, then `git init` + `add` + `commit`), removed again on close. Here each of those is
made once per process and looked up afterwards:

- images: `image(source, cache_dir)` / `built_image(dockerfile, ...)`, memoized on the source's identity (the
  real path and the `lstat` of the files that name its content: a layout's index.json, an archive; for a
  Dockerfile every file of its build context and the base image in the store), so a changed image or context
  is prepared again. A memo whose unpacked tree has gone from the image cache is dropped.
- base snapshots: `snapshot(seed)` of a task repository (keyed by its real path and an `lstat` fingerprint of its
  tree, so a repository edited on disk is snapshotted again; `.git` entries are skipped, as the snapshot skips
  them) or of an image's tree (`immutable=True`: the image cache is content-addressed). At most `max_snapshots`
  (LRU; $C2JAX_ENV_POOL_SNAPSHOTS, default 64) are kept; an evicted one stays on disk until its last sandbox
  closes.

Each episode still gets a new sandbox: its own overlay (or copy) upper layer over the snapshot and over the image's
tree, cgroup and temporary directories, all removed on close, so nothing one episode writes reaches the next. The
pool only holds read-only inputs. Thread-safe: concurrent first calls for one key wait for one preparation.

`environment_pool()` is the process's pool (a new one in a forked child), or None with $C2JAX_ENV_POOL=0 (then
the factory prepares everything per call, as before). Its snapshots live in `<state dir>/pool-<pid>-env<rand>/`,
removed at exit; one left by a process that died is removed by the next `SandboxPool` or `EnvironmentPool`.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import stat
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from c2jax.rl.sandbox.base import SandboxError
from c2jax.rl.sandbox.layers import BaseSnapshot

POOL_ENV = "C2JAX_ENV_POOL"  # "0" / "off" / "false": no pool (every call prepares its environment)
SNAPSHOTS_ENV = "C2JAX_ENV_POOL_SNAPSHOTS"  # how many base snapshots a process keeps (LRU)
DEFAULT_MAX_SNAPSHOTS = 64
T = TypeVar("T")


def _stat_key(st: os.stat_result) -> tuple:
    if stat.S_ISDIR(st.st_mode):  # a directory's times change with its entries, which are listed themselves
        return (stat.S_IFDIR, st.st_mode & 0o7777, st.st_ino)
    # ctime changes with any write or utime, so a rewrite that restores size and mtime is still seen
    return (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def tree_fingerprint(root: str | os.PathLike, *, skip: frozenset[str] = frozenset()) -> str:
    """A digest of the names, types, modes, sizes, times and inodes of every entry under `root` (symlinks not
    followed; entries named in `skip` left out at every level). Any write under `root` changes it; reads no
    file's content."""
    root = Path(root)
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(_stat_key(os.lstat(root))).encode())
    stack = [("", str(root))]
    while stack:
        rel, path = stack.pop()
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            if e.name in skip:
                continue
            st = e.stat(follow_symlinks=False)
            name = f"{rel}/{e.name}"
            h.update(f"{name}\0{_stat_key(st)}\n".encode("utf-8", "surrogateescape"))
            if stat.S_ISDIR(st.st_mode):
                stack.append((name, e.path))
    return h.hexdigest()


def source_fingerprint(source: str | os.PathLike) -> tuple:
    """What identifies a saved image's content: an archive's `lstat`, or a layout directory's and its index."""
    source = Path(source)
    if source.is_dir():
        parts = [_stat_key(os.lstat(source))]
        for name in ("index.json", "manifest.json"):
            try:
                parts.append((name, _stat_key(os.lstat(source / name))))
            except FileNotFoundError:
                pass
        return tuple(parts)
    try:
        return (_stat_key(os.stat(source)),)
    except FileNotFoundError:
        return ("missing",)


class EnvironmentPool:
    """Images and base snapshots shared by the episodes of one worker process (see the module docstring)."""

    def __init__(self, state_dir: str | os.PathLike | None = None, *, max_snapshots: int | None = None):
        from c2jax.rl.sandbox.bwrap import default_state_dir
        from c2jax.rl.sandbox.pool import _reap_stale

        root = Path(state_dir) if state_dir is not None else default_state_dir()
        root.mkdir(parents=True, exist_ok=True)
        _reap_stale(root)
        if max_snapshots is None:
            max_snapshots = int(os.environ.get(SNAPSHOTS_ENV) or DEFAULT_MAX_SNAPSHOTS)
        if max_snapshots < 1:
            raise ValueError(f"max_snapshots must be at least 1, got {max_snapshots}")
        self.max_snapshots = max_snapshots
        self.pid = os.getpid()
        # named as SandboxPool's directories, so a dead process's one is reaped by either
        self.dir = root / f"pool-{self.pid}-env{os.urandom(4).hex()}"
        self.dir.mkdir(mode=0o700)
        self._lock = threading.Lock()
        self._images: dict[tuple, tuple[object, object]] = {}  # key -> (fingerprint, Image)
        self._snapshots: OrderedDict[tuple, tuple[object, BaseSnapshot]] = OrderedDict()
        self._building: dict[tuple, threading.Lock] = {}
        self._closed = False
        self.prepared: Counter[str] = Counter()  # "image", "build", "snapshot": preparations made
        self.reused: Counter[str] = Counter()  # lookups answered from the pool

    # ----------------------------------------------------------------------------------------- memo
    def _memo(self, table: dict, key: tuple, fingerprint: object, kind: str, make: Callable[[], T],
              valid: Callable[[T], bool] = lambda _: True) -> T:
        """table[key]'s value when its fingerprint matches and it is still valid, else make() once (concurrent
        callers of one key wait for it). Snapshots are reference-counted: the table holds one reference, and
        each caller gets one more, which it releases."""
        counted = table is self._snapshots
        with self._lock:
            self._check_open()
            hit = table.get(key)
            if hit is not None and hit[0] == fingerprint and valid(hit[1]):
                return self._hit(table, key, kind)
            build_lock = self._building.setdefault((kind, key), threading.Lock())
        with build_lock:
            with self._lock:
                hit = table.get(key)
                if hit is not None and hit[0] == fingerprint and valid(hit[1]):
                    return self._hit(table, key, kind)
            value = make()
            dropped = []
            with self._lock:
                self.prepared[kind] += 1
                if self._closed:  # closed while preparing: hand it out, keep nothing
                    return value.retain() if counted else value
                old = table.pop(key, None)
                if old is not None:
                    dropped.append(old[1])
                table[key] = (fingerprint, value.retain() if counted else value)
                while counted and len(table) > self.max_snapshots:  # least recently used first
                    dropped.append(table.popitem(last=False)[1][1])
                out = value.retain() if counted else value
        if counted:
            for snap in dropped:  # removed from disk with the last sandbox over it
                snap.release()
        return out

    def _hit(self, table: dict, key: tuple, kind: str):
        self.reused[kind] += 1
        value = table[key][1]
        if table is self._snapshots:
            table.move_to_end(key)
            return value.retain()
        return value

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the environment pool is closed")

    # ---------------------------------------------------------------------------------------- images
    def image(self, source: str | os.PathLike, cache_dir: str | os.PathLike):
        """`oci.load_image(source, cache_dir)`, once per process while the saved image is unchanged."""
        from c2jax.rl.sandbox import oci

        key = (os.path.realpath(source), os.path.realpath(cache_dir))

        def make():
            try:
                return oci.load_image(source, cache_dir)
            except oci.ImageError as e:
                if str(source) in str(e):
                    raise
                raise oci.ImageError(f"image {source}: {e}") from e

        return self._memo(self._images, ("oci", *key), source_fingerprint(source), "image", make, _unpacked)

    def built_image(self, dockerfile: str | os.PathLike, *, store: str | os.PathLike | None,
                    cache_dir: str | os.PathLike, network: bool = False):
        """`image_build.build_image(dockerfile, ...)` (its build context: the Dockerfile's directory), once per
        process while the Dockerfile, its context and its base image are unchanged."""
        from c2jax.rl.tasks import image_build

        dockerfile = Path(dockerfile)
        context = dockerfile.parent
        key = ("build", os.path.realpath(dockerfile), os.path.realpath(cache_dir), str(store or ""), bool(network))

        def make():
            try:
                return image_build.build_image(dockerfile, store=store, cache_dir=cache_dir, network=network)
            except image_build.ImageBuildError as e:
                if str(dockerfile) in str(e):
                    raise
                raise image_build.ImageBuildError(f"image built from {dockerfile}: {e}") from e

        try:
            fingerprint = (tree_fingerprint(context), _base_fingerprint(dockerfile, store))
        except (OSError, ValueError):  # unreadable, or not buildable: build_image says why
            return make()
        return self._memo(self._images, key, fingerprint, "build", make, _unpacked)

    # ------------------------------------------------------------------------------------- snapshots
    def snapshot(self, seed: str | os.PathLike, *, immutable: bool = False) -> BaseSnapshot:
        """The sealed base snapshot of directory `seed`, retained for the caller (who releases it once its
        sandbox holds it). `immutable`: `seed` is content-addressed (in the image cache), not fingerprinted."""
        real = os.path.realpath(seed)
        if not os.path.isdir(real):
            raise SandboxError(f"repository directory {str(seed)!r} does not exist or is not a directory")
        fingerprint = None if immutable else tree_fingerprint(real, skip=frozenset({".git"}))
        return self._memo(self._snapshots, (real,), fingerprint, "snapshot", lambda: BaseSnapshot(real, self.dir),
                          lambda s: s.tree.is_dir())

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**{f"{k}_prepared": v for k, v in self.prepared.items()},
                    **{f"{k}_reused": v for k, v in self.reused.items()},
                    "snapshots_kept": len(self._snapshots), "images_kept": len(self._images)}

    def close(self) -> None:
        """Drops every memo and the pool's references (open sandboxes keep theirs); removes its directory
        once no snapshot in it is used."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            snaps = [s for _, s in self._snapshots.values()]
            self._snapshots.clear()
            self._images.clear()
        for s in snaps:
            s.release()
        try:
            self.dir.rmdir()  # empty unless a live sandbox still holds a snapshot (reaped after exit)
        except OSError:
            pass

    def __enter__(self) -> EnvironmentPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unpacked(image) -> bool:
    from c2jax.rl.sandbox.oci import COMPLETE_MARKER

    return (image.rootfs.parent / COMPLETE_MARKER).is_file()


def _base_fingerprint(dockerfile: Path, store) -> tuple:
    from c2jax.rl.sandbox.oci import find_in_store
    from c2jax.rl.tasks.image_build import base_reference

    ref = base_reference(dockerfile)
    source = find_in_store(ref, store)
    return (ref, None if source is None else (os.path.realpath(source), source_fingerprint(source)))


def open_over_snapshot(cls, pool: EnvironmentPool | None, seed: str | os.PathLike, *, immutable: bool, **kwargs):
    """`cls(seed, **kwargs)` (a BwrapSandbox or an EngineSandbox), over the pool's shared base snapshot of `seed`
    when there is a pool (`immutable`: a tree of the content-addressed image cache, not fingerprinted)."""
    if pool is None:
        return cls(seed, **kwargs)
    snapshot = pool.snapshot(seed, immutable=immutable)
    try:
        return cls(snapshot, **kwargs)  # the sandbox retains the snapshot for itself
    finally:
        snapshot.release()


def pool_enabled() -> bool:
    return os.environ.get(POOL_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


_pool_lock = threading.Lock()
_pool: EnvironmentPool | None = None


def environment_pool() -> EnvironmentPool | None:
    """This process's pool (made on first use; a forked child makes its own), or None when $C2JAX_ENV_POOL=0."""
    global _pool
    if not pool_enabled():
        return None
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid() or _pool._closed:
            _pool = EnvironmentPool()
        return _pool


def reset_environment_pool() -> None:
    """Closes this process's pool; the next `environment_pool()` makes a new one (tests, benchmarks)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None and pool.pid == os.getpid():
        pool.close()


@atexit.register
def _close_at_exit() -> None:
    pool = _pool
    if pool is not None and pool.pid == os.getpid():
        pool.close()
        shutil.rmtree(pool.dir, ignore_errors=True)
