"""experiments.seeds: seeds as an axis (issue 38 item 3). A tiny stand-in experiment writes results.json with
per-task values; the runner runs it per seed, resumes, reports failures, and summarises with the intervals."""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest

from c2jax.rl.eval.metrics import bootstrap_ci, hierarchical_bootstrap_ci
from experiments.seeds.figures import SeedFigures, summarize
from experiments.seeds.runner import build_command, main, parse_seeds


def test_parse_seeds_ranges_and_lists():
    assert parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert parse_seeds("0-2,9") == [0, 1, 2, 9]
    for bad, msg in (("3-1", "backwards"), ("a", "not a seed"), ("1,1", "twice")):
        with pytest.raises(ValueError, match=msg):
            parse_seeds(bad)


def test_hierarchical_bootstrap_reduces_to_the_one_level_cases():
    rng = np.random.default_rng(0)
    # one seed: the task bootstrap of that seed (same interval up to Monte Carlo error)
    x = rng.normal(size=60)
    lo1, hi1 = bootstrap_ci(x, n_boot=20000)
    lo2, hi2 = hierarchical_bootstrap_ci([x], n_boot=20000)
    assert abs(lo1 - lo2) < 0.03 and abs(hi1 - hi2) < 0.03
    # no task variation within a seed: the bootstrap over the seeds' means
    means = [0.1, 0.5, 0.3, 0.9, 0.2]
    lo1, hi1 = bootstrap_ci(means, n_boot=20000)
    lo2, hi2 = hierarchical_bootstrap_ci([[m] * 30 for m in means], n_boot=20000)
    assert abs(lo1 - lo2) < 0.02 and abs(hi1 - hi2) < 0.02
    # both sources of variation: wider than either alone
    groups = [m + rng.normal(scale=0.5, size=30) for m in means]
    lo3, hi3 = hierarchical_bootstrap_ci(groups, n_boot=20000)
    lo4, hi4 = bootstrap_ci([g.mean() for g in groups], n_boot=20000)
    assert hi3 - lo3 > hi4 - lo4
    with pytest.raises(ValueError, match="non-empty"):
        hierarchical_bootstrap_ci([[1.0], []])


def test_summary_counts_seeds_whose_own_interval_is_above_zero():
    figs = {s: SeedFigures({"effect": d}, {"effect": [d - 0.1, d + 0.1]}, {"effect": (d - w, d + w)})
            for s, (d, w) in enumerate([(0.2, 0.1), (0.1, 0.2), (0.3, 0.05)])}
    figs[3] = SeedFigures({"effect": float("nan")})
    row = summarize(figs, n_boot=2000)["effect"]
    assert row["seeds"] == 3 and row["missing"] == 1
    assert row["mean"] == pytest.approx(0.2)
    assert row["seeds_ci_above_0"] == 2 and row["seeds_with_ci"] == 3 and row["seeds_positive"] == 3
    lo, hi = row["ci_over_seeds"]
    assert 0.1 <= lo <= 0.2 <= hi <= 0.3
    assert len(row["ci_seeds_and_tasks"]) == 2


STANDIN = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    seed, out = int(sys.argv[1]), Path(sys.argv[2])
    if seed == 13:
        sys.exit(3)
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "calls.txt", "a") as f:
        f.write(f"{seed}\\n")
    json.dump({"reward": 0.1 * seed, "nested": {"loss": 2.0 - seed}, "per": [1, 2]}, open(out / "results.json", "w"))
''')


def test_runner_runs_each_seed_once_resumes_and_reports_a_failed_seed(tmp_path, capsys):
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    out = tmp_path / "study"
    cmd = ["--", sys.executable, str(script), "{seed}", "{out}"]
    assert main(["--seeds", "0-2", "--out", str(out), *cmd]) == 0
    result = json.loads((out / "seeds.json").read_text())
    assert [r["status"] for r in result["per_seed"]] == ["ok"] * 3
    assert result["summary"]["reward"]["mean"] == pytest.approx(0.1)
    assert result["summary"]["nested.loss"]["mean"] == pytest.approx(1.0)
    assert "machine" in result and "load_avg_start" in result["machine"]
    md = (out / "SEEDS.md").read_text()
    assert "seed 2" in md and "95% CI over seeds" in md
    # rerun with more seeds: the finished ones are reused, the new one runs; a failing seed is reported
    assert main(["--seeds", "0-3,13", "--out", str(out), "--parallel", "2", *cmd]) == 1
    calls = sorted(int(x) for x in (out / "calls.txt").read_text().split())
    assert calls == [0, 1, 2, 3]
    result = json.loads((out / "seeds.json").read_text())
    assert {r["seed"]: r["status"] for r in result["per_seed"]}[13] == "exit 3"
    assert result["summary"]["reward"]["seeds"] == 4
    assert "seeds not ok: [13]" in capsys.readouterr().err


def test_build_command_for_the_demo_and_an_ablation(tmp_path):
    argv, fig = build_command(["demo", "--until", "eval"], 4, tmp_path / "seed-4")
    assert fig == "demo" and argv[1:] == ["-m", "experiments.demo", "--seed", "4", "--out", str(tmp_path / "seed-4"),
                                          "--until", "eval"]
    with pytest.raises(ValueError, match="set by the seed runner"):
        build_command(["demo", "--seed", "1"], 0, tmp_path)
    run = tmp_path / "study" / "seed-2"  # not made yet: a new study plans every seed before running any
    argv, fig = build_command(["ablation02", "--quick"], 2, run)
    assert fig == "ablation02" and "experiments.ablations.02_rl_lifts_best_of_k.run" in argv and "--quick" in argv
    import yaml

    assert yaml.safe_load((run / "config.yaml").read_text())["seed"] == 2
    with pytest.raises(ValueError, match="no ablation"):
        build_command(["ablation99"], 0, run)
    with pytest.raises(ValueError, match="must take the seed"):
        build_command(["--", "python", "x.py"], 0, run)


def test_ablation01_rank_correlation_and_slope_within_a_seed_and_pooled_over_seeds(tmp_path):
    """Ablation 01's figure over seeds: per seed, Spearman and the least-squares slope of RL reward on post-SFT
    loss across the CPT budgets (NumPy polyfit / the rank formula as references); pooled over seeds x budgets
    with intervals from resampling whole seeds."""
    from experiments.seeds.figures import ablation01_figures, ablation01_pooled, spearman

    def write(seed, losses, rewards):
        d = tmp_path / f"seed-{seed}"
        d.mkdir()
        runs = [{"budget": b, "cpt_eval_loss": 3.0 - i * 0.1, "sft_eval_loss": x, "rl_final_train_reward": y,
                 "eval_reward_after_rl": y + 0.01, "eval_reward_before_rl": y / 2}
                for i, (b, x, y) in enumerate(zip((25, 100, 400), losses, rewards))]
        (d / "results.json").write_text(json.dumps({"runs": runs}))
        return d

    d0 = write(0, [2.2, 2.1, 1.9], [0.05, 0.09, 0.12])  # lower loss, higher reward: rho -1
    d1 = write(1, [2.3, 2.05, 2.12], [0.04, 0.10, 0.06])  # ranks agree with -1 again
    d2 = write(2, [2.25, 2.15, 2.01], [0.08, 0.07, 0.11])  # 2.25 -> 0.08, 2.15 -> 0.07: rho -0.5
    f0 = ablation01_figures(d0).scalars
    assert f0["spearman/sft_loss_vs_rl_final_train_reward"] == pytest.approx(-1.0)
    assert f0["slope/rl_final_train_reward_per_nat_sft_loss"] == pytest.approx(
        np.polyfit([2.2, 2.1, 1.9], [0.05, 0.09, 0.12], 1)[0])
    assert f0["budget_400/sft_eval_loss"] == 1.9
    assert ablation01_figures(d2).scalars["spearman/sft_loss_vs_rl_final_train_reward"] == pytest.approx(-0.5)
    assert spearman([1, 2], [2, 1]) != spearman([1, 2], [2, 1])  # nan below 3 points
    pooled = ablation01_pooled({0: d0, 1: d1, 2: d2}, n_boot=500)
    row = pooled["rl_final_train_reward"]
    xs = [2.2, 2.1, 1.9, 2.3, 2.05, 2.12, 2.25, 2.15, 2.01]
    ys = [0.05, 0.09, 0.12, 0.04, 0.10, 0.06, 0.08, 0.07, 0.11]
    assert pooled["points"] == 9 and row["slope"] == pytest.approx(np.polyfit(xs, ys, 1)[0])
    d = np.argsort(np.argsort(xs)) - np.argsort(np.argsort(ys))  # no ties: rho = 1 - 6 sum d^2 / (n (n^2 - 1))
    assert row["spearman"] == pytest.approx(1 - 6 * np.sum(d ** 2) / (9 * 80))
    assert row["spearman_ci"][0] <= row["spearman"] <= row["spearman_ci"][1]
    assert row["slope_ci"][0] <= row["slope"] <= row["slope_ci"][1] < 0


def test_recorded_commands_name_no_path_of_this_machine():
    """seeds.json / SEEDS.md are committed with studies: the interpreter is `python`, repository paths relative."""
    from experiments.seeds.runner import ROOT, portable

    argv = [sys.executable, "-m", "experiments.demo", "--sft-from", str(ROOT / "runs" / "sft" / "seed-{seed}"),
            "--out", "{out}", ".venv/bin/python", "/elsewhere/data"]
    assert portable(argv) == ["python", "-m", "experiments.demo", "--sft-from", "runs/sft/seed-{seed}", "--out",
                              "{out}", "python", "/elsewhere/data"]
