"""The Docker / Podman sandbox backend (c2jax.rl.sandbox.engine): engine detection and its reasons (no engine
needed), and, where an engine runs, the Sandbox contract in a fresh container per sandbox: exec with env, cwd,
timeout and output caps, no network unless allowed, memory and process caps, file methods, diff and fork,
upload_dir, removal on close, and a Harbor `docker_image` task run end to end (oracle 1, nop 0). The engine
tests skip with the detection's reason where no engine runs (CI installs none)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_oci import LAYER1, LAYER2, _host_tools_layer, make_layout

from c2jax.rl.sandbox import engine as eng
from c2jax.rl.sandbox.base import Limits, SandboxError
from c2jax.rl.sandbox.engine import Engine, EngineError, EngineSandbox

TOOLS = ["sh", "bash", "env", "chmod", "tee", "cp", "cat", "sleep", "mkdir", "ls"]


# ------------------------------------------------------------------------------------------- no engine needed
def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_reason_when_the_client_is_missing(tmp_path, monkeypatch):
    missing = str(tmp_path / "no-such" / "docker")
    why = eng.engine_unusable_reason("docker", missing)
    assert why.startswith("docker: no client at") and missing in why and "C2JAX_DOCKER" in why
    monkeypatch.setenv("C2JAX_PODMAN", str(tmp_path / "nowhere" / "podman"))
    monkeypatch.setenv("C2JAX_DOCKER", missing)
    found, reasons = eng.detect_engine()
    assert found is None and "docker: no client" in reasons and "podman: no client" in reasons
    assert eng.engine_for_kind("auto") is None  # auto falls back to bwrap's OCI path
    with pytest.raises(EngineError, match="docker: no client"):
        eng.engine_for_kind("docker")


def test_reason_when_the_daemon_does_not_answer(tmp_path):
    down = _script(tmp_path, "docker-down", 'echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock.'
                                             ' Is the docker daemon running?" >&2\nexit 1\n')
    why = eng.engine_unusable_reason("docker", down)
    assert "info` failed (exit 1)" in why and "Cannot connect to the Docker daemon" in why
    hung = _script(tmp_path, "podman-hung", "exec sleep 5\n")
    t0 = time.perf_counter()
    why = eng.engine_unusable_reason("podman", hung, timeout_s=0.5)
    assert "did not answer within 0.5s" in why and time.perf_counter() - t0 < 4
    up = _script(tmp_path, "docker-up", 'echo 27.1.0\n')
    assert eng.engine_unusable_reason("docker", up) is None
    noexec = tmp_path / "docker-noexec"
    noexec.write_text("")
    assert "not executable" in eng.engine_unusable_reason("docker", str(noexec))
    with pytest.raises(ValueError, match="must be one of"):
        eng.engine_unusable_reason("lxc", up)


def test_factory_kinds_and_bad_input_are_named():
    from c2jax.rl.tasks.build import BackendFactory

    for kind in ("docker", "podman", "auto"):
        BackendFactory(kind)
    with pytest.raises(ValueError, match="sandbox must be one of bwrap, local, docker, podman, auto, got 'dockr'"):
        BackendFactory("dockr")
    fake = Engine("docker", "/nonexistent/docker")
    with pytest.raises(ValueError, match="workdir '/usr/app' would cover or sit inside"):
        EngineSandbox("/nonexistent", engine=fake, image="x", workdir="/usr/app")
    with pytest.raises(ValueError, match="inside /.c2jax"):
        EngineSandbox("/nonexistent", engine=fake, image="x", workdir="/.c2jax/w")
    with pytest.raises(TypeError, match="network must be True or False"):
        EngineSandbox("/nonexistent", engine=fake, image="x", network="yes")
    with pytest.raises(TypeError, match="engine must be an Engine"):
        EngineSandbox("/nonexistent", engine="docker", image="x")
    with pytest.raises(ValueError, match="invalid environment variable name 'A=B'"):
        EngineSandbox("/nonexistent", engine=fake, image="x", env={"A=B": "1"})


def test_loaded_image_names_are_parsed():
    assert eng._loaded_name(b"Getting image source signatures\nLoaded image: localhost/demo:latest\n") == \
        "localhost/demo:latest"
    assert eng._loaded_name(b"Loaded image ID: sha256:abc\n") == "sha256:abc"
    assert eng._loaded_name(b"Loaded image(s): localhost/a:1,localhost/b:2\n") == "localhost/a:1"
    assert eng._loaded_name(b"nothing here\n") is None


# ------------------------------------------------------------------------------------------- with an engine
@pytest.fixture(scope="module")
def engine():
    found, why = eng.detect_engine()
    if found is None:
        pytest.skip(f"no container engine runs here: {why}")
    return found


def _dedupe(entries):
    seen, out = set(), []
    for entry in entries:  # the engines refuse a layer naming one path twice
        if entry[0] not in seen:
            seen.add(entry[0])
            out.append(entry)
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    make_layout(root / "example_hello_1", layers=[_dedupe(_host_tools_layer(TOOLS) + LAYER1), LAYER2])
    return root


@pytest.fixture(scope="module")
def image(engine, store):
    from c2jax.rl.sandbox.oci import read_image_config

    yield eng.ensure_image(engine, store / "example_hello_1")
    digest = read_image_config(store / "example_hello_1")[0]
    engine.run("rmi", f"c2jax/store:{digest.split(':')[1]}", check=False)  # untag: the layers stay cached


@pytest.fixture
def box(engine, image, tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "mod.py").write_text("x = 1\n")
    made = []

    def make(**kw):
        kw.setdefault("workdir", "/app")
        sb = EngineSandbox(repo, engine=engine, image=image, state_dir=tmp_path, **kw)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.close()


def test_image_loads_once_and_missing_images_are_named(engine, store, image, monkeypatch, tmp_path):
    assert eng.ensure_image(engine, store / "example_hello_1") == image  # tagged c2jax/store:<digest>
    # a workspace seed: what the image holds at a path (one entry, a whole tree, or nothing)
    assert [p.name for p in eng.image_tree(engine, image, "/app/keep", tmp_path).iterdir()] == ["a.txt"]
    app = eng.image_tree(engine, image, "/app", tmp_path)
    assert sorted(p.name for p in app.iterdir()) == ["hard", "keep", "link", "new.txt"]
    assert (app / "link").readlink() == Path("new.txt") and (app / "hard").read_text() == "new"
    assert not list(eng.image_tree(engine, image, "/no/such/dir", tmp_path).iterdir())
    monkeypatch.setenv("C2JAX_IMAGE_STORE", str(store))
    assert eng.ensure_image(engine, "example/hello:1") == image  # a reference found in the store
    with pytest.raises(EngineError, match=f"image 'example/not-there:2': {engine.name} does not have it and it is "
                                          "not in the image store"):
        eng.ensure_image(engine, "example/not-there:2")
    monkeypatch.delenv("C2JAX_IMAGE_STORE")
    with pytest.raises(EngineError, match=r"no image store \(\$C2JAX_IMAGE_STORE is not set\)"):
        EngineSandbox(store, engine=engine, image="example/not-there:2")


def test_exec_env_cwd_stdin_timeout_and_output_cap(box):
    sb = box(env={"GREETING": "from the task", "ONLY_SANDBOX": "s"}, limits=Limits(output_bytes=2000))
    res = sb.exec('echo "$GREETING|$ONLY_SANDBOX|$EXTRA|$(pwd)"; cat mod.py; read line < /etc/greeting; '
                  'echo "$line"; echo err >&2; exit 3', cwd="pkg", env={"EXTRA": "e", "ONLY_SANDBOX": "cmd"})
    assert res.exit_code == 3 and res.stderr == "err\n" and not res.timed_out
    assert res.stdout == "from the task|cmd|e|/app/pkg\nx = 1\nhello from the image\n"
    assert sb.exec("cat", stdin="piped in\n").stdout == "piped in\n"
    flood = sb.exec("i=0; while [ $i -lt 3000 ]; do echo line$i; i=$((i+1)); done")
    assert flood.truncated and "bytes of output omitted" in flood.stdout and flood.stdout.endswith("line2999\n")

    sb.exec("echo kept > /opq/root-change")  # the container's own layer
    t0 = time.perf_counter()
    res = sb.exec("echo started; sleep 30 & sleep 30", timeout_s=1.0)
    assert res.timed_out and res.exit_code == 124 and time.perf_counter() - t0 < 10
    # the container was restarted: no process of the command is left, the files are
    after = sb.exec("for p in /proc/[0-9]*; do read c < $p/comm 2>/dev/null && echo $c; done; cat /opq/root-change")
    assert "sleep" not in after.stdout.split() and after.stdout.endswith("kept\n"), after
    with pytest.raises(SandboxError, match="not a directory"):
        sb.exec("true", cwd="pkg/mod.py")


def test_no_network_unless_allowed(box):
    dev = "while read line; do echo \"$line\"; done < /proc/net/dev"
    ifaces = {line.split(":")[0].strip() for line in box().exec(dev).stdout.splitlines()[2:]}
    assert ifaces == {"lo"}
    ifaces = {line.split(":")[0].strip() for line in box(network=True).exec(dev).stdout.splitlines()[2:]}
    assert ifaces - {"lo"}, ifaces  # the engine's default network: an interface besides lo


def test_memory_and_process_caps(box):
    sb = box(limits=Limits(memory_bytes=64 * 1024**2, max_processes=16, timeout_s=20))
    hog = sb.exec('a=$(printf "%0200000000d" 0) || exit $?; echo ${#a}', timeout_s=20)  # 200 MB in one string
    assert hog.exit_code == 137 and "200000000" not in hog.stdout, hog  # the OOM killer
    assert sb.exec("echo alive").stdout == "alive\n"  # the container survives (or is restarted)
    forks = sb.exec('i=0; while [ $i -lt 40 ]; do sleep 5 & i=$((i+1)); done; echo forked $i', timeout_s=20)
    assert "forked 40" not in forks.stdout and "fork" in forks.stderr.lower(), forks


def test_files_diff_and_fork(box):
    sb = box()
    sb.write_text("pkg/new.py", "y = 2\n")
    assert sb.exec("cat pkg/new.py; echo 'x = 10' > pkg/mod.py; mkdir -p out; echo o > out/f").exit_code == 0
    assert sb.read_text("pkg/mod.py") == "x = 10\n" and sb.list_dir("out") == ["f"] and sb.is_dir("pkg")
    patch = sb.diff()
    assert "+x = 10" in patch and "pkg/new.py" in patch and "out/f" in patch
    sb.exec("echo only-parent > /opq/root-change")
    child = sb.fork()
    assert child.read_text("pkg/mod.py") == "x = 10\n" and child.name != sb.name
    res = child.exec("cat pkg/new.py; [ -e /opq/root-change ] || echo clean-root; echo child > pkg/mod.py")
    assert res.stdout == "y = 2\nclean-root\n", res
    assert sb.read_text("pkg/mod.py") == "x = 10\n"  # independent
    sb.remove("pkg/new.py")
    assert sb.exec("[ -e pkg/new.py ] || echo gone").stdout == "gone\n"
    child.close()


def test_upload_dir_is_shared_with_the_host(box, tmp_path):
    src = tmp_path / "solution"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "solve.sh").write_text("echo solved\n")
    sb = box()
    sb.exec("echo before-upload")  # uploads work after the container started too
    host = sb.upload_dir(src, "/solution")
    logs = sb.upload_dir(tmp_path / "solution", "/logs/run")
    res = sb.exec("sh /solution/sub/solve.sh; echo reward > /logs/run/out.txt; echo 1 > /solution/new")
    assert res.stdout == "solved\n", res
    assert (logs / "out.txt").read_text() == "reward\n" and (host / "new").read_text() == "1\n"
    assert not (src / "new").exists()  # a copy
    with pytest.raises(SandboxError, match="already mounted"):
        sb.upload_dir(src, "/solution")
    with pytest.raises(SandboxError, match="overlaps the workspace"):
        sb.upload_dir(src, "/app/x")
    with pytest.raises(SandboxError, match="/opq already exists in the image"):
        sb.upload_dir(src, "/opq")
    child = sb.fork()  # a fork gets its own copies
    assert child.exec("cat /logs/run/out.txt").stdout == "reward\n"
    child.exec("echo child > /logs/run/out.txt")
    assert (logs / "out.txt").read_text() == "reward\n"
    child.close()


def test_fresh_container_per_sandbox_removed_on_close(box, tmp_path):
    first = box()
    first.exec("echo leaked > /opq/mark; echo ws > left.txt")
    second = box()
    assert second.name != first.name
    assert second.exec("[ -e /opq/mark ] || echo fresh; [ -e left.txt ] || echo clean").stdout == "fresh\nclean\n"
    assert first.container_exists()
    first.close()
    assert not first.container_exists() and not first._dir.exists()
    first.close()  # idempotent
    with pytest.raises(SandboxError, match="closed"):
        first.exec("true")


def test_harbor_task_with_a_docker_image_through_the_engine(engine, store, tmp_path, monkeypatch):
    """A Harbor task naming `docker_image` runs in containers of the engine when the factory asks for it
    (sandbox: docker / podman, or auto where an engine runs): the oracle resolves it, nop scores 0."""
    from test_oci import _oracle_resolves_and_nop_scores_zero

    from c2jax.rl.tasks import build
    from c2jax.rl.tasks.task import load_task

    task_dir = tmp_path / "tasks" / "image-task"
    for d in ("tests", "solution", "environment"):
        (task_dir / d).mkdir(parents=True)
    (task_dir / "environment" / "Dockerfile").write_text("FROM example/hello:1\nRUN make\n")  # never built
    (task_dir / "task.toml").write_text('schema_version = "1.1"\n[environment]\ndocker_image = "example/hello:1"\n'
                                        "[verifier]\ntimeout_sec = 60.0\n")
    (task_dir / "instruction.md").write_text("Write done to result.txt.\n")
    (task_dir / "solution" / "solve.sh").write_text("echo done > result.txt\n")
    (task_dir / "tests" / "test.sh").write_text(
        '#!/bin/bash\nif [ "$(cat result.txt)" = done ] && [ "$(cat /etc/greeting)" = "hello from the image" ] '
        '&& [ "$PWD" = /app ] && [ -f keep/a.txt ] && [ "$(hostname 2>/dev/null || cat /etc/hostname)" = sandbox ]; '
        'then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n')
    monkeypatch.setenv("C2JAX_IMAGE_STORE", str(store))
    monkeypatch.setenv("C2JAX_IMAGE_CACHE", str(tmp_path / "cache"))
    task = load_task(task_dir)
    assert task.unsupported_reason is None and task.environment.workdir == "/app"

    opened = []
    real = eng.open_image_sandbox
    monkeypatch.setattr(eng, "open_image_sandbox", lambda *a, **k: opened.append(real(*a, **k)) or opened[-1])
    real_factory = build.sandbox_factory
    monkeypatch.setattr(build, "sandbox_factory", lambda kind, **k: real_factory(engine.name, **k))
    _oracle_resolves_and_nop_scores_zero(task)
    assert len(opened) >= 3 and all(isinstance(s, EngineSandbox) and s.closed for s in opened)
    assert not any(s.container_exists() for s in opened)

    auto = real_factory("auto")(task.repo_dir, **task.environment.sandbox_options("agent"))
    with auto:
        assert isinstance(auto, EngineSandbox) and auto.list_dir("keep") == ["a.txt"]
    monkeypatch.setenv(eng.BINARY_ENV[engine.name], str(tmp_path / "gone" / engine.name))
    with pytest.raises(EngineError, match=f"{engine.name}: no client"):
        real_factory(engine.name)(task.repo_dir, **task.environment.sandbox_options("agent"))

