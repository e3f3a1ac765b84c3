"""Loading an eval suite, fingerprinting it, and the c2bench manifest with its statistics.

A suite is one of: a directory of task directories (ours from `c2jax tasks build`, Harbor, or
Terminal-Bench 1), a SWE-bench instances file (`.json` / `.jsonl`) with a directory holding each
instance's repository, `humaneval[:N]` (rl/eval/humaneval.py), or `behaviour` (rl/eval/behaviour.py).
All become `c2jax.rl.tasks.Task`s and go through the same runner and graders.

c2bench is the eval split of a suite built by `c2jax tasks build` (every library carries one split, so
eval tasks never share a repository with training tasks). Its manifest, `c2bench.json`, pins each task
directory by sha256 and records what the Composer 2 report uses to argue CursorBench is harder than
public benchmarks (§7, Fig. 7): prompt length and the size of the reference change.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

from c2jax.rl.tasks.build import check_splits_disjoint
from c2jax.rl.tasks.task import Task, TaskFormatError, load_tasks

MANIFEST = "c2bench.json"
_SKIP = {"__pycache__", ".pytest_cache", ".git"}

# Published figures the suite's statistics are shown next to. Ranges are (low, high).
REFERENCE_STATS = (
    {"benchmark": "CursorBench", "median_prompt_chars": (390, 390), "median_lines_changed": (181, 181),
     "source": "Composer 2 technical report, arXiv 2603.24477 §7 and Fig. 7"},
    {"benchmark": "SWE-bench Verified / Multilingual", "median_prompt_chars": (1185, 3055),
     "median_lines_changed": (7, 10),
     "source": "Composer 2 technical report, arXiv 2603.24477 §7 and Fig. 7 (prompt range over the public "
               "benchmarks compared)"},
)


class SuiteError(ValueError):
    """A suite path, manifest or selection is not usable."""


def tree_sha256(root: Path) -> str:
    """sha256 over (relative path, file bytes) of every file under `root`, in sorted path order; caches
    (__pycache__, .pytest_cache, .git) are skipped so running a suite does not change its hash."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if not _SKIP & set(p.relative_to(root).parts)):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            h.update(f"L {rel} -> {path.readlink()}\n".encode())
        elif path.is_file():
            if path.suffix == ".pyc":
                continue
            h.update(f"F {rel} {path.stat().st_size}\n".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def task_sha256(task: Task) -> str:
    """The task directory's hash; for tasks without one (SWE-bench instances) the repository plus the
    instance fields that define grading."""
    if task.path is not None and task.path.is_dir():
        return tree_sha256(task.path)
    h = hashlib.sha256(json.dumps({"id": task.id, "instruction": task.instruction, "f2p": task.fail_to_pass,
                                   "p2p": task.pass_to_pass, "test_patch": task.metadata.get("test_patch", "")},
                                  sort_keys=True).encode())
    if task.environment is not None and task.environment.image is not None:
        # an instance image: its manifest digest pins every byte of it
        from c2jax.rl.sandbox.oci import read_image_config

        h.update(read_image_config(task.environment.image)[0].encode())
    elif task.repo_dir is not None:
        h.update(tree_sha256(task.repo_dir).encode())
    return h.hexdigest()


def load_suite(spec: str, *, repos: str = "", image_store: str | None = None,
               cache_dir: str | Path | None = None) -> list[Task]:
    """Tasks of a suite (see the module docstring), sorted by id. Errors name the path and the problem."""
    if not spec:
        raise SuiteError("no suite given: pass a task directory, a SWE-bench .json/.jsonl file, or humaneval[:N]")
    cache = Path(cache_dir or Path.home() / ".cache" / "c2jax" / "eval")
    if spec == "behaviour":
        import shutil

        from c2jax.rl.eval.behaviour import build_behaviour_suite

        shutil.rmtree(cache / "behaviour", ignore_errors=True)
        build_behaviour_suite(cache / "behaviour")
        return load_tasks(cache / "behaviour")
    if spec == "humaneval" or spec.startswith("humaneval:"):
        from c2jax.rl.eval.humaneval import build_humaneval

        limit = None
        if ":" in spec:
            try:
                limit = int(spec.split(":", 1)[1])
            except ValueError:
                raise SuiteError(f"suite {spec!r}: expected humaneval:N with an integer N") from None
        return load_tasks(build_humaneval(cache / "humaneval", limit=limit))
    path = Path(spec)
    if not path.exists():
        raise SuiteError(f"suite {spec!r} does not exist")
    if path.is_file():
        if path.suffix not in (".json", ".jsonl"):
            raise SuiteError(f"suite file {spec!r}: expected SWE-bench instances (.json or .jsonl)")
        return _swebench_tasks(path, repos, image_store)
    try:
        tasks = load_tasks(path)
    except TaskFormatError as e:
        raise SuiteError(f"suite {spec!r} is not a task suite: {e}") from None
    if (path / MANIFEST).is_file():  # a c2bench directory: exactly the pinned tasks
        tasks = verify_manifest(path, tasks)
    return tasks


def _swebench_tasks(path: Path, repos: str, image_store: str | None) -> list[Task]:
    """Instances with their repositories from `repos` (one directory per instance_id), else from their
    container images in the image store (`image_store`, default $C2JAX_IMAGE_STORE)."""
    import os

    from c2jax.rl.sandbox.oci import IMAGE_STORE_ENV, find_in_store, store_name
    from c2jax.rl.tasks.swebench import image_reference, instance_to_task, load_instances

    store = image_store if image_store is not None else os.environ.get(IMAGE_STORE_ENV, "")
    if not repos and not store:
        raise SuiteError(f"{path}: SWE-bench instances need their repositories: --repos DIR holding one per "
                         f"instance_id, or an image store (--image-store DIR or ${IMAGE_STORE_ENV}) holding each "
                         "instance's container image (c2jax runs offline and cannot clone them)")
    tasks = []
    for inst in load_instances(path):
        if repos:
            repo = Path(repos) / inst["instance_id"]
            if not repo.is_dir():
                raise SuiteError(f"{path}: no repository for {inst['instance_id']} at {repo}")
            tasks.append(instance_to_task(inst, repo))
            continue
        ref = image_reference(inst)
        image = find_in_store(ref, store)
        if image is None:
            raise SuiteError(f"{path}: no image for {inst['instance_id']}: {ref!r} is not in the image store {store} "
                             f"(save it there as {store_name(ref)} or {store_name(ref)}.tar, e.g. "
                             f"`c2jax images pull {ref}` where the registry is reachable)")
        tasks.append(instance_to_task(inst, image=image))
    return sorted(tasks, key=lambda t: t.id)


def select(tasks: list[Task], *, categories: tuple[str, ...] = (), split: str = "") -> list[Task]:
    out = [t for t in tasks if (not categories or t.category in categories)
           and (not split or str(t.metadata.get("split", "")) == split)]
    if not out:
        raise SuiteError(f"no task matches categories={list(categories)} split={split!r} "
                         f"(the suite has categories {sorted({t.category for t in tasks})} and splits "
                         f"{sorted({str(t.metadata.get('split', '')) for t in tasks})})")
    return out


def fingerprint(tasks: list[Task]) -> str:
    """One hash for a task set: a resumed run must see exactly the same tasks."""
    h = hashlib.sha256()
    for t in sorted(tasks, key=lambda t: t.id):
        h.update(f"{t.id} {task_sha256(t)}\n".encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ c2bench
def task_row(task: Task) -> dict[str, Any]:
    return {"id": task.id, "sha256": task_sha256(task), "category": task.category, "repo": task.repo,
            "split": str(task.metadata.get("split", "")), "difficulty": task.difficulty,
            "lines_changed": task.lines_changed, "files_changed": task.files_changed,
            "prompt_chars": len(task.instruction),
            "prompt_chars_by_level": {k: len(v) for k, v in task.prompts.items()}}


def suite_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's task-size statistics (§7, Fig. 7) for manifest rows: median prompt length (the
    instruction, and the terse level where tasks have one) and median lines / files changed by the
    reference."""
    from c2jax.rl.eval.metrics import median

    if not rows:
        raise SuiteError("no tasks to compute statistics over")
    terse = [r["prompt_chars_by_level"]["terse"] for r in rows if "terse" in r["prompt_chars_by_level"]]
    return {
        "tasks": len(rows),
        "repos": len({r["repo"] for r in rows}),
        "categories": dict(sorted(Counter(r["category"] for r in rows).items())),
        "median_prompt_chars": median([r["prompt_chars"] for r in rows]),
        "median_terse_prompt_chars": median(terse) if terse else None,
        "median_lines_changed": median([r["lines_changed"] for r in rows]),
        "median_files_changed": median([r["files_changed"] for r in rows]),
        "multi_file_share": sum(r["files_changed"] > 1 for r in rows) / len(rows),
    }


def build_manifest(suite_dir: str | Path, *, version: str = "v1", split: str = "eval") -> dict[str, Any]:
    """The c2bench manifest of the `split` tasks under `suite_dir` (all tasks when split is "")."""
    suite_dir = Path(suite_dir)
    try:
        every = load_tasks(suite_dir)
    except TaskFormatError as e:
        raise SuiteError(f"{suite_dir}: {e}") from None
    check_splits_disjoint(every)
    tasks = select(every, split=split) if split else every
    rows = [task_row(t) for t in tasks]
    return {"name": "c2bench", "version": version, "split": split or "all", "tasks": rows,
            "stats": suite_stats(rows), "reference": [dict(r) for r in REFERENCE_STATS]}


def write_manifest(suite_dir: str | Path, *, version: str = "v1", split: str = "eval") -> Path:
    manifest = build_manifest(suite_dir, version=version, split=split)
    path = Path(suite_dir) / MANIFEST
    path.write_text(json.dumps(manifest, indent=1))
    return path


def verify_manifest(suite_dir: Path, tasks: list[Task]) -> list[Task]:
    """Checks every manifest task is present with its pinned sha256; returns the manifest's tasks.
    Tasks in the directory but not in the manifest (e.g. the train split) are not part of c2bench."""
    manifest = json.loads((suite_dir / MANIFEST).read_text())
    by_id = {t.id: t for t in tasks}
    for row in manifest.get("tasks", []):
        task = by_id.get(row["id"])
        if task is None:
            raise SuiteError(f"{suite_dir / MANIFEST}: task {row['id']} is missing from the suite")
        if task_sha256(task) != row["sha256"]:
            raise SuiteError(f"{suite_dir / MANIFEST}: task {row['id']} changed since the manifest was written "
                             "(sha256 mismatch); rebuild the manifest or restore the task")
    return [by_id[r["id"]] for r in manifest.get("tasks", [])]


def stats_markdown(stats: dict[str, Any]) -> str:
    """The suite's statistics next to CursorBench's and SWE-bench's published figures."""
    def fmt(v):
        return "-" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))

    def rng(lo_hi):
        lo, hi = lo_hi
        return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"

    lines = ["| suite | tasks | median prompt chars | median lines changed | median files changed | source |",
             "|---|---|---|---|---|---|",
             f"| this suite | {stats['tasks']} | {fmt(stats['median_prompt_chars'])} (terse: "
             f"{fmt(stats['median_terse_prompt_chars'])}) | {fmt(stats['median_lines_changed'])} | "
             f"{fmt(stats['median_files_changed'])} | measured |"]
    for ref in REFERENCE_STATS:
        lines.append(f"| {ref['benchmark']} | - | {rng(ref['median_prompt_chars'])} | "
                     f"{rng(ref['median_lines_changed'])} | - | {ref['source']} |")
    return "\n".join(lines) + "\n"
