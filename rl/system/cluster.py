"""Starting Ray from a process that already runs JAX, without forking it.

`ray.init()` on a fresh machine starts the cluster's processes (GCS, raylet, ...) with
`subprocess.Popen(preexec_fn=...)`, which is a full `fork()` of the caller that runs Python code before
`exec`. JAX is multithreaded once its backend is up, and JAX warns on every such fork ("os.fork() was
called ... will likely lead to a deadlock"): a real hazard, not only noise. The demo, notebooks and the
test suite all use JAX before they start Ray.

So when this process's JAX backend is already initialized, `init_ray` starts the local cluster from a
separate, JAX-free launcher process (`ray start --head --block`, spawned with vfork + exec, which runs
no Python in the child), and this process joins it as a driver, which forks nothing. `shutdown_ray`
disconnects and stops that launcher's whole process group; so does exit, if nobody called it. Before
JAX's backend is up, `init_ray` is plain `ray.init` (no hazard, one process fewer).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_launcher: subprocess.Popen | None = None
_launcher_dir: Path | None = None


def jax_backend_running() -> bool:
    """True when JAX has started its (multithreaded) backend in this process."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # layout changed: assume the worst
        return True
    check = getattr(xla_bridge, "backends_are_initialized", None)
    return True if check is None else bool(check())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _use_token_auth(token: str) -> None:
    """Present `token` to the cluster. Ray reads its auth mode from the environment when it is imported and
    turns it on for a driver only when ray.init starts a cluster itself, so this process's cached Ray
    config is refreshed after setting it, as Ray does for that case (Ray >= 2.52; older Rays have no
    token authentication, and `ray start` none to ask for)."""
    os.environ["RAY_AUTH_TOKEN"] = token
    try:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
    except ImportError:
        return
    _enable_token_auth()


def _join(address: str, logging_level: str) -> None:
    """ray.init at an explicit address. A `ray start --head` cluster on a machine holding a Ray token
    requires token authentication (Ray >= 2.52), but a driver given an explicit address never turns it on
    by itself (only `auto` does), so the recipe `ray start --head` + `ray.address=HOST:PORT` failed after
    half a minute of "InvalidAuthToken ... RAY_AUTH_MODE is currently 'disabled'". With RAY_AUTH_MODE unset
    and a token at hand, the driver presents it: a cluster without authentication accepts such a driver too
    (checked: RAY_AUTH_MODE=disabled head, token-mode driver, Ray 2.60). RAY_AUTH_MODE set is respected."""
    import ray

    try:  # Ray's own rule for `auto`: RAY_AUTH_MODE if set, else token mode when a token exists
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        pass
    else:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    ray.init(address=address, logging_level=logging_level)


def init_ray(*, num_cpus: int | None = None, address: str | None = None, logging_level: str = "ERROR",
             start_timeout_s: float = 120.0) -> None:
    """Connect to Ray at `address`, or start a local cluster with `num_cpus` logical CPUs: from a
    JAX-free launcher process when this process's JAX backend is running (see the module docstring)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        _join(address, logging_level)
        return
    if not jax_backend_running():
        # "local": a new cluster of this process's own, never one that `ray start` left on the machine
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging_level)
        return
    global _launcher, _launcher_dir
    port = _free_port()
    # A temp dir of its own: `ray start` records its cluster as the machine's current one in its temp dir,
    # and under the default /tmp/ray every later plain ray.init() on this machine would join ours.
    _launcher_dir = Path(tempfile.mkdtemp(prefix="c2jax-ray-"))
    log = _launcher_dir / "launcher.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o600)
    # Ports of its own for the services `ray start` gives fixed defaults (client server 10001, dashboard
    # agent 52365), so two clusters on one machine (two test workers, a demo beside a run) do not collide.
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
            f"--temp-dir={_launcher_dir}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
            f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
            "--disable-usage-stats"]
    if num_cpus is not None:
        argv.append(f"--num-cpus={num_cpus}")
    # Token authentication, as ray.init gives a new local cluster: `ray start` turns it on for a new
    # cluster and takes this token; the driver below finds it in its environment.
    auth = {"RAY_AUTH_TOKEN": os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32)}
    # The launcher's environment is this process's, so the workers Ray starts see the same XLA_FLAGS,
    # JAX_PLATFORMS and sys.path as they would under ray.init; no preexec_fn, so Popen uses vfork.
    _launcher = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True,
                                 env={**os.environ, **auth, "RAY_USAGE_STATS_ENABLED": "0"})
    os.close(fd)
    atexit.unregister(shutdown_ray)  # registered once, however many clusters this process launches
    atexit.register(shutdown_ray)
    deadline = time.monotonic() + start_timeout_s
    while True:
        if _launcher.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            _launcher = None
            raise RuntimeError(f"the Ray launcher (`ray start --head`) exited before the cluster came up; "
                               f"its log ({log}) ends:\n{tail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                break
        except OSError:
            if time.monotonic() > deadline:
                shutdown_ray()
                raise TimeoutError(f"the local Ray cluster did not come up within {start_timeout_s:.0f} s; "
                                   f"see {log}") from None
            time.sleep(0.2)
    _use_token_auth(auth["RAY_AUTH_TOKEN"])
    try:
        ray.init(address=f"127.0.0.1:{port}", logging_level=logging_level)
    except BaseException:
        shutdown_ray()
        raise


def shutdown_ray() -> None:
    """ray.shutdown, and stop the cluster `init_ray` launched (its whole process group), if any."""
    global _launcher, _launcher_dir
    import ray

    with contextlib.suppress(Exception):
        if ray.is_initialized():
            ray.shutdown()
    launcher, _launcher = _launcher, None
    if launcher is None:
        return
    # SIGTERM to the launcher alone: `ray start --block` then stops the cluster's processes itself (about
    # 2 s here); whatever of its process group is left after that is killed.
    with contextlib.suppress(ProcessLookupError):
        launcher.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        launcher.wait(timeout=15.0)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(launcher.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        launcher.wait(timeout=5.0)
    if _launcher_dir is not None:
        shutil.rmtree(_launcher_dir, ignore_errors=True)
        _launcher_dir = None
