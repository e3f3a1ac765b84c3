"""`EngineSandbox`: the Sandbox contract in a Docker or Podman container, for container-image tasks where an
engine runs (docs/sandbox.md, "Container engines").

One sandbox is one container, started from the task's image when the sandbox is made and removed (`rm -f`) on
`close()`; every episode and every grade gets a fresh one. The workspace stays a host directory (the same
sealed single-commit snapshot and overlay / copy layer as `BwrapSandbox`), bind-mounted read-write at the
task's `workdir`, so the file methods, `host_path()`, `diff()` and `fork()` work on the host exactly as for
bwrap. Commands run with `<engine> exec -w <workdir>/<cwd> -e K=V ... /bin/sh -c COMMAND`.

The container: `--network none` unless `network=True` (then the engine's default network: a bridge with its
own namespace, not the host's as bwrap's `network=True`), `--memory` = `--memory-swap` = `Limits.memory_bytes`
(no swap), `--pids-limit`, `--cpus` when `Limits.cpus` is set, rlimits `fsize`, `nofile`, `nproc`, `core=0`, a
private tmpfs `/tmp` of `Limits.tmp_bytes`, uid 0 of the container (as the bwrap image path; the image's USER is
not applied), the image's Env under the sandbox's `env` and the command's `env`. The main process is a
`/bin/sh` blocked opening a FIFO of the sandbox's private state (`/.c2jax/keep`), so any image with /bin/sh
works without `sleep`. Background processes survive between commands, as in Docker; a command that runs past
its timeout or floods its output is killed by killing the container (every process in it) and starting it
again: files (the container's layer, the workspace, uploads) are kept.

`upload_dir(source, target)` copies `source` under the sandbox's private state, which is bind-mounted at
`/.c2jax/uploads`, and places a symlink `target -> /.c2jax/uploads/N` into the container with `<engine> cp`
(a tar stream: no tool of the image is needed); the host reads what commands write there (Harbor's /logs).

Images (`ensure_image`): a reference the engine already has, else a saved image of c2jax's image store
(`$C2JAX_IMAGE_STORE`, a `docker save` tar or an OCI layout directory) loaded with `<engine> load` and tagged
`c2jax/store:<manifest digest>` so it loads once; a tree built by c2jax's Dockerfile interpreter
(`c2jax.rl.tasks.image_build`) is imported with `<engine> import` as `c2jax/built:<digest>`.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from c2jax.rl.sandbox import gitseal
from c2jax.rl.sandbox.base import WORKSPACE, ExecResult, Limits, SandboxError
from c2jax.rl.sandbox.bwrap import check_mount_point, default_state_dir
from c2jax.rl.sandbox.hostfs import HostWorkspace, HostWorkspaceSandbox, normalize
from c2jax.rl.sandbox.layers import BaseSnapshot, Workspace, overlay_supported
from c2jax.rl.sandbox.procs import run_captured

if TYPE_CHECKING:
    from c2jax.rl.sandbox.oci import Image

ENGINES = ("docker", "podman")
# the client binary of each engine, when not `docker` / `podman` on PATH (also how tests point at a fake one)
BINARY_ENV = {"docker": "C2JAX_DOCKER", "podman": "C2JAX_PODMAN"}
PROBE_TIMEOUT_S = 10.0
PRIVATE = "/.c2jax"  # the sandbox's own mounts inside the container: uploads/ and the keeper FIFO
LABEL = "c2jax.sandbox"
_INFO_FORMAT = {"docker": "{{.ServerVersion}}", "podman": "{{.Version.Version}}"}


class EngineError(SandboxError):
    """The container engine is missing, does not answer, or refused a command; the message says which."""


@dataclass(frozen=True)
class Engine:
    """A container engine client that can run containers here (from `find_engine` / `detect_engine`)."""

    name: str  # "docker" or "podman"
    binary: str
    version: str = ""

    def run(self, *args: str, input: bytes | None = None, timeout_s: float = 120.0,
            check: bool = True) -> subprocess.CompletedProcess:
        try:
            proc = subprocess.run([self.binary, *args], input=input, capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise EngineError(f"`{self.name} {args[0]}` did not finish within {timeout_s:g}s") from None
        if check and proc.returncode != 0:
            raise EngineError(f"`{self.name} {' '.join(args[:2])}` failed (exit {proc.returncode}): "
                              f"{_tail(proc.stderr or proc.stdout)}")
        return proc


def _tail(data: bytes, n: int = 600) -> str:
    text = data.decode("utf-8", errors="replace").strip()
    return text if len(text) <= n else "..." + text[-n:]


def engine_binary(name: str) -> str:
    """The client of engine `name`: $C2JAX_DOCKER / $C2JAX_PODMAN when set, else the name on PATH."""
    if name not in ENGINES:
        raise ValueError(f"container engine must be one of {ENGINES}, got {name!r}")
    return os.environ.get(BINARY_ENV[name]) or shutil.which(name) or name


def engine_unusable_reason(name: str, binary: str | None = None, *,
                           timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when engine `name`'s client exists and its daemon / runtime answers `info`, else why not."""
    binary = binary or engine_binary(name)
    return _probe(name, binary, timeout_s)[1]


@functools.lru_cache(maxsize=16)
def _probe(name: str, binary: str, timeout_s: float) -> tuple[str, str | None]:
    """(version, None) or ("", reason); cached per process (an engine does not come and go mid-run)."""
    if name not in ENGINES:
        raise ValueError(f"container engine must be one of {ENGINES}, got {name!r}")
    path = binary if os.sep in binary else shutil.which(binary)
    if not path or not os.path.isfile(path):
        return "", (f"{name}: no client at {binary!r} (install {name}, or set ${BINARY_ENV[name]} to its path)"
                    if os.sep in binary else f"{name}: no `{binary}` client on PATH (install {name}, or set "
                    f"${BINARY_ENV[name]} to its path)")
    if not os.access(path, os.X_OK):
        return "", f"{name}: the client {path} is not executable"
    try:
        proc = subprocess.run([path, "info", "--format", _INFO_FORMAT[name]], capture_output=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "", f"{name}: `{path} info` did not answer within {timeout_s:g}s (daemon hung or unreachable)"
    except OSError as e:
        return "", f"{name}: cannot run {path}: {e}"
    version = proc.stdout.decode(errors="replace").strip()
    if proc.returncode != 0 or not version or version == "<no value>":
        why = _tail(proc.stderr or proc.stdout) or "no output"
        return "", f"{name}: `{path} info` failed (exit {proc.returncode}), so no daemon / runtime answers: {why}"
    return version, None


def find_engine(name: str) -> Engine:
    """Engine `name` ("docker" or "podman"), or EngineError with the reason it cannot run containers."""
    binary = engine_binary(name)
    version, reason = _probe(name, binary, PROBE_TIMEOUT_S)
    if reason is not None:
        raise EngineError(reason)
    return Engine(name, shutil.which(binary) or binary, version)


def detect_engine(preference: tuple[str, ...] = ENGINES) -> tuple[Engine | None, str]:
    """(the first engine of `preference` that runs containers, "") or (None, every engine's reason)."""
    reasons = []
    for name in preference:
        try:
            return find_engine(name), ""
        except EngineError as e:
            reasons.append(str(e))
    return None, "; ".join(reasons) or "no engine asked for"


# -------------------------------------------------------------------------------------------------- images
_image_lock = threading.Lock()


def _loaded_name(output: bytes) -> str | None:
    """The image `docker load` / `podman load` reports ("Loaded image: X", "Loaded image ID: X",
    "Loaded image(s): X,Y")."""
    for line in reversed(output.decode(errors="replace").splitlines()):
        if line.startswith("Loaded image"):
            return line.split(":", 1)[1].strip().split(",")[0].strip() or None
    return None


def _image_id(engine: Engine, ref: str) -> str | None:
    proc = engine.run("image", "inspect", "--format", "{{.Id}}", ref, check=False, timeout_s=60)
    out = proc.stdout.decode(errors="replace").strip().splitlines()
    return out[0] if proc.returncode == 0 and out else None


def load_saved_image(engine: Engine, source: str | os.PathLike) -> str:
    """The engine's image id of a saved image (a `docker save` tar, an OCI layout directory or its tar),
    loaded once: tagged `c2jax/store:<manifest digest>`, which later calls find."""
    from c2jax.rl.sandbox.oci import ImageError, read_image_config

    source = Path(source)
    try:
        digest = read_image_config(source)[0]
    except ImageError as e:
        raise EngineError(f"cannot load {source} into {engine.name}: {e}") from None
    tag = f"c2jax/store:{digest.split(':', 1)[1]}"
    with _image_lock:
        found = _image_id(engine, tag)
        if found:
            return found
        if source.is_dir() and engine.name == "docker":  # docker loads archives only: tar the layout
            with tempfile.TemporaryDirectory(prefix="c2jax-load-") as tmp:
                archive = Path(tmp) / "image.tar"
                with tarfile.open(archive, "w") as tar:
                    for child in sorted(source.iterdir()):
                        tar.add(child, arcname=child.name)
                proc = engine.run("load", "-i", str(archive), timeout_s=600)
        else:  # podman loads an OCI layout directory itself
            proc = engine.run("load", "-i", str(source), timeout_s=600)
        name = _loaded_name(proc.stdout + proc.stderr)
        if name is None:
            raise EngineError(f"`{engine.name} load -i {source}` did not say which image it loaded: "
                              f"{_tail(proc.stdout + proc.stderr)}")
        engine.run("tag", name, tag, timeout_s=60)
        if source.as_posix().strip("/") in name:  # podman names an unnamed layout by its path: drop that name
            engine.run("rmi", name, check=False, timeout_s=60)
        found = _image_id(engine, tag)
        if not found:
            raise EngineError(f"{engine.name} loaded {source} as {name}, but {tag} is not found after tagging")
        return found


def import_built_image(engine: Engine, image: Image) -> str:
    """The engine's image id of an image tree built by c2jax (`c2jax.rl.tasks.image_build`), imported once
    with its Env and WorkingDir as `c2jax/built:<digest>`."""
    tag = f"c2jax/built:{image.digest.split(':', 1)[-1][:64]}"
    with _image_lock:
        found = _image_id(engine, tag)
        if found:
            return found
        changes = []
        for key, value in image.config.env.items():
            changes += ["--change", f"ENV {key}={value}"]
        if image.config.workdir:
            changes += ["--change", f"WORKDIR {image.config.workdir}"]
        tar = subprocess.Popen(["tar", "-C", str(image.rootfs), "--numeric-owner", "-cf", "-", "."],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            proc = subprocess.run([engine.binary, "import", *changes, "-", tag], stdin=tar.stdout,
                                  capture_output=True, timeout=600)
        finally:
            tar.stdout.close()
            tar.wait()
        if proc.returncode != 0:
            raise EngineError(f"`{engine.name} import` of the built image {image.digest} failed: "
                              f"{_tail(proc.stderr)}")
        found = _image_id(engine, tag)
        if not found:
            raise EngineError(f"{engine.name} imported {image.digest}, but {tag} is not found")
        return found


def ensure_image(engine: Engine, image: str | os.PathLike) -> str:
    """The engine's image id for `image`: a path to a saved image (loaded once), or a reference the engine
    has, or one of the image store ($C2JAX_IMAGE_STORE); EngineError naming both places otherwise."""
    from c2jax.rl.sandbox.oci import IMAGE_STORE_ENV, find_in_store, store_name

    if not isinstance(image, (str, os.PathLike)) or not str(image).strip():
        raise ValueError(f"image must be a reference or a saved image's path, got {image!r}")
    if isinstance(image, os.PathLike) or os.path.exists(str(image)):
        return load_saved_image(engine, image)
    ref = str(image)
    found = _image_id(engine, ref)
    if found:
        return found
    saved = find_in_store(ref)
    if saved is not None:
        return load_saved_image(engine, saved)
    store = os.environ.get(IMAGE_STORE_ENV)
    where = f"not in the image store {store}" if store else f"no image store (${IMAGE_STORE_ENV} is not set)"
    raise EngineError(f"image {ref!r}: {engine.name} does not have it and it is {where}; `{engine.name} pull` "
                      f"or `{engine.name} load` it, or save it as {store_name(ref)}.tar in the store")


def image_env_workdir(engine: Engine, image_id: str) -> tuple[dict[str, str], str]:
    """(Env, WorkingDir) of an image the engine has."""
    proc = engine.run("image", "inspect", "--format", "{{json .Config.Env}}\n{{.Config.WorkingDir}}", image_id,
                      timeout_s=60)
    import json

    lines = proc.stdout.decode(errors="replace").splitlines() + ["", ""]
    env = {}
    for item in json.loads(lines[0] or "null") or []:
        key, _, value = item.partition("=")
        env[key] = value
    return env, lines[1].strip() or "/"


def image_tree(engine: Engine, image_id: str, path: str, cache_dir: str | os.PathLike) -> Path:
    """A host copy of what the image holds at absolute `path` (an empty directory when nothing), made once
    per image and path under `cache_dir`: the seed of a workspace mounted there."""
    key = hashlib.sha256(f"{engine.name}\0{image_id}\0{path}".encode()).hexdigest()[:24]
    out = Path(cache_dir) / f"engine-tree-{key}"
    if (out / ".c2jax-complete").is_file():
        return out / "tree"
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".engine-tree-", dir=cache_dir))
    name = f"c2jax-seed-{uuid.uuid4().hex[:12]}"
    try:
        (staging / "tree").mkdir()
        engine.run("create", "--name", name, "--label", f"{LABEL}=seed", "--entrypoint", "/bin/sh", image_id,
                   timeout_s=120)
        try:
            proc = engine.run("cp", f"{name}:{path.rstrip('/')}/.", "-", check=False, timeout_s=600)
        finally:
            engine.run("rm", "-f", name, check=False, timeout_s=60)
        if proc.returncode != 0 and not _missing(proc.stderr):
            raise EngineError(f"could not copy {path} out of {image_id}: {_tail(proc.stderr or proc.stdout)}")
        if proc.returncode == 0:
            with tarfile.open(fileobj=io.BytesIO(proc.stdout), mode="r:") as tar:
                members = []
                for m in tar.getmembers():  # `cp DIR/. -` names members relative to DIR (podman: "x", or "./x")
                    rel = _relative(m.name)
                    if rel in ("", "."):
                        continue
                    m.name = rel
                    if m.islnk():
                        m.linkname = _relative(m.linkname)
                    members.append(m)
                tar.extractall(staging / "tree", members=members, filter="tar")
        (staging / ".c2jax-complete").write_text(image_id + "\n")
        try:
            os.rename(staging, out)
        except OSError:
            if not (out / ".c2jax-complete").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out / "tree"


def _relative(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name


def _missing(stderr: bytes) -> bool:
    """Whether `<engine> cp` failed because the path does not exist in the image (then the seed is empty)."""
    s = stderr.decode(errors="replace").lower()
    return "could not be found" in s or "no such file" in s or "not found" in s


# -------------------------------------------------------------------------------------------------- sandbox
class EngineSandbox(HostWorkspaceSandbox):
    """A workspace over `source` (a directory or a shared `BaseSnapshot`) in a fresh container of `image` (an
    image id / reference the engine has, or a saved image's path: see `ensure_image`) run by `engine`.

    `workdir` is where the workspace is mounted and commands start; `env` is set for every command over the
    image's Env; `network=True` gives the container the engine's default network; `mode` is the workspace
    layer ('overlay' or 'copy', as `BwrapSandbox`)."""

    def __init__(self, source: str | os.PathLike | BaseSnapshot, *, engine: Engine, image: str | os.PathLike,
                 limits: Limits | None = None, state_dir: Path | None = None, mode: str | None = None,
                 workdir: str = WORKSPACE, env: dict[str, str] | None = None, network: bool = False,
                 _fork_of: EngineSandbox | None = None):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be an Engine (find_engine / detect_engine), got {engine!r}")
        if not isinstance(network, bool):
            raise TypeError(f"network must be True or False, got {network!r}")
        self.workdir = _check_target(workdir, "workdir")
        self.network, self.engine = network, engine
        self.limits = limits if limits is not None else Limits()
        self._env = {str(k): str(v) for k, v in (env or {}).items()}
        for key in self._env:
            if not key or "=" in key or "\x00" in key:
                raise ValueError(f"invalid environment variable name {key!r}")
        self.image_id = image if _fork_of is not None else ensure_image(engine, image)
        self._state_dir = Path(state_dir) if state_dir is not None else default_state_dir()
        snapshot = source if isinstance(source, BaseSnapshot) else BaseSnapshot(source, self._state_dir)
        self._snapshot = snapshot.retain()
        self._mode = mode or ("overlay" if overlay_supported(self._state_dir) else "copy")
        self._closed = False
        self._uploads: dict[str, Path] = {}
        self._dir = Path(tempfile.mkdtemp(prefix="ctr-", dir=self._state_dir))
        self.name = f"c2jax-{self._dir.name.removeprefix('ctr-')}-{uuid.uuid4().hex[:8]}"
        self._container = False
        self._lock = threading.Lock()
        try:
            self._workspace = Workspace(self._snapshot, self._dir, mode=self._mode,
                                        copy_from=_fork_of._workspace if _fork_of else None)
            private = self._dir / "private"
            (private / "uploads").mkdir(parents=True)
            os.mkfifo(private / "keep", 0o600)  # the main process blocks opening it: no `sleep` needed
            self._start()
        except BaseException:
            self._teardown()
            self._snapshot.release()
            raise
        self._ws = HostWorkspace(self._workspace.merged)

    # ---------------------------------------------------------------------------------------- lifecycle
    def _run_argv(self) -> list[str]:
        lim = self.limits
        argv = ["run", "-d", "--name", self.name, "--label", f"{LABEL}=1", "--pull", "never",
                "--hostname", "sandbox", "--user", "0:0", "--stop-signal", "SIGKILL", "--log-driver", "none",
                "--memory", f"{lim.memory_bytes}b", "--memory-swap", f"{lim.memory_bytes}b",
                "--pids-limit", str(lim.max_processes),
                "--ulimit", f"fsize={lim.file_size_bytes}:{lim.file_size_bytes}",
                "--ulimit", f"nofile={lim.max_open_files}:{lim.max_open_files}",
                "--ulimit", f"nproc={lim.max_processes}:{lim.max_processes}", "--ulimit", "core=0:0",
                "--tmpfs", f"/tmp:rw,exec,size={lim.tmp_bytes},mode=1777",
                "-v", f"{self._workspace.merged}:{self.workdir}:rw", "-v", f"{self._dir / 'private'}:{PRIVATE}:rw",
                "-w", self.workdir, "--entrypoint", "/bin/sh"]
        if not self.network:
            argv += ["--network", "none"]
        if lim.cpus is not None:
            if not lim.cpus > 0:
                raise ValueError(f"Limits.cpus must be positive, got {lim.cpus}")
            argv += ["--cpus", f"{lim.cpus:g}"]
        return argv + [self.image_id, "-c", f"read _ < {PRIVATE}/keep"]

    def _start(self) -> None:
        proc = self.engine.run(*self._run_argv(), check=False, timeout_s=120)
        self._container = True  # even a failed `run` may leave a created container: close() removes it
        if proc.returncode != 0:
            raise EngineError(f"{self.engine.name} could not start a container of {self.image_id}: "
                              f"{_tail(proc.stderr or proc.stdout)}")

    def _restart(self) -> None:
        """Kills every process in the container and starts it again (files are kept)."""
        self.engine.run("kill", self.name, check=False, timeout_s=60)
        for _ in range(50):  # `kill` returns before the container is down on some engines
            state = self.engine.run("inspect", "--format", "{{.State.Running}}", self.name, check=False,
                                    timeout_s=60).stdout.strip()
            if state != b"true":
                break
            time.sleep(0.05)
        self.engine.run("start", self.name, timeout_s=120)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def mode(self) -> str:
        return self._mode

    # ---------------------------------------------------------------------------------------- commands
    def exec(self, command: str, *, timeout_s: float | None = None, cwd: str = ".",
             env: dict[str, str] | None = None, stdin: str | None = None) -> ExecResult:
        self._check_open()
        rel = normalize(cwd)
        if not self._ws.resolve(rel).is_dir():
            raise SandboxError(f"cwd {cwd!r} is not a directory in the workspace")
        argv = [self.engine.binary, "exec", "-w", f"{self.workdir}/{rel}" if rel != "." else self.workdir]
        if stdin is not None:
            argv.append("-i")
        for key, value in {**self._env, **(env or {})}.items():
            argv += ["-e", f"{key}={value}"]
        argv += [self.name, "/bin/sh", "-c", command]
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            res = run_captured(argv, limits=self.limits, timeout_s=timeout, env=_client_env(), stdin=stdin)
            if res.exit_code < 0 or res.timed_out:
                # we killed the client (timeout, output flood): the command may still run in the container
                self._restart()
            elif res.exit_code in (125, 126, 127) and _not_running(res.stderr):
                self._restart()  # the container's main process died (e.g. killed by the OOM killer): once more
                res = run_captured(argv, limits=self.limits, timeout_s=timeout, env=_client_env(), stdin=stdin)
        return res

    def upload_dir(self, source: str | os.PathLike, target: str) -> Path:
        self._check_open()
        inside = _check_target(target, "upload target")
        if inside in self._uploads:
            raise SandboxError(f"{inside} is already mounted in this sandbox")
        if inside == self.workdir or inside.startswith(self.workdir + "/") or self.workdir.startswith(inside + "/"):
            raise SandboxError(f"upload target {inside} overlaps the workspace at {self.workdir}")
        index = str(len(self._uploads))
        host = self._dir / "private" / "uploads" / index
        shutil.copytree(source, host, symlinks=True)
        host.chmod(0o777)  # whatever user a command runs as writes there (Harbor's /logs)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            parts = inside.strip("/").split("/")
            for i in range(1, len(parts)):  # parents, created when missing
                info = tarfile.TarInfo("/".join(parts[:i]))
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            link = tarfile.TarInfo("/".join(parts))
            link.type, link.linkname = tarfile.SYMTYPE, f"{PRIVATE}/uploads/{index}"
            tar.addfile(link)
        check = self.engine.run("exec", self.name, "/bin/sh", "-c", '[ -e "$1" ] || [ -L "$1" ]', "sh", inside,
                                check=False, timeout_s=60)
        if check.returncode == 0:
            shutil.rmtree(host, ignore_errors=True)
            raise SandboxError(f"upload target {inside} already exists in the image {self.image_id}; c2jax "
                               "uploads only to paths the image does not have")
        proc = self.engine.run("cp", "-", f"{self.name}:/", input=buf.getvalue(), check=False, timeout_s=120)
        if proc.returncode != 0:
            shutil.rmtree(host, ignore_errors=True)
            raise SandboxError(f"could not place {inside} in the container: {_tail(proc.stderr or proc.stdout)}")
        self._uploads[inside] = host
        return host

    # ---------------------------------------------------------------------------------------- state
    def diff(self) -> str:
        self._check_open()
        return gitseal.diff(self._snapshot.git_dir, self._ws.root, self._snapshot.base_sha)

    def fork(self) -> EngineSandbox:
        """A new container of the same image with a copy of this workspace (and of the uploads); like a
        bwrap fork, it starts from the image, not from this container's changes outside the workspace."""
        self._check_open()
        child = EngineSandbox(self._snapshot, engine=self.engine, image=self.image_id, limits=self.limits,
                              state_dir=self._state_dir, mode=self._mode, workdir=self.workdir, env=self._env,
                              network=self.network, _fork_of=self)
        try:
            for inside, host in self._uploads.items():
                child.upload_dir(host, inside)
        except BaseException:
            child.close()
            raise
        return child

    def container_exists(self) -> bool:
        """Whether the engine still has this sandbox's container (False after close)."""
        return self.engine.run("inspect", "--format", "{{.Id}}", self.name, check=False,
                               timeout_s=60).returncode == 0

    def _teardown(self) -> None:
        if getattr(self, "_container", False):
            self.engine.run("rm", "-f", self.name, check=False, timeout_s=120)
            self._container = False
        if getattr(self, "_workspace", None) is not None:
            self._workspace.remove()
        shutil.rmtree(self._dir, ignore_errors=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._teardown()
        self._snapshot.release()

    def __repr__(self) -> str:
        return f"EngineSandbox({self.engine.name}, {self.name!r}, image={self.image_id!r}, workdir={self.workdir!r})"


def _check_target(path: str, what: str) -> str:
    norm = check_mount_point(path, what)
    if norm == PRIVATE or norm.startswith(PRIVATE + "/"):
        raise ValueError(f"{what} {path!r} is inside {PRIVATE}, the sandbox's own mounts")
    return norm


def _not_running(stderr: str) -> bool:
    s = stderr.lower()
    return "is not running" in s or "state improper" in s or "no such container" in s


def _client_env() -> dict[str, str]:
    """The engine client's environment: ours (DOCKER_HOST, XDG_RUNTIME_DIR... reach the engine), never the
    container's: nothing of it enters the container except what `-e` passes."""
    return dict(os.environ)


# -------------------------------------------------------------------------------------------------- factories
def open_image_sandbox(engine: Engine, repo, *, image_source: str | None = None, image_build: str | None = None,
                       build_network: bool = False, pool=None, **options) -> EngineSandbox:
    """A container-image task's sandbox on `engine`: `image_source` a saved image of the store, or
    `image_build` a Dockerfile built by c2jax (then imported). The workspace is seeded from what the image holds
    at the working directory (options' `workdir`, default /workspace), as on the bwrap path; the image's WORKDIR
    is not used here (task.toml / harbor_config already resolved it into `workdir`). With `pool` (an
    `envpool.EnvironmentPool`) the build and the workspace's base snapshot are made once per process."""
    from c2jax.rl.sandbox.envpool import open_over_snapshot
    from c2jax.rl.sandbox.oci import IMAGE_STORE_ENV, image_cache_dir

    workdir = options.get("workdir", WORKSPACE)
    if image_build is not None:
        from c2jax.rl.tasks.image_build import build_image

        store = os.environ.get(IMAGE_STORE_ENV)
        built = (pool.built_image(image_build, store=store, cache_dir=image_cache_dir(), network=build_network)
                 if pool is not None else
                 build_image(image_build, store=store, cache_dir=image_cache_dir(), network=build_network))
        image_id = import_built_image(engine, built)
        seed = built.rootfs / workdir.lstrip("/")
        if not seed.is_dir() or seed.is_symlink():
            seed = image_tree(engine, image_id, workdir, image_cache_dir())
    elif image_source is not None:
        image_id = ensure_image(engine, image_source)
        seed = image_tree(engine, image_id, workdir, image_cache_dir())
    else:
        raise ValueError("open_image_sandbox needs image_source or image_build")
    del repo  # an image task's repository is what its image holds
    # the seed is a tree of the content-addressed image cache (the built rootfs, or image_tree's copy)
    return open_over_snapshot(EngineSandbox, pool, seed, immutable=True, engine=engine, image=image_id, **options)


def engine_for_kind(kind: str) -> Engine | None:
    """The engine a sandbox kind runs container-image tasks with: "docker" / "podman" that engine (EngineError
    with the reason when it does not run), "auto" the first that runs or None (then bwrap's OCI path)."""
    if kind in ENGINES:
        return find_engine(kind)
    if kind == "auto":
        return detect_engine()[0]
    raise ValueError(f"sandbox kind {kind!r} does not use a container engine")


__all__ = ["ENGINES", "Engine", "EngineError", "EngineSandbox", "detect_engine", "engine_for_kind",
           "engine_unusable_reason", "ensure_image", "find_engine", "image_tree", "load_saved_image",
           "open_image_sandbox"]
