"""RL on task suites (issue 40): task sources and their splits, the curriculum with source weights, stages and the
pass-rate filter, online-eval figures per category, task transfer to environment workers, `c2jax rl --tasks`,
and an async run over a mixed suite (ladder tasks + Harbor tasks) on Ray."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from c2jax.config import ConfigError, from_dict, load
from c2jax.rl.system.config import (
    CurriculumConfig,
    CurriculumStage,
    DifficultyFilterConfig,
    EnvConfig,
    LadderSourceConfig,
    RLSystemConfig,
    TaskSourceConfig,
)
from c2jax.rl.system.curriculum import Curriculum
from c2jax.rl.system.suite import SuiteSourceError, load_taskset

HARBOR = Path(__file__).resolve().parent / "fixtures" / "harbor"


@pytest.fixture(scope="module")
def ladder_dirs(tmp_path_factory):
    """The demo's way of putting a ladder on disk: train tasks from seed 0, held-out tasks from seed 1000."""
    from c2jax.rl.tasks.ladder import build_ladder

    root = tmp_path_factory.mktemp("ladder")
    build_ladder(root / "train", seed=0, per_rung=6, rungs=("echo", "lookup"))
    build_ladder(root / "eval", seed=1000, per_rung=6, rungs=("echo", "lookup"))
    return root


def _suite(*sources, **env) -> EnvConfig:
    return EnvConfig(kind="suite", sources=tuple(from_dict(TaskSourceConfig, s) for s in sources), **env)


# ------------------------------------------------------------------------------------------ sources
def test_hash_split_is_deterministic_disjoint_and_follows_the_task_id(ladder_dirs, tmp_path):
    env = _suite({"path": str(ladder_dirs / "train"), "held_out_fraction": 0.3})
    a, b = load_taskset(env, tmp_path, 0), load_taskset(env, tmp_path, 7)  # the seed plays no part
    assert list(a.train) == list(b.train) and list(a.held_out) == list(b.held_out)
    assert not set(a.train) & set(a.held_out) and len(a.train) + len(a.held_out) == 12
    for tid in a.held_out:  # the rule, recomputed: sha256(id) as a fraction of 16**12 below 0.3
        assert int(hashlib.sha256(tid.encode()).hexdigest()[:12], 16) / 16 ** 12 < 0.3
    for tid in a.train:
        assert int(hashlib.sha256(tid.encode()).hexdigest()[:12], 16) / 16 ** 12 >= 0.3


def test_explicit_split_modes_and_id_list(ladder_dirs, tmp_path):
    ids = tmp_path / "held.txt"
    ids.write_text("# held out\nladder-echo-001\nladder-lookup-002\n")
    ts = load_taskset(_suite({"path": str(ladder_dirs / "train"), "held_out_ids": str(ids)}), tmp_path, 0)
    assert set(ts.held_out) == {"ladder-echo-001", "ladder-lookup-002"} and len(ts.train) == 10
    ts = load_taskset(_suite({"path": str(ladder_dirs / "train"), "split": "train", "name": "tr"},
                             {"path": str(ladder_dirs / "eval"), "split": "held_out", "name": "ev"}), tmp_path, 0)
    assert {st.source for st in ts.train.values()} == {"tr"} and {st.source for st in ts.held_out.values()} == {"ev"}
    assert ts.weights == {"tr": 1.0}  # an eval-only source samples nothing
    bad = tmp_path / "bad.txt"
    bad.write_text("no-such-task\n")
    with pytest.raises(SuiteSourceError, match="no-such-task"):
        load_taskset(_suite({"path": str(ladder_dirs / "train"), "held_out_ids": str(bad)}), tmp_path, 0)


def test_the_ladder_kind_is_the_suite_of_its_generated_source(tmp_path):
    """`env.kind: ladder` goes through the suite loader: the same ids, order and prompts as the ladder's own
    splits (rl/system/envs.ladder_splits), held-out tasks alternating rungs."""
    from c2jax.rl.system.envs import ladder_splits
    from c2jax.rl.tasks.task import load_task

    env = EnvConfig(kind="ladder", rungs=("echo", "lookup"), per_rung=5, prompt_level="terse")
    ts = load_taskset(env, tmp_path / "a", 3)
    train, held = ladder_splits(env, tmp_path / "b", 3)
    assert list(ts.train) == list(train) and list(ts.held_out) == list(held)
    assert [st.instruction for st in ts.train.values()] == [load_task(p).prompt("terse") for p in train.values()]
    assert [st.category for st in ts.held_out.values()][:4] == ["ladder/echo", "ladder/lookup"] * 2
    # the same ladder written to disk and read as two sources: the same train and held-out tasks
    disk = load_taskset(_suite({"path": str(tmp_path / "b" / "train"), "split": "train", "name": "train"},
                               {"path": str(tmp_path / "b" / "eval"), "split": "held_out", "name": "eval"},
                               prompt_level="terse"), tmp_path, 3)
    assert list(disk.train) == list(ts.train) and list(disk.held_out) == list(ts.held_out)


def test_train_tasks_equal_to_a_held_out_task_are_left_out(tmp_path):
    """Small ladders repeat tasks across seeds: a copy of a held-out task in the train source is dropped."""
    from c2jax.rl.tasks.ladder import build_ladder

    build_ladder(tmp_path / "eval", seed=5, per_rung=3, rungs=("echo",))
    train = tmp_path / "train"
    shutil.copytree(tmp_path / "eval", train)
    build_ladder(tmp_path / "extra", seed=6, per_rung=4, rungs=("echo",))
    for d in (tmp_path / "extra").iterdir():  # other ids, other content (a duplicate of seed 5 is skipped too)
        shutil.copytree(d, train / f"x-{d.name}")
        toml = train / f"x-{d.name}" / "task.toml"
        toml.write_text(toml.read_text().replace(f'id = "{d.name}"', f'id = "x-{d.name}"'))
    ts = load_taskset(_suite({"path": str(train), "split": "train", "name": "tr"},
                             {"path": str(tmp_path / "eval"), "split": "held_out", "name": "ev"}), tmp_path, 0)
    assert all(tid.startswith("x-") for tid in ts.train) and len(ts.held_out) == 3
    assert any("equal to a held-out task left out" in n for n in ts.notes)
    # a held-out id that a train task holds takes the -heldout suffix (here no train task kept the id)
    assert list(ts.held_out) == [f"ladder-echo-00{i}" for i in range(3)]


def test_categories_weights_and_errors(ladder_dirs, tmp_path):
    ts = load_taskset(_suite({"path": str(ladder_dirs / "train"), "category": "copying", "weight": 3.0,
                              "categories": ["ladder/lookup"], "split": "train"}), tmp_path, 0)
    assert len(ts.train) == 6 and {st.category for st in ts.train.values()} == {"copying"}
    assert ts.weights == {"train": 3.0}
    with pytest.raises(SuiteSourceError, match="does not exist"):
        load_taskset(_suite({"path": str(tmp_path / "nope")}), tmp_path, 0)
    with pytest.raises(SuiteSourceError, match="no train task"):
        load_taskset(_suite({"path": str(ladder_dirs / "eval"), "split": "held_out"}), tmp_path, 0)
    with pytest.raises(SuiteSourceError, match="none of its 1 tasks can run here.*example/tb2-task"):
        load_taskset(_suite({"path": str(HARBOR / "refused-docker-image"), "split": "train"}), tmp_path, 0)
    with pytest.raises(ConfigError, match="exactly one of path"):
        TaskSourceConfig(path="x", ladder=LadderSourceConfig())
    with pytest.raises(ConfigError, match="env.sources"):
        EnvConfig(kind="suite")
    with pytest.raises(ConfigError, match="share a name"):
        _suite({"path": "a/t"}, {"path": "b/t"})
    with pytest.raises(ConfigError, match="weight must be > 0"):
        TaskSourceConfig(path="x", weight=0)


def test_harbor_and_generated_ladder_sources_mix(tmp_path):
    env = _suite({"path": str(HARBOR), "split": "train", "name": "harbor"},
                 {"ladder": {"rungs": ["echo"], "per_rung": 3}, "name": "gen"})
    ts = load_taskset(env, tmp_path, 0)
    harbor = [st for st in ts.train.values() if st.source == "harbor"]
    # refused-docker-image needs a registry image: loaded as unsupported, left out and said so
    assert "refused-docker-image" not in ts.train and any("unsupported" in n for n in ts.notes)
    assert len(harbor) >= 5 and all(st.task.harbor for st in harbor)
    assert len([t for t in ts.train.values() if t.source == "gen"]) == 3 and len(ts.held_out) == 3
    assert (tmp_path / "tasks" / "gen" / "train").is_dir()  # a generated source is written as task dirs


def test_swebench_instances_are_a_source_graded_on_the_environment_worker(tmp_path):
    """SWE-bench instances with their repositories: a train source; the environment host grades the reference
    patch 1 and no patch 0; shipping them is refused (no task directory), naming the way out."""
    from c2jax.rl.system.envs import EnvironmentHost
    from c2jax.rl.system.suite import ship_tasks
    from c2jax.rl.tasks.patches import make_patch

    repos = tmp_path / "repos"
    for i in range(3):
        repo = repos / f"calc__calc-{i}"
        repo.mkdir(parents=True)
        (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    test = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    rows = [{"instance_id": f"calc__calc-{i}", "repo": "calc/calc", "base_commit": "0" * 40,
             "problem_statement": f"add() subtracts ({i})",
             "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]),
             "PASS_TO_PASS": "[]", "patch": make_patch({"calc.py": "def add(a, b):\n    return a - b\n"},
                                                        {"calc.py": "def add(a, b):\n    return a + b\n"}),
             "test_patch": make_patch({}, {"tests/test_calc.py": test})} for i in range(3)]
    (tmp_path / "inst.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = _suite({"path": str(tmp_path / "inst.jsonl"), "repos": str(repos), "split": "train", "category": "swe"},
                 sandbox="local")
    ts = load_taskset(env, tmp_path, 0)
    assert list(ts.train) == [f"calc__calc-{i}" for i in range(3)]
    assert {st.category for st in ts.train.values()} == {"swe"}
    host = EnvironmentHost(env, ts.tasks())
    task = ts.train["calc__calc-1"].task
    assert host.grade_patch("calc__calc-1", task.solution_patch)[0] == 1.0
    assert host.grade_patch("calc__calc-1", "")[0] == 0.0
    with pytest.raises(SuiteSourceError, match="task_transfer=path"):
        ship_tasks(ts.tasks())
    with pytest.raises(SuiteSourceError, match="repositories"):  # no repos, no image store
        load_taskset(_suite({"path": str(tmp_path / "inst.jsonl"), "split": "train"}), tmp_path, 0)


# ------------------------------------------------------------------------------------------ curriculum
def test_one_source_samples_exactly_as_the_report_heuristic():
    """With one source and no filter the schedule is (1 + h / mean h) ** strength over every prompt, unseen
    prompts at the mean, drawn with the same generator calls as before sources existed."""
    ids = ["a", "b", "c"]
    cur = Curriculum(ids, CurriculumConfig(by="turns", strength=2.0), seed=0)
    cur.observe("a", turns=1, tokens=0)
    cur.observe("b", turns=3, tokens=0)
    mean = 2.0
    expect = np.array([(1 + 1 / mean) ** 2, (1 + 3 / mean) ** 2, (1 + 1) ** 2])
    np.testing.assert_allclose(cur.weights(), expect / expect.sum())
    rng = np.random.default_rng(0)
    draws = [cur.next_prompt() for _ in range(20)]
    assert draws == [ids[int(rng.choice(3, p=expect / expect.sum()))] for _ in range(20)]


def test_source_weights_set_each_sources_share():
    ids = [f"a{i}" for i in range(4)] + ["b0"]
    cur = Curriculum(ids, CurriculumConfig(), seed=1, sources={**{f"a{i}": "A" for i in range(4)}, "b0": "B"},
                     source_weights={"A": 1.0, "B": 3.0})
    w = cur.weights()
    np.testing.assert_allclose([w[:4].sum(), w[4]], [0.25, 0.75])
    counts = sum(cur.next_prompt() == "b0" for _ in range(4000))
    assert abs(counts / 4000 - 0.75) < 0.03


def test_stages_switch_the_hardness_signal():
    cfg = CurriculumConfig(by="tokens", strength=1.0, stages=(CurriculumStage(start_step=10, by="thinking_tokens",
                                                                               strength=1.0),))
    cur = Curriculum(["a", "b"], cfg)
    cur.observe("a", turns=1, tokens=30, thinking_tokens=0)
    cur.observe("b", turns=1, tokens=10, thinking_tokens=40)
    early, late = cur.weights(step=9), cur.weights(step=10)
    np.testing.assert_allclose(early, np.array([1 + 30 / 20, 1 + 10 / 20]) / 4.0)
    np.testing.assert_allclose(late, np.array([1 + 0, 1 + 40 / 20]) / 4.0)
    with pytest.raises(ConfigError, match="increase strictly"):
        CurriculumConfig(stages=(CurriculumStage(start_step=5), CurriculumStage(start_step=5)))


def test_filter_drops_never_and_always_solved_tasks_and_reprobes_them():
    cfg = CurriculumConfig(filter=DifficultyFilterConfig(enabled=True, window=2, min_groups=2, reprobe_rate=0.0))
    cur = Curriculum(["never", "always", "mixed"], cfg, seed=0)
    for _ in range(2):
        cur.observe("never", 1, 1, solve_rate=0.0)
        cur.observe("always", 1, 1, solve_rate=1.0)
        cur.observe("mixed", 1, 1, solve_rate=0.5)
    assert cur.filtered == {"never", "always"}
    assert {e["prompt_id"] for e in cur.take_events()} == {"never", "always"}
    np.testing.assert_allclose(cur.weights(), [0.0, 0.0, 1.0])
    assert {cur.next_prompt() for _ in range(50)} == {"mixed"}
    cur.observe("never", 1, 1, solve_rate=0.25)  # a re-probe solves it once in four: live again
    assert "never" not in cur.filtered and cur.take_events()[0]["event"] == "reinstated"
    assert cur.live_counts() == {"": (2, 1)}
    # re-probing at rate r picks a filtered task about r of the time
    probe = Curriculum(["x", "y"], CurriculumConfig(filter=DifficultyFilterConfig(
        enabled=True, window=1, min_groups=1, reprobe_rate=0.2)), seed=3)
    probe.observe("x", 1, 1, solve_rate=0.0)
    share = sum(probe.next_prompt() == "x" for _ in range(3000)) / 3000
    assert abs(share - 0.2) < 0.03
    # everything filtered: the filter steps aside rather than stall the run
    for p in ("mixed", "never"):
        for _ in range(2):
            cur.observe(p, 1, 1, solve_rate=1.0)
    np.testing.assert_allclose(cur.weights(), [1 / 3] * 3)


def test_eval_breakdown_has_intervals_per_category_and_source():
    from c2jax.rl.eval.metrics import bootstrap_ci
    from c2jax.rl.system.actors import eval_breakdown

    per = {"a": {"avg@1": 1.0}, "b": {"avg@1": 0.0}, "c": {"avg@1": 0.5}, "d": {"avg@1": 0.25}}
    cats = {"a": "x", "b": "x", "c": "y", "d": "y"}
    out = eval_breakdown(per, cats, {"a": "S", "b": "S", "c": "T", "d": "T"}, seed=0)
    assert out["category/x/avg@1"] == 0.5 and out["category/y/avg@1"] == 0.375 and out["category/x/prompts"] == 2
    assert (out["avg@1/ci_low"], out["avg@1/ci_high"]) == bootstrap_ci([1.0, 0.0, 0.5, 0.25], seed=0)
    assert (out["category/y/avg@1/ci_low"], out["category/y/avg@1/ci_high"]) == bootstrap_ci([0.5, 0.25], seed=0)
    assert out["source/T/avg@1"] == 0.375


# ------------------------------------------------------------------------------------------ transfer
def test_shipped_task_dirs_are_unpacked_and_graded_on_the_worker(ray_local, tmp_path):
    """env.task_transfer=ship: a worker grades a task whose directory is gone from the driver's disk."""
    from c2jax.rl.system.envs import EnvironmentHost
    from c2jax.rl.system.suite import ship_tasks, unseen_paths
    from c2jax.rl.tasks.ladder import build_ladder
    from c2jax.rl.tasks.task import load_task

    (d,) = build_ladder(tmp_path / "t", seed=0, per_rung=1, rungs=("lookup",))
    task = load_task(d)
    shipped = ship_tasks({"renamed-id": task})
    shutil.rmtree(tmp_path / "t")
    assert unseen_paths({"renamed-id": task}) == [f"renamed-id: {d}"]
    host = EnvironmentHost(EnvConfig(kind="suite", sources=(TaskSourceConfig(path="x"),), sandbox="local"), shipped)
    assert host.grade_patch("renamed-id", task.solution_patch)[0] == 1.0
    assert host.grade_patch("renamed-id", "")[0] == 0.0
    assert host._task("renamed-id").id == "renamed-id" and host._shipped.unpacked == 1


def test_environment_calls_wait_for_a_restarting_worker():
    """A call to an environment worker Ray is restarting is retried until it is back (within the call timeout),
    not failed at once: an immediate episode retry would hit the same restarting actor and fail too."""
    from ray.exceptions import ActorUnavailableError

    from c2jax.rl.system.actors import RolloutWorker

    class FakeRay:
        def __init__(self, unavailable):
            self.unavailable, self.calls = unavailable, 0

        def get(self, value, timeout):
            self.calls += 1
            if self.calls <= self.unavailable:
                raise ActorUnavailableError("restarting", b"\0" * 16)
            return value

    class Env:
        class grade_patch:  # noqa: N801 -- stands for an actor method
            @staticmethod
            def remote(*args):
                return ("graded", args)

    worker = RolloutWorker.__new__(RolloutWorker)
    worker.cfg = load(RLSystemConfig, None, ["system.call_timeout_s=5"])
    worker.ray = FakeRay(unavailable=3)
    assert worker._env_call(Env)("grade_patch", "t", "") == ("graded", ("t", "")) and worker.ray.calls == 4
    worker.cfg = load(RLSystemConfig, None, ["system.call_timeout_s=1"])
    worker.ray = FakeRay(unavailable=10 ** 6)
    with pytest.raises(ActorUnavailableError):  # still down at the timeout: the error propagates
        worker._env_call(Env)("grade_patch", "t", "")


def test_each_actor_resolves_the_moe_kernel_for_its_own_device(tmp_path):
    """moe_impl=grouped: the learner and samplers pick the grouped GEMM for the device they run on (a CPU driver
    must not decide a GPU learner's kernel) and say so in run_dir/execution.jsonl."""
    from c2jax.kernels import dispatch
    from c2jax.rl.system.backends import on_this_device, record_execution

    cfg = load(RLSystemConfig, None, ["model.preset=tiny", "model.moe_impl=grouped", f"output_dir={tmp_path}"])
    assert cfg.model.moe_kernel is None and on_this_device(cfg).model.moe_kernel == "xla"
    with dispatch.target("gpu", "NVIDIA H100 80GB HBM3"):
        assert on_this_device(cfg).model.moe_kernel == "pallas_triton"  # fp32: mosaic_sm90 takes bf16 only
    assert on_this_device(load(RLSystemConfig, None, ["model.preset=tiny"])).model.moe_kernel is None  # not grouped
    record_execution(on_this_device(cfg), tmp_path, "learner")
    (row,) = [json.loads(line) for line in (tmp_path / "execution.jsonl").read_text().splitlines()]
    assert (row["role"], row["platform"], row["moe_impl"], row["moe_kernel"]) == ("learner", "cpu", "grouped", "xla")


# ------------------------------------------------------------------------------------------ command line
def _args(*argv):
    from c2jax.rl.system.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["rl", *argv])


def test_rl_tasks_command_line_builds_a_suite_run(tmp_path):
    from c2jax.rl.system.cli import command_line_config

    cfg = command_line_config(_args("--tasks", "a/tasks", "--tasks", "b.jsonl", "--preset", "tiny", "--steps", "7",
                                    "--out", str(tmp_path), "env.sources.0.weight=2"))
    assert cfg.env.kind == "suite" and [s.path for s in cfg.env.sources] == ["a/tasks", "b.jsonl"]
    assert cfg.env.sources[0].weight == 2.0 and cfg.env.sources[1].weight == 1.0  # an override into a list item
    assert cfg.system.steps == 7 and cfg.output_dir == str(tmp_path) and cfg.curriculum.filter.enabled
    assert cfg.model.vocab_size >= 264 and cfg.engine.max_len >= 12288 and cfg.env.episode.tool_schemas == "signatures"
    with pytest.raises(ConfigError, match="--tasks"):
        command_line_config(_args("--steps", "3"))
    with pytest.raises(ConfigError, match="has 1 items, no item 3"):
        command_line_config(_args("--tasks", "a", "env.sources.3.weight=2"))
    with pytest.raises(ConfigError, match="--steps must be positive"):
        command_line_config(_args("--tasks", "a", "--steps", "0"))


# ------------------------------------------------------------------------------------------ a run on Ray
@pytest.fixture(scope="module")
def ray_local():
    pytest.importorskip("ray")
    from c2jax.rl.system.cluster import init_ray, shutdown_ray

    init_ray(num_cpus=2)
    yield
    shutdown_ray()


def test_async_run_over_a_mixed_suite_filters_and_logs_per_source(ray_local, ladder_dirs, tmp_path):
    """Ladder lookup tasks (train) + their held-out split + Harbor tasks the tiny model cannot solve, on the real
    engine and learner: every episode is graded, the never-solved Harbor tasks are filtered (and the log says so),
    and metrics carry per-source and per-category rows, the online eval per-category figures."""
    from c2jax.rl.sandbox.bwrap import bwrap_unusable_reason
    from c2jax.rl.system.reconciler import run_system
    from c2jax.train.metrics import read_metrics

    if bwrap_unusable_reason() is not None:
        pytest.skip(f"Harbor tasks need bwrap: {bwrap_unusable_reason()}")
    from tests.test_rl_system import AGENTIC_TINY

    sources = [{"path": str(ladder_dirs / "train"), "split": "train", "name": "ladder",
                "categories": ["ladder/lookup"]},
               {"path": str(ladder_dirs / "eval"), "split": "held_out", "name": "held",
                "categories": ["ladder/lookup"]},
               {"path": str(HARBOR), "split": "train", "name": "harbor", "weight": 1.0}]
    base = [o for o in AGENTIC_TINY if not o.startswith(("env.kind", "env.rungs", "env.per_rung", "env.sandbox"))]
    cfg = load(RLSystemConfig, None, [*base, ("env.kind", "suite"), ("env.sources", sources), "env.sandbox=bwrap",
                                      f"output_dir={tmp_path}", "name=mixed", "system.steps=3", "system.group_size=4",
                                      "system.groups_per_step=3", "curriculum.filter.enabled=true",
                                      "curriculum.filter.window=1", "curriculum.filter.min_groups=1",
                                      "curriculum.filter.reprobe_rate=0.0", "eval.every=3", "eval.k=2",
                                      "system.max_staleness=2", "system.call_timeout_s=300",
                                      "system.max_episode_retries=2"])
    import ray

    killed = []

    def on_step(rec):  # the environment worker dies mid-run: Ray restarts it, its episodes run again
        if rec.version == 1 and not killed:
            killed.append(ray.get(rec.env_workers[0].check_tasks.remote())["pid"])
            ray.kill(rec.env_workers[0], no_restart=False)

    out = run_system(cfg, on_step=on_step)
    assert killed and out["version"] == 3 and out["counts"].get("episodes_errored", 0) == 0, out["counts"]
    c = out["counts"]
    assert c["groups_dispatched"] == c["groups_returned"] + c.get("groups_lost", 0) + out["inflight_at_end"] + \
        out["retry_at_end"] and c.get("groups_lost", 0) == 0
    rows = [json.loads(line) for line in (cfg.run_dir / "groups.jsonl").read_text().splitlines()]
    ids = {r["prompt_id"] for r in rows if "prompt_id" in r and r.get("rollouts")}
    assert any(i.startswith("ladder-lookup") for i in ids)
    # each episode says how its environment was made: the ladder and Harbor tasks here all run in bwrap
    assert {x["env_kind"] for r in rows if r.get("rollouts") for x in r["rollouts"]} == {"bwrap"}
    events = [json.loads(line) for line in (cfg.run_dir / "events.jsonl").read_text().splitlines()]
    filtered = [e for e in events if e["event"] == "filter_filtered"]
    harbor_ids = {p.name for p in HARBOR.iterdir()}
    assert any(e["source"] == "harbor" and e["prompt_id"] in harbor_ids for e in filtered)
    assert out["counts"]["tasks_filtered"] == len(filtered)
    metrics = read_metrics(cfg.run_dir)
    last = metrics[-1]
    assert last["source/harbor/tasks_filtered"] >= 1
    assert last["source/ladder/tasks_live"] + last["source/ladder/tasks_filtered"] == 6
    assert any("source/harbor/solve_rate" in m for m in metrics) and any("category/ladder/lookup/turns" in m
                                                                          for m in metrics)
    evals = read_metrics(cfg.run_dir, kind="eval")
    assert evals and "category/ladder/lookup/avg@1" in evals[-1] and "avg@1/ci_high" in evals[-1]
    assert (cfg.run_dir / "tensorboard").is_dir()
    assert out["tasks"]["source/harbor"]["train"] >= 5
    # each actor wrote what it runs on its own device (the driver cannot know a remote device's kernel)
    roles = [json.loads(line) for line in (cfg.run_dir / "execution.jsonl").read_text().splitlines()]
    assert {r["role"] for r in roles} == {"learner", "sampler"} and all(r["platform"] == "cpu" for r in roles)
