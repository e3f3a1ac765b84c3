"""The environment pool (c2jax.rl.sandbox.envpool) behind `sandbox_factory`: an image's root filesystem and the
workspace's base snapshot are prepared once per worker process, each episode gets a fresh writable layer over them
(nothing one episode writes reaches the next), concurrent opens are safe, a changed repository, context or image is
prepared again, and a broken image fails with its source named."""

from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path

import pytest
from test_oci import EXPECTED, LAYER1, LAYER2, _bwrap_ok, _host_tools_layer, make_layout, tree

from c2jax.rl.sandbox import envpool, oci
from c2jax.rl.sandbox.envpool import EnvironmentPool, tree_fingerprint
from c2jax.rl.sandbox.oci import ImageError
from c2jax.rl.tasks import image_build
from c2jax.rl.tasks.build import sandbox_factory

pytestmark = pytest.mark.skipif(not _bwrap_ok(), reason="bubblewrap cannot create namespaces here")
TOOLS = ["sh", "cat", "rm", "mkdir", "ls"]


@pytest.fixture
def pool(tmp_path, monkeypatch):
    """A fresh process pool for the test (its own state directory), and an empty image cache."""
    monkeypatch.delenv(envpool.POOL_ENV, raising=False)
    monkeypatch.setenv("C2JAX_IMAGE_CACHE", str(tmp_path / "cache"))
    p = EnvironmentPool(tmp_path / "state")
    monkeypatch.setattr(envpool, "_pool", p)
    yield p
    p.close()


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    return make_layout(tmp_path_factory.mktemp("img") / "example_hello_1",
                       layers=[_host_tools_layer(TOOLS) + LAYER1, LAYER2])


def _counting(monkeypatch, module, name) -> list:
    calls, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def _repo(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("x = 1\n")
    (root / "README").write_text("base\n")
    return root


def test_an_image_is_prepared_once_across_episodes(pool, layout, monkeypatch):
    loads = _counting(monkeypatch, oci, "load_image")
    snapshots = _counting(monkeypatch, envpool, "BaseSnapshot")
    factory = sandbox_factory("bwrap")
    for _ in range(4):
        with factory(None, image_source=str(layout), workdir="/app") as sb:
            res = sb.exec("cat /etc/greeting new.txt")
            assert res.stdout == "hello from the image\nnew", res.stderr
    assert len(loads) == 1 and len(snapshots) == 1
    assert pool.stats()["image_prepared"] == 1 and pool.stats()["image_reused"] == 3
    assert pool.stats()["snapshot_prepared"] == 1 and pool.stats()["snapshot_reused"] == 3
    # without the pool (C2JAX_ENV_POOL=0) every episode loads the image again, as before the pool
    monkeypatch.setenv(envpool.POOL_ENV, "0")
    for _ in range(2):
        with factory(None, image_source=str(layout), workdir="/app") as sb:
            assert sb.exec("cat new.txt").stdout == "new"
    assert len(loads) == 3 and len(snapshots) == 1


@pytest.mark.parametrize("mode", ["overlay", "copy"])
def test_episodes_do_not_see_each_others_writes(pool, layout, mode, tmp_path):
    factory = sandbox_factory("bwrap")
    write = ("echo agent > new.txt && rm keep/a.txt && echo made > made.txt && echo sys > /etc/greeting && "
             "mkdir -p /root && echo secret > /root/note && echo tmp > /tmp/t")
    with factory(None, image_source=str(layout), workdir="/app", mode=mode) as first:
        assert first.exec(write).exit_code == 0
        assert first.exec("cat new.txt /etc/greeting").stdout == "agent\nsys\n"
        assert "made.txt" in first.diff()
    with factory(None, image_source=str(layout), workdir="/app", mode=mode) as second:
        res = second.exec("cat new.txt /etc/greeting keep/a.txt; ls made.txt /root/note /tmp/t 2>/dev/null; :")
        assert res.stdout == "newhello from the image\na", res.stderr
        assert second.diff() == ""
    # the shared trees were never written: the unpacked image and the workspace's base snapshot
    image = oci.load_image(layout, tmp_path / "cache")
    assert tree(image.rootfs) == EXPECTED
    (snapshot,) = pool.dir.glob("base-*")
    assert sorted(p.name for p in (snapshot / "tree").iterdir()) == [".git", "hard", "keep", "link", "new.txt"]


def test_repository_episodes_share_one_snapshot_until_the_repository_changes(pool, tmp_path, monkeypatch):
    repo = _repo(tmp_path / "repo")
    snapshots = _counting(monkeypatch, envpool, "BaseSnapshot")
    factory = sandbox_factory("bwrap")
    for _ in range(3):
        with factory(repo) as sb:
            assert sb.read_text("README") == "base\n"
            sb.write_text("README", "changed by the agent\n")
            sb.exec("echo new > pkg/new.py")
            assert "pkg/new.py" in sb.diff()
    assert len(snapshots) == 1
    assert (repo / "README").read_text() == "base\n" and not (repo / "pkg" / "new.py").exists()
    # an edit on disk (as a task build may make) is seen by the next episode, as without the pool
    (repo / "README").write_text("edited\n")
    with factory(repo) as sb:
        assert sb.read_text("README") == "edited\n" and sb.diff() == ""
    (repo / ".git").mkdir()  # a .git is never part of the snapshot: no new one
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    with factory(repo) as sb:
        assert sb.read_text("README") == "edited\n"
    assert len(snapshots) == 2


def test_concurrent_opens_prepare_once_and_stay_private(pool, layout, monkeypatch):
    loads = _counting(monkeypatch, oci, "load_image")
    snapshots = _counting(monkeypatch, envpool, "BaseSnapshot")
    factory = sandbox_factory("bwrap")
    n = 6
    barrier = threading.Barrier(n)
    out, errors = {}, []

    def episode(i):
        try:
            barrier.wait()
            with factory(None, image_source=str(layout), workdir="/app") as sb:
                sb.exec(f"echo {i} > mine.txt && echo {i} > /etc/who")
                barrier.wait()  # every sandbox has written before any reads
                out[i] = sb.exec("cat mine.txt /etc/who; ls").stdout
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(n):
        assert out[i].startswith(f"{i}\n{i}\n"), out[i]
    assert len(loads) == 1 and len(snapshots) == 1


def test_a_dockerfile_is_built_once_and_again_when_its_context_changes(pool, layout, tmp_path, monkeypatch):
    store = layout.parent
    monkeypatch.setenv("C2JAX_IMAGE_STORE", str(store))
    ctx = tmp_path / "env"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM example/hello:1\nWORKDIR /srv\nCOPY app.txt .\nRUN mkdir -p out\n")
    (ctx / "app.txt").write_text("v1\n")
    builds = _counting(monkeypatch, image_build, "build_image")
    factory = sandbox_factory("bwrap")
    for _ in range(3):
        with factory(None, image_build=str(ctx / "Dockerfile"), workdir="/srv") as sb:
            assert sb.exec("cat app.txt").stdout == "v1\n"
    assert len(builds) == 1
    (ctx / "app.txt").write_text("v2\n")
    with factory(None, image_build=str(ctx / "Dockerfile"), workdir="/srv") as sb:
        assert sb.exec("cat app.txt").stdout == "v2\n"
    assert len(builds) == 2


def test_engine_episodes_share_one_build_and_one_snapshot(pool, layout, tmp_path, monkeypatch):
    """On docker / podman the build and the workspace's base snapshot are pooled the same way (the engine itself
    is faked: no daemon is needed to see what each episode is handed)."""
    from c2jax.rl.sandbox import engine as eng

    made = []

    class FakeEngineSandbox:
        def __init__(self, source, *, engine, image, **options):
            self.source, self.image, self.options = source.retain(), image, options
            made.append(self)

        def close(self):
            self.source.release()

    monkeypatch.setattr(eng, "engine_for_kind", lambda kind: eng.Engine("docker", "/nonexistent/docker"))
    monkeypatch.setattr(eng, "EngineSandbox", FakeEngineSandbox)
    monkeypatch.setattr(eng, "import_built_image", lambda engine, image: f"c2jax/built:{image.digest[7:]}")
    monkeypatch.setenv("C2JAX_IMAGE_STORE", str(layout.parent))
    ctx = tmp_path / "env"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM example/hello:1\nWORKDIR /srv\nCOPY app.txt .\n")
    (ctx / "app.txt").write_text("v1\n")
    builds = _counting(monkeypatch, image_build, "build_image")
    factory = sandbox_factory("docker")
    for _ in range(3):
        factory(None, image_build=str(ctx / "Dockerfile"), workdir="/srv").close()
    assert len(builds) == 1 and len({id(m.source) for m in made}) == 1 and len(made) == 3
    assert (made[0].source.tree / "app.txt").read_text() == "v1\n" and made[0].options == {"workdir": "/srv"}


def test_a_replaced_image_is_loaded_again(pool, tmp_path):
    store = tmp_path / "store"
    src = make_layout(store / "example_x_1", layers=[_host_tools_layer(TOOLS) + LAYER1, LAYER2])
    factory = sandbox_factory("bwrap")
    with factory(None, image_source=str(src), workdir="/app") as sb:
        assert sb.exec("cat /etc/greeting").stdout == "hello from the image\n"
    shutil.rmtree(src)
    make_layout(src, layers=[_host_tools_layer(TOOLS) + [("etc", "dir", None), ("etc/greeting", "file", "v2\n"),
                                                         ("app", "dir", None)]])
    with factory(None, image_source=str(src), workdir="/app") as sb:
        assert sb.exec("cat /etc/greeting").stdout == "v2\n"
    assert pool.stats()["image_prepared"] == 2


def test_a_broken_image_names_the_image(pool, tmp_path, monkeypatch):
    factory = sandbox_factory("bwrap")
    bad = make_layout(tmp_path / "store" / "example_bad_1", layers=[[("../escape", "file", "x")]])
    why = re.escape(f"image {bad}: layer sha256:") + "[0-9a-f]+: member '../escape' leaves the root filesystem"
    with pytest.raises(ImageError, match=why):
        factory(None, image_source=str(bad), workdir="/app")
    corrupt = make_layout(tmp_path / "store" / "example_corrupt_1")
    blob = max((corrupt / "blobs" / "sha256").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of a file in the layer
    blob.write_bytes(bytes(data))
    with pytest.raises(ImageError, match=re.escape(str(corrupt)) + ".*does not match its digest"):
        factory(None, image_source=str(corrupt), workdir="/app")
    with pytest.raises(ImageError, match="no such image"):
        factory(None, image_source=str(tmp_path / "store" / "missing"), workdir="/app")
    # a Dockerfile whose build fails names the Dockerfile's path, line and reason
    monkeypatch.setenv("C2JAX_IMAGE_STORE", str(tmp_path / "empty-store"))
    ctx = tmp_path / "tasks" / "my-task" / "environment"
    ctx.mkdir(parents=True)
    (ctx / "Dockerfile").write_text("FROM example/absent:1\n")
    why = f"image built from {ctx / 'Dockerfile'}: Dockerfile line 1: base image 'example/absent:1'"
    with pytest.raises(image_build.ImageBuildError, match=re.escape(why)):
        factory(None, image_build=str(ctx / "Dockerfile"), workdir="/app")
    assert "image_prepared" not in pool.stats()  # failures are not kept: the next episode tries again


def test_evicted_snapshots_outlive_their_open_sandboxes(tmp_path, monkeypatch):
    monkeypatch.delenv(envpool.POOL_ENV, raising=False)
    pool = EnvironmentPool(tmp_path / "state", max_snapshots=2)
    monkeypatch.setattr(envpool, "_pool", pool)
    factory = sandbox_factory("bwrap")
    repos = [_repo(tmp_path / f"repo{i}") for i in range(3)]
    held = factory(repos[0])
    for r in repos[1:]:
        factory(r).close()
    assert pool.stats()["snapshots_kept"] == 2
    assert held.read_text("README") == "base\n" and held.exec("cat pkg/mod.py").stdout == "x = 1\n"
    held.close()
    assert len(list(pool.dir.glob("base-*"))) == 2  # the evicted one went with its last sandbox
    pool.close()
    assert not pool.dir.exists()


def test_tree_fingerprint_sees_every_write(tmp_path):
    repo = _repo(tmp_path / "repo")
    before = tree_fingerprint(repo)
    assert tree_fingerprint(repo) == before
    (repo / "pkg" / "mod.py").write_text("x = 2\n")  # same size
    after = tree_fingerprint(repo)
    assert after != before
    (repo / "pkg" / "extra").mkdir()
    assert tree_fingerprint(repo) != after
    assert tree_fingerprint(repo, skip=frozenset({"extra"})) == after
