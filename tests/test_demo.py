"""`make demo` end to end in --quick mode: every stage runs (info, pretraining, CPT + SFT on oracle
transcripts, async RL on Ray, eval before/after, HF round trip, report) and writes what it promises."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_demo_quick_end_to_end(tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # one CPU device, as `make demo` runs (conftest fakes 8 for the sharding tests)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "").strip()
    proc = subprocess.run([sys.executable, "-m", "experiments.demo", "--quick", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"tensorboard --logdir {out}" in proc.stdout
    assert "os.fork() was called" not in proc.stderr  # no fork of the JAX process (Ray, sandboxes)
    # output to a pipe (a log file, CI): plain lines, no progress-bar frames
    assert "\r" not in proc.stdout + proc.stderr, [x[-200:] for x in (proc.stdout + proc.stderr).split("\r")[:3]]

    report = (out / "REPORT.md").read_text()
    for section in ("Kimi K2.5", "Pretraining", "Asynchronous RL", "before and after RL", "Hugging Face",
                    "TensorBoard"):
        assert section in report
    for name in ("pretraining_loss", "rl_reward_staleness", "eval_before_after"):
        png = out / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for run in ("base", "cpt", "rl", "eval"):
        assert list((out / run / "tensorboard").glob("events.out.tfevents.*")), f"no TensorBoard events in {run}"
    for cfg in ("base/config.yaml", "cpt/config.yaml", "rl/config.yaml", "eval/before/config.yaml",
                "data/sft_data.yaml"):
        assert (out / cfg).is_file(), cfg

    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["git"]["commit"] and results["meta"]["seed"] == 0
    # graded transcripts: the oracle's resolved, the imperfect teacher's (--teacher-error) not (else stage_data fails)
    from experiments.demo.pipeline import DemoConfig

    assert results["data"]["oracle_graded"] > 0 and results["data"]["teacher_error"] == DemoConfig().teacher_error
    # one line per tool in the system prompt, so SFT, RL and eval fit the short context
    data = results["data"]
    # every SFT prompt (2 rungs x up to 2 turns) tokenizes to the ids the RL harness renders
    assert data["prompts_checked_against_renderer"] == data["records"] > 0
    assert 512 <= data["vocab_size"] <= results["meta"]["config"]["vocab_size"]
    assert data["tool_schemas"] == "signatures"
    assert data["prompt_tokens"] + data["completion_tokens"] < results["meta"]["config"]["context"]
    assert [p["name"] for p in results["cpt"]["phases"]] == ["code", "long", "sft"]
    assert results["rl"]["summary"]["steps"] >= 1
    from tokenizers import Tokenizer

    data_tok = Tokenizer.from_file(data["tokenizer"])
    for label in ("before", "after"):
        summary = json.loads((out / "eval" / label / "summary.json").read_text())
        assert summary["demo"]["episodes"] == summary["summary"]["episodes"] >= 4
        assert 0.0 <= summary["demo"]["avg@1"] <= summary["demo"]["pass@2"] <= 1.0
        assert set(summary["demo"]["by_rung"]) == {"echo", "lookup"}
        # each reference completion that writes answer.txt splits into the answer and the call's format
        al = summary["demo"]["answer_likelihood"]
        refs = [json.loads(line) for line in (out / "eval" / label / "reference_completions.jsonl").open()]
        scored = [r for r in refs if '"answer.txt"' in r["completion"]]
        assert al["tasks"] == len(scored) == 2  # one held-out task per rung
        lengths = [len(data_tok.encode(r["completion"], add_special_tokens=False).ids) for r in scored]
        assert al["format_tokens"] + al["answer_tokens"] == pytest.approx(sum(lengths) / len(lengths))
        assert al["p_exact_answer"] == pytest.approx(math.exp(-al["answer_nll_sum"]), rel=1e-5)
        assert min(al["answer_nll_by_position"]) >= 0.0
        # the copy diagnostic: shares of the answer position's mass over the closed vocabulary's words
        for key in ("context_share_of_word_mass", "answer_over_distractor"):
            assert 0.0 <= al[key] <= 1.0 + 1e-6, (key, al[key])
        assert 0.0 < al["p_answer_word"] + al["p_distractor_word"] <= 1.0 + 1e-6
    # RL's effect: paired per-task differences with bootstrap intervals, overall and per rung
    effect = results["rl_effect"]
    assert set(effect["categories"]) == {"echo", "lookup"} and effect["all"]["tasks"] == 2
    for part in (effect["all"], *effect["categories"].values()):
        for key in ("avg@1", "best_of_2"):
            v = part[key]
            assert v["ci_low"] <= v["diff"] <= v["ci_high"]
            assert v["diff"] == pytest.approx(v["after"] - v["before"])
    assert results["hf"]["ok"] and results["hf"]["rel_l2"] <= 1e-4
    assert set(results["timings"]) >= {"1 info", "3 asynchronous RL", "5 HF export + transformers reload"}
    # the evaluation CLI on the RL run alone (its newest checkpoint and tokenizer, the demo's eval config)
    # reproduces the after-RL eval: the same seeds give the same samples
    cli = subprocess.run([sys.executable, "-m", "c2jax.cli", "eval", "--config", str(out / "eval/after/config.yaml"),
                          "--suite", str(out / "eval/tasks"), "--agent", "checkpoint", str(out / "rl"), "--out",
                          str(tmp_path / "cli_eval"), "--no-progress"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-2000:]
    cli_acc = json.loads((tmp_path / "cli_eval" / "results.json").read_text())["summary"]["accuracy"]
    after = json.loads((out / "eval" / "after" / "summary.json").read_text())["summary"]["accuracy"]
    assert cli_acc["avg@1"]["mean"] == after["avg@1"]["mean"]
    assert cli_acc["best_of_2"]["mean"] == after["best_of_2"]["mean"]

    # an RL variant from the same SFT start (--sft-from): only RL and what follows run; the before-RL eval is the
    # source run's
    variant = tmp_path / "variant"
    proc = subprocess.run([sys.executable, "-m", "experiments.demo", "--quick", "--out", str(variant), "--sft-from",
                           str(out), "--rl-penalty-gate", "resolved"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    again = json.loads((variant / "results.json").read_text())
    assert again["sft_from"] == str(out) and again["eval_before"] == results["eval_before"]
    assert "2c continued pretraining + SFT" not in again["timings"] and "3 asynchronous RL" in again["timings"]
    assert again["meta"]["config"]["rl_penalty_gate"] == "resolved"
    assert (variant / "eval" / "before" / "summary.json").read_text() == \
        (out / "eval" / "before" / "summary.json").read_text()
    assert "--sft-from" in (variant / "REPORT.md").read_text()


def test_sft_from_refuses_a_run_made_with_other_sft_settings(tmp_path):
    from experiments.demo.pipeline import DemoConfig, reused_sft_start

    src = tmp_path / "src"
    with pytest.raises(ValueError, match="own --out"):
        DemoConfig(sft_from=str(src), out=str(src))
    with pytest.raises(FileNotFoundError, match="no results.json"):
        reused_sft_start(DemoConfig(sft_from=str(src)), tmp_path / "out")
    (src / "eval" / "before").mkdir(parents=True)
    (src / "eval" / "before" / "summary.json").write_text("{}")
    (src / "tokenizer").mkdir()
    made = dataclasses.asdict(DemoConfig(teacher_error=0.5, rl_steps=5))
    (src / "results.json").write_text(json.dumps({"meta": {"config": made}, "data": {}, "cpt": {}}))
    with pytest.raises(ValueError, match="stopped before its before-RL eval"):
        reused_sft_start(DemoConfig(sft_from=str(src), teacher_error=0.5), tmp_path / "out")
    (src / "results.json").write_text(json.dumps({"meta": {"config": made}, "data": {}, "cpt": {},
                                                  "eval_before": {"avg@1": 0.1}}))
    # RL settings may differ; an SFT setting may not
    with pytest.raises(ValueError, match=r"teacher_error=0\.5 \(here 0\.4\)"):
        reused_sft_start(DemoConfig(sft_from=str(src)), tmp_path / "out")
    got = reused_sft_start(DemoConfig(sft_from=str(src), teacher_error=0.5, rl_steps=9, rl_penalty_gate="resolved"),
                           tmp_path / "out")
    assert got["eval_before"] == {"avg@1": 0.1} and (tmp_path / "out" / "eval" / "before" / "summary.json").is_file()


@pytest.mark.parametrize("rung", ["lookup", "micro_bug"])
def test_answer_likelihood_scores_exactly_the_answer_span(tmp_path, rung):
    """The demo's reward diagnosis: the NLL of the oracle's completion, split at the text it writes to
    answer.txt (JSON-escaped inside the write_file call); rungs without answer.txt have nothing to split."""
    from c2jax.models.transformer import init
    from c2jax.rl.system.envs import byte_tokenizer
    from experiments.demo.pipeline import DemoConfig, answer_likelihood, ladder, model_config
    from experiments.demo.tokenizer import data_tokenizer
    from experiments.demo.transcripts import direct_oracle_turns

    cfg = DemoConfig(**{**DemoConfig.quick_defaults(), "rungs": rung, "eval_tasks": 1, "out": str(tmp_path)})
    (tmp_path / "tokenizer").mkdir()
    data_tokenizer(byte_tokenizer()).save(str(tmp_path / "tokenizer" / "tokenizer.json"))
    held_out = ladder(tmp_path / "eval" / "tasks", cfg.seed + 1000, cfg.eval_tasks, rung)
    result = answer_likelihood(cfg, tmp_path, init(model_config(cfg), seed=0), "before", held_out)
    if rung == "micro_bug":
        assert result is None
        return
    tasks = ladder(tmp_path / "expected", cfg.seed + 1000, cfg.eval_tasks, rung)
    answers = [c["arguments"]["content"] for t in tasks for turn in direct_oracle_turns(t) for c in turn
               if c["name"] == "write_file"]
    escaped = [json.dumps(a)[1:-1] for a in answers]  # e.g. '417\\n': the newline is two bytes in the call
    assert result["tasks"] == 1
    assert result["answer_tokens"] == len(escaped[0])
    records = [json.loads(line) for line in (tmp_path / "eval" / "before" / "reference_completions.jsonl").open()]
    # lookup's first turn (read_file) holds no answer: only the turn that writes answer.txt is scored
    (scored,) = [r for r in records if '"answer.txt"' in r["completion"]]
    assert len(records) == (2 if rung == "lookup" else 1)
    assert result["format_tokens"] + result["answer_tokens"] == len(scored["completion"])
    # a random-init byte model: about ln(264) nats a token, and the exact answer is very unlikely
    assert 3.0 < result["answer_nll_per_token"] < 8.0 and result["p_exact_answer"] < 1e-6
    assert len(result["answer_nll_by_position"]) == min(map(len, escaped))


def test_lookup_transcripts_read_before_they_write(tmp_path):
    """The `lookup` rung's oracle transcript is multi-turn: a read_file of settings.ini, then, with the file's
    contents in the context as a tool result, the write_file of the looked-up value; graded by the hidden test."""
    from experiments.demo.pipeline import DemoConfig, episode_config, ladder, sandbox_factory
    from experiments.demo.transcripts import write_transcripts

    cfg = DemoConfig(**{**DemoConfig.quick_defaults(), "rungs": "lookup", "context": 1024, "sandbox": "local"})
    tasks = ladder(tmp_path / "tasks", 0, 3, "lookup")
    stats = write_transcripts(tasks, tmp_path / "t.jsonl", episode_config(cfg), sandbox_factory(cfg), grade_first=3)
    assert stats["oracle_resolved"] == stats["oracle_graded"] == 3 and stats["records"] == 6
    records = [json.loads(line) for line in (tmp_path / "t.jsonl").open()]
    for task, (read, write) in zip(tasks, zip(records[::2], records[1::2])):
        assert read["task_id"] == write["task_id"] == task.id
        assert '"name": "read_file"' in read["completion"] and '"settings.ini"' in read["completion"]
        settings = (Path(task.repo_dir) / "settings.ini").read_text()
        key = task.prompt("terse").split()[2]  # "value of KEY -> answer.txt"
        value = next(line.split(" = ")[1] for line in settings.splitlines() if line.startswith(key + " "))
        # the second turn sees the first call and the file's lines in a tool result, and writes the value
        assert read["completion"] in write["prompt"] and f"{key} = {value}" in write["prompt"]
        assert f'"path": "answer.txt", "content": "{value}\\n"' in write["completion"]


def test_heldout_filter_compares_task_content_not_prompts(tmp_path):
    """Lookup prompts name one of 16 keys, so train and held-out prompts coincide while their settings files
    differ: only a task with the same prompt AND the same files is the same task."""
    from c2jax.rl.tasks.ladder import task_content
    from experiments.demo.pipeline import ladder

    train, held = ladder(tmp_path / "a", 0, 40, "lookup"), ladder(tmp_path / "b", 1000, 8, "lookup")
    assert {t.prompt("terse") for t in train} & {t.prompt("terse") for t in held}  # prompts repeat
    assert not {task_content(t) for t in train} & {task_content(t) for t in held}
    again = ladder(tmp_path / "c", 1000, 8, "lookup")
    assert [task_content(t) for t in again] == [task_content(t) for t in held]


def test_reward_trend_compares_the_last_third_of_policy_versions_with_the_first(tmp_path):
    """Groups are the bootstrap unit: the last third of the versions minus the first third, per rung too; a
    steady rise is significant, a flat reward is not."""
    from experiments.demo.pipeline import reward_trend

    rows = []
    for version in range(12):
        for i, rung in enumerate(["echo", "lookup"] * 4):
            # echo rises from 1/8 to 7/8 solved; lookup alternates 2/8 and 6/8 solved in every version
            solved = 1 + version * 6 // 11 if rung == "echo" else (2 if i % 4 == 1 else 6)
            rows.append({"min_version": version, "prompt_id": f"ladder-{rung}-{i:03d}",
                         "rollouts": [{"reward": float(k < solved)} for k in range(8)]})
    path = tmp_path / "groups.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trend = reward_trend(path, 12)
    echo, lookup = trend["rungs"]["echo"], trend["rungs"]["lookup"]
    assert echo["first_versions"] == [0, 3] and echo["last_versions"] == [8, 11]
    assert echo["groups_first"] == echo["groups_last"] == 16
    first = sum(1 + v * 6 // 11 for v in range(4)) / 4 / 8
    last = sum(1 + v * 6 // 11 for v in range(8, 12)) / 4 / 8
    assert echo["diff"] == pytest.approx(last - first) and echo["significant"]
    assert lookup["diff"] == pytest.approx(0.0) and lookup["ci_low"] < 0 < lookup["ci_high"]
    assert not lookup["significant"]
    assert trend["all"]["groups_first"] == 32


def test_imperfect_teacher_copies_the_distractor_in_the_stated_fraction_and_fails_the_hidden_test(tmp_path):
    """--teacher-error e: in a fraction e of the SFT transcripts (drawn per task from the seed) the teacher writes
    the task's distractor (the echo sender, the lookup key) instead of the answer; graded episodes show each kind
    gets the verdict it should (the oracle's resolved, the erring teacher's not)."""
    from experiments.demo.pipeline import DemoConfig, episode_config, ladder, sandbox_factory
    from experiments.demo.transcripts import write_transcripts

    cfg = DemoConfig(**{**DemoConfig.quick_defaults(), "rungs": "echo,lookup", "context": 1024, "sandbox": "local"})
    tasks = ladder(tmp_path / "tasks", 0, 40, ("echo", "lookup"), lookup_keys=1)
    stats = write_transcripts(tasks, tmp_path / "t.jsonl", episode_config(cfg), sandbox_factory(cfg), grade_first=12,
                              teacher_error=0.5, seed=3)
    assert stats["oracle_graded"] == 12 and 0 < stats["oracle_resolved"] < 12  # both kinds graded, as expected
    writes = [json.loads(line) for line in (tmp_path / "t.jsonl").open()]
    writes = [r for r in writes if '"answer.txt"' in r["completion"]]
    by_id = {t.id: t for t in tasks}
    wrong = 0
    for r in writes:
        task = by_id[r["task_id"]]
        written = json.loads(r["completion"].split("\n")[1])["arguments"]["content"].strip()
        answer = task.solution_patch.rstrip("\n").splitlines()[-1][1:]  # the patch's last line: "+WORD"
        assert written in (answer, task.metadata["distractor"])
        wrong += written == task.metadata["distractor"]
    assert wrong == stats["erring_episodes"] and 25 <= wrong <= 55  # Binomial(80, 0.5): P(outside) < 1e-3
    with pytest.raises(ValueError, match="teacher_error"):
        write_transcripts(tasks[:1], tmp_path / "v.jsonl", episode_config(cfg), sandbox_factory(cfg), teacher_error=1.0)


def test_copy_probe_scores_the_first_answer_token_as_a_plain_forward_does(tmp_path):
    """The copy probe's eval batches (padded rows, one scored position each) give the same NLL as scoring the
    answer word's first token after `[bos] + prefix` with the model directly: -log softmax at the last prefix
    position."""
    import jax
    import numpy as np
    from flax import nnx

    from c2jax.data.tokenizer import load_tokenizer
    from c2jax.models.transformer import init
    from c2jax.rl.system.envs import byte_tokenizer
    from c2jax.train.evaluate import eval_loss, make_eval_step
    from experiments.demo.copy_probe import probe_batch, probe_sources
    from experiments.demo.pipeline import DemoConfig, ladder, model_config, write_copy_probe
    from experiments.demo.tokenizer import data_tokenizer

    cfg = DemoConfig(**{**DemoConfig.quick_defaults(), "eval_tasks": 2, "out": str(tmp_path)})
    (tmp_path / "tokenizer").mkdir()
    data_tokenizer(byte_tokenizer()).save(str(tmp_path / "tokenizer" / "tokenizer.json"))
    tasks = ladder(tmp_path / "eval" / "tasks", cfg.seed + 1000, cfg.eval_tasks, cfg.rung_list)
    stats = write_copy_probe(cfg, tmp_path, tasks)
    rows = [json.loads(line) for line in open(stats["path"])]
    assert stats["rows"] == len(rows) == 4  # one answer-writing turn per task, 2 tasks x 2 rungs
    for row in rows:
        assert row["prefix"].endswith('"content": "') and row["answer"] != row["distractor"]
        assert row["distractor"] in row["prefix"] and row["answer"] in row["prefix"]  # both words are in context
    tok = load_tokenizer(str(tmp_path / "tokenizer" / "tokenizer.json"))
    model = init(model_config(cfg, tok.vocab_size), seed=3)
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    step = make_eval_step(graphdef)
    for word in ("answer", "distractor"):
        expected = []
        for row in rows:
            prefix = [tok.bos_id] * (tok.bos_id is not None) + tok.encode(row["prefix"])  # as the pipeline packs
            logp = jax.nn.log_softmax(model(np.asarray([prefix], np.int32), return_mtp=False).logits[0, -1])
            expected.append(-float(logp[tok.encode(row[word])[0]]))
        seq = 1024  # the byte tokenizer's prefixes are ~700 tokens
        batch = probe_batch(rows, tok, word, seq)
        assert batch["loss_mask"].sum() == len(rows)
        got = eval_loss(step, params, state, probe_sources(rows, tok, seq)[f"copy_{word}"](), 1)
        assert got == pytest.approx(np.mean(expected), rel=1e-5)
    with pytest.raises(ValueError, match="longer than seq_len"):
        probe_batch(rows, tok, "answer", 8)


def test_copy_formation_step_is_the_first_probe_below_the_threshold():
    from experiments.demo.copy_probe import formation_step

    curve = [{"sft_step": 50, "copy_answer": 3.3}, {"sft_step": 25, "copy_answer": 3.4},
             {"sft_step": 75, "copy_answer": 0.9}, {"sft_step": 100, "copy_answer": 1.2}]
    assert formation_step(curve) == 75
    assert formation_step(curve, threshold=0.5) is None


def test_demo_records_the_cpu_it_ran_on():
    """demo.json / REPORT.md name the CPU (family, model, ISA, cores): results differ between machines."""
    from c2jax.machine import describe
    from experiments.demo.pipeline import machine_info

    m, d = machine_info(), describe()
    assert m["cpu"].startswith(d["cpu_model"]) and f"{d['logical_cores']} cores" in m["cpu"] and "load" not in m["cpu"]
