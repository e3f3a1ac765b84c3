"""runs/demo/REPORT.md and its plots (matplotlib, Agg): pretraining loss per phase, RL reward and staleness
over steps, eval before vs after RL. Every number comes from the run's results; nothing is filled in."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pretraining(results: dict, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    offset = 0
    for run in ("base", "cpt"):
        r = results[run]
        for p in r["phases"]:
            xs = list(range(offset + p["start"] + 1, offset + p["start"] + p["steps"] + 1))
            ax.plot(xs, r["losses"][p["start"]:p["start"] + p["steps"]], lw=1, marker=".", ms=3,
                    label=f"{run}/{p['name']} (train)")
        for e in r["evals"]:
            for k, v in e.items():
                if k.startswith("eval_loss/"):
                    ax.scatter([offset + e["step"]], [v], marker="x", color="k", zorder=3, s=20)
        offset += sum(p["steps"] for p in r["phases"])
    ax.scatter([], [], marker="x", color="k", label="held-out eval loss")
    ax.set_xlabel("step (base, then continued pretraining)")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("Pretraining loss per phase")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_rl(results: dict, path: Path) -> Path:
    plt = _plt()
    hist = results["rl"]["summary"]["history"]
    steps = [h["step"] for h in hist]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(steps, [h["reward/mean"] for h in hist], marker="o")
    a.set_xlabel("learner step (policy version)")
    a.set_ylabel("mean reward of the trained batch")
    a.set_title("RL reward")
    a.grid(alpha=0.3)
    b.plot(steps, [h["staleness/batch_max"] for h in hist], marker="o", label="max")
    b.plot(steps, [h["staleness/batch_mean"] for h in hist], marker=".", label="mean")
    b.set_xlabel("learner step")
    b.set_ylabel("staleness (versions behind the learner)")
    b.set_title("Staleness of trained tokens")
    b.legend()
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_eval(results: dict, k: int, path: Path) -> Path:
    plt = _plt()
    before, after = results["eval_before"], results["eval_after"]
    keys = [key for key in ("avg@1", f"best_of_{k}", f"pass@{k}", "tool_call_attempted", "parsed_tool_call",
                            "wrote_answer_txt") if key in before and key in after]
    xs = range(len(keys))
    fig, ax = plt.subplots(figsize=(9, 4))
    for shift, row, name in ((-0.2, before, "before RL (CPT+SFT)"), (0.2, after, "after RL")):
        bars = ax.bar([x + shift for x in xs], [row[key] for key in keys], width=0.4, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(list(xs), keys)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fraction")
    ax.set_title(f"Held-out ladder tasks ({before['tasks']} tasks x {before['samples_per_task']} samples)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _max_verdict(groups_jsonl: Path) -> float:
    """The best hidden-test verdict of any trained RL episode (the reward before any length penalty)."""
    import json

    from c2jax.rl.system.groups import stored_verdict

    lines = groups_jsonl.read_text().splitlines() if groups_jsonl.is_file() else []
    return max((stored_verdict(x) for line in lines for x in json.loads(line)["rollouts"]), default=0.0)


def _same_samples(out: Path) -> bool:
    """Whether the eval after RL produced exactly the samples of the eval before RL (measured, not assumed)."""
    import json

    def read(label):
        rows = [json.loads(line) for line in (out / "eval" / label / "samples.jsonl").read_text().splitlines()]
        return {(r["task_id"], r["sample"]): (r["final_message"], r["patch"], r["completion_tokens"]) for r in rows}

    return read("before") == read("after")


def _fmt(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def _sandbox_note(cfg) -> str:
    if cfg.sandbox != "auto" or cfg.sandbox_kind() != "local":
        return ""
    from c2jax.rl.sandbox.bwrap import bwrap_unusable_reason

    return f" (no isolation: {bwrap_unusable_reason()})"


def answer_likelihood_section(before: dict, after: dict) -> list[str]:
    L = ["Where the reward is lost: the model's negative log-likelihood (nats per token) of the scripted "
         "oracle's completion on the same held-out tasks, split into the answer (the text written to answer.txt) "
         "and the tool-call format around it. P(exact answer) = exp(-sum of the answer's NLL), the probability "
         "of sampling exactly the right answer at temperature 1 once the call is right so far.\n",
         "| reference completion | before RL | after RL |\n|---|---|---|"]
    rows = [("format NLL / token", "format_nll_per_token", "{:.3f}"), ("format tokens", "format_tokens", "{:.0f}"),
            ("answer NLL / token", "answer_nll_per_token", "{:.3f}"), ("answer tokens", "answer_tokens", "{:.1f}"),
            ("answer NLL, sum", "answer_nll_sum", "{:.2f}"), ("P(exact answer)", "p_exact_answer", "{:.2e}"),
            # copying (docs/demo_regime.md): the share of the answer position's word mass on the two words of the
            # context, and how it splits between the answer and the distractor
            ("P(answer word)", "p_answer_word", "{:.3f}"), ("P(distractor word)", "p_distractor_word", "{:.3f}"),
            ("word mass on the context's two words", "context_share_of_word_mass", "{:.3f}"),
            ("answer / (answer + distractor)", "answer_over_distractor", "{:.3f}")]
    rows = [r for r in rows if r[1] in before and r[1] in after]
    for name, key, fmt in rows:
        L.append(f"| {name} | {fmt.format(before[key])} | {fmt.format(after[key])} |")
    L.append("| answer NLL by position | " + " ".join(f"{x:.2f}" for x in before["answer_nll_by_position"])
             + " | " + " ".join(f"{x:.2f}" for x in after["answer_nll_by_position"]) + " |\n")
    return L


def write_report(cfg, out: Path, results: dict) -> dict:
    plots_dir = out / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    k = cfg.best_of
    plots = [plot_pretraining(results, plots_dir / "pretraining_loss.png"),
             plot_rl(results, plots_dir / "rl_reward_staleness.png"),
             plot_eval(results, k, plots_dir / "eval_before_after.png")]
    meta, data, rl, hf = results["meta"], results["data"], results["rl"], results["hf"]
    summ = rl["summary"]
    hist = summ["history"]
    before, after = results["eval_before"], results["eval_after"]
    L = []
    L.append("# c2jax end-to-end demo\n")
    machine = meta["machine"].get("cpu") or f"{meta['machine']['cpus']} CPUs"
    L.append(f"Run {meta['started']}, git commit `{meta['git']['commit']}`"
             f"{' (working tree dirty)' if meta['git']['dirty'] else ''}, seed {meta['seed']}"
             f"{', **--quick** sizes' if cfg.quick else ''}. Machine: {machine}, load average "
             f"{meta['machine']['load_avg_1_5_15']} at the start (shared with other jobs), JAX "
             f"{meta['machine']['jax']} on {meta['machine']['backend']}. "
             f"Sandbox: `{cfg.sandbox_kind()}`{_sandbox_note(cfg)}.\n")
    if results.get("sft_from"):
        L.append(f"The transcripts, base, CPT + SFT model and before-RL eval are reused from `{results['sft_from']}` "
                 "(`--sft-from`; its stage times are not in the table below).\n")
    L.append(f"**Total wall time: {results['total_s']:.0f} s ({results['total_s'] / 60:.1f} min).**\n")
    L.append("| stage | wall s |\n|---|---|")
    for name, s in results["timings"].items():
        L.append(f"| {name} | {s:.1f} |")
    L.append("")
    L.append("## 1. Kimi K2.5 from abstract shapes\n")
    L.append("`c2jax info kimi-k2.5` (nothing allocated): see [`info.txt`](info.txt).\n")
    L.append("## 2. Pretraining, continued pretraining, SFT\n")
    L.append(f"Tokenizer: a byte-level BPE with c2jax's code pre-tokenizer, trained on the SFT transcripts and "
             f"standard-library text, {data['vocab_size']} ids with the 8 chat tokens "
             f"([`tokenizer/`](tokenizer/): `chat_tokenizer.json` for the harness, `tokenizer.json` for the data "
             "pipeline, where only the markers the renderer inserts by id are special); "
             f"{data['answer_words_single_token']}/{data['answer_words']} answer words are one token. Model: hidden "
             f"{cfg.hidden}, {cfg.layers} layers (1 dense + MoE with {cfg.experts} experts), MLA attention. "
             f"Configs: [`base/config.yaml`](base/config.yaml), [`cpt/config.yaml`](cpt/config.yaml), "
             f"[`data/sft_data.yaml`](data/sft_data.yaml).\n")
    L.append(f"Tool-use transcripts: the scripted teacher ran {data['tasks']} episodes on TRAIN ladder tasks "
             f"({cfg.sft_transcripts_per_task} per task; rungs "
             f"`{cfg.rungs}`, lookup files with {cfg.lookup_keys} key(s), "
             f"terse prompts) through the harness. The teacher is imperfect (`--teacher-error {cfg.teacher_error:g}`): "
             f"in {data['erring_episodes']} of the {data['tasks']} episodes it copies the wrong word from the context "
             "(the echo sender, the lookup key) and the hidden test fails, as SFT on a weaker agent's transcripts "
             f"teaches its mistakes; {data['oracle_graded']} episodes were graded and each got the verdict it should "
             f"({data['oracle_resolved']} resolved). {data['records']} prompt/completion records; "
             f"{data['dropped_overlapping_heldout']} train "
             f"tasks dropped because they equal a held-out task. Prompt {data['prompt_tokens']} "
             "tokens (system prompt: short instructions and one line per tool, "
             f"`tool_schemas={data['tool_schemas']!r}`, {data['system_prompt_tokens']} tokens; + the task), "
             f"completion {data['completion_tokens']} tokens, e.g. "
             f"`{data['completion_example']!r}`. All {data['prompts_checked_against_renderer']} SFT prompts were "
             "checked to tokenize to exactly the ids the RL harness renders for the same conversation.\n")
    L.append("| run / phase | steps | seq | first loss | last loss | mean of last 5 |\n|---|---|---|---|---|---|")
    seqs = {"base": cfg.base_seq, "code": cfg.code_seq, "long": cfg.long_seq, "sft": cfg.context}
    for run in ("base", "cpt"):
        for p in results[run]["phases"]:
            L.append(f"| {run}/{p['name']} | {p['steps']} | {seqs[p['name']]} | {p['first_loss']:.3f} | "
                     f"{p['last_loss']:.3f} | {p['mean_last_5']:.3f} |")
    L.append("")
    ev = [(run, e["step"], kk, v) for run in ("base", "cpt") for e in results[run]["evals"]
          for kk, v in e.items() if kk.startswith("eval_loss/")]
    if ev:
        L.append("Held-out eval loss (short-context phases): " +
                 ", ".join(f"{run} step {s} {kk.split('/')[1]} {v:.3f}" for run, s, kk, v in ev) + ".\n")
    L.append("The SFT loss is on completion tokens only (the tool call); the long phase uses YaRN "
             f"(factor {cfg.max_position_embeddings / cfg.code_seq:g} over {cfg.code_seq}).\n")
    L.append("![pretraining loss](plots/pretraining_loss.png)\n")
    L.append("## 3. Asynchronous RL (c2jax.rl.system)\n")
    L.append(f"Started from the CPT+SFT model (`init_from: {rl['init_from']}`): the learner loads it, the rollout "
             "workers get it with the version-0 weight packet.\n")
    L.append(f"{summ['steps']} learner steps in {summ['wall_s']:.0f} s, mode async, group size {cfg.group_size}, "
             f"{cfg.groups_per_step} group(s) per step, max staleness {cfg.max_staleness}, {cfg.rollout_workers} "
             f"rollout worker(s). Config: [`rl/config.yaml`](rl/config.yaml).\n")
    shaped = cfg.rl_length_penalty > 0
    if shaped:
        L.append(f"The reward is the hidden tests' verdict minus the report's concave length penalty (scale "
                 f"{cfg.rl_length_penalty:g} of C_k,q over tokens, tool calls and turns; `rl.reward.length_penalty`); "
                 "the trend below is on the verdict alone.\n")
    reward_col = "mean reward (verdict - length penalty)" if shaped else "mean reward"
    L.append(f"| step | {reward_col} | staleness max | staleness mean | tokens trained |\n|---|---|---|---|---|")
    for h in hist:
        L.append(f"| {h['step']} | {h['reward/mean']:.3f} | {h['staleness/batch_max']} | "
                 f"{h['staleness/batch_mean']:.2f} | {h.get('tokens_trained', float('nan')):.0f} |")
    L.append("")
    trend = summ.get("reward_trend") or {}
    if trend.get("all"):
        L.append("Does the training reward rise? Mean episode verdict of the groups sampled by the policies of the "
                 "last third of the steps minus the first third, 95% percentile-bootstrap interval (groups "
                 "resampled):\n")
        L.append("| rungs | groups first / last | reward first third | reward last third | difference [95% CI] | "
                 "CI above 0 |\n|---|---|---|---|---|---|")
        for name, t in [("all", trend["all"]), *(trend.get("rungs") or {}).items()]:
            if t:
                L.append(f"| {name} | {t['groups_first']} / {t['groups_last']} | {t['reward_first']:.3f} | "
                         f"{t['reward_last']:.3f} | {t['diff']:+.3f} [{t['ci_low']:+.3f}, {t['ci_high']:+.3f}] | "
                         f"{'yes' if t['significant'] else 'no'} |")
        L.append("")
    counts = summ.get("counts", {})
    L.append(f"Counts: {', '.join(f'{kk} {v}' for kk, v in sorted(counts.items()))}.\n")
    if _max_verdict(out / "rl" / "groups.jsonl") == 0.0:
        same = _same_samples(out)
        L.append("**The RL reward stayed 0 in every step**: no sampled episode wrote the right answer, so every "
                 "group had zero advantage and a zero policy gradient"
                 + (" (no KL or entropy term either), and the policy did not change: the eval after RL repeated "
                    "the eval before RL token for token (same seeds)" if same else "") + ".\n")
    L.append("![rl](plots/rl_reward_staleness.png)\n")
    L.append("## 4. Evaluation before and after RL (held-out ladder tasks)\n")
    L.append(f"{before['tasks']} held-out tasks ({cfg.eval_tasks} per rung of `{cfg.rungs}`, ladder seed "
             f"{cfg.seed + 1000}; no train task of SFT or RL equals one of them), {cfg.eval_k} samples "
             f"each at temperature {cfg.temperature}; best-of-K (K = {k} and {cfg.eval_k}, estimated from the "
             f"{cfg.eval_k} samples) picks the sample with the highest mean sampled-token log-probability "
             "(`model_score`, no access to the tests); "
             "pass@K is the oracle-selector upper bound. Tool-use columns are measured from the stored trajectories. "
             "Configs: [`eval/before/config.yaml`](eval/before/config.yaml).\n")
    keys = ["avg@1", f"best_of_{k}", f"pass@{k}", f"best_of_{cfg.eval_k}", f"pass@{cfg.eval_k}",
            "tool_call_attempted", "parsed_tool_call", "tool_call_ran", "wrote_answer_txt", "completion_tokens_mean"]
    keys = list(dict.fromkeys(keys))
    keys = [key for key in keys if key in before and key in after]
    L.append("| metric | before RL | after RL |\n|---|---|---|")
    for key in keys:
        L.append(f"| {key} | {_fmt(before[key])} | {_fmt(after[key])} |")
    L.append(f"| statuses | {before['statuses']} | {after['statuses']} |")
    L.append(f"| finish reasons | {before['finish_reasons']} | {after['finish_reasons']} |\n")
    effect = results.get("rl_effect")
    if effect:
        L.append(f"**What RL changed**, per task after - before (the same held-out tasks and samples per task), mean "
                 f"and 95% percentile-bootstrap interval over tasks ({effect['bootstrap_samples']} resamples; "
                 "resampling tasks keeps each task's two scores together):\n")
        L.append("| rungs | tasks | metric | before RL | after RL | difference [95% CI] | CI above 0 |\n"
                 "|---|---|---|---|---|---|---|")
        for name, part in [("all", effect["all"]), *effect.get("categories", {}).items()]:
            for key, v in part.items():
                if isinstance(v, dict):
                    L.append(f"| {name} | {part['tasks']} | {key} | {v['before']:.3f} | {v['after']:.3f} | "
                             f"{v['diff']:+.3f} [{v['ci_low']:+.3f}, {v['ci_high']:+.3f}] | "
                             f"{'yes' if v['significant'] else 'no'} |")
        L.append("")
    L.append(f"The after-RL eval is reproducible from the RL run alone with the evaluation CLI (the learner's "
             f"newest checkpoint, the run's tokenizer, this eval's config): `c2jax eval --config "
             f"{out}/eval/after/config.yaml --suite {out}/eval/tasks --agent checkpoint {out}/rl --out DIR`.\n")
    L.append("![eval](plots/eval_before_after.png)\n")
    if before.get("answer_likelihood") and after.get("answer_likelihood"):
        L += answer_likelihood_section(before["answer_likelihood"], after["answer_likelihood"])
    L.append("## 5. Hugging Face export\n")
    L.append(f"Final model written to [`hf/`](hf/) (DeepseekV3 format) and reloaded with transformers "
             f"(`{hf['hf_class']}`): logits on {hf['tokens']} tokens of a transcript match c2jax with relative L2 "
             f"error {hf['rel_l2']:.2e} (argmax agreement {hf['argmax_agreement']:.4f}; threshold 1e-4: "
             f"{'pass' if hf['ok'] else 'FAIL'}).\n")
    L.append("## 6. Files and TensorBoard\n")
    L.append("- `demo.json`: demo config, git commit, seed, machine; `results.json`: every number above\n"
             "- `base/`, `cpt/`: pretraining runs (`config.yaml`, `metrics.jsonl`, `tensorboard/`, `checkpoints/`, "
             "`hf/`)\n"
             "- `data/`: tokenizer-compatible SFT transcripts (`sft_tool_use.jsonl`) and the ladder tasks used\n"
             "- `rl/`: RL run (`config.yaml`, `metrics.jsonl`, `tensorboard/`, `groups.jsonl`, `events.jsonl`, "
             "`checkpoints/`)\n"
             "- `eval/{before,after}/`: `samples.jsonl`, `trajectories.jsonl`, `summary.json`, `config.yaml`; "
             "`eval/tensorboard/`\n- `hf/`: the final model\n")
    L.append(f"TensorBoard: `tensorboard --logdir {out}`\n")
    report = out / "REPORT.md"
    report.write_text("\n".join(L))
    return {"report": report, "plots": plots}
