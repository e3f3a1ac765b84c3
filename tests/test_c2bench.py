"""c2bench v1, the pinned eval suite (experiments/configs/c2bench_v1.yaml and its manifest
c2bench_v1.json): the scale issue 22 asks for (CursorBench-like), pins, and train/eval separation."""

from __future__ import annotations

import json
import re
from pathlib import Path

from c2jax.config import from_dict, load_yaml
from c2jax.rl.eval.suite import suite_stats
from c2jax.rl.tasks.build import SuiteConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"
MANIFEST = json.loads((CONFIGS / "c2bench_v1.json").read_text())
CONFIG = from_dict(SuiteConfig, load_yaml(CONFIGS / "c2bench_v1.yaml"))


def test_c2bench_v1_is_at_cursorbench_scale():
    """At least 60 tasks from at least 8 libraries; median reference change at least 40 lines over at
    least 2 files; terse prompts, median at most 400 characters (CursorBench: 390)."""
    rows = MANIFEST["tasks"]
    stats = suite_stats(rows)
    assert MANIFEST["name"] == "c2bench" and MANIFEST["version"] == "v1" and MANIFEST["split"] == "eval"
    assert stats == MANIFEST["stats"]  # the stored statistics are those of the stored rows
    assert stats["tasks"] >= 60 and stats["repos"] >= 8
    assert stats["median_lines_changed"] >= 40 and stats["median_files_changed"] >= 2
    assert stats["median_prompt_chars"] <= 400 and stats["median_terse_prompt_chars"] <= 400
    assert set(stats["categories"]) <= {"multi_file_feature", "reimplement", "release"}


def test_every_manifest_task_is_pinned_and_comes_from_a_pinned_library():
    sources = {lib.name: lib for lib in CONFIG.libraries} | {rel.name: rel for rel in CONFIG.releases}
    for lib in CONFIG.libraries:
        assert re.fullmatch(r"[0-9a-f]{64}", lib.sha256), lib.name
    for rel in CONFIG.releases:
        assert re.fullmatch(r"[0-9a-f]{64}", rel.old_sha256) and re.fullmatch(r"[0-9a-f]{64}", rel.new_sha256)
    ids = [r["id"] for r in MANIFEST["tasks"]]
    assert len(ids) == len(set(ids))
    for row in MANIFEST["tasks"]:
        assert re.fullmatch(r"[0-9a-f]{64}", row["sha256"]), row["id"]
        assert row["split"] == "eval" and row["repo"] in sources, row["id"]
        assert row["id"].startswith(row["repo"] + "-")
    assert {r["repo"] for r in MANIFEST["tasks"]} == set(sources)  # every pinned source gave tasks


def test_c2bench_v1_shares_no_library_with_any_training_suite():
    """Split by repository: no library of c2bench v1 appears in a suite config that trains."""
    eval_repos = {lib.name for lib in CONFIG.libraries} | {rel.name for rel in CONFIG.releases}
    assert all(lib.split == "eval" for lib in CONFIG.libraries)
    assert all(rel.split == "eval" for rel in CONFIG.releases)
    for path in CONFIGS.glob("*.yaml"):
        raw = load_yaml(path)
        if path.name == "c2bench_v1.yaml" or not isinstance(raw, dict) or "libraries" not in raw:
            continue
        suite = from_dict(SuiteConfig, raw)
        train = {lib.name for lib in suite.libraries if lib.split == "train"}
        train |= {rel.name for rel in suite.releases if rel.split == "train"}
        assert not (train & eval_repos), f"{path.name} trains on {sorted(train & eval_repos)}"
