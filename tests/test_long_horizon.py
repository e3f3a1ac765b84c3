"""The long-horizon pointer-chain task family (rl/tasks/long_horizon.py): deterministic, the chain is well
formed, and the normal grader fails the base repository and passes the reference."""

from __future__ import annotations

import re

import pytest

from c2jax.rl.sandbox import LocalSandbox
from c2jax.rl.tasks import grade, load_task
from c2jax.rl.tasks.build import validate_task
from c2jax.rl.tasks.long_horizon import build_chain_tasks
from c2jax.rl.tasks.patches import make_patch


def factory(repo):
    return LocalSandbox(repo, allow_unisolated=True)


def _follow(task) -> tuple[list[str], str]:
    """The notes visited from the start note, and the answer at the end."""
    path, seen = task.metadata["start"], []
    while True:
        assert path not in seen, "the chain has a cycle"
        seen.append(path)
        text = (task.repo_dir / path).read_text()
        keys = re.findall(r"^(next|answer): (\S+)$", text, re.MULTILINE)
        assert len(keys) == 1, (path, keys)
        (kind, value), = keys
        if kind == "answer":
            return seen, value
        path = value


def test_chain_tasks_are_deterministic_and_well_formed(tmp_path):
    paths = build_chain_tasks(tmp_path / "a", seed=7, lengths=(1, 5), per_length=2, filler_lines=6, line_chars=40)
    again = build_chain_tasks(tmp_path / "b", seed=7, lengths=(1, 5), per_length=2, filler_lines=6, line_chars=40)
    assert [p.name for p in paths] == ["chain-001-000", "chain-001-001", "chain-005-000", "chain-005-001"]
    for p, q in zip(paths, again):
        files = sorted(f.relative_to(p) for f in p.rglob("*") if f.is_file())
        assert files == sorted(f.relative_to(q) for f in q.rglob("*") if f.is_file())
        assert all((p / f).read_bytes() == (q / f).read_bytes() for f in files)
    other = build_chain_tasks(tmp_path / "c", seed=8, lengths=(5,), per_length=1, filler_lines=6, line_chars=40)
    assert (other[0] / "task.toml").read_text() != (paths[2] / "task.toml").read_text()
    for p in paths:
        task = load_task(p)
        n = task.metadata["chain_length"]
        seen, answer = _follow(task)
        notes = sorted(f.relative_to(task.repo_dir).as_posix() for f in (task.repo_dir / "notes").iterdir())
        assert len(seen) == n and sorted(seen) == notes  # every note is on the chain, each once
        assert f"`{task.metadata['start']}`" in task.instruction and answer not in task.instruction
        assert all(len((task.repo_dir / s).read_text().splitlines()) == 7 for s in seen)  # 6 filler + key line
        assert repr(answer) in (p / "tests" / "overlay" / "tests" / "test_answer.py").read_text()
        assert task.category == "long_horizon/chain" and task.fail_to_pass == ("tests/test_answer.py::test_answer",)


def test_chain_task_grades_with_the_normal_grader(tmp_path):
    (path,) = build_chain_tasks(tmp_path, seed=0, lengths=(3,), per_length=1)
    task = load_task(path)
    v = validate_task(task, factory)  # hidden test fails on the base, passes with the reference
    assert v.ok, v.reason
    assert v.base.status == "unresolved" and v.reference.resolved
    _, answer = _follow(task)
    readme = {"README.md": (task.repo_dir / "README.md").read_text()}
    wrong = grade(task, make_patch(readme, {**readme, "answer.txt": answer + "0\n"}), factory)
    assert wrong.status == "unresolved"


def test_chain_task_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="lengths"):
        build_chain_tasks(tmp_path, lengths=(0,))
    with pytest.raises(ValueError, match="filler_lines"):
        build_chain_tasks(tmp_path, lengths=(2,), filler_lines=500)
