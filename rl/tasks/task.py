"""The task format: a directory in the Harbor / Terminal-Bench-2 layout, plus Terminal-Bench 1 reading.

    TASK_ID/
      instruction.md        the prompt the agent sees (the "issue" specificity level for our own tasks)
      task.toml             [metadata] (category, difficulty, prompts, reference size), [verifier], ...
      environment/repo/     the repository the agent works in (our tasks); a Dockerfile that needs
                            building (any RUN step) makes the task `unsupported`
      tests/overlay/        hidden test files, copied onto the repository at the same relative paths
      tests/test.sh         Harbor-style script that writes $LOGS/verifier/reward.{txt,json}
      solution/solution.patch or solution/solve.sh   the reference

`verifier.kind` says how a task is graded: "pytest" (SWE-bench semantics over fail_to_pass /
pass_to_pass node ids) or "reward" (a Harbor test.sh writes the reward). Terminal-Bench 1 tasks
(`task.yaml`, `run-tests.sh`) load as kind "tb1": resolved when every parsed test passes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from c2jax.rl.tasks import dockerfile as docker
from c2jax.rl.tasks.harbor_config import HarborConfigError, TaskEnvironment, parse_environment

PROMPT_LEVELS = ("terse", "issue", "full")
KINDS = ("pytest", "reward", "tb1")


class TaskFormatError(ValueError):
    """A task directory or instance file does not follow the expected format."""


@dataclass(frozen=True)
class Task:
    id: str
    instruction: str
    repo_dir: Path | None  # the base repository; None when the environment is unsupported
    tests_dir: Path | None  # hidden material (overlay/, test.sh, run-tests.sh); never shown to the agent
    kind: str = "pytest"
    prompts: dict[str, str] = field(default_factory=dict)  # specificity level -> prompt
    category: str = "software_engineering"
    difficulty: str = "medium"
    repo: str = ""  # source repository / library name: the unit of train/eval splits
    lines_changed: int = 0  # by the reference solution (added + removed)
    files_changed: int = 0
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    test_files: tuple[str, ...] = ()  # repository paths given to pytest; empty = pytest's default discovery
    timeout_s: float = 600.0
    solution_patch: str | None = None
    solution_script: str | None = None
    unsupported_reason: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None  # the task directory it was loaded from
    # task.toml's runtime fields (rl/tasks/harbor_config.py); None for tasks without a task.toml
    environment: TaskEnvironment | None = None

    @property
    def harbor(self) -> bool:
        """Graded by Harbor's contract: test.sh at /tests writing /logs/verifier/reward.*, and the oracle
        runs solution/solve.sh from /solution (rl/tasks/harbor.py)."""
        return self.kind == "reward"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise TaskFormatError(f"task {self.id}: verifier kind must be one of {KINDS}, got {self.kind!r}")
        unknown = set(self.prompts) - set(PROMPT_LEVELS)
        if unknown:
            raise TaskFormatError(f"task {self.id}: unknown prompt levels {sorted(unknown)}")

    @property
    def supported(self) -> bool:
        return self.unsupported_reason is None

    def prompt(self, level: str = "issue") -> str:
        """The prompt at `level`, falling back to the instruction when the task has no such level."""
        if level not in PROMPT_LEVELS:
            raise TaskFormatError(f"prompt level must be one of {PROMPT_LEVELS}, got {level!r}")
        return self.prompts.get(level) or self.instruction


# ---------------------------------------------------------------------------------------------- TOML
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TaskFormatError(f"cannot write non-finite float {value} to TOML")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TaskFormatError(f"cannot write {type(value).__name__} to TOML")


def dumps_toml(data: dict[str, Any], _prefix: str = "") -> str:
    """TOML for nested dicts of str/int/float/bool/lists (what task.toml holds; tomllib only reads)."""
    lines, tables = [], []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    out = "\n".join(lines) + ("\n" if lines else "")
    for key, value in tables:
        name = f"{_prefix}{key}"
        out += f"\n[{name}]\n" + dumps_toml(value, name + ".")
    return out


# ---------------------------------------------------------------------------------------------- load
def _read_solution(solution_dir: Path) -> tuple[str | None, str | None]:
    patch = next((p for p in sorted(solution_dir.glob("*.patch")) + sorted(solution_dir.glob("*.diff"))), None)
    script = solution_dir / "solve.sh"
    return (patch.read_text() if patch else None, script.read_text() if script.is_file() else None)


def load_task(path: str | Path) -> Task:
    """Loads a Harbor-layout (task.toml) or Terminal-Bench 1 (task.yaml) task directory."""
    path = Path(path)
    if (path / "task.toml").is_file():
        return _load_harbor(path)
    if (path / "task.yaml").is_file():
        return _load_tb1(path)
    raise TaskFormatError(f"{path}: no task.toml or task.yaml")


def _dockerfile_env(dockerfile: Path) -> tuple[dict[str, str], str | None]:
    """(what the Dockerfile's ENV instructions set, None) or ({}, why they cannot be read). Docker keeps
    ENV for every process of the container, so c2jax sets it for every command of the task; `$PATH`
    and the like in a value stand for the sandbox's own environment (the base image's, in Docker)."""
    if not dockerfile.is_file():
        return {}, None
    from c2jax.rl.sandbox.bwrap import default_env

    try:
        return docker.env(dockerfile, base=default_env()), None
    except ValueError as e:
        return {}, str(e)


def _load_harbor(path: Path) -> Task:
    try:
        spec = tomllib.loads((path / "task.toml").read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskFormatError(f"{path / 'task.toml'}: {e}") from None
    meta = dict(spec.get("metadata", {}))
    verifier = spec.get("verifier", {})
    instruction_file = path / "instruction.md"
    if not instruction_file.is_file():
        raise TaskFormatError(f"{path}: missing instruction.md")
    env_dir = path / "environment"
    dockerfile = env_dir / "Dockerfile"
    image_env, env_error = _dockerfile_env(dockerfile)
    try:
        environment, unsupported = parse_environment(
            spec, dockerfile_workdir=docker.workdir(dockerfile) if dockerfile.is_file() else None,
            dockerfile_env=image_env)
    except HarborConfigError as e:
        raise TaskFormatError(f"{path / 'task.toml'}: {e}") from None
    if environment.image is None:  # a Dockerfile's ENV matters only when the Dockerfile is what runs
        unsupported = unsupported or env_error
    repo_dir = None
    if environment.image is not None:
        # a prebuilt image from the image store: the Dockerfile (if any) is not built, and the workspace is
        # seeded from the image's working directory when the sandbox opens (c2jax.rl.tasks.build)
        repo_dir = env_dir if env_dir.is_dir() else path
    elif (env_dir / "repo").is_dir():
        repo_dir = env_dir / "repo"
    elif dockerfile.is_file() or docker.compose_reason(env_dir):
        plain = docker.compose_reason(env_dir) or docker.unsupported_reason(dockerfile)
        if plain is not None and unsupported is None and not docker.compose_reason(env_dir):
            # a Dockerfile that builds something: built over its base image when the image store holds it
            from c2jax.rl.sandbox.oci import IMAGE_STORE_ENV
            from c2jax.rl.tasks.image_build import buildable_reason

            why = buildable_reason(dockerfile, os.environ.get(IMAGE_STORE_ENV))
            if why is None:
                environment = dataclasses.replace(environment, dockerfile=str(dockerfile))
                plain = None
            else:
                plain = f"{plain}; and it cannot be built here: {why}"
        unsupported = unsupported or plain
        repo_dir = env_dir
    elif env_dir.is_dir():
        repo_dir = env_dir
    elif unsupported is None:
        raise TaskFormatError(f"{path}: missing environment/ (the repository)")
    if unsupported is not None:
        repo_dir = None
    tests_dir = path / "tests"
    kind = verifier.get("kind") or ("pytest" if "fail_to_pass" in verifier else "reward")
    if kind == "reward" and not (tests_dir / "test.sh").is_file():
        raise TaskFormatError(f"{path}: a reward-graded task needs tests/test.sh")
    patch, script = _read_solution(path / "solution")
    prompts = meta.pop("prompts", {})
    return Task(
        id=str(meta.pop("id", path.name)), instruction=instruction_file.read_text(), repo_dir=repo_dir,
        tests_dir=tests_dir if tests_dir.is_dir() else None, kind=kind, prompts=dict(prompts),
        category=str(meta.pop("category", "software_engineering")),
        difficulty=str(meta.pop("difficulty", "medium")), repo=str(meta.pop("repo", "")),
        lines_changed=int(meta.pop("lines_changed", 0)), files_changed=int(meta.pop("files_changed", 0)),
        fail_to_pass=tuple(verifier.get("fail_to_pass", ())), pass_to_pass=tuple(verifier.get("pass_to_pass", ())),
        test_files=tuple(verifier.get("test_files", ())), timeout_s=float(verifier.get("timeout_sec", 600.0)),
        solution_patch=patch, solution_script=script, unsupported_reason=unsupported, metadata=meta, path=path,
        environment=environment)


_TB1_META_FILES = {"task.yaml", "Dockerfile", "docker-compose.yaml", "docker-compose.yml", "run-tests.sh",
                   "solution.sh", "solution.yaml", "tests"}


def _load_tb1(path: Path) -> Task:
    """Terminal-Bench 1: the workspace is the task directory minus its metadata files (what a plain
    Dockerfile would COPY); tests/ and run-tests.sh are the hidden verifier."""
    try:
        spec = yaml.safe_load((path / "task.yaml").read_text()) or {}
    except yaml.YAMLError as e:
        raise TaskFormatError(f"{path / 'task.yaml'}: {e}") from None
    if "instruction" not in spec:
        raise TaskFormatError(f"{path / 'task.yaml'}: missing 'instruction'")
    unsupported = None
    if (path / "Dockerfile").is_file():
        unsupported = docker.unsupported_reason(path / "Dockerfile")
    if not (path / "run-tests.sh").is_file() and unsupported is None:
        unsupported = "no run-tests.sh"
    image_env, env_error = _dockerfile_env(path / "Dockerfile")
    unsupported = unsupported or env_error
    script = (path / "solution.sh").read_text() if (path / "solution.sh").is_file() else None
    meta = {k: v for k, v in spec.items() if k not in {"instruction", "difficulty", "category"}}
    return Task(
        id=path.name, instruction=str(spec["instruction"]),
        repo_dir=_tb1_workspace(path) if unsupported is None else None,
        tests_dir=path, kind="tb1", category=str(spec.get("category", "software_engineering")),
        difficulty=str(spec.get("difficulty", "medium")), timeout_s=float(spec.get("max_test_timeout_sec", 60)),
        solution_script=script, unsupported_reason=unsupported, metadata=meta, path=path,
        # Terminal-Bench 1's containers have the public internet (offline here unless the run allows it)
        environment=TaskEnvironment(network="public", env=image_env))


def _tb1_workspace(path: Path) -> Path:
    """A copy of the task directory without its metadata, tests and solution, under the temp dir
    (keyed by the directory's absolute path), so the agent never sees the hidden tests."""
    import hashlib
    import shutil
    import tempfile

    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    dest = Path(tempfile.gettempdir()) / "c2jax-tb1" / f"{path.name}-{key}"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(path, dest, ignore=lambda d, names: [n for n in names if Path(d) == path and n in
                                                           _TB1_META_FILES])
    return dest


def load_tasks(root: str | Path) -> list[Task]:
    """Every task directory directly under `root` (or `root` itself if it is one), sorted by id."""
    root = Path(root)
    if (root / "task.toml").is_file() or (root / "task.yaml").is_file():
        return [load_task(root)]
    dirs = [d for d in sorted(root.iterdir()) if (d / "task.toml").is_file() or (d / "task.yaml").is_file()]
    if not dirs:
        raise TaskFormatError(f"{root}: no task directories (with task.toml or task.yaml) found")
    return [load_task(d) for d in dirs]


# --------------------------------------------------------------------------------------------- write
def write_task(task: Task, out_dir: str | Path, *, overlay: dict[str, bytes] | None = None,
               test_sh: str | None = None) -> Path:
    """Writes `task` as a Harbor-layout directory `out_dir/task.id`; `task.repo_dir` is copied into
    environment/repo, `overlay` (repository path -> bytes) into tests/overlay."""
    import shutil

    dest = Path(out_dir) / task.id
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "environment").mkdir(parents=True)
    if task.repo_dir is None:
        raise TaskFormatError(f"task {task.id}: cannot write a task without a repository")
    shutil.copytree(task.repo_dir, dest / "environment" / "repo", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
    for rel, data in (overlay or {}).items():
        target = dest / "tests" / "overlay" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    if test_sh is not None:
        (dest / "tests").mkdir(exist_ok=True)
        (dest / "tests" / "test.sh").write_text(test_sh)
    if task.solution_patch is not None or task.solution_script is not None:
        (dest / "solution").mkdir()
        if task.solution_patch is not None:
            (dest / "solution" / "solution.patch").write_text(task.solution_patch)
        if task.solution_script is not None:
            (dest / "solution" / "solve.sh").write_text(task.solution_script)
    (dest / "instruction.md").write_text(task.instruction)
    metadata = {"id": task.id, "category": task.category, "difficulty": task.difficulty, "repo": task.repo,
                "lines_changed": task.lines_changed, "files_changed": task.files_changed,
                **{k: v for k, v in task.metadata.items() if _toml_ok(v)}, "prompts": dict(task.prompts)}
    verifier: dict[str, Any] = {"kind": task.kind, "timeout_sec": float(task.timeout_s)}
    if task.kind == "pytest":
        verifier |= {"fail_to_pass": list(task.fail_to_pass), "pass_to_pass": list(task.pass_to_pass),
                     "test_files": list(task.test_files)}
    spec = {"schema_version": "1.4", "metadata": metadata, "verifier": verifier,
            "environment": {"allow_internet": False}}
    (dest / "task.toml").write_text(dumps_toml(spec))
    return dest


def _toml_ok(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) or (
        isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) for v in value))


def with_changes(task: Task, **changes) -> Task:
    return dataclasses.replace(task, **changes)
