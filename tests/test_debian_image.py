"""Container-image tasks on a real distribution, without any registry or container engine: a Debian root
filesystem made from the Debian archive by mmdebstrap (c2jax.rl.sandbox.debian), saved as an OCI layout in an
image store; a Harbor task whose Dockerfile builds on it with apt and pip, and a SWE-bench instance whose
environment is a container image, each run end to end under bubblewrap (and the instance under Docker / Podman
where one runs) by the oracle (reward 1) and the no-op
agent (reward 0).

These need mmdebstrap and the Debian archive (deb.debian.org): they skip, saying which is missing, where either
is absent (the CI machines have no mmdebstrap). ~80 s here.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import tarfile
from pathlib import Path

import pytest

from c2jax.rl.sandbox.bwrap import bwrap_unusable_reason
from c2jax.rl.sandbox.debian import (
    SANDBOX_APT_OPTION,
    build_debian_base,
    mmdebstrap_unusable_reason,
    write_layout,
)
from c2jax.rl.sandbox.oci import ImageError, find_in_store, load_image, read_image_config, store_name

MIRROR_HOST = "deb.debian.org"


def _unusable_reason() -> str | None:
    reason = bwrap_unusable_reason() or mmdebstrap_unusable_reason()
    if reason:
        return reason
    try:
        socket.create_connection((MIRROR_HOST, 80), timeout=5).close()
    except OSError as e:
        return f"the Debian archive ({MIRROR_HOST}) is not reachable: {e}"
    return None


REASON = _unusable_reason()
needs_debian = pytest.mark.skipif(REASON is not None, reason=str(REASON))


@pytest.fixture(scope="module")
def debian_store(tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    ref, path, seconds = build_debian_base(store)
    assert ref == "c2jax/debian:bookworm" and path == store / "c2jax_debian_bookworm" and seconds > 0
    return store


@needs_debian
def test_debian_base_is_a_saved_image_with_apt_set_up_for_the_sandbox(debian_store, tmp_path):
    path = find_in_store("c2jax/debian:bookworm", debian_store)
    assert path is not None
    digest, config = read_image_config(path)
    assert config.env["PATH"].startswith("/usr/local/sbin") and config.cmd == ("bash",)
    image = load_image(path, tmp_path / "cache")
    assert image.digest == digest and len(image.layers) == 1
    assert (image.rootfs / "etc" / "debian_version").read_text().startswith("12.")
    assert (image.rootfs / "usr" / "bin" / "apt-get").is_file()
    apt_conf = "".join(p.read_text() for p in (image.rootfs / "etc" / "apt" / "apt.conf.d").iterdir() if p.is_file())
    assert SANDBOX_APT_OPTION in apt_conf
    # a second build is a lookup, and a layout is never written over an existing path
    assert build_debian_base(debian_store)[2] == 0.0
    with pytest.raises(ImageError, match="already exists"):
        write_layout(tmp_path / "missing.tar", path)


def _evaluate(task, mode: str, sandbox: str = "bwrap"):
    from c2jax.rl.eval import EvalConfig, evaluate
    from c2jax.rl.eval.agents import scripted_factory
    from c2jax.rl.tasks.build import sandbox_factory

    # the network is allowed so that builds reach the Debian archive; the tasks themselves run offline
    res = evaluate([task], scripted_factory(mode), 1, config=EvalConfig(sandbox=sandbox, concurrency=1,
                                                                        allow_network=True),
                   sandbox_factory=sandbox_factory(sandbox, allow_network=True), progress=False)
    (r,) = res.results
    return r.status, r.reward, r.error


DOCKERFILE = """FROM c2jax/debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-setuptools \\
    && rm -rf /var/lib/apt/lists/*
COPY greet /opt/greet
RUN pip install --break-system-packages --no-build-isolation --no-index /opt/greet
WORKDIR /app
COPY app/ ./
"""


@needs_debian
def test_harbor_task_whose_dockerfile_apt_and_pip_installs_on_the_debian_base(debian_store, tmp_path, monkeypatch):
    """apt installs Python from the Debian archive, pip installs a package from the build context, COPY and
    WORKDIR lay out the app: the oracle's fix resolves the task (its tests import the pip-installed package
    with the apt-installed interpreter), the no-op agent scores 0."""
    from c2jax.rl.tasks.task import load_task

    task = tmp_path / "tasks" / "greet-task"
    env = task / "environment"
    for d in ("tests", "solution", "environment/greet/greet", "environment/app"):
        (task / d).mkdir(parents=True)
    (env / "Dockerfile").write_text(DOCKERFILE)
    (env / "greet" / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\n'
                                                  'build-backend = "setuptools.build_meta"\n'
                                                  '[project]\nname = "greet"\nversion = "0.1"\n')
    (env / "greet" / "greet" / "__init__.py").write_text("def hello(name):\n    return f'hello, {name}'\n")
    (env / "app" / "main.py").write_text("from greet import hello\n\n\ndef main():\n    return hello('world')\n")
    (task / "task.toml").write_text('schema_version = "1.1"\n[environment]\nallow_internet = false\n'
                                    "[verifier]\ntimeout_sec = 120.0\n")
    (task / "instruction.md").write_text("Make main() shout: return its greeting in upper case.\n")
    (task / "solution" / "solve.sh").write_text(
        "sed -i \"s/return hello('world')/return hello('world').upper()/\" main.py\n")
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\n"
        'out=$(python3 -c "import main; print(main.main())")\n'
        'if [ "$out" = "HELLO, WORLD" ] && [ "$PWD" = /app ] && dpkg -s python3-pip >/dev/null '
        '&& pip show greet >/dev/null; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n')

    monkeypatch.setenv("C2JAX_IMAGE_STORE", str(debian_store))
    monkeypatch.setenv("C2JAX_IMAGE_CACHE", str(tmp_path / "cache"))
    loaded = load_task(task)
    assert loaded.unsupported_reason is None and loaded.environment.workdir == "/app"
    assert _evaluate(loaded, "oracle")[:2] == ("resolved", 1.0)
    assert _evaluate(loaded, "nop")[:2] == ("unresolved", 0.0)
    assert len(list((tmp_path / "cache").glob("built-*"))) == 1  # built once, by content


INSTANCE_DOCKERFILE = """FROM c2jax/debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pytest \\
    && rm -rf /var/lib/apt/lists/*
COPY repo /testbed
WORKDIR /testbed
"""
CALC = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a + b\n"
GOLD = """--- a/calc.py
+++ b/calc.py
@@ -3,4 +3,4 @@ def add(a, b):
 
 
 def mul(a, b):
-    return a + b
+    return a * b
"""
TEST_PATCH = """--- /dev/null
+++ b/tests/test_calc.py
@@ -0,0 +1,9 @@
+from calc import add, mul
+
+
+def test_add():
+    assert add(2, 3) == 5
+
+
+def test_mul():
+    assert mul(2, 3) == 6
"""


def _save_built_image(built, store: Path, reference: str, work: Path) -> Path:
    """A built image's root filesystem saved in the store as `reference` (what `docker save` of the instance
    image gives a user), with its config."""
    tar = work / "rootfs.tar"
    subprocess.run(["tar", "-C", str(built.rootfs), "--numeric-owner", "-cf", str(tar), "."], check=True)
    return write_layout(tar, store / store_name(reference), reference=reference, env=built.config.env,
                        workdir=built.config.workdir)


def _engine_reason() -> str | None:
    from c2jax.rl.sandbox.engine import detect_engine

    engine, why = detect_engine()
    return None if engine is not None else why


@needs_debian
@pytest.mark.parametrize("sandbox", ["bwrap", pytest.param("auto", marks=pytest.mark.skipif(
    _engine_reason() is not None, reason=f"no container engine runs here: {_engine_reason()}"))])
def test_swebench_instance_runs_in_its_container_image(debian_store, tmp_path, monkeypatch, sandbox):
    """A SWE-bench instance without a checked-out repository: its image (named as the SWE-bench harness names
    them) holds the repository at /testbed and the interpreter; the suite loads it from the image store, the
    gold patch resolves it (FAIL_TO_PASS fixed, PASS_TO_PASS kept, tests from the instance's test_patch run by
    the image's pytest), the no-op agent does not."""
    from c2jax.rl.eval.suite import SuiteError, load_suite, task_sha256
    from c2jax.rl.tasks.image_build import build_image
    from c2jax.rl.tasks.swebench import image_reference

    ctx = tmp_path / "ctx"
    (ctx / "repo").mkdir(parents=True)
    (ctx / "repo" / "calc.py").write_text(CALC)
    (ctx / "Dockerfile").write_text(INSTANCE_DOCKERFILE)
    built = build_image(ctx / "Dockerfile", store=debian_store, cache_dir=tmp_path / "cache", network=True)
    instance = {"instance_id": "demo__calc-1", "repo": "demo/calc", "base_commit": "0" * 40,
                "problem_statement": "mul(2, 3) returns 5; it should multiply.", "patch": GOLD,
                "test_patch": TEST_PATCH, "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_mul"]),
                "PASS_TO_PASS": ["tests/test_calc.py::test_add"], "python": "/usr/bin/python3"}
    ref = image_reference(instance)
    assert ref == "swebench/sweb.eval.x86_64.demo_1776_calc-1:latest"
    (tmp_path / "inst.jsonl").write_text(json.dumps(instance) + "\n")
    store = tmp_path / "instance-store"
    store.mkdir()
    with pytest.raises(SuiteError, match="sweb.eval.x86_64.demo_1776_calc-1"):
        load_suite(str(tmp_path / "inst.jsonl"), image_store=str(store))
    _save_built_image(built, store, ref, tmp_path)
    monkeypatch.setenv("C2JAX_IMAGE_CACHE", str(tmp_path / "cache"))
    (task,) = load_suite(str(tmp_path / "inst.jsonl"), image_store=str(store))
    assert task.environment.workdir == "/testbed" and task.metadata["python"] == "/usr/bin/python3"
    assert task.lines_changed == 2 and task.files_changed == 1
    assert len(task_sha256(task)) == 64
    # the fingerprint pins the image: the same instance on another image hashes differently
    other = dataclasses.replace(task, environment=dataclasses.replace(
        task.environment, image=str(find_in_store("c2jax/debian:bookworm", debian_store))))
    assert task_sha256(other) != task_sha256(task)
    status, reward, error = _evaluate(task, "oracle", sandbox)
    assert (status, reward) == ("resolved", 1.0), error
    assert _evaluate(task, "nop", sandbox)[:2] == ("unresolved", 0.0)


def test_layouts_written_from_a_tar_unpack_to_that_tar(tmp_path):
    """write_layout is what turns mmdebstrap's archive into an image: the layer is the archive byte for byte."""
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "motd").write_text("hi\n")
    with tarfile.open(tmp_path / "root.tar", "w") as tar:
        tar.add(src / "etc", arcname="etc")
    layout = write_layout(tmp_path / "root.tar", tmp_path / "layout", reference="x/y:1", env={"A": "b"},
                          workdir="/etc")
    image = load_image(layout, tmp_path / "cache")
    assert (image.rootfs / "etc" / "motd").read_text() == "hi\n"
    assert image.config.env["A"] == "b" and image.config.workdir == "/etc"
    index = json.loads((layout / "index.json").read_text())
    assert index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"] == "x/y:1"


@needs_debian
def test_images_debian_command_keeps_an_image_already_in_the_store(debian_store, capsys):
    from c2jax.cli import main

    assert main(["images", "debian", "--store", str(debian_store)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("c2jax/debian:bookworm: sha256:") and "(already in the store)" in out
