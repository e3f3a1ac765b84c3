"""OCI images without a container engine (c2jax.rl.sandbox.oci): layouts, tar archives and `docker save`
archives unpacked once per digest with the OCI spec's whiteouts, every blob checked against its digest, unsafe
members refused; commands run as root of a user namespace in a fresh copy-on-write container."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from c2jax.rl.sandbox import oci
from c2jax.rl.sandbox.container import ImageContainer
from c2jax.rl.sandbox.oci import ImageError, load_image

MT = "application/vnd.oci.image."


def _tar(entries) -> bytes:
    """entries: (name, kind, payload) with kind file/dir/symlink/hardlink."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, payload in entries:
            info = tarfile.TarInfo(name)
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, payload
                tar.addfile(info)
            elif kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, payload
                tar.addfile(info)
            else:
                data = payload if isinstance(payload, bytes) else payload.encode()
                info.size, info.mode = len(data), 0o755 if name.startswith(("bin/", "lib")) else 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _shell_files() -> list:
    """/bin/sh and the libraries it loads, copied from this host (enough to run shell builtins)."""
    sh = Path(os.path.realpath("/bin/sh"))
    out = subprocess.run(["ldd", str(sh)], capture_output=True, text=True).stdout
    libs = [p for line in out.splitlines() for p in line.split() if p.startswith("/")]
    entries = [("bin", "dir", None), ("bin/sh", "file", sh.read_bytes())]
    for lib in libs:
        real = Path(os.path.realpath(lib))
        rel = lib.lstrip("/")
        parts = Path(rel).parts
        for i in range(1, len(parts)):
            entries.append(("/".join(parts[:i]), "dir", None))
        entries.append((rel, "file", real.read_bytes()))
    return entries


LAYER1 = [("etc", "dir", None), ("etc/greeting", "file", "hello from the image\n"), ("app", "dir", None),
          ("app/old.txt", "file", "old"), ("app/keep", "dir", None), ("app/keep/a.txt", "file", "a"),
          ("opq", "dir", None), ("opq/x.txt", "file", "x"), ("opq/sub", "dir", None), ("opq/sub/z", "file", "z")]
LAYER2 = [("app/.wh.old.txt", "file", ""), ("opq/.wh..wh..opq", "file", ""), ("opq/y.txt", "file", "y"),
          ("app/new.txt", "file", "new"), ("app/link", "symlink", "new.txt"), ("app/hard", "hardlink", "app/new.txt")]
CONFIG = {"architecture": "amd64", "os": "linux",
          "config": {"Env": ["GREETING=hi there", "PATH=/bin"], "WorkingDir": "/app", "Cmd": ["sh"]},
          "rootfs": {"type": "layers", "diff_ids": []}}


def _blob(root: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / "sha256" / digest).write_bytes(data)
    return "sha256:" + digest


def make_layout(root: Path, layers=None, *, platforms=None, config=None) -> Path:
    layers = layers if layers is not None else [_shell_files() + LAYER1, LAYER2]
    root.mkdir(parents=True)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    tars = [_tar(entries) for entries in layers]
    cfg = json.loads(json.dumps(config or CONFIG))
    cfg["rootfs"]["diff_ids"] = ["sha256:" + hashlib.sha256(t).hexdigest() for t in tars]
    layer_descs = []
    for i, t in enumerate(tars):  # the first layer uncompressed, the others gzip, as real images mix them
        data = t if i == 0 else gzip.compress(t)
        layer_descs.append({"mediaType": MT + "layer.v1.tar" + ("" if i == 0 else "+gzip"), "digest": _blob(root, data),
                            "size": len(data)})
    cfg_bytes = json.dumps(cfg).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": MT + "manifest.v1+json",
                           "config": {"mediaType": MT + "config.v1+json", "digest": _blob(root, cfg_bytes),
                                      "size": len(cfg_bytes)}, "layers": layer_descs}).encode()
    mdigest = _blob(root, manifest)
    descs = [{"mediaType": MT + "manifest.v1+json", "digest": mdigest, "size": len(manifest),
              "platform": {"os": os_, "architecture": arch}} for os_, arch in (platforms or [("linux", "amd64")])]
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": descs}))
    return root


def make_docker_save(path: Path, layers=None) -> Path:
    layers = layers if layers is not None else [_shell_files() + LAYER1, LAYER2]
    tars = [_tar(entries) for entries in layers]
    cfg = json.loads(json.dumps(CONFIG))
    cfg["rootfs"]["diff_ids"] = ["sha256:" + hashlib.sha256(t).hexdigest() for t in tars]
    with tarfile.open(path, "w") as out:
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
        add("config.json", json.dumps(cfg).encode())
        for i, t in enumerate(tars):
            add(f"layer{i}/layer.tar", t)
        add("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": ["demo:latest"],
                                          "Layers": [f"layer{i}/layer.tar" for i in range(len(tars))]}]).encode())
    return path


def tree(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if rel.startswith(("bin", "lib", "usr")):
            continue
        out[rel] = ("-> " + os.readlink(p)) if p.is_symlink() else ("dir" if p.is_dir() else p.read_text())
    return out


EXPECTED = {"app": "dir", "app/hard": "new", "app/keep": "dir", "app/keep/a.txt": "a", "app/link": "-> new.txt",
            "app/new.txt": "new", "etc": "dir", "etc/greeting": "hello from the image\n", "opq": "dir",
            "opq/y.txt": "y"}


def test_layout_unpacks_with_whiteouts_and_opaque_dirs(tmp_path):
    image = load_image(make_layout(tmp_path / "img"), tmp_path / "cache")
    # .wh.old.txt deleted app/old.txt; the opaque marker hid opq/x.txt and opq/sub but not the new opq/y.txt
    assert tree(image.rootfs) == EXPECTED
    assert os.stat(image.rootfs / "app/hard").st_ino == os.stat(image.rootfs / "app/new.txt").st_ino
    assert image.config.env == {"GREETING": "hi there", "PATH": "/bin"} and image.config.workdir == "/app"
    assert image.config.cmd == ("sh",) and len(image.layers) == 2 and image.digest.startswith("sha256:")


def test_unpacked_once_per_digest(tmp_path, monkeypatch):
    layout = make_layout(tmp_path / "img")
    first = load_image(layout, tmp_path / "cache")
    monkeypatch.setattr(oci, "_apply_layer", lambda *a: pytest.fail("unpacked again"))
    again = load_image(layout, tmp_path / "cache")
    assert again == first and [p.name for p in (tmp_path / "cache").iterdir()] == [first.digest.replace(":", "-")]


def test_layout_tar_and_docker_save_give_the_same_tree(tmp_path):
    layout = make_layout(tmp_path / "img")
    archive = tmp_path / "img.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(layout, arcname=".")
    from_tar = load_image(archive, tmp_path / "cache")
    assert from_tar.digest == load_image(layout, tmp_path / "cache2").digest
    assert tree(from_tar.rootfs) == EXPECTED
    saved = load_image(make_docker_save(tmp_path / "saved.tar"), tmp_path / "cache3")
    assert tree(saved.rootfs) == EXPECTED and saved.config.workdir == "/app"


def test_platform_selection(tmp_path):
    image = load_image(make_layout(tmp_path / "multi", platforms=[("linux", "arm64"), ("linux", "amd64")]),
                       tmp_path / "cache")
    assert tree(image.rootfs) == EXPECTED
    with pytest.raises(ImageError, match="no linux/amd64 manifest.*linux/arm64.*windows/amd64"):
        load_image(make_layout(tmp_path / "arm", platforms=[("linux", "arm64"), ("windows", "amd64")]),
                   tmp_path / "cache")


def test_corrupt_blobs_and_bad_sources_are_named(tmp_path):
    layout = make_layout(tmp_path / "img")
    manifest = json.loads((layout / "blobs/sha256" / json.loads((layout / "index.json").read_text())
                           ["manifests"][0]["digest"].split(":")[1]).read_text())
    layer = layout / "blobs/sha256" / manifest["layers"][0]["digest"].split(":")[1]
    data = bytearray(layer.read_bytes())
    data[-2000] ^= 0xFF  # inside the tar's payload or padding: the tar may still parse, the digest cannot match
    layer.write_bytes(bytes(data))
    with pytest.raises(ImageError, match="does not match its digest"):
        load_image(layout, tmp_path / "cache")
    assert not any(p.name.endswith(tuple("0123456789abcdef")) for p in (tmp_path / "cache").iterdir())  # nothing cached
    with pytest.raises(ImageError, match="no such image"):
        load_image(tmp_path / "missing", tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageError, match="neither index.json"):
        load_image(tmp_path / "empty", tmp_path / "cache")


def test_zstd_layers_are_refused_with_the_reason(tmp_path):
    layout = make_layout(tmp_path / "img", layers=[LAYER1])
    index = json.loads((layout / "index.json").read_text())
    mpath = layout / "blobs/sha256" / index["manifests"][0]["digest"].split(":")[1]
    manifest = json.loads(mpath.read_text())
    manifest["layers"][0]["mediaType"] = MT + "layer.v1.tar+zstd"
    data = json.dumps(manifest).encode()
    index["manifests"][0]["digest"] = _blob(layout, data)
    (layout / "index.json").write_text(json.dumps(index))
    with pytest.raises(ImageError, match="zstd-compressed layers are not supported"):
        load_image(layout, tmp_path / "cache")


@pytest.mark.parametrize("layer, why", [
    ([("../escape", "file", "x")], "leaves the root filesystem"),
    ([("etc", "symlink", "/../../.."), ("etc/passwd", "file", "x")], "out of the root filesystem"),
    ([("up", "symlink", "../.."), ("up/x", "file", "x")], "out of the root filesystem"),
])
def test_members_leaving_the_root_are_refused(tmp_path, layer, why):
    with pytest.raises(ImageError, match=why):
        load_image(make_layout(tmp_path / "img", layers=[layer]), tmp_path / "cache")
    assert not (tmp_path / "escape").exists()


def _bwrap_ok() -> bool:
    from c2jax.rl.sandbox.bwrap import bwrap_unusable_reason

    return bwrap_unusable_reason() is None


@pytest.mark.skipif(not _bwrap_ok(), reason="bubblewrap cannot create namespaces here")
def test_container_runs_as_root_of_its_namespace_on_a_private_layer(tmp_path):
    image = load_image(make_layout(tmp_path / "img"), tmp_path / "cache")
    script = ('read line < /etc/greeting; echo "$line|$GREETING|$(pwd)"; '
              'while read k v rest; do [ "$k" = "Uid:" ] && echo "uid $v"; done < /proc/self/status; '
              'echo written > /app/w; echo more >> /etc/greeting')
    with ImageContainer(image, tmp_path / "state") as box:
        res = box.exec(script)
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines() == ["hello from the image|hi there|/app", "uid 0"]
        assert box.exec("read x < /app/w; echo $x").stdout == "written\n"
    with ImageContainer(image, tmp_path / "state", mode="copy") as fresh:  # a fresh container sees none of it
        res = fresh.exec("if [ -e /app/w ]; then echo leaked; fi; read line < /etc/greeting; echo $line")
        assert res.stdout == "hello from the image\n", res.stderr
    assert tree(image.rootfs) == EXPECTED  # the image's tree was never written
    assert not list((tmp_path / "state").iterdir())  # containers removed on close


@pytest.mark.skipif(not _bwrap_ok(), reason="bubblewrap cannot create namespaces here")
def test_container_has_no_network_unless_asked(tmp_path):
    image = load_image(make_layout(tmp_path / "img"), tmp_path / "cache")
    with ImageContainer(image, tmp_path / "state") as box:
        # only the loopback interface exists in a fresh network namespace
        res = box.exec("while read line; do echo \"$line\"; done < /proc/net/dev")
        ifaces = {line.split(":")[0].strip() for line in res.stdout.splitlines()[2:]}
        assert ifaces == {"lo"}, res.stdout
    with ImageContainer(image, tmp_path / "state", network=True) as box:
        res = box.exec("while read line; do echo \"$line\"; done < /proc/net/dev")
        assert len(res.stdout.splitlines()[2:]) >= 1
    shutil.rmtree(tmp_path / "cache")


@pytest.mark.skipif(not _bwrap_ok(), reason="bubblewrap cannot create namespaces here")
@pytest.mark.parametrize("mode", ["overlay", "copy"])
def test_bwrap_sandbox_on_an_image(tmp_path, mode):
    """The Sandbox contract over an image: the image's root (its /etc, Env, uid 0), the workspace at the
    image's working directory (seeded from the image's tree there), diffs of the workspace, and a root that
    no other sandbox sees."""
    from c2jax.rl.sandbox.bwrap import BwrapSandbox

    image = load_image(make_layout(tmp_path / "img"), tmp_path / "cache")
    state = tmp_path / "state"
    state.mkdir()
    box = BwrapSandbox(image.rootfs / "app", image=image, workdir=image.config.workdir, state_dir=state, mode=mode)
    try:
        res = box.exec('read g < /etc/greeting; read n < new.txt; echo "$g|$n|$GREETING|$(pwd)"; '
                       'while read k v rest; do [ "$k" = "Uid:" ] && echo "uid $v"; done < /proc/self/status; '
                       'echo fixed > keep/a.txt; echo sys > /etc/changed')
        assert res.exit_code == 0, res.stderr
        assert res.stdout.splitlines() == ["hello from the image|new|hi there|/app", "uid 0"]
        assert "+fixed" in box.diff() and "keep/a.txt" in box.diff()
        fork = box.fork()
        try:  # a fork copies the workspace, and starts from the image's root
            res = fork.exec("read a < keep/a.txt; echo $a; [ -e /etc/changed ] || echo clean")
            assert res.stdout == "fixed\nclean\n"
        finally:
            fork.close()
    finally:
        box.close()
    assert tree(image.rootfs) == EXPECTED and not list(state.iterdir())


def _host_tools_layer(names) -> list:
    """Host binaries (and every library they load) as layer entries: enough of a distribution for Harbor's
    oracle and verifier commands (bash, env, chmod, tee, cp, cat)."""
    entries, seen = [], set()
    for name in names:
        exe = Path(shutil.which(name))
        out = subprocess.run(["ldd", str(exe)], capture_output=True, text=True).stdout
        files = [(f"bin/{name}", Path(os.path.realpath(exe)))]
        files += [(p.lstrip("/"), Path(os.path.realpath(p))) for line in out.splitlines()
                  for p in line.split() if p.startswith("/")]
        for rel, real in files:
            if rel in seen:
                continue
            seen.add(rel)
            parts = Path(rel).parts
            entries += [("/".join(parts[:i]), "dir", None) for i in range(1, len(parts))]
            entries.append((rel, "file", real.read_bytes()))
    return entries


def _oracle_resolves_and_nop_scores_zero(task) -> None:
    from c2jax.rl.eval import EvalConfig, evaluate
    from c2jax.rl.eval.agents import scripted_factory
    from c2jax.rl.tasks.build import sandbox_factory

    scores = {}
    for mode in ("oracle", "nop"):
        res = evaluate([task], scripted_factory(mode), 1, config=EvalConfig(sandbox="bwrap", concurrency=1),
                       sandbox_factory=sandbox_factory("bwrap"), progress=False)
        (r,) = res.results
        scores[mode] = (r.status, r.reward, r.error)
    assert scores["oracle"][:2] == ("resolved", 1.0), scores
    assert scores["nop"][:2] == ("unresolved", 0.0), scores


@pytest.mark.skipif(not _bwrap_ok(), reason="bubblewrap cannot create namespaces here")
def test_harbor_task_with_a_docker_image_from_the_store(tmp_path, monkeypatch):
    """A Harbor task naming `docker_image` runs in that image once the image store holds it: the oracle
    resolves it (its solve.sh and the verifier's test.sh see the image's files at its WORKDIR and its /etc), the
    nop agent scores 0; without the image in the store the task is refused, naming the image and the store."""
    from c2jax.rl.tasks.build import sandbox_factory
    from c2jax.rl.tasks.task import load_task

    task_dir = tmp_path / "tasks" / "image-task"
    (task_dir / "tests").mkdir(parents=True)
    (task_dir / "solution").mkdir()
    (task_dir / "environment").mkdir()
    (task_dir / "environment" / "Dockerfile").write_text("FROM example/hello:1\nRUN make\n")  # never built
    (task_dir / "task.toml").write_text('schema_version = "1.1"\n[environment]\ndocker_image = "example/hello:1"\n'
                                        "[verifier]\ntimeout_sec = 60.0\n")
    (task_dir / "instruction.md").write_text("Write done to result.txt.\n")
    (task_dir / "solution" / "solve.sh").write_text("echo done > result.txt\n")
    (task_dir / "tests" / "test.sh").write_text(
        '#!/bin/bash\nif [ "$(cat result.txt)" = done ] && [ "$(cat /etc/greeting)" = "hello from the image" ] '
        '&& [ "$PWD" = /app ] && [ -f keep/a.txt ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n')

    monkeypatch.delenv("C2JAX_IMAGE_STORE", raising=False)
    refused = load_task(task_dir)
    assert "example/hello:1" in refused.unsupported_reason and "C2JAX_IMAGE_STORE" in refused.unsupported_reason

    store = tmp_path / "store"
    store.mkdir()
    make_layout(store / "example_hello_1", layers=[_host_tools_layer(["sh", "bash", "env", "chmod", "tee", "cp",
                                                                      "cat"]) + LAYER1, LAYER2])
    monkeypatch.setenv("C2JAX_IMAGE_STORE", str(store))
    monkeypatch.setenv("C2JAX_IMAGE_CACHE", str(tmp_path / "cache"))
    task = load_task(task_dir)
    assert task.unsupported_reason is None and task.environment.workdir == "/app"
    _oracle_resolves_and_nop_scores_zero(task)
    with pytest.raises(ValueError, match="needs the bwrap sandbox"):
        sandbox_factory("local")(task.repo_dir, **task.environment.sandbox_options("agent"))


# ------------------------------------------------------------------------------------------- Dockerfile builds
BUILD_TOOLS = ["sh", "bash", "env", "cat", "mkdir", "chmod", "tee", "cp"]


@pytest.fixture(scope="module")
def base_store(tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    make_layout(store / "example_base_1", layers=[_host_tools_layer(BUILD_TOOLS) + LAYER1, LAYER2])
    return store


def _context(root: Path, dockerfile: str) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("print('a')\n")
    (root / "src" / "secret.txt").write_text("never copied\n")
    (root / "top.txt").write_text("top v1\n")
    (root / ".dockerignore").write_text("# comment\nsrc/secret.txt\n")
    inner = root / "inner.txt"
    inner.write_text("from the archive\n")
    with tarfile.open(root / "bundle.tar", "w") as tar:
        tar.add(inner, arcname="inner.txt")
    inner.unlink()
    (root / "Dockerfile").write_text(dockerfile)
    return root / "Dockerfile"


DOCKERFILE = """ARG BASE=example/base:1
FROM ${BASE}
ARG WORD=built
ENV APP_HOME=/srv/app PATH=/bin
WORKDIR $APP_HOME
COPY src/ ./src/
COPY top.txt .
ADD bundle.tar /opt/bundle/
RUN echo "$WORD in $(pwd) as $(cat /etc/greeting)" > /etc/built && mkdir -p logs
RUN ["/bin/sh", "-c", "echo json-form > /etc/json"]
CMD ["bash"]
EXPOSE 80
"""


@pytest.mark.skipif(not _bwrap_ok(), reason="bubblewrap cannot create namespaces here")
def test_dockerfile_builds_over_a_store_image(tmp_path, base_store, monkeypatch):
    from c2jax.rl.tasks import image_build
    from c2jax.rl.tasks.image_build import build_image

    dockerfile = _context(tmp_path / "ctx", DOCKERFILE)
    image = build_image(dockerfile, store=base_store, cache_dir=tmp_path / "cache")
    root = image.rootfs
    assert (root / "srv/app/src/a.py").read_text() == "print('a')\n"
    assert not (root / "srv/app/src/secret.txt").exists()  # .dockerignore
    assert (root / "srv/app/top.txt").read_text() == "top v1\n"
    assert (root / "opt/bundle/inner.txt").read_text() == "from the archive\n"  # ADD unpacks a local tar
    assert (root / "etc/built").read_text() == "built in /srv/app as hello from the image\n"
    assert (root / "etc/json").read_text() == "json-form\n" and (root / "srv/app/logs").is_dir()
    assert not (root / "app/old.txt").exists() and (root / "opq/y.txt").exists()  # the base's whiteouts hold
    assert image.config.workdir == "/srv/app" and image.config.env["APP_HOME"] == "/srv/app"
    assert image.config.cmd == ("bash",)

    # cached by content: the same Dockerfile and context build once
    monkeypatch.setattr(image_build, "_run", lambda *a: pytest.fail("built again"))
    assert build_image(dockerfile, store=base_store, cache_dir=tmp_path / "cache") == image
    monkeypatch.undo()
    # a changed file the build copies, or a build argument, is another image
    (tmp_path / "ctx" / "top.txt").write_text("top v2\n")
    changed = build_image(dockerfile, store=base_store, cache_dir=tmp_path / "cache")
    assert changed.digest != image.digest and (changed.rootfs / "srv/app/top.txt").read_text() == "top v2\n"
    hello = build_image(dockerfile, store=base_store, cache_dir=tmp_path / "cache", build_args={"WORD": "hello"})
    assert (hello.rootfs / "etc/built").read_text().startswith("hello in /srv/app")
    # and the built image runs like any other
    with ImageContainer(hello, tmp_path / "state") as box:
        res = box.exec('cat /etc/json; echo "$APP_HOME $(pwd)"')
        assert res.stdout == "json-form\n/srv/app /srv/app\n", res.stderr


@pytest.mark.skipif(not _bwrap_ok(), reason="bubblewrap cannot create namespaces here")
@pytest.mark.parametrize("dockerfile, why", [
    ("FROM example/base:1 AS a\nRUN true\nFROM example/base:1\n", "multi-stage build"),
    ("FROM example/base:1\nCOPY --from=builder /x /y\n", "line 2: COPY --from"),
    ("FROM example/base:1\nRUN --mount=type=cache,target=/c true\n", "line 2: RUN --mount"),
    ("FROM example/base:1\nADD https://example.com/x.tar /x\n", "line 2: ADD of a URL"),
    ("FROM example/missing:2\n", "base image 'example/missing:2' is not in the image store"),
    ("FROM example/base:1\nWORKDIR /w\nRUN echo failing step; exit 3\n",
     "line 3: RUN: exited with status 3:\nfailing step"),
    ("FROM example/base:1\nCOPY nothere.txt /x\n", "line 2: COPY source 'nothere.txt' not found"),
    ("FROM example/base:1\nCOPY ../outside /x\n", "outside the build context"),
])
def test_dockerfile_refusals_name_the_line(tmp_path, base_store, dockerfile, why):
    from c2jax.rl.tasks.image_build import ImageBuildError, build_image

    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "Dockerfile").write_text(dockerfile)
    with pytest.raises(ImageBuildError, match=why.replace("(", r"\(")):
        build_image(tmp_path / "ctx" / "Dockerfile", store=base_store, cache_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").glob("built-*")]  # nothing half-built is cached


@pytest.mark.skipif(not _bwrap_ok(), reason="bubblewrap cannot create namespaces here")
def test_harbor_task_whose_dockerfile_builds_over_a_store_image(tmp_path, base_store, monkeypatch):
    """A Harbor task whose Dockerfile RUNs build steps (which mounting the context cannot reproduce) is built
    over its base from the image store and run in the result: the oracle resolves it, nop scores 0; without
    the base in the store the task is refused, with the Dockerfile's line and the missing image named."""
    from c2jax.rl.tasks.task import load_task

    task_dir = tmp_path / "tasks" / "built-task"
    for d in ("tests", "solution", "environment"):
        (task_dir / d).mkdir(parents=True)
    (task_dir / "environment" / "Dockerfile").write_text(
        "FROM example/base:1\nWORKDIR /app\nCOPY app.txt .\nRUN echo built > /etc/built && mkdir -p /app/out\n")
    (task_dir / "environment" / "app.txt").write_text("payload\n")
    (task_dir / "task.toml").write_text('schema_version = "1.1"\n[verifier]\ntimeout_sec = 60.0\n')
    (task_dir / "instruction.md").write_text("Copy app.txt to out/result.txt.\n")
    (task_dir / "solution" / "solve.sh").write_text("cp app.txt out/result.txt\n")
    (task_dir / "tests" / "test.sh").write_text(
        '#!/bin/bash\nif [ "$(cat out/result.txt)" = payload ] && [ "$(cat /etc/built)" = built ]; '
        "then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n")

    monkeypatch.setenv("C2JAX_IMAGE_STORE", str(tmp_path / "empty-store"))
    refused = load_task(task_dir)
    assert "line 4: RUN" in refused.unsupported_reason and "example/base:1" in refused.unsupported_reason

    monkeypatch.setenv("C2JAX_IMAGE_STORE", str(base_store))
    monkeypatch.setenv("C2JAX_IMAGE_CACHE", str(tmp_path / "cache"))
    task = load_task(task_dir)
    assert task.unsupported_reason is None and task.environment.workdir == "/app"
    _oracle_resolves_and_nop_scores_zero(task)
    assert len(list((tmp_path / "cache").glob("built-*"))) == 1  # built once for every sandbox of the run
