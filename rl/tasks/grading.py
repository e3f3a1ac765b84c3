"""Grading an agent's patch in a fresh sandbox, with SWE-bench semantics for pytest tasks.

Every grade starts from a new sandbox on the task's base repository, never from the agent's episode
sandbox: the agent's diff is applied with `git apply` after its sections for test files (tests,
conftest.py, pytest config) are dropped, so those stay at the base version; then the hidden tests
are copied over the repository. pytest writes a JUnit report to a path carrying a random nonce, and
the per-test statuses come from that report, not from the log, so a patch that prints "PASSED" lines
changes nothing. The report is cross-checked with pytest's exit code (SWE-bench 5.x's rule): a
non-zero exit with no failed or errored test, or exit 0 with failures, makes the run `invalid`.

SWE-bench rules: a FAIL_TO_PASS test succeeds if PASSED or XFAIL; a PASS_TO_PASS test if PASSED,
XFAIL or SKIPPED; a test missing from the report fails. resolved = every F2P and P2P test succeeds.
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from c2jax.rl.sandbox.base import ExecResult, Sandbox
from c2jax.rl.sandbox.hostfs import HostWorkspace
from c2jax.rl.tasks.harbor import open_task_sandbox, read_reward, run_verifier
from c2jax.rl.tasks.patches import drop_test_files
from c2jax.rl.tasks.results import FAILING, PASSED, SKIPPED, XFAIL, ReportError, parse_junit, parse_pytest_rA
from c2jax.rl.tasks.task import Task

SandboxFactory = Callable[[Path], Sandbox]
STATUSES = ("resolved", "unresolved", "patch_failed", "invalid", "timeout", "unsupported")
_F2P_OK = {PASSED, XFAIL}
_P2P_OK = {PASSED, XFAIL, SKIPPED}
_LOG_TAIL = 4000


@dataclass
class GradeResult:
    task_id: str
    status: str  # one of STATUSES
    reward: float = 0.0
    reason: str = ""
    patch_applied: bool = False
    dropped_test_files: list[str] = field(default_factory=list)
    exit_code: int | None = None
    tests_status: dict[str, str] = field(default_factory=dict)
    fail_to_pass: dict[str, list[str]] = field(default_factory=lambda: {"success": [], "failure": []})
    pass_to_pass: dict[str, list[str]] = field(default_factory=lambda: {"success": [], "failure": []})
    log_tail: str = ""
    wall_s: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)  # Harbor tasks: every numeric key of reward.json

    @property
    def resolved(self) -> bool:
        return self.status == "resolved"

    def to_dict(self) -> dict:
        return asdict(self) | {"resolved": self.resolved}


def _tail(text: str) -> str:
    """Head and tail of a log: collection errors show at the start, the summary at the end."""
    if len(text) <= _LOG_TAIL:
        return text
    return text[: _LOG_TAIL // 4] + "\n[... log cut ...]\n" + text[-3 * _LOG_TAIL // 4:]


def swebench_outcome(statuses: dict[str, str], f2p, p2p) -> tuple[dict, dict, bool]:
    """(F2P split, P2P split, resolved) under SWE-bench's rules; missing tests count as failures."""
    f2p_split = {"success": [t for t in f2p if statuses.get(t) in _F2P_OK],
                 "failure": [t for t in f2p if statuses.get(t) not in _F2P_OK]}
    p2p_split = {"success": [t for t in p2p if statuses.get(t) in _P2P_OK],
                 "failure": [t for t in p2p if statuses.get(t) not in _P2P_OK]}
    return f2p_split, p2p_split, not f2p_split["failure"] and not p2p_split["failure"]


def apply_patch(sandbox: Sandbox, patch: str, workdir: str) -> tuple[bool, str]:
    """(applied, error tail) of applying `patch` to the sandbox's workspace, written to `workdir/agent.patch`:
    with git apply, else patch(1), else (neither in the environment) the host's git on the host tree."""
    if not patch.strip():
        return True, ""
    sandbox.write_text(f"{workdir}/agent.patch", patch)
    res = sandbox.exec(f"git apply --whitespace=nowarn {workdir}/agent.patch", timeout_s=60)
    if res.exit_code == 0:
        return True, ""
    fallback = sandbox.exec(f"patch --batch --forward -p1 --fuzz=5 < {workdir}/agent.patch", timeout_s=60)
    if fallback.exit_code == 0:
        return True, ""
    if res.exit_code == fallback.exit_code == 127 and hasattr(sandbox, "host_path"):
        # neither git nor patch in the environment (a container image without them): apply with the host's
        # git to the workspace's host tree; git apply refuses paths that leave the tree or cross a symlink
        host = subprocess.run(["git", "apply", "--whitespace=nowarn", f"{workdir}/agent.patch"],
                              cwd=sandbox.host_path(), capture_output=True, text=True, timeout=60,
                              env={**os.environ, "GIT_CEILING_DIRECTORIES": str(sandbox.host_path().parent)})
        if host.returncode == 0:
            return True, ""
        return False, _tail(host.stderr + host.stdout)
    return False, _tail(res.stderr + res.stdout)


def _overlay(sandbox: Sandbox, overlay_dir: Path) -> None:
    for src in sorted(overlay_dir.rglob("*")):
        if src.is_file():
            sandbox.write_bytes(src.relative_to(overlay_dir).as_posix(), src.read_bytes())


def _copy_dir(sandbox: Sandbox, src_dir: Path, dest: str, skip: set[str] = frozenset()) -> None:
    for src in sorted(src_dir.rglob("*")):
        rel = src.relative_to(src_dir)
        if src.is_file() and rel.parts[0] not in skip:
            sandbox.write_bytes(f"{dest}/{rel.as_posix()}", src.read_bytes())


def grade(task: Task, patch: str | None, sandbox_factory: SandboxFactory, *,
          python: str = sys.executable, timeout_s: float | None = None) -> GradeResult:
    """Grades `patch` (a unified diff against the task's base repository; None or "" = no change)."""
    start = time.perf_counter()
    if not task.supported:
        return GradeResult(task.id, "unsupported", reason=task.unsupported_reason or "")
    # Harbor's verifier grades the agent's final state as it is: its tests live at /tests, out of reach
    if task.kind == "reward":
        kept, dropped = patch or "", []
    else:
        kept, dropped = drop_test_files(patch or "")
    timeout = timeout_s or task.timeout_s
    # a task in a container image (a SWE-bench instance image) names the image's interpreter
    python = task.metadata.get("python") or python
    sandbox, logs = open_task_sandbox(sandbox_factory, task, "verifier")
    with sandbox:
        workdir = f".c2jax-grade-{secrets.token_hex(8)}"  # the agent cannot predict this name
        applied, err = apply_patch(sandbox, kept, workdir)
        if not applied:
            return GradeResult(task.id, "patch_failed", reason="the patch does not apply", log_tail=err,
                               dropped_test_files=dropped, wall_s=time.perf_counter() - start)
        if task.kind == "pytest":
            result = _grade_pytest(task, sandbox, workdir, python, timeout)
        elif task.kind == "reward":
            if sandbox.exists(workdir):  # test.sh sees the working directory as the agent left it
                sandbox.exec(f"rm -rf {workdir}", timeout_s=60)
            result = _grade_reward(task, sandbox, logs, python, timeout)
        else:
            result = _grade_tb1(task, sandbox, workdir, python, timeout)
    result.patch_applied, result.dropped_test_files = True, dropped
    result.wall_s = time.perf_counter() - start
    return result


def _pytest_env(python: str) -> dict[str, str]:
    # the venv first on PATH, so `python`/`pytest` in scripts are the venv's; installed pytest plugins
    # are not auto-loaded, so what runs is the repository's tests and conftest only
    return {"PATH": f"{Path(python).parent}:/usr/local/bin:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def _read_junit(sandbox: Sandbox, path: str) -> dict[str, str] | None:
    if not sandbox.exists(path):
        return None
    try:
        return parse_junit(sandbox.read_bytes(path))
    except ReportError:
        return None


def _cross_check(exit_code: int, statuses: dict[str, str]) -> str | None:
    """Why the report disagrees with pytest's exit status, or None when consistent."""
    failing = any(s in FAILING for s in statuses.values())
    if exit_code != 0 and not failing:
        return f"pytest exited {exit_code} but reported no failed test"
    if exit_code == 0 and failing:
        return "pytest exited 0 but its report lists failed tests"
    return None


def _run_tests(task: Task, sandbox: Sandbox, cmd: str, timeout: float, env: dict[str, str],
               what: str) -> tuple[ExecResult, GradeResult]:
    """Runs the grading command; the result starts "unresolved" (or "timeout") with the log's tail."""
    res = sandbox.exec(cmd, timeout_s=timeout, env=env)
    out = GradeResult(task.id, "unresolved", exit_code=res.exit_code, log_tail=_tail(res.stdout + res.stderr))
    if res.timed_out:
        out.status, out.reason = "timeout", f"{what} ran past {timeout:g}s"
    return res, out


def _grade_pytest(task: Task, sandbox: Sandbox, workdir: str, python: str, timeout: float) -> GradeResult:
    if task.tests_dir is not None and (task.tests_dir / "overlay").is_dir():
        _overlay(sandbox, task.tests_dir / "overlay")
    test_patch = task.metadata.get("test_patch")  # SWE-bench instances carry their tests as a patch
    if test_patch:
        applied, err = apply_patch(sandbox, test_patch, workdir + "/tests")
        if not applied:
            return GradeResult(task.id, "invalid", reason="the instance's test_patch does not apply", log_tail=err)
    junit = f"{workdir}/junit.xml"
    targets = " ".join(shlex.quote(t) for t in task.test_files)
    cmd = (f"{shlex.quote(python)} -m pytest -p no:cacheprovider -o junit_family=xunit1 --rootdir=. "
           f"--junitxml={junit} -q -rA {targets}")
    res, out = _run_tests(task, sandbox, cmd, timeout, _pytest_env(python), "tests")
    if res.timed_out:
        return out
    statuses = _read_junit(sandbox, junit)
    if statuses is None:
        out.status, out.reason = "invalid", "pytest wrote no readable JUnit report"
        return out
    out.tests_status = statuses
    out.fail_to_pass, out.pass_to_pass, resolved = swebench_outcome(statuses, task.fail_to_pass, task.pass_to_pass)
    mismatch = _cross_check(res.exit_code, statuses)
    if mismatch:
        out.status, out.reason = "invalid", mismatch
    elif resolved:
        out.status, out.reward = "resolved", 1.0
    return out


def _script_env(workdir: str) -> str:
    """Shell prelude for Terminal-Bench 1: /tests and /logs as per-grade directories in the workspace."""
    return f'export TEST_DIR="$PWD/{workdir}/tests" LOGS_DIR="$PWD/{workdir}/logs"; ' \
           f'mkdir -p "$LOGS_DIR/verifier" "$LOGS_DIR/agent"; '


def _grade_reward(task: Task, sandbox: Sandbox, logs: HostWorkspace, python: str, timeout: float) -> GradeResult:
    """Harbor's verifier (rl/tasks/harbor.py): tests/ at /tests, /tests/test.sh from the working
    directory, the reward from /logs/verifier (reward.json first). The venv leads PATH unless the task
    sets PATH itself."""
    task_env = {**task.environment.env, **task.environment.verifier_env} if task.environment else {}
    env = {k: v for k, v in _pytest_env(python).items() if k not in task_env}
    res = run_verifier(sandbox, task, timeout, env)
    out = GradeResult(task.id, "unresolved", exit_code=res.exit_code, log_tail=_tail(res.stdout + res.stderr))
    if res.timed_out:
        out.status, out.reason = "timeout", f"test.sh ran past {timeout:g}s ([verifier].timeout_sec)"
        return out
    reward, rewards, err = read_reward(logs)
    if reward is None:
        out.status, out.reason = "invalid", err
        return out
    out.reward, out.rewards = reward, rewards
    if reward >= 1.0:
        out.status = "resolved"
    return out


def _grade_tb1(task: Task, sandbox: Sandbox, workdir: str, python: str, timeout: float) -> GradeResult:
    """Terminal-Bench 1: run-tests.sh with tests/ at $TEST_DIR; resolved = every parsed test passed.
    PYTEST_ADDOPTS makes any pytest the script runs write a JUnit report, preferred to its log."""
    if (task.tests_dir / "tests").is_dir():
        _copy_dir(sandbox, task.tests_dir / "tests", f"{workdir}/tests")
    sandbox.write_bytes(f"{workdir}/run-tests.sh", (task.tests_dir / "run-tests.sh").read_bytes())
    junit = f"{workdir}/junit.xml"
    env = _pytest_env(python) | {"PYTEST_ADDOPTS": f"-rA -o junit_family=xunit1 --junitxml=$PWD/{junit}"}
    cmd = _script_env(workdir) + f'export PYTEST_ADDOPTS="{env.pop("PYTEST_ADDOPTS")}"; ' \
        f"bash {workdir}/run-tests.sh"
    res, out = _run_tests(task, sandbox, cmd, timeout, env, "run-tests.sh")
    if res.timed_out:
        return out
    statuses = _read_junit(sandbox, junit)
    if statuses is None:
        statuses = parse_pytest_rA(res.stdout)
    out.tests_status = statuses
    if not statuses:
        out.status, out.reason = "invalid", "no test results parsed"
        return out
    mismatch = _cross_check(res.exit_code, statuses)
    if mismatch:
        out.status, out.reason = "invalid", mismatch
    elif all(s in _P2P_OK for s in statuses.values()):
        out.status, out.reward = "resolved", 1.0
    return out
