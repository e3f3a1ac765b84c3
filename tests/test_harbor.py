"""Harbor conformance on the fixture tasks in tests/fixtures/harbor: the oracle resolves each runnable
task and the nop agent scores 0 on it; task.toml fields are honoured (workdir, env, limits, timeouts)
or the task is refused with the field named; the reward files are read in Harbor's order. A plain
Dockerfile's ENV persists into every phase; the RL environment opens tasks as eval does; the file tools
work in a task's workdir; the network policy (offline unless allowed) is visible and switchable."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from c2jax.rl.eval import EvalConfig, evaluate
from c2jax.rl.eval.agents import scripted_factory
from c2jax.rl.sandbox import Limits, LocalSandbox
from c2jax.rl.sandbox.base import SandboxError
from c2jax.rl.sandbox.bwrap import check_mount_point
from c2jax.rl.sandbox.hostfs import HostWorkspace
from c2jax.rl.tasks import load_task
from c2jax.rl.tasks.build import sandbox_factory, validate_task
from c2jax.rl.tasks.harbor import open_task_sandbox, read_reward
from c2jax.rl.tasks.task import TaskFormatError, load_tasks

FIXTURES = Path(__file__).parent / "fixtures" / "harbor"
RUNNABLE = ("dockerfile-env", "env-and-limits", "reward-json-first", "solution-dir")


@pytest.fixture(scope="module")
def bwrap():
    from c2jax.rl.sandbox.bwrap import bwrap_unusable_reason

    reason = bwrap_unusable_reason()
    if reason:
        pytest.skip(reason)
    return sandbox_factory("bwrap")


def _run(mode: str, factory):
    res = evaluate(load_tasks(FIXTURES), scripted_factory(mode), 1,
                   config=EvalConfig(sandbox="bwrap", concurrency=1), sandbox_factory=factory, progress=False)
    return res, {r.task_id: r for r in res.results}


@pytest.fixture(scope="module")
def oracle(bwrap):
    return _run("oracle", bwrap)


@pytest.fixture(scope="module")
def nop(bwrap):
    return _run("nop", bwrap)


# ------------------------------------------------------------------------------------ oracle and nop
@pytest.mark.parametrize("task_id", RUNNABLE)
def test_oracle_resolves_runnable_fixture(oracle, task_id):
    r = oracle[1][task_id]
    assert (r.status, r.reward) == ("resolved", 1.0), (r.error, r.grade)


@pytest.mark.parametrize("task_id", RUNNABLE)
def test_nop_scores_zero(nop, task_id):
    r = nop[1][task_id]
    assert (r.status, r.reward, r.patch) == ("unresolved", 0.0, ""), r.grade


def test_reward_json_wins_over_decoy_reward_txt(oracle, nop):
    # test.sh writes reward.txt = 1 every time; the nop's 0 can only come from reward.json
    assert nop[1]["reward-json-first"].grade["rewards"] == {"reward": 0.0, "style": 0.5}
    assert oracle[1]["reward-json-first"].grade["rewards"] == {"reward": 1.0, "style": 0.5}


def test_docker_image_task_is_listed_unsupported(oracle):
    res, by_id = oracle
    assert res.config["unsupported"] == ["refused-docker-image"]
    assert "refused-docker-image" not in by_id


def test_agent_timeout_cuts_the_oracle_off(oracle):
    r = oracle[1]["agent-timeout"]  # solve.sh sleeps 30 s under [agent].timeout_sec = 2
    assert (r.status, r.reward) == ("unresolved", 0.0)
    assert r.episode_s < 15


def test_verifier_timeout_is_a_timeout(oracle):
    r = oracle[1]["verifier-timeout"]  # test.sh sleeps 30 s under [verifier].timeout_sec = 1
    assert r.status == "timeout" and "[verifier].timeout_sec" in r.grade["reason"]


def test_validate_uses_harbors_oracle(bwrap):
    v = validate_task(load_task(FIXTURES / "solution-dir"), bwrap)
    assert v.ok, v.reason
    assert (v.base.reward, v.reference.reward) == (0.0, 1.0)


def test_agent_phase_sandbox(bwrap):
    """The workdir is where the agent starts; /logs exists; /solution and /tests do not; the
    task's env and limits are the sandbox's."""
    task = load_task(FIXTURES / "solution-dir")
    sandbox, logs = open_task_sandbox(bwrap, task, "agent")
    with sandbox:
        r = sandbox.exec("pwd; ls /logs; test -e /solution || echo no-solution; test -e /tests || echo no-tests")
        assert r.stdout.split() == ["/app", "agent", "artifacts", "verifier", "no-solution", "no-tests"]
        assert logs is not None and logs.exists("verifier")
    limited = load_task(FIXTURES / "env-and-limits")
    sandbox, _ = open_task_sandbox(bwrap, limited, "verifier")
    with sandbox:
        assert (sandbox.limits.memory_bytes, sandbox.limits.cpus, sandbox.limits.file_size_bytes) == \
            (1024**3, 1.0, 512 * 1024**2)
        r = sandbox.exec('echo "$GREETING|$EXPECTED|$WHO"')
        assert r.stdout.strip() == "hello|hello from solve|"


def test_cpu_quota_written_where_the_cpu_controller_is_writable(tmp_path):
    from c2jax.rl.sandbox.bwrap import BwrapSandbox, bwrap_unusable_reason

    if bwrap_unusable_reason():
        pytest.skip(bwrap_unusable_reason())
    (tmp_path / "f").write_text("x\n")
    with BwrapSandbox(tmp_path, limits=Limits(cpus=0.5)) as sb:
        if not sb.cpu_limited:
            pytest.skip("no writable cgroup cpu controller here: Limits.cpus is not enforced")
        quotas = [d / "cpu.cfs_quota_us" for d in sb._cgroup.dirs if (d / "cpu.cfs_quota_us").exists()]
        quotas += [d / "cpu.max" for d in sb._cgroup.dirs if (d / "cpu.max").exists()]
        assert quotas and quotas[0].read_text().split()[0] == "50000"


# ------------------------------------------------------------------------------------------ refusals
def _task_dir(tmp_path: Path, toml: str) -> Path:
    dest = tmp_path / "t"
    shutil.copytree(FIXTURES / "reward-json-first", dest)
    (dest / "task.toml").write_text(toml)
    return dest


@pytest.mark.parametrize("toml,field", [
    ('[environment]\ngpus = 1\n', "[environment].gpus"),
    ('[environment]\nos = "windows"\n', "[environment].os"),
    ('[environment]\nhealthcheck = { command = "true" }\n', "[environment].healthcheck"),
    ('[environment]\nmcp_servers = [{ name = "x", url = "http://x" }]\n', "[environment].mcp_servers"),
    ('[environment]\nworkdir = "/usr/src/app"\n', "[environment].workdir"),
    ('[environment]\nworkdir = "/"\n', "[environment].workdir"),
    ('[environment]\nenv = { TOKEN = "${C2JAX_TEST_SURELY_UNSET_VARIABLE}" }\n', "[environment].env.TOKEN"),
    ('[agent]\nuser = "root"\n', "[agent].user"),
    ('[verifier]\nuser = "root"\n', "[verifier].user"),
    ('[verifier]\nenvironment_mode = "separate"\n', "[verifier].environment_mode"),
    ('steps = [{ name = "one" }]\n', "steps"),
])
def test_refused_with_the_field_named(tmp_path, toml, field):
    task = load_task(_task_dir(tmp_path, toml))
    assert not task.supported and task.unsupported_reason.startswith(field), task.unsupported_reason
    assert task.repo_dir is None


def test_refused_docker_image_fixture():
    task = load_task(FIXTURES / "refused-docker-image")
    assert task.unsupported_reason.startswith("[environment].docker_image = 'example/tb2-task:20251031'")


@pytest.mark.parametrize("toml,field", [
    ('[environment]\nmemory = "lots"\n', "[environment].memory"),
    ('[environment]\ncpus = -1\n', "[environment].cpus"),
    ('[environment]\nmemory_mb = 1.5\n', "[environment].memory_mb"),
    ('[environment]\nnetwork_mode = "internet"\n', "[environment].network_mode"),
    ('[environment]\nallow_internet = "yes"\n', "[environment].allow_internet"),
    ('[environment]\nenv = "A=1"\n', "[environment].env"),
    ('[agent]\ntimeout_sec = 0\n', "[agent].timeout_sec"),
    ('environment = 3\n', "[environment]"),
])
def test_malformed_field_is_a_format_error(tmp_path, toml, field):
    with pytest.raises(TaskFormatError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_task(_task_dir(tmp_path, toml))


@pytest.mark.parametrize("toml,network,memory", [
    ("", "public", None),  # Harbor's default
    ('[environment]\nallow_internet = false\nmemory = "512M"\n', "no-network", 512),
    ('[environment]\nallowed_hosts = ["pypi.org"]\nmemory_mb = 300\n', "allowlist", 300),
    ('[environment]\nnetwork_mode = "no-network"\nallow_internet = true\nstorage = "2G"\n', "no-network", None),
])
def test_network_baseline_and_sizes(tmp_path, toml, network, memory):
    env = load_task(_task_dir(tmp_path, toml)).environment
    assert (env.network, env.memory_mb) == (network, memory)


def test_mount_points_and_local_backend(tmp_path):
    for bad in ("relative", "/", "/usr", "/etc/app", "/tmp/work", "/proc/x"):
        with pytest.raises(ValueError):
            check_mount_point(bad, "workdir")
    assert check_mount_point("/app/./src/", "workdir") == "/app/src"
    (tmp_path / "f").write_text("x\n")
    with pytest.raises(SandboxError, match="workdir '/app'"):
        LocalSandbox(tmp_path, allow_unisolated=True, workdir="/app")
    with LocalSandbox(tmp_path, allow_unisolated=True, env={"A": "1"}) as sb:
        assert sb.exec("echo $A").stdout.strip() == "1"
        with pytest.raises(SandboxError, match="cannot place"):
            sb.upload_dir(tmp_path, "/solution")


# ---------------------------------------------------------------------------------------- reward files
def _logs(tmp_path: Path, files: dict[str, str]) -> HostWorkspace:
    (tmp_path / "verifier").mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (tmp_path / "verifier" / name).write_text(text)
    return HostWorkspace(tmp_path)


@pytest.mark.parametrize("files,reward,error", [
    ({"reward.txt": "1\n", "reward.json": json.dumps({"reward": 0.25})}, 0.25, ""),
    ({"reward.txt": "0.5", "reward.json": json.dumps({"tests": 1.0})}, 0.5, ""),  # the scalar from reward.txt
    ({"reward.json": json.dumps({"a": 1.0, "b": 0.0, "why": "text"})}, 0.5, ""),  # mean of the numbers
    ({"reward.txt": " 0.75 \n"}, 0.75, ""),
    ({"reward.txt": ""}, None, "reward.txt is empty"),
    ({"reward.txt": "pass"}, None, "not a number"),
    ({"reward.json": "[1]"}, None, "JSON object"),
    ({"reward.json": ""}, None, "reward.json is empty"),
    ({"reward.json": json.dumps({"ok": True})}, None, "no numeric reward"),
    ({"reward.txt": "nan"}, None, "not finite"),
    ({}, None, "neither"),
])
def test_read_reward(tmp_path, files, reward, error):
    value, _, err = read_reward(_logs(tmp_path, files))
    assert value == reward and error in err


def test_reward_symlink_out_of_logs_is_refused(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("0.123")
    logs = _logs(tmp_path / "logs", {})
    (tmp_path / "logs" / "verifier" / "reward.txt").symlink_to(secret)
    value, _, err = read_reward(logs)
    assert value is None and "safely" in err and "0.123" not in err


# ------------------------------------------------------------------------------ environment definitions
@pytest.mark.parametrize("text,reason", [
    ('FROM python:3.13\nWORKDIR /app\nCOPY . /app\nEXPOSE 80\nCMD ["bash"]\n', None),
    ("FROM python:3.13\nWORKDIR /srv\nWORKDIR app\n# a comment\nCOPY . .\n", None),
    ("FROM a AS build\nRUN make\nFROM c\nCOPY --from=build /x /x\n",
     "Dockerfile: multi-stage build (FROM at lines 1, 3)"),
    ("FROM x\nRUN --mount=type=cache,target=/root/.cache pip install y\n", "Dockerfile line 2: RUN --mount"),
    ("FROM x\nADD https://example.com/a.tgz /opt/\n", "Dockerfile line 2: ADD of a URL"),
    ("FROM x\nWORKDIR /app\nCOPY src/ /app/source\nRUN apt-get update && \\\n    apt-get install -y make\n",
     "Dockerfile line 4: RUN apt-get update && apt-get install -y make: a build step needs the container"),
    ("FROM x\nWORKDIR /app\nCOPY src/ /app/source\n", "Dockerfile line 3: COPY src/ /app/source: c2jax mounts the"),
    ("FROM x\nVOLUME /data\n", "Dockerfile line 2: VOLUME is not supported"),
    ("FROM x\nWORKDIR /app\nCOPY app.py /app/\nCOPY src src\nCOPY app.py lib ./\n",
     "Dockerfile line 5: COPY app.py lib ./"),  # a directory's contents land in ./, not ./lib
    ("FROM x\nWORKDIR /app\nCOPY app.py /app/\nCOPY src/ /app/src\nCOPY lib lib/\nCOPY app.py ./\n", None),
    ("FROM x\nWORKDIR /app\nCOPY app.py /app/main.py\n", "Dockerfile line 3: COPY app.py /app/main.py"),
    ("FROM x\nWORKDIR /app\nCOPY src/ .\n", "Dockerfile line 3: COPY src/ ."),
])
def test_dockerfile_reasons(tmp_path, text, reason):
    from c2jax.rl.tasks import dockerfile

    (tmp_path / "src").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "app.py").write_text("")
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    got = dockerfile.unsupported_reason(path)
    assert got == reason if reason is None else got.startswith(reason), got


def test_dockerfile_workdir_is_the_tasks_working_directory(tmp_path):
    dest = _task_dir(tmp_path, "")
    (dest / "environment" / "Dockerfile").write_text("FROM python:3.13\nWORKDIR /srv\nWORKDIR app\nCOPY . .\n")
    task = load_task(dest)
    assert task.supported and task.environment.workdir == "/srv/app"
    (dest / "task.toml").write_text('[environment]\nworkdir = "/opt/w"\n')
    assert load_task(dest).environment.workdir == "/opt/w"  # task.toml wins, as in Harbor


@pytest.mark.parametrize("compose,reason", [
    ("services:\n  main:\n    devices: ['/dev/kvm:/dev/kvm']\n", "needs KVM"),
    ("services:\n  main: {}\n  db:\n    image: postgres\n", "compose environments"),
])
def test_compose_environment_is_refused(tmp_path, compose, reason):
    dest = _task_dir(tmp_path, "")
    (dest / "environment" / "docker-compose.yaml").write_text(compose)
    task = load_task(dest)
    assert not task.supported and task.unsupported_reason.startswith("environment/docker-compose.yaml")
    assert reason in task.unsupported_reason


# ------------------------------------------------------------------------------------ Dockerfile ENV
@pytest.mark.parametrize("text,expected", [
    ("FROM x\nENV A=1 B=\"two words\" C='no $A' D=a\\ b\n", {"A": "1", "B": "two words", "C": "no $A", "D": "a b"}),
    ("FROM x\nENV P=/opt/bin:$PATH Q=${PATH}\n", {"P": "/opt/bin:/usr/bin", "Q": "/usr/bin"}),  # base = sandbox's
    ("FROM x\nENV LEGACY the rest of $HOME\n", {"LEGACY": "the rest of /tmp"}),
    ("ARG V=1\nFROM x\nARG V\nARG W=w\nENV T=v$V-${W} U=${NOPE:-dflt} S=${W:+set} E=${NOPE}\n",
     {"T": "v1-w", "U": "dflt", "S": "set", "E": ""}),
    ("ARG V=1\nFROM x\nENV T=v$V\n", {"T": "v"}),  # a global ARG is out of scope unless redeclared
    ("FROM x\nENV A=1\nENV B=$A$A \\\n    A=2\nENV C=$A\n", {"A": "2", "B": "11", "C": "2"}),
    ("FROM x\nWORKDIR /app\nCOPY . .\n", {}),
])
def test_dockerfile_env(tmp_path, text, expected):
    from c2jax.rl.tasks import dockerfile

    path = tmp_path / "Dockerfile"
    path.write_text(text)
    assert dockerfile.env(path, base={"PATH": "/usr/bin", "HOME": "/tmp"}) == expected


@pytest.mark.parametrize("line,reason", [
    ("ENV LONELY", "Dockerfile line 2: ENV 'LONELY' sets no value"),
    ("ENV A=1 B", "Dockerfile line 2: ENV 'A=1 B' mixes NAME=value pairs with a bare 'B'"),
    ("ENV 1A=x", "Dockerfile line 2: ENV '1A=x': '1A' is not a variable name"),
    ("ENV A=\x00", "Dockerfile line 2: ENV A holds a NUL byte"),
    ("ENV A-B value", "Dockerfile line 2: ENV 'A-B value' is not NAME value"),
])
def test_malformed_dockerfile_env_refuses_the_task(tmp_path, line, reason):
    dest = _task_dir(tmp_path, "")
    (dest / "environment" / "Dockerfile").write_text(f"FROM x\n{line}\n")
    task = load_task(dest)
    assert not task.supported and task.unsupported_reason.startswith(reason), task.unsupported_reason


def test_dockerfile_env_reaches_every_phase(bwrap, oracle, nop):
    """The fixture's solve.sh runs `greet` from ENV PATH and prints ENV GREETING; test.sh checks both,
    the ARG default and that [environment].env wins over an ENV of the same name (oracle 1, nop 0 above)."""
    task = load_task(FIXTURES / "dockerfile-env")
    assert task.environment.env["GREETING"] == "hello from the image"
    assert task.environment.env["OVERRIDDEN"] == "by task.toml"
    sandbox, _ = open_task_sandbox(bwrap, task, "agent")
    with sandbox:
        r = sandbox.exec("pwd; greet; command -v python3 >/dev/null && echo venv-still-on-path")
    assert r.stdout.split("\n")[:3] == ["/app", "hello from the image", "venv-still-on-path"], r.stderr


def test_tb1_dockerfile_env_is_applied(tmp_path, bwrap):
    """A Terminal-Bench 1 task's Dockerfile ENV reaches its solution.sh and its tests (validation)."""
    d = tmp_path / "tb1"
    (d / "tests").mkdir(parents=True)
    (d / "task.yaml").write_text("instruction: Write $MODE to mode.txt\nmax_test_timeout_sec: 60\n")
    (d / "run-tests.sh").write_text("#!/bin/bash\npython -m pytest $TEST_DIR/test_outputs.py\n")
    (d / "tests" / "test_outputs.py").write_text(
        "import os\nfrom pathlib import Path\n\n\ndef test_mode():\n"
        "    assert os.environ['MODE'] == 'strict' == Path('mode.txt').read_text().strip()\n")
    (d / "solution.sh").write_text('echo "$MODE" > mode.txt\n')
    (d / "Dockerfile").write_text("FROM x\nWORKDIR /app\nENV MODE=strict\nCOPY . /app\n")
    task = load_task(d)
    assert task.supported and task.environment.env == {"MODE": "strict"}
    assert task.environment.network == "public"  # Terminal-Bench 1 containers have the internet
    v = validate_task(task, bwrap)
    assert v.ok, v.reason
    assert (list(v.base.tests_status.values()), list(v.reference.tests_status.values())) == (["FAILED"], ["PASSED"])


# ------------------------------------------------------------------------------- tools in the workdir
def test_file_tools_in_a_workdir_task_resolve_it(bwrap):
    """A scripted agent writes /app/answer.py with write_file (an absolute path inside the task's
    workdir), reads it back relative to the workdir, and the task's own test.sh resolves it."""
    from c2jax.rl.harness import ScriptedAgent

    def agent(task, sample):
        return ScriptedAgent([
            [{"name": "write_file", "arguments": {"path": "/app/answer.py", "content": 'print("forty-two")\n'}}],
            [{"name": "read_file", "arguments": {"path": "answer.py"}},
             {"name": "list_dir", "arguments": {"path": "/app"}},
             {"name": "read_file", "arguments": {"path": "/workspace/answer.py"}}],
            [{"name": "submit", "arguments": {"message": "wrote it"}}]])

    res = evaluate([load_task(FIXTURES / "solution-dir")], agent, 1, config=EvalConfig(concurrency=1),
                   sandbox_factory=bwrap, progress=False)
    r = res.results[0]
    assert (r.status, r.reward) == ("resolved", 1.0), (r.error, r.grade)
    assert "+print(\"forty-two\")" in r.patch and "answer.py" in r.patch


def test_workdir_tools_observations(bwrap):
    from c2jax.rl.harness import EpisodeTask, ScriptedAgent, default_registry, run_episode

    task = load_task(FIXTURES / "solution-dir")
    sandbox, _ = open_task_sandbox(bwrap, task, "agent")
    agent = ScriptedAgent([
        [{"name": "write_file", "arguments": {"path": "/app/pkg/x.py", "content": "X = 1\n"}},
         {"name": "read_file", "arguments": {"path": "pkg/x.py"}},
         {"name": "grep", "arguments": {"pattern": "X =", "path": "/app"}},
         {"name": "run_terminal_cmd", "arguments": {"command": "cat /app/pkg/x.py"}},
         {"name": "read_file", "arguments": {"path": "/workspace/pkg/x.py"}}]])
    with sandbox:
        traj = run_episode(agent, sandbox, EpisodeTask(task.id, task.instruction), default_registry())
    obs = traj.steps[0].observations
    assert [o.is_error for o in obs] == [False, False, False, False, True], [o.output for o in obs]
    assert obs[0].output.startswith("Created pkg/x.py") and "X = 1" in obs[1].output
    assert "pkg/x.py:1:X = 1" in obs[2].output and "X = 1" in obs[3].output
    assert "relative to /app" in obs[4].output
    assert "a repository at /app." in traj.segments[0].messages[0]["content"]


# ---------------------------------------------------------------------------------------- RL path
def _rl_host(tasks: dict, allow_network: bool = False):
    from c2jax.rl.harness import EpisodeConfig
    from c2jax.rl.system.config import EnvConfig
    from c2jax.rl.system.envs import EnvironmentHost

    episode = EpisodeConfig(max_turns=4, max_model_tokens=2000, max_new_tokens_per_turn=400,
                            max_context_tokens=16384, tool_schemas="signatures", wall_clock_s=60.0)
    cfg = EnvConfig(kind="ladder", sandbox="bwrap", allow_network=allow_network, episode=episode)
    host = EnvironmentHost(cfg, tasks)

    def env_call(method, *args):
        return getattr(host, method)(*args)

    return host, env_call


def test_rl_environment_opens_tasks_as_eval_does(bwrap):
    """The RL environment worker opens a Harbor task's sandbox through open_task_sandbox: the workdir,
    the task's env (agent phase only), its limits and /logs, as in c2jax eval."""
    from c2jax.rl.system.envs import RemoteSandbox

    host, env_call = _rl_host({"solution-dir": FIXTURES / "solution-dir",
                               "env-and-limits": FIXTURES / "env-and-limits",
                               "agent-timeout": FIXTURES / "agent-timeout"})
    remote = RemoteSandbox(env_call, "solution-dir")
    try:
        assert remote.workdir == "/app" and remote.network is False and remote.agent_timeout_s is None
        r = remote.exec("pwd; ls /logs; test -e /tests || echo no-tests")
        assert r.stdout.split() == ["/app", "agent", "artifacts", "verifier", "no-tests"]
    finally:
        remote.close()
    assert host._sandboxes == {}
    remote = RemoteSandbox(env_call, "env-and-limits")
    try:
        limits = host._sandboxes[remote.sid].limits
        assert (limits.memory_bytes, limits.cpus, limits.file_size_bytes) == (1024**3, 1.0, 512 * 1024**2)
        r = remote.exec('echo "$GREETING|$FROM_HOST|$EXPECTED|$WHO"')
        assert r.stdout.strip() == "hello|default||"  # [verifier].env and [solution].env stay in their phases
    finally:
        remote.close()
    remote = RemoteSandbox(env_call, "agent-timeout")
    remote.close()
    assert remote.agent_timeout_s == 2.0


def test_rl_remote_sandbox_runs_glob_and_grep_on_the_environment_worker(bwrap):
    """The rollout side has no host tree: glob / grep run on the environment worker, with the workdir's
    path rules, and a refused path or a missing directory comes back as the model's error."""
    from c2jax.rl.harness import ToolCall, ToolContext, default_registry
    from c2jax.rl.system.envs import RemoteSandbox

    host, env_call = _rl_host({"solution-dir": FIXTURES / "solution-dir"})
    reg = default_registry()
    remote = RemoteSandbox(env_call, "solution-dir")
    try:
        ctx = ToolContext(remote, workdir=remote.workdir)

        def run(name, arguments):
            return reg.execute(ToolCall("c", name, arguments), ctx)

        assert run("write_file", {"path": "/app/src/x.py", "content": "X = 1\n"}).output.startswith("Created")
        assert run("grep", {"pattern": "X =", "path": "/app/src"}).output.startswith("src/x.py:1:X = 1")
        assert run("glob", {"pattern": "*.py"}).output == "src/x.py"
        refused = run("grep", {"pattern": "x", "path": "/workspace"})
        assert refused.is_error and refused.output.startswith("Error: path refused") and "/app" in refused.output
        missing = run("glob", {"pattern": "*", "path": "nope"})
        assert missing.is_error and "nope does not exist" in missing.output
    finally:
        remote.close()


class _ScriptedPolicy:
    """A TokenPolicy that emits fixed assistant texts, one per call, and keeps the prompts it saw."""

    def __init__(self, renderer, texts):
        self.renderer, self.texts, self.prompts = renderer, list(texts), []

    def generate_tokens(self, prompt_ids, *, max_new_tokens, stop_token_ids, temperature, seed):
        from types import SimpleNamespace

        self.prompts.append(self.renderer.decode(list(prompt_ids)))
        ids = self.renderer.encode_env(self.texts.pop(0)) + [self.renderer.im_end_id]
        return SimpleNamespace(token_ids=ids, logprobs=[0.0] * len(ids), policy_versions=[0] * len(ids),
                               expert_ids=None, finish_reason="stop")


def test_rl_episode_on_a_workdir_task_resolves_it(bwrap):
    """A training episode (run_ladder_episode, the sampler as agent) on the /app task: the policy's
    write_file to /app/answer.py lands in the workspace and the environment worker grades it 1.0."""
    from c2jax.rl.harness import ChatRenderer
    from c2jax.rl.harness.chat_format import render_tool_call
    from c2jax.rl.system.envs import byte_tokenizer, run_ladder_episode

    host, env_call = _rl_host({"solution-dir": FIXTURES / "solution-dir"})
    renderer = ChatRenderer(byte_tokenizer())
    policy = _ScriptedPolicy(renderer, [
        render_tool_call("write_file", {"path": "/app/answer.py", "content": 'print("forty-two")\n'}),
        render_tool_call("submit", {"message": "done"})])
    task = load_task(FIXTURES / "solution-dir")
    rollout = run_ladder_episode(policy, renderer, env_call, "solution-dir", task.instruction, host.cfg,
                                 seed=0, max_retries=0)
    assert rollout.error is None and (rollout.reward, rollout.finish_reason) == (1.0, "submitted")
    assert "a repository at /app." in policy.prompts[0] and "/workspace" not in policy.prompts[0]
    assert host._sandboxes == {}


# ---------------------------------------------------------------------------------------- network
def _network_task(tmp_path: Path, name: str, environment: str) -> Path:
    """A task whose test.sh rewards 1 when the host's loopback listener (port from the host's
    C2JAX_TEST_NET_PORT, resolved when the task loads) answers from inside the verifier's sandbox."""
    dest = tmp_path / name
    shutil.copytree(FIXTURES / "reward-json-first", dest)
    (dest / "task.toml").write_text(f'[environment]\n{environment}\n\n[verifier]\ntimeout_sec = 60.0\n'
                                    'env = { PORT = "${C2JAX_TEST_NET_PORT}" }\n')
    (dest / "tests" / "test.sh").write_text(
        "#!/bin/bash\nv=0\n"
        "if python3 -c \"import os, socket; socket.create_connection(('127.0.0.1', int(os.environ['PORT'])), 3)\"; "
        "then v=1; fi\necho $v > /logs/verifier/reward.txt\n")
    return dest


@pytest.fixture
def loopback(monkeypatch, loopback_server):
    monkeypatch.setenv("C2JAX_TEST_NET_PORT", str(loopback_server))


@pytest.mark.parametrize("environment,allow,reward,note", [
    ("", False, 0.0, "ran offline (allow_network is off)"),  # Harbor's default is the public internet
    ("", True, 1.0, None),
    ('network_mode = "public"', True, 1.0, None),
    ('allowed_hosts = ["127.0.0.1"]', True, 0.0, "c2jax does not enforce host allowlists"),
    ("allow_internet = false", True, 0.0, None),
])
def test_network_policy_toggles_the_sandbox_network(tmp_path, loopback, bwrap, environment, allow, reward, note):
    """Offline unless the run allows the network AND the task permits the public internet; the eval
    results and summary.md list every task that got less than its task.toml permits."""
    from c2jax.rl.eval.report import summary_markdown

    task = load_task(_network_task(tmp_path, "net", environment))
    factory = sandbox_factory("bwrap", allow_network=allow)
    res = evaluate([task], scripted_factory("nop"), 1, config=EvalConfig(concurrency=1, allow_network=allow),
                   sandbox_factory=factory, progress=False)
    r = res.results[0]
    assert r.reward == reward and r.status in ("resolved", "unresolved"), (r.grade, r.error)
    restricted = res.config["network_restricted"]
    assert res.config["allow_network"] is allow
    if note is None:
        assert restricted == {}
    else:
        assert note in restricted["net"]
        md = summary_markdown("x", res.summary(EvalConfig()), network_restricted=restricted)
        assert "## Network" in md and "`net`" in md and note in md


def test_factory_refuses_network_it_was_not_allowed(tmp_path):
    (tmp_path / "f").write_text("x\n")
    with pytest.raises(ValueError, match="allow_network"):
        sandbox_factory("bwrap")(tmp_path, network=True)
    with pytest.raises(ValueError, match="sandbox must be one of bwrap, local, docker, podman, auto"):
        sandbox_factory("firecracker")
    with pytest.raises(ValueError, match="does not allow the network"):  # config and factory disagree
        evaluate([load_task(FIXTURES / "reward-json-first")], scripted_factory("nop"), 1,
                 config=EvalConfig(allow_network=True), sandbox_factory=sandbox_factory("bwrap"), progress=False)


def test_tasks_validate_lists_tasks_that_permit_more_network(tmp_path, loopback, bwrap, capsys):
    import argparse

    from c2jax.rl.tasks.cli import run

    suite = tmp_path / "suite"
    suite.mkdir()
    _network_task(suite, "wants-net", "")
    shutil.copytree(FIXTURES / "reward-json-first", suite / "offline")
    out = tmp_path / "v.json"
    args = argparse.Namespace(tasks_command="validate", dir=str(suite), sandbox="bwrap", allow_network=False,
                              json=str(out))
    run(args)
    printed = capsys.readouterr().out
    assert "1 task(s) permit network access they do not get here" in printed
    assert "wants-net: the public internet is allowed by the task: ran offline" in printed
    assert {v["task_id"]: v["network"] is not None for v in json.loads(out.read_text())} == \
        {"offline": False, "wants-net": True}


def test_resuming_a_run_under_another_network_policy_is_refused(tmp_path, loopback, bwrap):
    task = load_task(_network_task(tmp_path, "net", ""))
    out = tmp_path / "run"
    evaluate([task], scripted_factory("nop"), 1, config=EvalConfig(concurrency=1), out_dir=out,
             sandbox_factory=bwrap, progress=False)
    assert json.loads((out / "run.json").read_text())["network_restricted"].keys() == {"net"}
    with pytest.raises(ValueError, match="allow_network changed"):
        evaluate([task], scripted_factory("nop"), 1, config=EvalConfig(concurrency=1, allow_network=True),
                 out_dir=out, sandbox_factory=sandbox_factory("bwrap", allow_network=True), progress=False)
