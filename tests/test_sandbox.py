"""Sandbox escape battery: each attack a buggy or reward-hacking policy might try must be contained."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from c2jax.rl.sandbox import BwrapSandbox, Limits, LocalSandbox, SandboxError, SandboxPathError, SandboxPool
from c2jax.rl.sandbox.bwrap import bwrap_unusable_reason

_UNUSABLE = bwrap_unusable_reason()
needs_bwrap = pytest.mark.skipif(_UNUSABLE is not None, reason=f"bubblewrap unusable: {_UNUSABLE}")


def _git(repo: Path, *args: str) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(repo), "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "u",
           "GIT_AUTHOR_EMAIL": "u@x", "GIT_COMMITTER_NAME": "u", "GIT_COMMITTER_EMAIL": "u@x"}
    proc = subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True)
    return proc.stdout


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A task repo whose own git history holds the 'answer' and a remote, which sealing must drop."""
    r = tmp_path_factory.mktemp("repo")
    (r / "pkg").mkdir()
    (r / "pkg" / "mod.py").write_text("def add(a, b):\n    return a + b  # THE_ANSWER\n")
    (r / "tests").mkdir()
    (r / "tests" / "test_mod.py").write_text(
        "from pkg.mod import add\n\ndef test_add():\n    assert add(1, 2) == 3\n")
    _git(r, "init", "-q")
    _git(r, "add", "-A")
    _git(r, "commit", "-q", "-m", "solution commit")
    (r / "pkg" / "mod.py").write_text("def add(a, b):\n    return a - b\n")
    _git(r, "commit", "-q", "-am", "inject bug")
    _git(r, "remote", "add", "origin", "https://example.com/upstream.git")
    return r


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(limits=Limits(timeout_s=10.0, memory_bytes=256 * 1024**2, max_processes=64,
                                   file_size_bytes=1024**2, tmp_bytes=4 * 1024**2)) as p:
        yield p


@pytest.fixture
def sbx(pool, repo):
    s = pool.acquire(repo)
    yield s
    s.close()


@pytest.fixture
def outside(tmp_path) -> Path:
    """Host files outside every workspace: a fake secret, and a hidden-tests dir."""
    (tmp_path / "secret.txt").write_text("HOST_SECRET_TOKEN\n")
    (tmp_path / "hidden_tests").mkdir()
    (tmp_path / "hidden_tests" / "test_hidden.py").write_text("def test_hidden():\n    assert True\n")
    return tmp_path


def test_local_sandbox_refuses_without_explicit_opt_in(repo):
    with pytest.raises(SandboxError, match="allow_unisolated=True"):
        LocalSandbox(repo)
    with pytest.raises(SandboxError):
        LocalSandbox(repo, allow_unisolated="yes")  # truthy is not explicit


def test_local_sandbox_runs_diffs_and_times_out(repo):
    with LocalSandbox(repo, allow_unisolated=True) as s:
        assert s.exec("cat pkg/mod.py").stdout == "def add(a, b):\n    return a - b\n"
        s.write_text("pkg/mod.py", "def add(a, b):\n    return a + b\n")
        assert "+    return a + b" in s.diff()
        r = s.exec("sleep 20", timeout_s=0.3)
        assert r.timed_out and r.exit_code == 124 and r.wall_s < 5
        r = s.exec("exec >&- 2>&-; sleep 20", timeout_s=0.3)  # closed its pipes, still running
        assert r.timed_out and r.wall_s < 5
        assert s.exec("wc -c", stdin="x" * 300_000).stdout.strip() == "300000"  # more than a pipe buffer
        with pytest.raises(SandboxPathError):
            s.read_text("../outside")


@needs_bwrap
def test_network_option_shares_the_host_network(tmp_path, loopback_server):
    """network=True keeps every namespace but the network one: a host loopback listener answers, the
    host's resolv.conf is there (never ssl/private); the default sandbox and a fork keep their own."""
    (tmp_path / "f").write_text("x\n")
    port = loopback_server
    probe = (f"python -c \"import socket; s = socket.create_connection(('127.0.0.1', {port}), timeout=3); "
             "print(s.recv(64).decode())\"; test -e /etc/resolv.conf && echo resolv; "
             "test -e /etc/ssl/private || echo no-private; id -u")
    with BwrapSandbox(tmp_path) as off, BwrapSandbox(tmp_path, network=True) as on:
        r_off, r_on = off.exec(probe), on.exec(probe)
        with on.fork() as child:
            r_fork = child.exec(probe)
        assert (off.network, on.network) == (False, True)
    assert "host-says-hi" not in r_off.stdout and "ConnectionRefusedError" in r_off.stderr
    assert "resolv" not in r_off.stdout.split()
    for r in (r_on, r_fork):
        assert r.stdout.split() == ["host-says-hi", "resolv", "no-private", "1000"], (r.stdout, r.stderr)
    with pytest.raises(TypeError, match="network"):
        BwrapSandbox(tmp_path, network="yes")


@needs_bwrap
def test_no_network(sbx):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        r = sbx.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '; python -c \"import socket\n"
                     f"for a in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
                     "    try: socket.create_connection(a, timeout=1); print('CONNECTED', a)\n"
                     "    except OSError as e: print('refused', e.errno)\"")
    finally:
        server.close()
    assert r.stdout.split("\n")[0] == "lo" and "CONNECTED" not in r.stdout and r.stdout.count("refused") == 2


@needs_bwrap
def test_cannot_write_outside_workspace(sbx, outside):
    targets = ["/usr/c2jax_x", "/etc/c2jax_x", "/c2jax_x", f"{os.path.realpath(os.sys.prefix)}/c2jax_x",
               f"{outside}/c2jax_x"]
    attempts = "; ".join(f"touch {t} 2>/dev/null && echo WROTE {t}" for t in targets)
    r = sbx.exec(attempts + "; echo tmp > /tmp/t")
    assert "WROTE" not in r.stdout
    assert not any(Path(t).exists() for t in targets)
    assert not Path("/tmp/t").exists() or Path("/tmp/t").read_text() != "tmp\n"


@needs_bwrap
def test_cannot_read_host_secrets(sbx, outside, monkeypatch):
    home_secret = Path.home() / f".c2jax_fake_secret_{uuid.uuid4().hex[:8]}"
    home_secret.write_text("HOME_SECRET_TOKEN\n")
    monkeypatch.setenv("C2JAX_FAKE_API_KEY", "ENV_SECRET_TOKEN")
    try:
        r = sbx.exec(f"cat {outside}/secret.txt {home_secret} /etc/shadow /root/.bash_history; env; "
                     f"ls {Path.home()} /home /work 2>&1")
    finally:
        home_secret.unlink()
    assert r.exit_code != 0
    assert not {"HOST_SECRET_TOKEN", "HOME_SECRET_TOKEN", "ENV_SECRET_TOKEN"} & set(r.stdout.split())


@needs_bwrap
def test_fork_bomb_is_capped(sbx):
    forker = ("import os, time\nn = 0\ntry:\n    while n < 500:\n        if os.fork() == 0:\n"
              "            time.sleep(3); os._exit(0)\n        n += 1\nexcept OSError:\n    print('capped at', n)")
    r = sbx.exec(f'python -c "{forker}"', timeout_s=8)
    assert r.stdout.startswith("capped at") and int(r.stdout.split()[-1]) < 64, r
    bomb = sbx.exec("bomb() { bomb | bomb & }; bomb; sleep 0.5", timeout_s=2)
    assert bomb.wall_s < 5
    assert sbx.exec("echo alive").stdout == "alive\n"  # the sandbox (and the host) survived


@needs_bwrap
def test_memory_bomb_is_killed(sbx):
    r = sbx.exec("python -c \"x = bytearray(1024**3); x[::4096] = b'1' * len(x[::4096]); print('SURVIVED')\"")
    assert r.exit_code != 0 and "SURVIVED" not in r.stdout


@needs_bwrap
def test_memory_bomb_is_contained_without_cgroups(repo, tmp_path, monkeypatch):
    monkeypatch.setattr("c2jax.rl.sandbox.bwrap._cgroup_layout", lambda: None)  # a host with no writable cgroup
    with BwrapSandbox(repo, state_dir=tmp_path, limits=Limits(memory_bytes=512 * 1024**2)) as s:
        assert not s.cgroup_limited
        r = s.exec("python -c \"x = bytearray(1024**3); print('SURVIVED')\"")
        assert r.exit_code != 0 and "MemoryError" in r.stderr and "SURVIVED" not in r.stdout


@needs_bwrap
def test_output_flood_is_capped(pool, repo):
    with pool.acquire(repo, limits=Limits(output_bytes=1000, output_kill_bytes=4 * 1024**2)) as s:
        r = s.exec("yes FLOOD", timeout_s=20)
        assert r.truncated and not r.timed_out and r.wall_s < 10
        assert "bytes of output omitted" in r.stdout and len(r.stdout) < 1200
        assert r.stdout.startswith("FLOOD\n") and r.stdout.endswith("FLOOD\n") or r.stdout.endswith("FLOOD")


@needs_bwrap
def test_timeout_kills_whole_process_group(sbx):
    tag = f"{31 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 1000}"
    r = sbx.exec(f"sleep {tag} & setsid sleep {tag} & (trap '' TERM HUP; sleep {tag}) & "
                 f"echo started; sleep {tag}", timeout_s=1.0)
    assert r.timed_out and r.exit_code == 124 and r.stdout == "started\n" and r.wall_s < 5
    # the kernel kills what is left in the sandbox's PID namespace asynchronously (seen in a cold `make test`:
    # pgrep ran first); the sleeps last 31+ s, so one still there after 3 s survived the timeout
    deadline = time.monotonic() + 3.0
    while (left := subprocess.run(["pgrep", "-f", f"sleep {tag}"], capture_output=True, text=True).stdout) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == "", f"processes survived the timeout: {left}"


@needs_bwrap
def test_background_children_do_not_outlive_a_command(sbx):
    tag = f"{41 + uuid.uuid4().int % 1000}.5"
    assert sbx.exec(f"setsid sleep {tag} > /dev/null 2>&1 & echo ok").stdout == "ok\n"
    # the sandbox's PID namespace ends with the command; the kernel kills its remaining processes right after,
    # asynchronously (seen once in CI: pgrep ran first). The sleep lasts 41+ s: still there after 3 s is a leak
    deadline = time.monotonic() + 3.0
    while (left := subprocess.run(["pgrep", "-f", f"sleep {tag}"], capture_output=True).stdout) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == b"", f"a background child outlived its command: pid {left.decode().split()}"


@needs_bwrap
def test_file_size_and_tmp_caps(sbx):
    big = sbx.exec("head -c 2000000 /dev/zero > big.bin; echo rc=$?")
    assert "rc=0" not in big.stdout and sbx.host_path().joinpath("big.bin").stat().st_size <= 1024**2
    tmp = sbx.exec("head -c 900000 /dev/zero > /tmp/a; head -c 900000 /dev/zero > /tmp/b; "
                   "head -c 900000 /dev/zero > /tmp/c; head -c 900000 /dev/zero > /tmp/d; "
                   "head -c 900000 /dev/zero > /tmp/e; echo rc=$?")
    assert "rc=0" not in tmp.stdout  # 4.5 MB into a 4 MiB tmpfs


@needs_bwrap
def test_symlink_traversal_refused(sbx, outside):
    sbx.exec(f"ln -s {outside}/secret.txt leak; ln -s /etc/passwd passwd; ln -s ../../.. up; ln -s pkg inner")
    for path in ["leak", "passwd", "up/etc/passwd", "/etc/passwd", "../x", "pkg/../../x"]:
        with pytest.raises(SandboxPathError):
            sbx.read_bytes(path)
    with pytest.raises(SandboxPathError):
        sbx.write_text("up/c2jax_escape", "x")
    with pytest.raises(SandboxPathError):
        sbx.list_dir("up")
    assert sbx.read_text("inner/mod.py").startswith("def add")  # a symlink staying inside is fine
    assert "HOST_SECRET_TOKEN" not in sbx.exec("cat leak").stdout
    sbx.remove("leak")  # removes the link, never the target
    assert (outside / "secret.txt").exists()


@needs_bwrap
def test_hidden_tests_outside_workspace_cannot_be_modified(pool, repo, outside):
    hidden = outside / "hidden_tests"
    before = _tree_digest(hidden)
    with pool.acquire(repo) as s:
        s.exec(f"rm -rf {hidden}; echo 'assert False' > {hidden}/test_hidden.py")
    with pool.acquire(repo, extra_ro_binds={str(hidden): "/hidden"}) as s:
        r = s.exec("cat /hidden/test_hidden.py; echo hacked > /hidden/test_hidden.py; rm -f /hidden/test_hidden.py")
        assert "def test_hidden" in r.stdout and r.exit_code != 0
    assert _tree_digest(hidden) == before


@needs_bwrap
def test_git_history_is_sealed(sbx, repo):
    r = sbx.exec("git log --all --format=%s; echo ---; git remote -v; git reflog; ls .git/logs 2>&1; "
                 "git cat-file --batch-all-objects --batch-check | wc -l")
    log, rest = r.stdout.split("---\n")
    assert log == "base\n" and "origin" not in rest and "THE_ANSWER" not in r.stdout
    assert "No such file" in rest
    blobs = sbx.exec("git cat-file --batch-all-objects --batch | grep -c THE_ANSWER").stdout.strip()
    assert blobs == "0"
    assert "solution commit" in _git(repo, "log", "--format=%s")  # the host repo keeps its history


@needs_bwrap
@pytest.mark.parametrize("mode", ["overlay", "copy"])
def test_original_untouched_diff_and_fork_independence(repo, tmp_path, mode):
    before = _tree_digest(repo)
    with BwrapSandbox(repo, mode=mode, state_dir=tmp_path) as s:
        s.exec("sed -i 's/a - b/a + b/' pkg/mod.py && rm tests/test_mod.py && mkdir -p new && echo n > new/f.txt "
               "&& rm -rf pkg_copy && cp -r pkg pkg_copy && rm -rf tests && mkdir tests && echo t > tests/other.txt")
        d = s.diff()
        assert "+    return a + b" in d and "deleted file mode" in d and "new file mode" in d and "new/f.txt" in d
        child = s.fork()
        s.write_text("parent_only.txt", "p")
        child.exec("echo c > child_only.txt; rm new/f.txt")
        assert not s.exists("child_only.txt") and s.exists("new/f.txt")
        assert not child.exists("parent_only.txt") and child.exists("pkg/mod.py")
        assert child.list_dir("tests") == ["other.txt"]  # deletions (whiteouts, opaque dirs) carried over
        assert "+    return a + b" in child.diff() and "new/f.txt" not in child.diff()
        s.close()
        assert child.exec("cat pkg/mod.py").stdout.endswith("return a + b\n")  # outlives its parent
        child.close()
    assert _tree_digest(repo) == before


@needs_bwrap
def test_host_diff_ignores_planted_git_config(sbx, tmp_path):
    marker = tmp_path / "pwned"
    sbx.exec(f"git config core.fsmonitor 'touch {marker}'; git config core.pager 'touch {marker}'; "
             "echo x > added.txt")
    assert "added.txt" in sbx.diff()
    assert not marker.exists()


@needs_bwrap
def test_python_and_pytest_run_inside(sbx):
    r = sbx.exec("python -m pytest -q tests", env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert r.exit_code == 1 and "1 failed" in r.stdout  # the injected bug
    assert sbx.exec("id -u; pwd").stdout == "1000\n/workspace\n"


@needs_bwrap
def test_paths_and_closed_sandbox(pool, repo):
    s = pool.acquire(repo)
    with pytest.raises(SandboxPathError):
        s.write_text("/etc/x", "")
    with pytest.raises(SandboxError):
        s.exec("true", cwd="pkg/mod.py")
    assert s.exec("pwd", cwd="pkg").stdout == "/workspace/pkg\n"
    s.close()
    with pytest.raises(SandboxError, match="closed"):
        s.exec("true")


@needs_bwrap
def test_pool_close_tears_down_everything_and_reaps_stale_state(repo, tmp_path):
    stale = tmp_path / "pool-999999999-dead" / "sbx-x" / "ws"  # left by a crashed process (pid not alive)
    stale.mkdir(parents=True)
    pool = SandboxPool(state_dir=tmp_path)
    assert not stale.parent.parent.exists()
    s = pool.acquire(repo)
    fork = s.fork()
    grandchild = fork.fork()
    s.close()
    pool.close()
    assert fork.closed and grandchild.closed
    assert not list(tmp_path.glob("pool-*"))
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()
    with pytest.raises(SandboxError, match="closed"):
        pool.acquire(repo)
