"""Test-wide JAX setup. Runs before any test module imports jax, which is why it touches the
environment first: XLA reads XLA_FLAGS and JAX_PLATFORMS once, when the backend starts."""

import os
from pathlib import Path

import pytest

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"  # 8 fake CPU devices for sharding tests
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()
# Tests are dominated by XLA:CPU compile time, not run time (tiny shapes): LLVM at -O0 runs them 20-28%
# faster end to end than -O1 (cold cache, 2 cores: test_transformer 74 -> 53 s, test_pretrain 172 -> 140 s,
# its kill -9 resume test 81 -> 60 s), and -O1 was itself 15-30% faster than XLA's default. Subprocesses the
# tests start (resume after kill -9, notebooks, Ray actors, the demo) inherit it through the environment.
_OPT_FLAG = "--xla_backend_optimization_level"
if _OPT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {_OPT_FLAG}=0"
os.environ["JAX_PLATFORMS"] = "cpu"


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA knows `flag`: XLA aborts the process on an unknown flag in XLA_FLAGS, and
    experimental flags come and go between releases, so a short-lived process tries it first (~2 s, once:
    xdist workers and the processes tests start inherit the result through the environment)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    try:
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, timeout=120,
                              capture_output=True).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


# XLA:CPU's MLIR fusion emitters spend most of a test's compile in ~500 small kernels per train step; the
# older elemental emitter compiles the same programs 1.4x faster (a tiny-preset train step, dense MoE: 4.4 ->
# 3.1 s) to 2-3x (sorted MoE: 10.6-15.3 -> 5.4 s): the suite 969 -> 775 s on 2 cores. Tests only: `make demo`,
# bench and a GPU keep XLA's default. But the elemental emitter rounds f32 -> float4_e2m1fn twice (through a
# 16-bit float: 1.250486 becomes 1.25, a tie, then 1.0 instead of 1.5), so tests whose figures are FP4 codes
# are marked `xla_default_codegen` and run in a process without the flag (`pytest_pyfunc_call` below).
# C2JAX_TEST_XLA_PROBED: probed once; C2JAX_TEST_DEFAULT_XLA_FLAGS: the flags without it.
_EMITTER_FLAG = "--xla_cpu_use_fusion_emitters=false"
if not os.environ.get("C2JAX_TEST_XLA_PROBED") and "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["C2JAX_TEST_XLA_PROBED"] = "1"
    os.environ["C2JAX_TEST_DEFAULT_XLA_FLAGS"] = os.environ["XLA_FLAGS"]
    if _xla_accepts(_EMITTER_FLAG):
        os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {_EMITTER_FLAG}"
_ELEMENTAL_EMITTER_HERE = _EMITTER_FLAG in os.environ["XLA_FLAGS"].split()

import jax  # noqa: E402

# Many tests compile the same small programs; a persistent cache makes reruns much faster. Set in the
# environment, not only in this process's jax.config, so that every process a test starts (a resumed run
# after kill -9, the multi-process runs, Ray actors, notebook kernels, the demo) shares the cache at the same
# threshold: JAX's default (1 s) would leave their 0.5-1 s programs to be compiled again in each process.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


# Modules with the longest runs first (measured, cold cache): `make test` runs the suite on two xdist
# workers a file at a time (`--dist loadfile`), and a long file started last would leave one worker idle
# while the other finishes it. Within a module, the written order stands.
_LONG_FIRST = ("test_multihost.py", "test_rl_learner_group.py", "test_pretrain.py", "test_notebooks.py", "test_demo.py",
               "test_rl_system.py",
               "test_plan.py", "test_gpu_check.py", "test_transformer.py",
               "test_parallel.py", "test_ablations.py", "test_kernels.py", "test_rl_learner.py")


_default_codegen_results: dict[Path, dict[str, tuple[str, str]]] = {}


def _run_with_default_codegen(module: Path) -> dict[str, tuple[str, str]]:
    """The `xla_default_codegen` tests of `module`, run once in a pytest process with XLA's default CPU codegen:
    {test name: (outcome, message)}, outcome "passed", "failed" or "skipped" (from its JUnit XML)."""
    import subprocess
    import sys
    import tempfile
    import xml.etree.ElementTree as ET

    env = dict(os.environ, XLA_FLAGS=os.environ.get("C2JAX_TEST_DEFAULT_XLA_FLAGS", ""), C2JAX_TEST_XLA_PROBED="1")
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", str(module), "-m", "xla_default_codegen", "-q",
                               "-p", "no:xdist", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={junit}"],
                              cwd=module.parent.parent, env=env, capture_output=True, text=True, timeout=1800)
        if not junit.exists():
            raise RuntimeError(f"pytest of {module.name} with XLA's default codegen wrote no report "
                               f"(exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        results = {}
        for case in ET.parse(junit).iter("testcase"):
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome, message = "failed", f"{child.get('message', '')}\n{child.text or ''}"
                elif child.tag == "skipped":
                    outcome, message = "skipped", child.get("message", "")
            results[case.get("name")] = (outcome, message)
    return results


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test marked `xla_default_codegen` in a process that uses the elemental emitter: its outcome is the one
    of a run of its module's marked tests in a process with XLA's default codegen (one run per module)."""
    if not _ELEMENTAL_EMITTER_HERE or pyfuncitem.get_closest_marker("xla_default_codegen") is None:
        return None
    module = Path(pyfuncitem.path)
    if module not in _default_codegen_results:
        _default_codegen_results[module] = _run_with_default_codegen(module)
    outcome, message = _default_codegen_results[module].get(pyfuncitem.name, ("missing", ""))
    if outcome == "failed":
        raise AssertionError(f"(run with XLA's default CPU codegen) {message[-4000:]}")
    if outcome == "skipped":
        pytest.skip(message)
    if outcome == "missing":
        raise RuntimeError(f"{pyfuncitem.name} did not run in the default-codegen process of {module.name}")
    return True


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def loopback_server():
    """A host listener on 127.0.0.1 that answers every connection with b"host-says-hi": its port. For the
    network-policy tests of the sandboxes (reachable only from a sandbox that shares the host network)."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"host-says-hi")

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
