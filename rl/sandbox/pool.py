"""`SandboxPool`: a fresh sandbox per episode, cheap because everything shareable is prepared once.

Nothing is reused across episodes: `acquire` always builds a new sandbox with its own upper layer,
cgroup and temp dirs, and `close` on it destroys them. What *is* shared is read-only: the sealed base
snapshot of each task repository (made on the first `acquire` of that repository), the generated /etc,
the bwrap argv prefix and the cgroup layout. So starting a sandbox costs a few mkdirs, one overlay
mount(2) and a cgroup mkdir; repository size does not matter.

Each pool keeps its state in its own directory named after its pid; directories left by pools of dead
processes (a crash) are unmounted and removed when the next pool starts.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from c2jax.rl.sandbox.base import Limits, SandboxError
from c2jax.rl.sandbox.bwrap import BwrapSandbox, default_state_dir
from c2jax.rl.sandbox.layers import BaseSnapshot, unmount


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap_stale(state_root: Path) -> None:
    for d in state_root.glob("pool-*"):
        m = re.fullmatch(r"pool-(\d+)-\w+", d.name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        for ws in d.glob("sbx-*/ws"):
            try:
                unmount(ws)
            except OSError:
                pass
        shutil.rmtree(d, ignore_errors=True)


class SandboxPool:
    """Hands out new `BwrapSandbox`es over cached base snapshots. Thread-safe; use as a context manager.

    Task repositories are treated as immutable inputs: a repository's snapshot is taken on its first
    `acquire`; call `forget(repo_dir)` after changing a repository on disk.
    """

    def __init__(self, *, limits: Limits | None = None, state_dir: Path | None = None,
                 mode: str | None = None):
        root = Path(state_dir) if state_dir is not None else default_state_dir()
        _reap_stale(root)
        self.limits, self.mode = (limits if limits is not None else Limits()), mode
        self._dir = root / f"pool-{os.getpid()}-{os.urandom(4).hex()}"
        self._dir.mkdir(mode=0o700)
        self._lock = threading.Lock()
        self._snapshots: dict[str, BaseSnapshot] = {}
        self._building: dict[str, threading.Lock] = {}
        self._live: set[BwrapSandbox] = set()
        self._closing = self._closed = False
        # Unmounting and deleting a sandbox measured ~20 ms, so it happens off the caller's path.
        self._reap_queue: queue.Queue = queue.Queue()
        self._reaper = threading.Thread(target=self._reap_loop, name="sandbox-reaper", daemon=True)
        self._reaper.start()

    def _reap_loop(self) -> None:
        while True:
            job = self._reap_queue.get()
            try:
                if job is None:
                    return
                job()
            except Exception:  # noqa: BLE001 - teardown is best effort; leftovers are reaped later
                pass
            finally:
                self._reap_queue.task_done()

    def snapshot(self, repo_dir: str | os.PathLike) -> BaseSnapshot:
        """The sealed base snapshot of `repo_dir` (built once; concurrent callers wait for one build)."""
        key = os.path.realpath(repo_dir)
        with self._lock:
            if self._closing:
                raise SandboxError("sandbox pool is closed")
            snap = self._snapshots.get(key)
            if snap is not None:
                return snap
            build_lock = self._building.setdefault(key, threading.Lock())
        with build_lock:
            with self._lock:
                snap = self._snapshots.get(key)
            if snap is None:
                snap = BaseSnapshot(key, self._dir).retain()  # the pool's own reference
                with self._lock:
                    self._snapshots[key] = snap
        return snap

    def acquire(self, repo_dir: str | os.PathLike, *, limits: Limits | None = None,
                extra_ro_binds: dict[str, str] | None = None) -> BwrapSandbox:
        """A new sandbox whose workspace is the sealed base state of `repo_dir`."""
        sandbox = BwrapSandbox(self.snapshot(repo_dir), limits=limits or self.limits, state_dir=self._dir,
                               mode=self.mode, extra_ro_binds=extra_ro_binds, _pool=self)
        return sandbox

    def register(self, sandbox: BwrapSandbox) -> None:
        """Called by every sandbox of this pool, forks included, so `close` can close them all."""
        with self._lock:
            if self._closing:
                raise SandboxError("sandbox pool is closed")
            self._live = {s for s in self._live if not s.closed}
            self._live.add(sandbox)

    def submit_teardown(self, job: Callable[[], None]) -> None:
        """Runs a closed sandbox's teardown on the reaper thread (here, once the pool is closed)."""
        with self._lock:
            running = not self._closed
            if running:
                self._reap_queue.put(job)
        if not running:  # the reaper has stopped: tear down here
            job()

    def forget(self, repo_dir: str | os.PathLike) -> None:
        """Drops the cached snapshot of `repo_dir`; live sandboxes over it keep working."""
        with self._lock:
            snap = self._snapshots.pop(os.path.realpath(repo_dir), None)
        if snap is not None:
            snap.release()

    def close(self) -> None:
        """Closes every sandbox still open and removes all of the pool's state."""
        with self._lock:
            if self._closing:
                return
            self._closing = True  # no new sandboxes from here on; the reaper still runs
            live, self._live = list(self._live), set()
            snaps, self._snapshots = list(self._snapshots.values()), {}
        for s in live:
            s.close()  # queued on the reaper
        with self._lock:
            self._closed = True
            self._reap_queue.put(None)
        self._reaper.join()
        for snap in snaps:
            snap.release()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
