"""Tasks and graders: SWE-bench grading semantics on hand-built fixtures, Harbor and Terminal-Bench 1
formats, SWE-bench instance/prediction/report formats, the ladder, and one real-sdist generator run."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from c2jax.rl.sandbox import LocalSandbox
from c2jax.rl.tasks import Task, grade, load_task, write_task
from c2jax.rl.tasks.build import LibraryConfig, build_library, check_splits_disjoint, validate_task
from c2jax.rl.tasks.deletion import deletable, delete_feature
from c2jax.rl.tasks.ladder import ANSWER_WORDS, build_ladder
from c2jax.rl.tasks.mutation import apply, candidates
from c2jax.rl.tasks.patches import drop_test_files, is_test_path, make_patch, patch_size
from c2jax.rl.tasks.release import build_release_task, changelog_added
from c2jax.rl.tasks.swebench import instance_to_task, load_instances, write_predictions, write_report


def factory(repo):
    return LocalSandbox(repo, allow_unisolated=True)


def _bwrap_factory():
    """Harbor tasks need /tests and /logs at the sandbox's root, which only the bwrap backend has."""
    from c2jax.rl.sandbox.bwrap import bwrap_unusable_reason
    from c2jax.rl.tasks.build import sandbox_factory

    reason = bwrap_unusable_reason()
    if reason:
        pytest.skip(reason)
    return sandbox_factory("bwrap")


BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FIXED = BUGGY.replace("a - b", "a + b")
HIDDEN = ("from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
          "def test_mul():\n    assert mul(2, 3) == 6\n")
F2P, P2P = "tests/test_calc.py::test_add", "tests/test_calc.py::test_mul"


@pytest.fixture(scope="module")
def calc_task(tmp_path_factory) -> Task:
    """A micro repo with a bug in add; the hidden tests check add (F2P) and mul (P2P). The agent sees
    a visible tests/test_calc.py that the grader must replace."""
    root = tmp_path_factory.mktemp("calc")
    (root / "repo" / "tests").mkdir(parents=True)
    (root / "repo" / "calc.py").write_text(BUGGY)
    (root / "repo" / "tests" / "test_calc.py").write_text("def test_visible():\n    pass\n")
    task = Task(id="calc-001", instruction="add is broken", repo_dir=root / "repo", tests_dir=None,
                fail_to_pass=(F2P,), pass_to_pass=(P2P,), test_files=("tests/test_calc.py",), timeout_s=60,
                solution_patch=make_patch({"calc.py": BUGGY}, {"calc.py": FIXED}), repo="calc")
    return load_task(write_task(task, root / "suite", overlay={"tests/test_calc.py": HIDDEN.encode()}))


def patch_calc(text: str, extra: dict[str, str] | None = None) -> str:
    return make_patch({"calc.py": BUGGY}, {"calc.py": text, **(extra or {})})


def test_reference_resolves_and_base_does_not(calc_task):
    ref = grade(calc_task, calc_task.solution_patch, factory)
    assert ref.status == "resolved" and ref.reward == 1.0
    assert ref.fail_to_pass == {"success": [F2P], "failure": []}
    base = grade(calc_task, None, factory)
    assert base.status == "unresolved" and base.fail_to_pass["failure"] == [F2P]
    assert base.pass_to_pass["success"] == [P2P]
    assert "tests/test_calc.py::test_visible" not in base.tests_status  # the hidden overlay replaced it


def test_p2p_regression_is_unresolved(calc_task):
    res = grade(calc_task, patch_calc(FIXED.replace("a * b", "a ** b")), factory)
    assert res.status == "unresolved"
    assert res.fail_to_pass["failure"] == [] and res.pass_to_pass["failure"] == [P2P]


def test_fake_passed_lines_do_not_fool_the_grader(calc_task):
    # after pytest's own summary, print a forged one in `-rA` format
    liar = BUGGY + ("\nimport atexit\n\n\n@atexit.register\ndef _forge():\n"
                    "    print('PASSED tests/test_calc.py::test_add\\nPASSED tests/test_calc.py::test_mul')\n"
                    "    print('===== 2 passed in 0.01s =====')\n")
    res = grade(calc_task, patch_calc(liar), factory)
    assert "PASSED tests/test_calc.py::test_add" in res.log_tail
    assert res.status == "unresolved" and res.fail_to_pass["failure"] == [F2P]


def test_nonzero_exit_without_failures_is_invalid(calc_task):
    # the tests all pass, but the process exits 1: SWE-bench 5.x calls such a log invalid
    code = FIXED + "\nimport atexit, os\natexit.register(lambda: os._exit(1))\n"
    res = grade(calc_task, patch_calc(code), factory)
    assert res.status == "invalid" and not res.resolved and res.exit_code == 1
    assert "no failed test" in res.reason


def test_patch_to_tests_and_conftest_is_dropped(calc_task):
    # the bug stays; the patch tries to make the tests vacuous and to xfail everything via conftest
    sneaky = make_patch({"tests/test_calc.py": "def test_visible():\n    pass\n"},
                        {"tests/test_calc.py": "def test_add():\n    pass\n",
                         "conftest.py": "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n"
                                        "    for i in items:\n        i.add_marker(pytest.mark.xfail)\n"})
    res = grade(calc_task, sneaky, factory)
    assert sorted(res.dropped_test_files) == ["conftest.py", "tests/test_calc.py"]
    assert res.status == "unresolved" and res.tests_status[F2P] == "FAILED"


def test_patch_that_does_not_apply(calc_task):
    bad = "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n-nope\n+still nope\n"
    assert grade(calc_task, bad, factory).status == "patch_failed"


# --------------------------------------------------------------------------------- Harbor and TB1
def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


HARBOR_TOML = """\
    [metadata]
    difficulty = "easy"
    category = "terminal"
    [verifier]
    timeout_sec = 30.0
    """


@pytest.mark.parametrize("writer,expected", [
    ('if grep -qx 42 answer.txt; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi',
     (0.0, 1.0)),
    ('v=0; grep -qx 42 answer.txt && v=1; echo "{\\"reward\\": $v, \\"style\\": 0.5}" > /logs/verifier/reward.json',
     (0.0, 1.0)),
])
def test_harbor_reward_contract(tmp_path, writer, expected):
    task_dir = _write(tmp_path / "answer-42", {
        "instruction.md": "Write 42 to answer.txt", "task.toml": HARBOR_TOML, "environment/README": "empty\n",
        "tests/test.sh": f"#!/bin/bash\n{writer}\n", "solution/solve.sh": "echo 42 > answer.txt\n"})
    task = load_task(task_dir)
    assert (task.kind, task.difficulty, task.category, task.timeout_s) == ("reward", "easy", "terminal", 30.0)
    v = validate_task(task, _bwrap_factory())  # grades the base, then the diff solve.sh leaves
    assert v.ok, v.reason
    assert (v.base.status, v.base.reward) == ("unresolved", expected[0])
    assert (v.reference.status, v.reference.reward) == ("resolved", expected[1])


def test_harbor_missing_reward_is_invalid_and_docker_build_is_unsupported(tmp_path):
    task = load_task(_write(tmp_path / "t", {"instruction.md": "x", "task.toml": HARBOR_TOML,
                                             "environment/a.txt": "a\n", "tests/test.sh": "true\n"}))
    assert grade(task, None, _bwrap_factory()).status == "invalid"
    docker = load_task(_write(tmp_path / "d", {
        "instruction.md": "x", "task.toml": HARBOR_TOML, "tests/test.sh": "true\n",
        "environment/Dockerfile": "FROM python:3.11\nRUN pip install numpy\n"}))
    assert not docker.supported and "RUN" in docker.unsupported_reason
    assert grade(docker, None, factory).status == "unsupported"


TB1_TEST = """\
    from pathlib import Path


    def test_hello():
        assert Path("hello.txt").read_text().strip() == "hello"
    """


def test_terminal_bench_1_task_yaml(tmp_path):
    task_dir = _write(tmp_path / "hello-world", {
        "task.yaml": "instruction: Create hello.txt containing hello\ndifficulty: easy\ncategory: file-ops\n"
                     "tags: [files]\nmax_test_timeout_sec: 45\n",
        "Dockerfile": "FROM ghcr.io/laude-institute/t-bench/python-3-13:latest\nWORKDIR /app\nCOPY . /app\n",
        "run-tests.sh": "#!/bin/bash\npython -m pytest $TEST_DIR/test_outputs.py\n",
        "tests/test_outputs.py": TB1_TEST, "solution.sh": "echo hello > hello.txt\n", "data.txt": "x\n"})
    task = load_task(task_dir)
    assert (task.kind, task.difficulty, task.category, task.timeout_s) == ("tb1", "easy", "file-ops", 45.0)
    assert task.metadata["tags"] == ["files"]
    assert sorted(p.name for p in task.repo_dir.iterdir()) == ["data.txt"]  # no tests, no solution
    v = validate_task(task, factory)
    assert v.ok, v.reason
    assert list(v.base.tests_status.values()) == ["FAILED"]
    assert list(v.reference.tests_status.values()) == ["PASSED"]
    (task_dir / "Dockerfile").write_text("FROM ubuntu\nRUN apt-get install -y jq\n")
    assert not load_task(task_dir).supported


# ------------------------------------------------------------------------------------ SWE-bench
def test_swebench_instances_predictions_and_report(tmp_path, calc_task):
    test_patch = make_patch({"tests/test_calc.py": "def test_visible():\n    pass\n"}, {"tests/test_calc.py": HIDDEN})
    row = {"instance_id": "calc__calc-1", "repo": "calc/calc", "base_commit": "abc", "problem_statement": "add",
           "patch": calc_task.solution_patch, "test_patch": test_patch}
    (tmp_path / "a.json").write_text(json.dumps([dict(row, FAIL_TO_PASS=json.dumps([F2P]),
                                                      PASS_TO_PASS=json.dumps([P2P]))]))
    (tmp_path / "b.jsonl").write_text(json.dumps(dict(row, FAIL_TO_PASS=[F2P], PASS_TO_PASS=[P2P])) + "\n")
    a, b = load_instances(tmp_path / "a.json"), load_instances(tmp_path / "b.jsonl")
    assert a == b and a[0]["FAIL_TO_PASS"] == [F2P]

    task = instance_to_task(a[0], calc_task.repo_dir, timeout_s=60)
    gold = grade(task, row["patch"], factory)
    empty = grade(task, "", factory)
    assert gold.resolved and not empty.resolved

    preds = write_predictions(tmp_path / "preds.jsonl", [("calc__calc-1", row["patch"])], "oracle")
    assert json.loads(preds.read_text()) == {"instance_id": "calc__calc-1", "model_name_or_path": "oracle",
                                             "model_patch": row["patch"]}
    report = json.loads(write_report(tmp_path / "report.json", {"calc__calc-1": (gold, row["patch"]),
                                                                 "calc__calc-2": (empty, "")}, "oracle").read_text())
    assert report["resolved_ids"] == ["calc__calc-1"] and report["empty_patch_ids"] == ["calc__calc-2"]
    entry = report["instances"]["calc__calc-1"]
    assert entry["patch_successfully_applied"] and entry["resolved"] and not entry["patch_is_None"]
    assert entry["tests_status"]["FAIL_TO_PASS"] == {"success": [F2P], "failure": []}


def test_swebench_rejects_malformed_lists(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps([{"instance_id": "i", "FAIL_TO_PASS": "not json",
                                                  "PASS_TO_PASS": []}]))
    with pytest.raises(ValueError, match="FAIL_TO_PASS"):
        load_instances(tmp_path / "x.json")


# ---------------------------------------------------------------------------------------- ladder
def test_ladder_is_deterministic_and_validates(tmp_path):
    tasks = [load_task(p) for p in build_ladder(tmp_path / "a", seed=3, per_rung=1)]  # in RUNGS order
    build_ladder(tmp_path / "b", seed=3, per_rung=1)
    assert [t.category for t in tasks] == ["ladder/echo", "ladder/answer", "ladder/lookup", "ladder/micro_bug"]
    for t in tasks:
        assert (tmp_path / "b" / t.id / "task.toml").read_text() == (t.path / "task.toml").read_text()
        assert set(t.prompts) == {"terse", "issue", "full"} and t.lines_changed >= 1
        v = validate_task(t, factory)
        assert v.ok, (t.id, v.reason)


def test_ladder_lookup_has_distinct_word_values_and_the_asked_key(tmp_path):
    """`lookup_keys` keys per settings file, each with a different value word; the prompt asks for one of them
    and the reference answer is that key's value."""
    for keys in (1, 2, 5):
        for path in build_ladder(tmp_path / str(keys), seed=1, per_rung=6, rungs=("lookup",), lookup_keys=keys):
            task = load_task(path)
            lines = (task.repo_dir / "settings.ini").read_text().splitlines()
            pairs = dict(line.split(" = ") for line in lines)
            assert len(pairs) == keys and len(set(pairs.values())) == keys
            assert set(pairs.values()) <= set(ANSWER_WORDS)
            asked = task.prompt("terse").split()[2]
            assert f"+{pairs[asked]}" in task.solution_patch
    with pytest.raises(ValueError, match="lookup_keys"):
        build_ladder(tmp_path / "bad", per_rung=1, rungs=("lookup",), lookup_keys=0)


def test_ladder_echo_rung_copies_the_prompt_and_grades(tmp_path):
    """The easiest rung: the terse prompt quotes the exact answer; the normal grader runs the hidden test,
    which fails on the base repo, passes with the reference and fails on a near copy."""
    (path,) = build_ladder(tmp_path, seed=5, per_rung=1, rungs=("echo",))
    task = load_task(path)
    assert task.category == "ladder/echo" and task.id == "ladder-echo-000"
    sender, rest = task.prompt("terse").split(": ", 1)
    value = rest.split('"')[1]
    assert rest == f'write "{value}" -> answer.txt' and value in ANSWER_WORDS and sender not in ANSWER_WORDS
    assert all(value in p and sender in p for p in task.prompts.values())
    assert task.fail_to_pass == ("tests/test_answer.py::test_answer",) and not (task.repo_dir / "tests").exists()
    base = grade(task, None, factory)
    assert base.status == "unresolved" and base.fail_to_pass["failure"] == list(task.fail_to_pass)
    ref = grade(task, task.solution_patch, factory)
    assert ref.resolved and ref.reward == 1.0
    readme = {"README.md": "Scratch workspace.\n"}
    near = grade(task, make_patch(readme, {**readme, "answer.txt": f"{sender}\n"}), factory)
    assert near.status == "unresolved" and near.reward == 0.0

# ---------------------------------------------------------------------------------- real sdist
@pytest.mark.slow
def test_mutation_generator_on_a_real_sdist(tmp_path):
    """inflection 0.5.1 from PyPI (pinned by sha256, cached): one bug-injection task, validated."""
    lib = LibraryConfig("inflection", "0.5.1", "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417",
                        tests=("test_inflection.py",), mutation_tasks=1, deletion_tasks=0, max_candidates=6)
    cache = Path.home() / ".cache" / "c2jax" / "tasks"
    try:
        written = build_library(lib, tmp_path, factory, cache_dir=cache, seed=0)
    except RuntimeError as e:
        if "could not download" in str(e):
            pytest.skip(f"sdist not available: {e}")
        raise
    assert len(written) == 1
    task = load_task(written[0])
    assert task.category == "bug" and task.files_changed == 1 and task.fail_to_pass
    assert not (task.repo_dir / "test_inflection.py").exists()  # the hidden tests are not in the agent's repo
    v = validate_task(task, factory)
    assert v.ok, v.reason
    assert set(v.base.fail_to_pass["failure"]) == set(task.fail_to_pass)


# ------------------------------------------------------------------------ generators, no sdist
def test_mutations_are_single_node_splices():
    src = "def f(a, b):\n    # keep me\n    if a < b:\n        return a + b\n    return 3\n"
    muts = candidates("m.py", src)
    assert {m.kind for m in muts} == {"compare", "binop", "constant", "remove_branch"}
    by_kind = {m.kind: m for m in muts}
    assert apply(src, [by_kind["compare"]]) == src.replace("a < b", "a <= b")
    assert apply(src, [by_kind["binop"]]) == src.replace("a + b", "a - b")
    assert apply(src, [by_kind["constant"]]) == src.replace("return 3", "return 4")
    assert apply(src, [by_kind["remove_branch"]]) == (
        "def f(a, b):\n    # keep me\n    pass\n    return 3\n")
    assert all(m.function == "f" for m in muts)


def test_feature_deletion_removes_def_and_reexports(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "from .core import keep, gone\n__all__ = ['keep', 'gone']\n",
                      "pkg/core.py": "def keep():\n    return 1\n\n\n@staticmethod\ndef gone():\n    return 2\n"})
    mods = ["pkg/__init__.py", "pkg/core.py"]
    assert ("pkg/core.py", "gone") in deletable(tmp_path, mods)
    edits = delete_feature(tmp_path, mods, "pkg/core.py", "gone")
    assert edits["pkg/__init__.py"] == "from .core import keep\n__all__ = ['keep']\n"
    assert edits["pkg/core.py"] == "def keep():\n    return 1\n\n\n"


def test_release_task_from_two_versions(tmp_path):
    """Version 2 adds `sub`; its test of sub is F2P on version 1's source, its test of add is P2P."""
    test_v2 = ("from calc import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n\n\n"
               "def test_sub():\n    from calc import sub\n\n    assert sub(3, 1) == 2\n")
    old = _write(tmp_path / "v1", {"calc.py": "def add(a, b):\n    return a + b\n",
                                    "CHANGES.rst": "1.0\n---\n- first release\n",
                                    "tests/test_calc.py": "from calc import add\n\n\ndef test_add():\n"
                                                          "    assert add(1, 2) == 3\n"})
    new = _write(tmp_path / "v2", {"calc.py": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
                                              "    return a - b\n",
                                    "CHANGES.rst": "2.0\n---\n- add ``sub``\n\n1.0\n---\n- first release\n",
                                    "tests/test_calc.py": test_v2})
    assert changelog_added(old, new) == ["2.0", "- add ``sub``"]
    base = Task(id="calc-release-2.0", instruction="", repo_dir=None, tests_dir=None, repo="calc")
    path = build_release_task(base, old, new, "calc", factory, tmp_path / "out", tests=("tests",))
    task = load_task(path)
    assert task.fail_to_pass == ("tests/test_calc.py::test_sub",)
    assert task.pass_to_pass == ("tests/test_calc.py::test_add",)
    # the version heading is not a change: the terse prompt is the first changelog line that is one
    assert task.prompts["terse"] == "add ``sub``" and "2.0" not in task.prompts["issue"]
    assert (task.lines_changed, task.files_changed) == (4, 1)
    v = validate_task(task, factory)
    assert v.ok, v.reason


def test_splits_must_not_share_a_repository():
    def t(i, repo, split):
        return Task(id=i, instruction="", repo_dir=None, tests_dir=None, repo=repo, metadata={"split": split})

    assert check_splits_disjoint([t("a", "toolz", "train"), t("b", "six", "eval")]) == {"train": ["a"],
                                                                                          "eval": ["b"]}
    with pytest.raises(ValueError, match="toolz"):
        check_splits_disjoint([t("a", "toolz", "train"), t("b", "toolz", "eval")])


def test_test_file_rule_and_patch_size():
    for path in ["tests/test_a.py", "pkg/tests/data.json", "conftest.py", "sub/conftest.py", "test_x.py",
                 "x_test.py", "pytest.ini", "tox.ini", "setup.cfg"]:
        assert is_test_path(path), path
    for path in ["pkg/core.py", "test_output.txt", "pkg/testing_utils.py", "latest.py"]:
        assert not is_test_path(path), path
    patch = make_patch({"a.py": "x = 1\n", "tests/test_a.py": "t = 1\n"},
                       {"a.py": "x = 2\ny = 3\n", "tests/test_a.py": "t = 2\n"})
    assert patch_size(patch) == (5, 2)
    kept, dropped = drop_test_files(patch)
    assert dropped == ["tests/test_a.py"] and patch_size(kept) == (3, 1)


def test_rl_ladder_train_tasks_never_equal_a_heldout_task(tmp_path):
    """One-key `lookup` has 256 possible tasks, so a train seed redraws held-out ones: the RL system's train set
    leaves those out (same prompt and files), keeping the held-out eval a test of what was not trained."""
    from c2jax.rl.system.config import EnvConfig
    from c2jax.rl.system.envs import ladder_splits
    from c2jax.rl.tasks.ladder import task_content

    cfg = EnvConfig(kind="ladder", rungs=("lookup",), per_rung=60, lookup_keys=1, sandbox="local")
    train, held = ladder_splits(cfg, tmp_path, seed=0)
    assert len(held) == 60 and 30 < len(train) < 60  # some of the 60 train draws repeat a held-out task
    held_content = {task_content(load_task(p)) for p in held.values()}
    assert not {task_content(load_task(p)) for p in train.values()} & held_content
    for path in train.values():  # env.lookup_keys reaches the ladder
        assert len((load_task(path).repo_dir / "settings.ini").read_text().splitlines()) == 1


def test_rl_ladder_task_ids_name_one_task_so_train_episodes_are_graded_by_their_own_tests(tmp_path):
    """Both splits number their tasks from 000; the environment host maps id -> directory for both. With shared
    ids, train `echo` episodes were graded against the held-out task's hidden test (a correct copy scored 0).
    Every id names one task, and the host grades a train task's reference solution as resolved."""
    from c2jax.rl.system.config import EnvConfig
    from c2jax.rl.system.envs import EnvironmentHost, ladder_splits
    from c2jax.rl.tasks.ladder import task_content

    cfg = EnvConfig(kind="ladder", rungs=("echo",), per_rung=4, sandbox="local")
    train, held = ladder_splits(cfg, tmp_path, seed=0)
    assert train and held and not set(train) & set(held)
    assert all(p.parent.name == "train" for p in train.values()) and all(p.parent.name == "eval" for p in held.values())
    two = EnvConfig(kind="ladder", rungs=("echo", "lookup"), per_rung=3, sandbox="local")
    _, held2 = ladder_splits(two, tmp_path / "two", seed=0)  # rungs alternate: the first N cover both
    assert [load_task(p).metadata["rung"] for p in held2.values()] == ["echo", "lookup"] * 3
    host = EnvironmentHost(cfg, {**train, **held})
    for tid, path in list(train.items())[:2] + list(held.items())[:1]:
        task = load_task(path)
        assert host.grade_patch(tid, task.solution_patch)[0] == 1.0
        other = load_task(held[next(iter(held))] if tid in train else train[next(iter(train))])
        if task_content(other) != task_content(task):
            assert host.grade_patch(tid, other.solution_patch)[0] == 0.0


# ------------------------------------------------------------------- multi-file feature deletion
SHAPES = {
    "shapes/__init__.py": "from .area import Square, circle_area\nfrom .fmt import describe, shout\n"
                          "__all__ = ['Square', 'circle_area', 'describe', 'shout']\n",
    "shapes/area.py": ("import math\n\n_PI = math.pi\n\n\ndef _sq(x):\n    return x * x\n\n\n"
                       "def _unused_elsewhere(x):\n    return _sq(x) + 0\n\n\n"
                       "class Square:\n    def __init__(self, side):\n        self.side = side\n\n"
                       "    def area(self):\n        return _unused_elsewhere(self.side)\n\n\n"
                       "def circle_area(r):\n    return _PI * _sq(r)\n"),
    "shapes/fmt.py": ("def _pad(text):\n    return f' {text} '\n\n\ndef describe(shape):\n"
                      "    return _pad(type(shape).__name__ + ' ' + str(shape.area()))\n\n\n"
                      "def shout(text):\n    return text.upper()\n"),
    "tests/test_shapes.py": ("from shapes import Square, describe\n\n\ndef test_area():\n"
                             "    assert Square(3).area() == 9\n\n\ndef test_describe():\n"
                             "    assert describe(Square(2)) == ' Square 4 '\n"),
    "tests/test_circle.py": ("import shapes\n\n\ndef test_circle():\n"
                             "    assert round(shapes.circle_area(1), 2) == 3.14\n\n\n"
                             "def test_shout():\n    assert shapes.shout('a') == 'A'\n"),
}
SHAPE_MODULES = ["shapes/__init__.py", "shapes/area.py", "shapes/fmt.py"]


def test_feature_closure_takes_the_private_helpers_only_the_feature_uses(tmp_path):
    """Square's closure takes _unused_elsewhere (only Square calls it) but not _sq (circle_area calls it
    too); with circle_area also removed, _sq and _PI go as well. Re-exports go from __init__.py."""
    from c2jax.rl.tasks.deletion import Package, closure

    pkg = Package(_write(tmp_path, SHAPES), SHAPE_MODULES)
    square = closure(pkg, [("shapes/area.py", "Square")])
    assert square.helpers == (("shapes/area.py", "_unused_elsewhere"),)
    edits = dict(square.edits)
    assert set(edits) == {"shapes/__init__.py", "shapes/area.py"} and square.files == 2
    assert "Square" not in edits["shapes/__init__.py"] and "circle_area" in edits["shapes/__init__.py"]
    assert "_unused_elsewhere" not in edits["shapes/area.py"] and "def _sq" in edits["shapes/area.py"]
    both = closure(pkg, [("shapes/area.py", "Square"), ("shapes/area.py", "circle_area")])
    assert {n for _, n in both.helpers} == {"_unused_elsewhere", "_sq", "_PI"}
    area = dict(both.edits)["shapes/area.py"]
    assert area.strip() == "import math"  # everything but the import went
    removed = len(SHAPES["shapes/area.py"].splitlines()) - len(area.splitlines())
    assert both.lines == removed + 1  # and __init__.py's `from .area import ...` line
    for text in dict(both.edits).values():
        compile(text, "x", "exec")


def test_multi_file_features_group_targets_one_test_file_uses(tmp_path):
    """test_shapes.py imports Square and describe (modules area and fmt): one cross-module feature;
    circle_area and shout are read off the imported package in test_circle.py: another. A target no
    test file uses is never grouped by the test-file rule."""
    import random

    from c2jax.rl.tasks.deletion import multi_file_features, test_mentions

    repo = _write(tmp_path, SHAPES)
    mentions = test_mentions(repo, {"Square", "describe", "circle_area", "shout"})
    assert mentions == {"Square": {"tests/test_shapes.py"}, "describe": {"tests/test_shapes.py"},
                        "circle_area": {"tests/test_circle.py"}, "shout": {"tests/test_circle.py"}}
    feats = multi_file_features(repo, SHAPE_MODULES, random.Random(0), min_lines=8, min_files=2)
    # Square and describe are large enough alone (with their helpers and re-exports); the others only
    # in a group
    assert {tuple(sorted(n for _, n in f.targets)) for f in feats} == {
        ("Square",), ("describe",), ("circle_area", "shout")}
    for f in feats:
        assert f.lines >= 8 and f.files >= 2
    assert not multi_file_features(repo, SHAPE_MODULES, random.Random(0), min_lines=500)


def test_build_library_writes_multi_file_feature_tasks_that_validate(tmp_path):
    """The generator on a pinned 'sdist' already in the cache: each task removes >= 8 lines over >= 2
    files, its hidden tests are the files that used the targets, the base fails them and the reference
    resolves; the prompts name the targets (terse: one line)."""
    cache = tmp_path / "cache"
    _write(cache / "repos" / "shapes-1.0", SHAPES)
    lib = LibraryConfig("shapes", "1.0", "0" * 64, tests=("tests",), mutation_tasks=0, deletion_tasks=0,
                        feature_tasks=2, feature_min_lines=8)
    written = build_library(lib, tmp_path / "out", factory, cache_dir=cache, seed=0)
    assert len(written) == 2
    for path in written:
        task = load_task(path)
        assert task.category == "multi_file_feature" and task.difficulty == "hard"
        assert task.lines_changed >= 8 and task.files_changed >= 2
        names = [t.split(":")[1] for t in task.metadata["targets"]]
        assert all(n in task.prompts["terse"] and n in task.prompts["issue"] for n in names)
        assert "\n" not in task.prompts["terse"]
        hidden = {t.split("::")[0] for t in task.fail_to_pass}
        assert all(not (task.repo_dir / h).exists() for h in hidden)
        v = validate_task(task, factory)
        assert v.ok, v.reason


def test_stub_features_empty_bodies_and_keep_signatures_and_docstrings(tmp_path):
    """A stub keeps the def line and docstring and raises NotImplementedError; the private helper only
    that body used goes with it; a method can be a target; callers elsewhere do not block a stub."""
    import random

    from c2jax.rl.tasks.deletion import Package, closure, multi_file_features

    files = dict(SHAPES)
    files["shapes/fmt.py"] = ('def _pad(text):\n    return f" {text} "\n\n\ndef describe(shape):\n'
                              '    """One line about a shape."""\n    name = type(shape).__name__\n'
                              '    return _pad(name + " " + str(shape.area()))\n\n\n'
                              'def shout(text):\n    return describe(text).upper()\n')
    repo = _write(tmp_path, files)
    pkg = Package(repo, SHAPE_MODULES)
    feature = closure(pkg, [("shapes/fmt.py", "describe"), ("shapes/area.py", "Square.area")], stub=True)
    fmt = dict(feature.edits)["shapes/fmt.py"]
    assert fmt.startswith('def describe(shape):\n    """One line about a shape."""\n    raise NotImplementedError\n')
    assert "_pad" not in fmt and "def shout" in fmt  # shout still calls describe: a stub does not care
    area = dict(feature.edits)["shapes/area.py"]
    assert "    def area(self):\n        raise NotImplementedError\n" in area
    assert "def _unused_elsewhere" not in area  # only Square.area used it
    assert feature.files == 2 and feature.stub
    assert {n for _, n in feature.helpers} == {"_pad", "_unused_elsewhere"}
    for text in dict(feature.edits).values():
        compile(text, "x", "exec")
    stubs = multi_file_features(repo, SHAPE_MODULES, random.Random(0), min_lines=1, min_files=1, stub=True,
                                min_body_lines=2)
    assert ("shapes/fmt.py", "describe") in {t for f in stubs for t in f.targets}


def test_build_library_writes_reimplement_tasks_that_validate(tmp_path):
    cache = tmp_path / "cache"
    files = dict(SHAPES)
    files["shapes/area.py"] = SHAPES["shapes/area.py"].replace(
        "    def area(self):\n        return _unused_elsewhere(self.side)\n",
        "    def area(self):\n        side = self.side\n        value = _unused_elsewhere(side)\n"
        "        return value\n")
    _write(cache / "repos" / "shapes-1.0", files)
    lib = LibraryConfig("shapes", "1.0", "0" * 64, tests=("tests",), mutation_tasks=0, deletion_tasks=0,
                        stub_tasks=1, stub_min_body_lines=2, feature_min_lines=3, feature_min_files=1)
    [path] = build_library(lib, tmp_path / "out", factory, cache_dir=cache, seed=0)
    task = load_task(path)
    assert task.category == "reimplement" and "NotImplementedError" in task.prompts["issue"]
    assert task.prompts["terse"].startswith("shapes: implement ")
    v = validate_task(task, factory)
    assert v.ok, v.reason


def test_removal_edits_only_the_removed_items_and_their_blank_lines(tmp_path):
    """A multi-line __all__ and import lose only the removed name's line; a one-line list loses the item
    and its comma; the removed def takes its surplus blank lines (two stay between top-level defs, one
    between methods), so the reference patch is the feature and nothing else."""
    from c2jax.rl.tasks.deletion import Package, closure

    init = ("from .core import (\n    keep,\n    gone,\n)\nfrom .core import gone as _g, keep as k2\n"
            "__all__ = [\n    'keep',\n    'gone',  # the one to go\n]\nSHORT = ['gone', 'keep']\n")
    core = ("import os\n\n\n\ndef keep():\n    return 1\n\n\ndef gone():\n    return 2\n\n\nclass C:\n"
            "    def a(self):\n        return 1\n\n    def gone_too(self):\n        return 2\n\n"
            "    def b(self):\n        return 3\n")
    repo = _write(tmp_path, {"pkg/__init__.py": init, "pkg/core.py": core})
    pkg = Package(repo, ["pkg/__init__.py", "pkg/core.py"])
    feature = closure(pkg, [("pkg/core.py", "gone"), ("pkg/core.py", "C.gone_too")])
    edits = dict(feature.edits)
    assert edits["pkg/__init__.py"] == ("from .core import (\n    keep,\n)\nfrom .core import keep as k2\n"
                                        "__all__ = [\n    'keep',\n]\nSHORT = ['gone', 'keep']\n")
    assert edits["pkg/core.py"] == ("import os\n\n\n\ndef keep():\n    return 1\n\n\nclass C:\n"
                                    "    def a(self):\n        return 1\n\n    def b(self):\n        return 3\n")
