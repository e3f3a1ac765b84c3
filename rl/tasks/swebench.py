"""SWE-bench compatibility: instance files in, predictions and reports out, in SWE-bench's formats.

An instance names a repository at a commit, which c2jax cannot fetch offline. Two ways to supply it:
- a directory where that repository already sits (e.g. unpacked from an sdist): `instance_to_task(inst, repo)`;
  tests run with the host's Python;
- the instance's container image (SWE-bench's harness publishes one per instance, with the repository at
  /testbed and its environment in conda's `testbed` env): `instance_to_task(inst, image=PATH)` with the image
  saved in the image store (c2jax.rl.sandbox.oci). The agent and the grader then run in containers of that
  image (bubblewrap, or Docker / Podman), the workspace is the image's /testbed, and pytest is the image's
  (`python` below). The image is found by the instance's own `image_name` / `docker_image` field, else by
  SWE-bench's naming (`image_reference`).
Either way the Task is pytest-graded and its hidden overlay is the instance's `test_patch`, applied in the
grading sandbox after the model patch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from c2jax.rl.tasks.grading import GradeResult
from c2jax.rl.tasks.harbor_config import TaskEnvironment
from c2jax.rl.tasks.patches import patch_size
from c2jax.rl.tasks.task import Task, TaskFormatError

REQUIRED = ("instance_id", "FAIL_TO_PASS", "PASS_TO_PASS")
# the SWE-bench harness's instance images on Docker Hub ("__" is not allowed in an image name)
IMAGE_TEMPLATE = "swebench/sweb.eval.x86_64.{id}:latest"
IMAGE_WORKDIR = "/testbed"
IMAGE_PYTHON = "/opt/miniconda3/envs/testbed/bin/python"  # the harness images' `testbed` conda env


def image_reference(instance: dict[str, Any], template: str = IMAGE_TEMPLATE) -> str:
    """The container image of an instance: its `image_name` / `docker_image` field when it has one, else
    `template` with {id} = the instance id lowercased with "__" spelled "_1776_" (the harness's naming)."""
    for key in ("image_name", "docker_image"):
        if isinstance(instance.get(key), str) and instance[key]:
            return instance[key]
    return template.format(id=instance["instance_id"].lower().replace("__", "_1776_"))


def _test_list(value: Any, field: str, instance_id: str) -> list[str]:
    """SWE-bench stores FAIL_TO_PASS / PASS_TO_PASS as JSON-encoded strings in its HF datasets."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError:
            raise TaskFormatError(f"{instance_id}: {field} is a string but not a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TaskFormatError(f"{instance_id}: {field} must be a list of test ids")
    return value


def load_instances(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a SWE-bench `.json` (a list) or `.jsonl` file, with F2P/P2P decoded to lists."""
    path = Path(path)
    text = path.read_text()
    try:
        if path.suffix == ".jsonl":
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            rows = json.loads(text)
            rows = [rows] if isinstance(rows, dict) else rows
    except json.JSONDecodeError as e:
        raise TaskFormatError(f"{path}: not valid JSON: {e}") from None
    out = []
    for i, row in enumerate(rows):
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise TaskFormatError(f"{path} row {i}: missing {missing}")
        iid = row["instance_id"]
        out.append(dict(row, FAIL_TO_PASS=_test_list(row["FAIL_TO_PASS"], "FAIL_TO_PASS", iid),
                        PASS_TO_PASS=_test_list(row["PASS_TO_PASS"], "PASS_TO_PASS", iid)))
    return out


def instance_to_task(instance: dict[str, Any], repo_dir: str | Path | None = None, *, image: str | Path | None = None,
                     workdir: str = IMAGE_WORKDIR, python: str | None = None, timeout_s: float = 1800.0) -> Task:
    """A Task from an instance; the hidden tests are its `test_patch` (kept in metadata, applied in the
    grading sandbox), the reference its gold `patch`. Give the repository either as `repo_dir` or as the saved
    container `image` whose `workdir` holds it; in an image, tests run with `python` (the instance's `python`
    field, else the harness images' testbed env)."""
    if (repo_dir is None) == (image is None):
        raise TaskFormatError(f"{instance.get('instance_id')}: give the repository as a directory or as an image "
                              "(exactly one)")
    environment, metadata = None, {}
    if image is not None:
        environment = TaskEnvironment(workdir=workdir, network="no-network", image=str(image))
        metadata = {"python": python or instance.get("python") or IMAGE_PYTHON}
        # the workspace is seeded from the image when a sandbox opens; the task has no host repository
        repo_dir = Path(image)
    gold = instance.get("patch")
    lines, files = patch_size(gold) if gold else (0, 0)
    test_files = sorted({t.split("::")[0] for t in instance["FAIL_TO_PASS"] + instance["PASS_TO_PASS"]
                         if "::" in t})
    return Task(
        id=instance["instance_id"], instruction=instance.get("problem_statement", ""), repo_dir=Path(repo_dir),
        tests_dir=None, kind="pytest", prompts={"issue": instance.get("problem_statement", "")},
        category="swe-bench", difficulty=str(instance.get("difficulty", "medium")),
        repo=str(instance.get("repo", "")), lines_changed=lines, files_changed=files,
        fail_to_pass=tuple(instance["FAIL_TO_PASS"]), pass_to_pass=tuple(instance["PASS_TO_PASS"]),
        test_files=tuple(test_files), timeout_s=timeout_s, solution_patch=gold,
        metadata={"test_patch": instance.get("test_patch", ""), "base_commit": instance.get("base_commit", ""),
                  **metadata},
        environment=environment)


def write_predictions(path: str | Path, predictions: Iterable[tuple[str, str | None]], model: str) -> Path:
    """SWE-bench predictions JSONL: one {instance_id, model_name_or_path, model_patch} per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for instance_id, patch in predictions:
            f.write(json.dumps({"instance_id": instance_id, "model_name_or_path": model,
                                "model_patch": patch}) + "\n")
    return path


def load_predictions(path: str | Path) -> dict[str, dict[str, Any]]:
    """instance_id -> prediction row, from a JSON list/dict or JSONL predictions file."""
    path = Path(path)
    text = path.read_text()
    rows = ([json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl"
            else json.loads(text))
    rows = list(rows.values()) if isinstance(rows, dict) else rows
    return {row["instance_id"]: row for row in rows}


def instance_report(result: GradeResult, patch: str | None) -> dict[str, Any]:
    """One instance's entry of SWE-bench's report.json."""
    f2f = p2f = {"success": [], "failure": []}
    return {
        "patch_is_None": patch is None,
        "patch_exists": bool(patch),
        "patch_successfully_applied": result.patch_applied,
        "resolved": result.resolved,
        "infra_failure": result.status in ("invalid", "timeout"),
        "tests_status": {"FAIL_TO_PASS": result.fail_to_pass, "PASS_TO_PASS": result.pass_to_pass,
                         "FAIL_TO_FAIL": f2f, "PASS_TO_FAIL": p2f},
    }


def write_report(path: str | Path, results: dict[str, tuple[GradeResult, str | None]], model: str) -> Path:
    """SWE-bench's run report: per-instance entries plus the summary id lists and counts."""
    entries = {iid: instance_report(r, patch) for iid, (r, patch) in results.items()}
    ids = sorted(entries)
    resolved = [i for i in ids if entries[i]["resolved"]]
    empty = [i for i in ids if not entries[i]["patch_exists"]]
    errors = [i for i in ids if results[i][0].status in ("invalid", "timeout", "patch_failed")]
    report = {
        "model_name_or_path": model, "total_instances": len(ids), "submitted_instances": len(ids) - len(empty),
        "completed_instances": len(ids) - len(errors) - len(empty), "resolved_instances": len(resolved),
        "unresolved_instances": len(ids) - len(resolved) - len(errors) - len(empty),
        "empty_patch_instances": len(empty), "error_instances": len(errors),
        "resolved_ids": resolved, "unresolved_ids": [i for i in ids if i not in resolved and i not in errors
                                                     and i not in empty],
        "empty_patch_ids": empty, "error_ids": errors, "schema_version": 2, "instances": entries,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return path
