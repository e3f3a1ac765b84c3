"""Harbor's runtime contract on c2jax sandboxes: where the solution, the tests and the logs appear.

What Harbor does (laude-institute/harbor: `agents/oracle.py`, `verifier/verifier.py`,
`models/trial/paths.py`, the docker environment's `exec`), and what this module does the same way:

- Every command runs under `bash -c` from the environment's working directory (`[environment].workdir`,
  else the image's WORKDIR). Here: the task's workspace is mounted at that directory.
- The oracle uploads the task's whole `solution/` directory to /solution, makes solve.sh executable and
  runs it by path from the working directory, with DEBIAN_FRONTEND=noninteractive and `[solution].env`.
  A solve.sh without a shebang still runs under bash: the kernel refuses to exec it and bash, the
  calling shell, runs it itself. Its output goes to /logs/agent/oracle.txt.
- /logs/agent and /logs/verifier exist in every phase.
- After the agent, tests/ is uploaded to /tests and /tests/test.sh runs by path from the working
  directory with `[verifier].env`, its output in /logs/verifier/test-stdout.txt. The reward is
  /logs/verifier/reward.json when it exists, else /logs/verifier/reward.txt.

Where c2jax differs: the verifier runs in a fresh sandbox holding the agent's diff (never the episode's
sandbox, so nothing the agent left outside the workspace, or in /logs, reaches the grade); commands run
as an unprivileged user on a read-only system, without network unless the run allows it for tasks
that permit the public internet (`TaskEnvironment.shares_network`).
"""

from __future__ import annotations

import json
import math
import shlex
import tempfile
from pathlib import Path
from typing import Any

from c2jax.rl.sandbox.base import Sandbox, SandboxPathError
from c2jax.rl.sandbox.hostfs import HostWorkspace
from c2jax.rl.tasks.task import Task

SOLUTION_DIR = "/solution"
TESTS_DIR = "/tests"
LOGS_DIR = "/logs"
ORACLE_ENV = {"DEBIAN_FRONTEND": "noninteractive"}


def open_task_sandbox(factory, task: Task, phase: str) -> tuple[Sandbox, HostWorkspace | None]:
    """A sandbox on the task's repository with its task.toml settings for `phase` ("agent", "solution",
    "verifier"): workdir, env, limits, and `network=True` when the factory allows the network
    (`factory.allow_network`, see `c2jax.rl.tasks.build.sandbox_factory`) and the task permits the
    public internet. Without settings the factory is called as before, `factory(repo_dir)`. The
    one entry point for eval, grading, validation and RL episodes alike; a Harbor task also gets an
    empty /logs, returned as host-side access."""
    allow = bool(getattr(factory, "allow_network", False))
    options = task.environment.sandbox_options(phase, allow_network=allow) if task.environment is not None else {}
    sandbox = factory(task.repo_dir, **options) if options else factory(task.repo_dir)
    try:
        return sandbox, upload_logs(sandbox) if task.harbor else None
    except BaseException:
        sandbox.close()
        raise


def upload_logs(sandbox: Sandbox) -> HostWorkspace:
    """An empty /logs with agent/, verifier/ and artifacts/; returns safe host-side access to it."""
    with tempfile.TemporaryDirectory(prefix="c2jax-logs-") as tmp:
        for sub in ("agent", "verifier", "artifacts"):
            (Path(tmp) / sub).mkdir()
        return HostWorkspace(sandbox.upload_dir(tmp, LOGS_DIR))


def _solve_script(task: Task) -> Path:
    script = task.path / "solution" / "solve.sh" if task.path is not None else None
    if script is None or not script.is_file():
        raise FileNotFoundError(f"task {task.id}: no solution/solve.sh for the oracle")
    return script


def upload_solution(sandbox: Sandbox, task: Task) -> None:
    """Harbor's oracle setup: the whole solution/ directory at /solution."""
    sandbox.upload_dir(_solve_script(task).parent, SOLUTION_DIR)


def solve_command(task: Task) -> str:
    """The oracle's command: solve.sh made executable and run by path under bash, from the working
    directory, with Harbor's oracle environment and `[solution].env`."""
    _solve_script(task)
    env = {**ORACLE_ENV, **(task.environment.solution_env if task.environment is not None else {})}
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    script = f"{SOLUTION_DIR}/solve.sh"
    inner = f"chmod +x {script} && {script} 2>&1 | tee {LOGS_DIR}/agent/oracle.txt; exit ${{PIPESTATUS[0]}}"
    return f"env {assignments} bash -c {shlex.quote(inner)}"


def run_verifier(sandbox: Sandbox, task: Task, timeout_s: float, env: dict[str, str] | None = None):
    """Uploads tests/ to /tests and runs /tests/test.sh by path under bash from the working directory
    (the sandbox's env holds `[verifier].env`; `env` adds to it); returns its ExecResult."""
    sandbox.upload_dir(task.tests_dir, TESTS_DIR)
    script = f"{TESTS_DIR}/test.sh"
    inner = f"chmod +x {script} && {script} 2>&1 | tee {LOGS_DIR}/verifier/test-stdout.txt; exit ${{PIPESTATUS[0]}}"
    return sandbox.exec(f"bash -c {shlex.quote(inner)}", timeout_s=timeout_s, env=env)


# ---------------------------------------------------------------------------------------------- reward
def _numbers(data: Any) -> dict[str, float]:
    return {k: float(v) for k, v in data.items()
            if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)}


def read_reward(logs: HostWorkspace) -> tuple[float | None, dict[str, float], str]:
    """(reward, every numeric reward key, error) from /logs/verifier, Harbor's order: reward.json when
    it exists (an object; its numeric values are the rewards, others ignored; when it has no "reward"
    key, reward.txt supplies it if present, else the mean of its values), else reward.txt (one number).
    An empty, unparsable, non-finite or missing reward is an error. Reads refuse symlinks that leave
    the logs directory, so a planted link cannot make the host read its own files."""
    js, txt = "verifier/reward.json", "verifier/reward.txt"
    try:
        has_js, has_txt = logs.exists(js), logs.exists(txt)
        if has_js:
            raw = logs.read_bytes(js).decode("utf-8", errors="replace")
            if not raw.strip():
                return None, {}, "reward.json is empty"
            try:
                data = json.loads(raw)
            except json.JSONDecodeError as e:
                return None, {}, f"reward.json is not JSON: {e}"
            if not isinstance(data, dict):
                return None, {}, "reward.json must be a JSON object"
            rewards = _numbers(data)
            if "reward" not in rewards and has_txt:
                value, err = _text_reward(logs.read_bytes(txt))
                if value is not None:
                    rewards["reward"] = value
            if not rewards:
                return None, {}, "reward.json holds no numeric reward"
            value = rewards["reward"] if "reward" in rewards else sum(rewards.values()) / len(rewards)
        elif has_txt:
            value, err = _text_reward(logs.read_bytes(txt))
            if value is None:
                return None, {}, err
            rewards = {"reward": value}
        else:
            return None, {}, "the test script wrote neither /logs/verifier/reward.json nor reward.txt"
    except (SandboxPathError, OSError) as e:
        return None, {}, f"the reward file could not be read safely: {e}"
    if not all(math.isfinite(v) for v in rewards.values()) or not math.isfinite(value):
        return None, {}, f"reward is not finite: {rewards}"
    return value, rewards, ""


def _text_reward(data: bytes) -> tuple[float | None, str]:
    text = data.decode("utf-8", errors="replace").strip()
    if not text:
        return None, "reward.txt is empty"
    try:
        return float(text), ""
    except ValueError:
        return None, f"reward.txt is not a number: {text[:80]!r}"
