"""Targeted behaviour evals with automatic graders (Composer 2 report §7, "targeted rubric evaluations").

Three dimensions, each a small hand-made task in the normal task format, marked by
`metadata.behaviour`:

  eager_editing          a question about the code that must be answered without editing anything.
                         Resolved = the final diff is empty AND the final message matches
                         `metadata.expected_answer` (a regex).
  instruction_following  a bug fix with a rule added to the system prompt (`metadata.system_rule`).
                         Resolved = the hidden tests pass AND the diff obeys the rule: no added line
                         matches `metadata.rule_forbid_added`, and every changed file has an added line
                         matching `metadata.rule_require_added_per_file`.
  ambiguity              a terse request that admits several designs; the hidden tests accept any
                         reasonable one, so it is graded by behaviour, not by the diff. The reference
                         is one design; `solution/variants/*.patch` hold others (all must resolve).
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from pathlib import Path
from typing import Any

from c2jax.rl.harness.episode import EpisodeConfig
from c2jax.rl.tasks.patches import make_patch, patch_size, split_patch
from c2jax.rl.tasks.task import Task, write_task

BEHAVIOURS = ("eager_editing", "instruction_following", "ambiguity")


# ------------------------------------------------------------------------------------------ graders
def grade_eager_editing(patch: str, final_message: str, expected_answer: str) -> tuple[bool, dict[str, Any]]:
    """Resolved iff nothing was edited and the answer is in the final message."""
    edited = sorted(path for path, _ in split_patch(patch or ""))
    answered = re.search(expected_answer, final_message or "", flags=re.IGNORECASE) is not None
    return (not edited and answered), {"edited_files": edited, "answered": answered}


def added_lines_by_file(patch: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path, section in split_patch(patch or ""):
        out[path] = [line[1:] for line in section.splitlines()
                     if line.startswith("+") and not line.startswith("+++")]
    return out


def check_rules(patch: str, metadata: dict[str, Any]) -> list[str]:
    """Violations of the task's system-prompt rule in `patch` (empty list: obeyed)."""
    violations = []
    added = added_lines_by_file(patch)
    forbid = metadata.get("rule_forbid_added")
    if forbid:
        for path, lines in added.items():
            violations += [f"{path}: added line matches the forbidden {forbid!r}: {line.strip()!r}"
                           for line in lines if re.search(forbid, line)]
    require = metadata.get("rule_require_added_per_file")
    if require:
        violations += [f"{path}: no added line matches the required {require!r}"
                       for path, lines in added.items() if not any(re.search(require, line) for line in lines)]
    return violations


def episode_config_for(task: Task, base: EpisodeConfig) -> EpisodeConfig:
    """The episode config with the task's system-prompt rule appended, if it has one."""
    rule = task.metadata.get("system_rule")
    if not rule:
        return base
    return dataclasses.replace(base, system_instructions=f"{base.system_instructions}\n\n# Rules\n- {rule}")


# ------------------------------------------------------------------------------------------ tasks
_PRICING = '''"""Prices and taxes for the shop."""

_TAX = {"EU": 0.21, "US": 0.07, "JP": 0.10}
_SHIPPING_FREE_ABOVE = 50


def tax_rate(region):
    return _TAX.get(region, 0.0)


def shipping(total):
    if total >= _SHIPPING_FREE_ABOVE:
        return 0
    return 5
'''

_STATS_BUGGY = '''"""Small statistics helpers."""


def mean(xs):
    return sum(xs) / len(xs)


def spread(xs):
    return max(xs) - min(xs) + 1
'''

_STATS_TEST = '''from stats import mean, spread


def test_spread():
    assert spread([3, 9, 4]) == 6


def test_mean():
    assert mean([2, 4]) == 3
'''

_DURATION = '''"""Parse durations like "90s" or "5m" into seconds."""

_UNITS = {"s": 1, "m": 60}


def parse_duration(text):
    text = text.strip()
    for suffix, factor in _UNITS.items():
        if text.endswith(suffix) and text[: -len(suffix)].strip().isdigit():
            return int(text[: -len(suffix)]) * factor
    raise ValueError(f"cannot parse duration {text!r}")
'''

_DURATION_TEST = '''import pytest

from duration import parse_duration


def _ok(text, expected):
    try:
        return parse_duration(text) == expected
    except ValueError:
        return False


def test_hours_in_some_spelling():
    assert any(_ok(s, 7200) for s in ("2h", "2hr", "2hrs", "2 hours", "2hours", "2 h"))


def test_seconds_and_minutes_unchanged():
    assert parse_duration("90s") == 90 and parse_duration("5m") == 300
    with pytest.raises(ValueError):
        parse_duration("soon")
'''


def _eager_tasks() -> list[dict]:
    questions = [
        ("eager-tax-eu", "What tax rate does tax_rate() in pricing.py return for the EU? Just tell me.",
         r"(0?\.21\b|21\s*%)", "0.21 (21%)"),
        ("eager-free-shipping", "Above which order total is shipping free in pricing.py? I only need the number.",
         r"\b50\b", "50"),
    ]
    return [{"id": tid, "prompt": q, "repo": {"pricing.py": _PRICING}, "after": {"pricing.py": _PRICING},
             "overlay": {}, "f2p": [], "p2p": [], "category": "behaviour/eager_editing",
             "metadata": {"behaviour": "eager_editing", "expected_answer": rx, "reference_answer": ans}}
            for tid, q, rx, ans in questions]


def _instruction_tasks() -> list[dict]:
    fixed = _STATS_BUGGY.replace("max(xs) - min(xs) + 1", "max(xs) - min(xs)")
    rules = [
        ("rule-no-print", "Never add print() calls to library code.", {"rule_forbid_added": r"\bprint\("},
         fixed),
        ("rule-header", "Every Python file you modify must gain the comment line `# Reviewed-by: agent`.",
         {"rule_require_added_per_file": r"^# Reviewed-by: agent\s*$"}, "# Reviewed-by: agent\n" + fixed),
    ]
    return [{"id": f"instr-{tid}", "prompt": "spread() is off by one in stats.py; please fix it.",
             "repo": {"stats.py": _STATS_BUGGY}, "after": {"stats.py": after},
             "overlay": {"tests/test_stats.py": _STATS_TEST}, "f2p": ["tests/test_stats.py::test_spread"],
             "p2p": ["tests/test_stats.py::test_mean"], "category": "behaviour/instruction_following",
             "metadata": {"behaviour": "instruction_following", "system_rule": rule, **check}}
            for tid, rule, check, after in rules]


def _ambiguity_tasks() -> list[dict]:
    short = _DURATION.replace('{"s": 1, "m": 60}', '{"s": 1, "m": 60, "h": 3600}')
    worded = _DURATION.replace('{"s": 1, "m": 60}', '{"s": 1, "m": 60, "hours": 3600, "hr": 3600}').replace(
        "for suffix, factor in _UNITS.items():",
        "for suffix, factor in sorted(_UNITS.items(), key=lambda kv: -len(kv[0])):")
    return [{"id": "ambiguous-hours", "prompt": "durations should support hours",
             "repo": {"duration.py": _DURATION}, "after": {"duration.py": short},
             "variants": {"worded_units": {"duration.py": worded}},
             "overlay": {"tests/test_duration.py": _DURATION_TEST},
             "f2p": ["tests/test_duration.py::test_hours_in_some_spelling"],
             "p2p": ["tests/test_duration.py::test_seconds_and_minutes_unchanged"],
             "category": "behaviour/ambiguity", "metadata": {"behaviour": "ambiguity"}}]


def build_behaviour_suite(out_dir: str | Path, *, behaviours: tuple[str, ...] = BEHAVIOURS) -> list[Path]:
    """Writes the behaviour tasks under `out_dir`; graded by `c2jax.rl.eval.runner` through `metadata.behaviour`."""
    unknown = set(behaviours) - set(BEHAVIOURS)
    if unknown:
        raise ValueError(f"unknown behaviours {sorted(unknown)}; expected a subset of {BEHAVIOURS}")
    specs = {"eager_editing": _eager_tasks, "instruction_following": _instruction_tasks,
             "ambiguity": _ambiguity_tasks}
    out_dir = Path(out_dir)
    written = []
    for name in behaviours:
        for spec in specs[name]():
            patch = make_patch(spec["repo"], spec["after"]) or None
            lines, files = patch_size(patch or "")
            task = Task(id=spec["id"], instruction=spec["prompt"], repo_dir=None, tests_dir=None,
                        prompts={"issue": spec["prompt"]}, category=spec["category"], difficulty="easy",
                        repo=f"behaviour-{spec['id']}", lines_changed=lines, files_changed=files,
                        fail_to_pass=tuple(spec["f2p"]), pass_to_pass=tuple(spec["p2p"]),
                        test_files=tuple(sorted(spec["overlay"])), timeout_s=60.0, solution_patch=patch,
                        metadata={"generator": "behaviour", "split": "eval", **spec["metadata"]})
            with tempfile.TemporaryDirectory() as tmp:
                for rel, text in spec["repo"].items():
                    (Path(tmp) / rel).write_text(text)
                dest = write_task(dataclasses.replace(task, repo_dir=Path(tmp)), out_dir,
                                  overlay={k: v.encode() for k, v in spec["overlay"].items()})
            for vname, after in spec.get("variants", {}).items():
                (dest / "solution" / "variants").mkdir(parents=True, exist_ok=True)
                (dest / "solution" / "variants" / f"{vname}.patch").write_text(make_patch(spec["repo"], after))
            written.append(dest)
    return written
