"""Ablation 01 (Composer 2 sec. 3, Fig. 2 left): continued-pretraining compute -> RL.

One base model (the demo's: a byte-level MoE pretrained briefly on standard-library docstrings) gets
continued pretraining on standard-library code at three log-spaced budgets; each checkpoint then gets the
same SFT (a short run on the task's records) and the same asynchronous RL run (rl/system, `text` env).
The task is verifiable code completion on files no run trained on: the prompt is the code before a cut
inside an identifier or keyword (raw text, as in pretraining), the answer must be the rest of that word,
ended by <|im_end|> (which SFT teaches); reward = longest common prefix over the longer of answer and
reference (1 only for the exact rest of the word). Recorded per budget: held-out code loss after CPT,
held-out SFT loss (the report's x-axis), RL training reward and held-out eval reward / exact-match rate.
    python -m experiments.ablations.01_cpt_compute_to_rl.run [--quick] [--out DIR]
"""

from __future__ import annotations

import collections
import json
import random
import re
import sysconfig
import time
from pathlib import Path

import matplotlib
import numpy as np
from tensorboardX import SummaryWriter

from experiments.ablations.provenance import ablation_args, git_commit, write_result

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------------------ tasks
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def completion_pairs(text: str, rng: random.Random, n: int, context: int, min_answer: int, max_answer: int,
                     vocabulary: set[str] | None = None):
    """Up to n (prompt, reference) cuts of one file inside an identifier or keyword (one of `vocabulary`,
    when given): the prompt is the `context` characters before the cut (at least two of the word's
    characters among them), the reference the rest of the word (min_answer..max_answer characters). What
    completes a word is decided by the code around it (a keyword, a name used above, an attribute), and a
    model knows more of it the more code it has read."""
    words = [m for m in _IDENTIFIER.finditer(text) if m.start() >= context and m.end() - m.start() >= min_answer + 2
             and (vocabulary is None or m.group() in vocabulary)]
    rng.shuffle(words)
    out = []
    for m in words[:n]:
        lo, hi = max(m.start() + 2, m.end() - max_answer), m.end() - min_answer
        cut = rng.randint(lo, hi)
        prompt, reference = text[cut - context:cut], text[cut:m.end()]
        if prompt.isascii():  # one byte token per character
            out.append((prompt, reference))
    return out


def make_tasks(out: Path, raw: dict) -> dict:
    """SFT records (raw prompt/completion; the data pipeline ends each with <|im_end|>, the answer's stop, from
    TRAIN-split files), RL train tasks (other TRAIN
    files) and held-out eval tasks (EVAL-split files, which CPT never sees: the split rule is the data
    pipeline's content hash at the CPT source's heldout_fraction)."""
    from c2jax.data.config import SourceConfig
    from c2jax.data.packing import split_of
    from c2jax.data.sources import open_source

    t = raw["tasks"]
    source = open_source(SourceConfig(name="code", kind="stdlib_code", path=sysconfig.get_paths()["stdlib"],
                                      max_documents=int(raw["max_documents"]),
                                      heldout_fraction=float(raw["heldout_fraction"])))
    docs = {"train": [], "eval": []}
    for i in range(len(source)):
        for doc in source[i]:
            docs[split_of(doc, float(raw["heldout_fraction"]))].append(doc["text"])
    rng = random.Random(int(raw["seed"]))
    rng.shuffle(docs["train"])
    # the task's words: the most frequent identifiers and keywords of the TRAIN files (common enough that a
    # small model can know them, varied enough that knowing them takes reading code)
    counts_by_word = collections.Counter(m.group() for text in docs["train"] for m in _IDENTIFIER.finditer(text)
                                         if len(m.group()) >= int(t["min_answer"]) + 2)
    vocabulary = {w for w, _ in counts_by_word.most_common(int(t["top_words"]))}
    half = len(docs["train"]) // 2
    pools = {"sft": docs["train"][:half], "rl": docs["train"][half:], "eval": docs["eval"]}
    counts = {"sft": int(t["sft"]), "rl": int(t["rl"]), "eval": int(t["eval"])}
    pairs: dict[str, list] = {}
    for name, pool in pools.items():
        found: list = []
        for text in pool:
            found += completion_pairs(text, rng, int(t["per_file"]), int(t["context"]), int(t["min_answer"]),
                                      int(t["max_answer"]), vocabulary)
            if len(found) >= counts[name]:
                break
        if len(found) < counts[name]:
            raise ValueError(f"only {len(found)} {name} completion tasks in {len(pool)} files; asked for "
                             f"{counts[name]} (raise max_documents or per_file)")
        pairs[name] = found[:counts[name]]
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    with open(out / "sft.jsonl", "w") as f:
        for prompt, reference in pairs["sft"]:
            f.write(json.dumps({"prompt": prompt, "completion": reference}) + "\n")
    paths["sft"] = str(out / "sft.jsonl")
    for name in ("rl", "eval"):
        paths[name] = str(out / f"{name}.jsonl")
        with open(paths[name], "w") as f:
            for i, (prompt, reference) in enumerate(pairs[name]):
                f.write(json.dumps({"id": f"{name}-{i:04d}", "prompt": prompt, "reference": reference}) + "\n")
    example = pairs["eval"][0]
    return {"paths": paths, "files": {k: len(v) for k, v in pools.items()}, "counts": counts,
            "vocabulary": sorted(vocabulary, key=lambda w: -counts_by_word[w])[:20],
            "example": {"prompt_tail": example[0][-60:], "reference": example[1]}}


def check_prompt_tokens(sft_jsonl: str, tokenizer: str) -> None:
    """SFT prompts, tokenized by the data pipeline, must be the token ids the RL sampler is given."""
    from c2jax.data.tokenizer import load_tokenizer
    from c2jax.rl.harness import ChatRenderer
    from c2jax.rl.system.envs import byte_tokenizer

    data, renderer = load_tokenizer(tokenizer), ChatRenderer(byte_tokenizer())
    if data.eos_id != renderer.im_end_id:
        raise RuntimeError("the SFT answers would end with a token other than the sampler's stop <|im_end|>")
    for line in Path(sft_jsonl).read_text().splitlines()[:32]:
        rec = json.loads(line)
        if data.encode(rec["prompt"]) != renderer.encode_env(rec["prompt"]):
            raise RuntimeError(f"SFT and RL tokenize the prompt {rec['prompt'][-40:]!r} differently")


# ------------------------------------------------------------------------------------------------ stages
def demo_config(raw: dict, out: Path, quick: bool):
    from experiments.demo.pipeline import DemoConfig

    m = raw["model"]
    return DemoConfig(out=str(out), seed=int(raw["seed"]), quick=quick, hidden=int(m["hidden"]),
                      layers=int(m["layers"]), heads=int(m["heads"]), experts=int(m["experts"]),
                      max_documents=int(raw["max_documents"]), base_steps=int(raw["base"]["steps"]),
                      base_seq=int(raw["base"]["seq_len"]), base_batch=int(raw["base"]["batch"]),
                      base_lr=float(raw["base"]["lr"]))


def _annealed_run(dcfg, out: Path, name: str, init_hf: str, data: dict, phase: dict, stage: dict, steps: int,
                  decay_fraction: float) -> dict:
    """One single-phase WSD run from `init_hf` (each checkpoint is the end of its own annealed run), its
    held-out loss on the data's one source as `eval_loss`."""
    from c2jax.train.config import (
        CheckpointConfig,
        EvalConfig,
        LossConfig,
        OptimizerConfig,
        PhaseConfig,
        PretrainConfig,
    )
    from experiments.demo.pipeline import _train, model_config

    pcfg = PretrainConfig(
        name=name, seed=dcfg.seed, output_dir=str(out), model=model_config(dcfg), init_from_hf=init_hf,
        data={"tokenizer": data["tokenizer"], "seq_len": int(stage["seq_len"]), "batch_size": int(stage["batch"]),
              "seed": dcfg.seed, **{k: v for k, v in data.items() if k != "tokenizer"}},
        optimizer=OptimizerConfig(lr=float(stage["lr"]), warmup_steps=max(1, steps // 10), schedule="wsd",
                                  decay_fraction=decay_fraction),
        loss=LossConfig(mtp_weight=0.0, router_bias_rate=1e-3),
        phases=(PhaseConfig(steps=steps, **phase),),
        checkpoint=CheckpointConfig(every=10**9, keep_last=1, async_save=False),
        eval=EvalConfig(every=steps, batches=int(stage["eval_batches"])), export_hf=True,
        log_every=max(1, steps // 20), progress=False)
    res = _train(pcfg)
    res["eval_loss"] = res["evals"][-1][f"eval_loss/{data['sources'][0]['name']}"]
    return res


def continued_pretraining(dcfg, raw: dict, out: Path, tokenizer: str, base_hf: str, budget: int) -> dict:
    c = raw["cpt"]
    data = {"tokenizer": tokenizer,
            "sources": [{"name": "code", "kind": "stdlib_code", "path": sysconfig.get_paths()["stdlib"],
                         "max_documents": int(raw["max_documents"]),
                         "heldout_fraction": float(raw["heldout_fraction"])}]}
    return _annealed_run(dcfg, out, f"cpt_{budget}", base_hf, data, {"name": "code"}, c, budget,
                         float(c["decay_fraction"]))


def sft(dcfg, raw: dict, out: Path, tokenizer: str, sft_jsonl: str, cpt_hf: str, budget: int) -> dict:
    s = raw["sft"]
    data = {"tokenizer": tokenizer, "loss_mask": "completion",
            "sources": [{"name": "completion", "kind": "jsonl", "path": sft_jsonl, "prompt_field": "prompt",
                         "completion_field": "completion", "heldout_fraction": float(s["heldout_fraction"])}]}
    return _annealed_run(dcfg, out, f"sft_{budget}", cpt_hf, data, {"name": "sft", "loss_mask": "completion"}, s,
                         int(s["steps"]), 0.5)


def reinforce(dcfg, raw: dict, out: Path, tasks: dict, sft_hf: str, budget: int) -> dict:
    from c2jax.models.inference.engine import EngineConfig
    from c2jax.rl.config import LossConfig as RLLossConfig
    from c2jax.rl.config import RLConfig
    from c2jax.rl.system.config import CheckpointConfig, EnvConfig, RayConfig, RLSystemConfig, SystemConfig
    from c2jax.rl.system.config import EvalConfig as OnlineEval
    from c2jax.rl.system.reconciler import run_system
    from experiments.demo.pipeline import model_config

    r = raw["rl"]
    seq = int(r["seq_len"])
    rcfg = RLSystemConfig(
        name=f"rl_{budget}", seed=dcfg.seed, output_dir=str(out), resume=False, model=model_config(dcfg),
        rl=RLConfig(learning_rate=float(r["lr"]), loss=RLLossConfig(constant_normalizer=float(r["gen_len"]))),
        engine=EngineConfig(slots=int(r["group_size"]) * 2, max_len=seq, chunk_steps=8, key_bucket=64,
                            min_prompt_bucket=16),
        env=EnvConfig(kind="text", text_tasks=tasks["paths"]["rl"], text_eval_tasks=tasks["paths"]["eval"],
                      eval_prompts=int(raw["tasks"]["eval"]), gen_len=int(r["gen_len"]), text_match="prefix",
                      text_template="raw",
                      temperature=float(r["temperature"])),
        system=SystemConfig(mode="async", steps=int(r["steps"]), group_size=int(r["group_size"]),
                            groups_per_step=int(r["groups_per_step"]), max_staleness=1, num_rollout_workers=1,
                            num_env_workers=1, seq_len=seq, min_rows=int(r["group_size"]) * int(r["groups_per_step"]),
                            call_timeout_s=600.0, group_timeout_s=900.0),
        eval=OnlineEval(every=int(r["eval_every"]), k=int(r["eval_k"]), success_threshold=1.0),
        checkpoint=CheckpointConfig(every=int(r["steps"]), keep_last=1), ray=RayConfig(num_cpus=2),
        dashboard=False, log_every=1, init_from=sft_hf)
    summary = run_system(rcfg)
    rewards = [h["reward/mean"] for h in summary["history"]]
    last = int(r["summary_last"])
    return {"rewards": rewards, "final_train_reward": float(np.mean(rewards[-last:])),
            "mean_train_reward": float(np.mean(rewards)), "eval": summary["eval"],
            "wall_s": summary["wall_s"], "run_dir": str(rcfg.run_dir)}


# ------------------------------------------------------------------------------------------------ driver
def shrink(raw: dict) -> dict:
    """--quick: tiny budgets and runs, to exercise every stage (numbers meaningless)."""
    return raw | {"budgets": [2, 4], "max_documents": 300, "base": raw["base"] | {"steps": 2},
                  "cpt": raw["cpt"] | {"eval_batches": 1},
                  "sft": raw["sft"] | {"steps": 2, "eval_batches": 1},
                  "tasks": raw["tasks"] | {"sft": 16, "rl": 8, "eval": 4},
                  "rl": raw["rl"] | {"steps": 2, "groups_per_step": 1, "group_size": 4, "eval_every": 2,
                                     "eval_k": 2, "summary_last": 1}}


def main(argv: list[str] | None = None) -> dict:
    from c2jax.rl.system.envs import byte_tokenizer
    from experiments.demo.pipeline import BYTE_VOCAB, _shutdown_ray, stage_base
    from experiments.demo.tokenizer import data_tokenizer

    args, raw = ablation_args(argv, __doc__, HERE, "two tiny budgets, a few steps each (for tests)")
    if args.quick:
        raw = shrink(raw)
    out = Path(args.out)
    work = out / "runs"  # every stage's run directory (checkpoints, HF exports): large, not committed
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer = work / "tokenizer.json"
    data_tokenizer(byte_tokenizer()).save(str(tokenizer))
    tasks = make_tasks(work / "tasks", raw)
    check_prompt_tokens(tasks["paths"]["sft"], str(tokenizer))
    dcfg = demo_config(raw, work, args.quick)
    base = stage_base(dcfg, work, {"tokenizer": str(tokenizer), "vocab_size": BYTE_VOCAB})
    runs = []
    try:
        for budget in raw["budgets"]:
            t = time.perf_counter()
            cpt = continued_pretraining(dcfg, raw, work, str(tokenizer), base["hf"], int(budget))
            tuned = sft(dcfg, raw, work, str(tokenizer), tasks["paths"]["sft"], cpt["hf"], int(budget))
            rl = reinforce(dcfg, raw, work, tasks, tuned["hf"], int(budget))
            ev = rl["eval"]
            runs.append({"budget": int(budget), "cpt_tokens": int(budget) * raw["cpt"]["seq_len"] * raw["cpt"]["batch"],
                         "cpt_eval_loss": cpt["eval_loss"], "sft_eval_loss": tuned["eval_loss"],
                         "rl_train_reward": rl["rewards"], "rl_final_train_reward": rl["final_train_reward"],
                         "rl_mean_train_reward": rl["mean_train_reward"],
                         "eval_reward_before_rl": ev[0]["reward/mean"], "eval_reward_after_rl": ev[-1]["reward/mean"],
                         "eval_exact_before_rl": ev[0]["avg@1"], "eval_exact_after_rl": ev[-1]["avg@1"],
                         "eval_pass_k_before_rl": ev[0][f"pass@{raw['rl']['eval_k']}"],
                         "eval_pass_k_after_rl": ev[-1][f"pass@{raw['rl']['eval_k']}"],
                         "eval": ev, "wall_s": time.perf_counter() - t})
            print(f"budget {budget}: code loss {cpt['eval_loss']:.3f}, SFT loss {tuned['eval_loss']:.3f}, RL reward "
                  f"{rl['rewards'][0]:.3f} -> {rl['final_train_reward']:.3f} (last {raw['rl']['summary_last']}), "
                  f"eval reward {ev[0]['reward/mean']:.3f} -> {ev[-1]['reward/mean']:.3f}", flush=True)
    finally:
        _shutdown_ray()
    x = np.array([r["sft_eval_loss"] for r in runs])
    y = np.array([r["rl_final_train_reward"] for r in runs])
    result = {"git_commit": git_commit(), "config": raw, "tasks": tasks, "wall_s": time.perf_counter() - t0,
              "base_eval_loss": base["evals"][-1]["eval_loss/docs"] if base["evals"] else None, "runs": runs,
              # the report's claim in one number: does lower post-SFT loss order the RL rewards?
              "spearman_sft_loss_vs_rl_reward": _spearman(x, y) if len(runs) > 2 else None}
    write_result(out, result, args.machine)
    write_tensorboard(out / "tb", runs)
    plot(out / "cpt_compute_to_rl.png", runs)
    return result


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def write_tensorboard(directory: Path, runs: list[dict]) -> None:
    with SummaryWriter(str(directory)) as tb:
        for r in runs:
            for i, reward in enumerate(r["rl_train_reward"]):
                tb.add_scalar(f"rl_train_reward/cpt_{r['budget']}", reward, i + 1)
            for e in r["eval"]:
                tb.add_scalar(f"eval_reward/cpt_{r['budget']}", e["reward/mean"], e["step"])
            tb.add_scalar("cpt_eval_loss", r["cpt_eval_loss"], r["budget"])
            tb.add_scalar("sft_eval_loss", r["sft_eval_loss"], r["budget"])
            tb.add_scalar("rl_final_train_reward", r["rl_final_train_reward"], r["budget"])


def plot(path: Path, runs: list[dict]) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for i, r in enumerate(runs):
        label = f"CPT {r['budget']} steps"
        axes[0].plot(range(1, len(r["rl_train_reward"]) + 1), r["rl_train_reward"], color=f"C{i}", label=label)
        axes[1].scatter(r["sft_eval_loss"], r["rl_final_train_reward"], color=f"C{i}", label=label, s=50)
        axes[2].scatter(r["cpt_eval_loss"], r["eval_reward_after_rl"], color=f"C{i}", label=label, s=50)
    axes[0].set(title="RL training reward", xlabel="RL step", ylabel="mean reward")
    axes[1].set(title="post-SFT loss vs RL reward (Fig. 2 left)", xlabel="held-out SFT loss",
                ylabel="RL train reward (last steps)")
    axes[2].set(title="code loss vs held-out reward after RL", xlabel="held-out code loss after CPT",
                ylabel="held-out eval reward")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
