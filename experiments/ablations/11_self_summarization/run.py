"""Ablation 11 (Composer 2 sec. 4.5): self-summarization vs truncation on long-horizon tasks.

Pointer-chain tasks (rl/tasks/long_horizon.py) of growing length need more context than one segment holds.
One scripted, context-limited policy runs them through the real harness loop (c2jax.rl.harness.run_episode, in
sandboxes) under two context policies, and the real grader scores the result:
  truncation    summary_trigger_tokens=None: when the segment's context is full the episode ends
  self_summary  at summary_trigger_tokens the policy writes a summary and continues from it (max_summaries)
The policy acts only on what is in its current context (messages of the current segment), so the arms
differ only in the context policy. It is token-level (byte tokenizer + ChatRenderer): the harness counts
the segment's context exactly and enforces max_context_tokens, as it does for the sampler.
    python -m experiments.ablations.11_self_summarization.run [--quick] [--out DIR]
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import matplotlib
import numpy as np
from tensorboardX import SummaryWriter

from c2jax.rl.harness import ChatRenderer, EpisodeConfig, EpisodeTask, default_registry, run_episode
from c2jax.rl.harness.agents import AgentContext, AgentTurn
from c2jax.rl.harness.chat_format import parse_assistant_text, render_tool_call
from c2jax.rl.tasks import grade, load_task
from c2jax.rl.tasks.build import sandbox_factory
from c2jax.rl.tasks.long_horizon import build_chain_tasks
from experiments.ablations.provenance import ablation_args, git_commit, write_result

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
# a note's key line as read_file shows it ("     3\tnext: notes/x.txt") or as a summary states it ("next: ...")
_KEY = re.compile(r"^(?:\s*\d+\t)?(next|answer): ([\w./-]+)\s*$", re.MULTILINE)
_START = re.compile(r"Start by reading `([^`]+)`")


def visible_state(messages: list[dict]) -> dict:
    """What the current context says: the start note (from the task text), the latest key line seen (in a tool
    output, or in the summary the segment starts from), and the notes read in this segment."""
    start, latest, read = None, None, []
    for m in messages:
        if m["role"] == "user" and start is None and (s := _START.search(m.get("content") or "")):
            start = s.group(1)
        if m["role"] in ("user", "tool") and (hits := _KEY.findall(m.get("content") or "")):
            latest = hits[-1]
        for c in m.get("tool_calls") or []:
            if c["function"]["name"] == "read_file":
                read.append(json.loads(c["function"]["arguments"])["path"])
    return {"start": start, "latest": latest, "read": read}


def summary_text(state: dict) -> str:
    """A faithful summary of the visible state: the goal, the start note, where the chain stands, what is left."""
    kind, value = state["latest"] or (None, None)
    lines = [f"Goal: follow the note chain that starts at `{state['start']}` to its answer line and write the "
             "answer value alone to answer.txt, then submit.",
             f"Progress: read {len(state['read'])} note(s) in this context"
             + (f", the last one {state['read'][-1]}." if state["read"] else ".")]
    if kind == "answer":
        lines += ["The chain has ended. The answer is:", f"answer: {value}",
                  "Remaining: write the answer to answer.txt and submit."]
    elif kind == "next":
        lines += ["The note to read next is:", f"next: {value}",
                  "Remaining: read that note and keep following the next lines until the answer line."]
    else:
        lines += ["No pointer found yet.", f"Remaining: read `{state['start']}` and follow the chain."]
    return "\n".join(lines)


class ChainFollower:
    """A scripted context-limited policy for chain tasks, token-level.

    Each turn it looks at its current context only: the latest `answer:` line -> write_file answer.txt and
    submit; else the latest `next:` line -> read_file that note; else (nothing visible: the first turn, or the
    pointer was lost) read the start note named in the task text, as a context-limited agent must. Asked to
    summarize, it states the goal, the start note and the current pointer or answer (`summary_text`). Its text
    is encoded with the byte tokenizer and cut at `max_new_tokens` like a sampler's (a cut tool call is
    malformed). `restarts` counts start-note reads after the first (for the record; the policy never reads it).
    """

    tools_in_system_prompt = True

    def __init__(self, renderer: ChatRenderer, name: str = "chain-follower"):
        self.renderer, self.name = renderer, name
        self.start_reads = 0

    @property
    def restarts(self) -> int:
        return max(0, self.start_reads - 1)

    def act(self, context: AgentContext, *, max_new_tokens: int, seed: int, call_id_prefix: str,
            summary: bool) -> AgentTurn:
        state = visible_state(context.messages)
        kind, value = state["latest"] or (None, None)
        if summary:
            text = summary_text(state)
        elif kind == "answer":
            text = (f"The chain ends with {value}."
                    + render_tool_call("write_file", {"path": "answer.txt", "content": value + "\n"})
                    + render_tool_call("submit", {"message": f"answer.txt holds {value}"}))
        else:
            path = value if kind == "next" else state["start"]
            if kind != "next":
                self.start_reads += 1
            text = f"Reading {path}." + render_tool_call("read_file", {"path": path})
        ids = self.renderer.encode_model_text(text) + [self.renderer.im_end_id]
        finish = "stop"
        if len(ids) > max_new_tokens:
            ids, finish = ids[:max_new_tokens], "length"
        parsed = parse_assistant_text(self.renderer.decode(ids), call_id_prefix)
        return AgentTurn(parsed.content, [] if summary else parsed.tool_calls, ids, [0.0] * len(ids), [0] * len(ids),
                         None, finish, len(ids))


def make_renderer() -> ChatRenderer:
    from c2jax.rl.system.envs import byte_tokenizer

    return ChatRenderer(byte_tokenizer())  # 1 token per byte: the context length is the transcript's byte count


def pick_sandbox(kind: str) -> str:
    if kind != "auto":
        return kind
    from c2jax.rl.sandbox.base import SandboxError
    from c2jax.rl.sandbox.bwrap import find_bwrap

    try:
        find_bwrap()
        return "bwrap"
    except SandboxError:
        return "local"


def run_one(task, episode: EpisodeConfig, renderer: ChatRenderer, factory, seed: int) -> dict:
    agent = ChainFollower(renderer)
    with factory(task.repo_dir) as sandbox:
        traj = run_episode(agent, sandbox, EpisodeTask(task.id, task.instruction), default_registry(), episode,
                           seed=seed)
    if traj.finish_reason == "error":
        raise RuntimeError(f"{task.id}: the episode failed:\n{traj.error}")
    graded = grade(task, traj.final_diff or None, factory)
    contexts = [len(s.token_ids) for s in traj.segments]
    return {"task_id": task.id, "length": int(task.metadata["chain_length"]), "resolved": graded.resolved,
            "grade_status": graded.status, "finish_reason": traj.finish_reason, "turns": traj.num_turns,
            "segments": len(traj.segments), "summaries": traj.num_summaries, "restarts": agent.restarts,
            "notes_read": sum(1 for s in traj.steps for c in s.tool_calls if c["name"] == "read_file"),
            "sampled_tokens": traj.num_model_tokens, "total_tokens": int(sum(contexts)),
            "peak_context": int(max(contexts)), "segment_tokens": contexts,
            "segment_prompt_tokens": [s.num_prompt_tokens for s in traj.segments],
            "summaries_cut": sum(1 for s in traj.steps if s.kind == "summary" and s.finish_reason == "length")}


def aggregate(arm: str, length: int, eps: list[dict]) -> dict:
    mean = lambda k: float(np.mean([e[k] for e in eps]))  # noqa: E731
    return {"arm": arm, "length": length, "tasks": len(eps), "resolved": sum(e["resolved"] for e in eps),
            "success_rate": mean("resolved"), "mean_sampled_tokens": mean("sampled_tokens"),
            "mean_total_tokens": mean("total_tokens"), "mean_peak_context": mean("peak_context"),
            "mean_turns": mean("turns"), "mean_segments": mean("segments"), "mean_summaries": mean("summaries"),
            "mean_notes_read": mean("notes_read"), "restarts": sum(e["restarts"] for e in eps),
            "summaries_cut": sum(e["summaries_cut"] for e in eps),
            "finish_reasons": dict(Counter(e["finish_reason"] for e in eps)), "episodes": eps}


def main(argv: list[str] | None = None) -> dict:
    args, cfg = ablation_args(argv, __doc__, HERE, "two chain lengths, one task each (seconds)")
    if args.quick:
        cfg = cfg | cfg["quick"]
    sandbox = pick_sandbox(cfg["sandbox"])
    factory, renderer = sandbox_factory(sandbox), make_renderer()
    episodes = {arm: EpisodeConfig(**{**cfg["episode"], **over}) for arm, over in cfg["arms"].items()}
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="c2jax-abl11-"))
    try:
        paths = build_chain_tasks(tmp, seed=int(cfg["seed"]), lengths=cfg["lengths"],
                                  per_length=int(cfg["per_length"]), filler_lines=int(cfg["filler_lines"]),
                                  line_chars=int(cfg["line_chars"]))
        tasks = [load_task(p) for p in paths]
        for arm, episode in episodes.items():
            for length in cfg["lengths"]:
                eps = [run_one(t, episode, renderer, factory, int(cfg["seed"]) + i)
                       for i, t in enumerate(tasks) if t.metadata["chain_length"] == length]
                rows.append(aggregate(arm, int(length), eps))
                r = rows[-1]
                print(f"{arm:13s} length {length:3d}: {r['resolved']}/{r['tasks']} resolved, "
                      f"{r['mean_sampled_tokens']:.0f} sampled / {r['mean_total_tokens']:.0f} total tokens, "
                      f"{r['mean_turns']:.1f} turns, {r['mean_summaries']:.1f} summaries, {r['finish_reasons']}",
                      flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"git_commit": git_commit(), "config": cfg, "sandbox": sandbox,
              "episode_configs": {arm: {k: v for k, v in vars(e).items() if k != "system_instructions"}
                                  for arm, e in episodes.items()},
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out, result, args.machine, indent=1)
    with SummaryWriter(str(out / "tb")) as tb:
        for r in rows:
            for key in ("success_rate", "mean_sampled_tokens", "mean_total_tokens", "mean_peak_context",
                        "mean_turns", "mean_summaries"):
                tb.add_scalar(f"{key}/{r['arm']}", r[key], r["length"])
    plot(rows, out / "self_summarization.png", cfg)
    return result


def plot(rows: list[dict], path: Path, cfg: dict) -> None:
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    # later arms thinner and dashed on top, so an arm with the same results as an earlier one stays visible
    for i, arm in enumerate(arms):
        rs = [r for r in rows if r["arm"] == arm]
        xs = [r["length"] for r in rs]
        style = dict(color=f"C{i}", lw=max(3.5 - 1.2 * i, 1.0), ls="-" if i < 2 else "--")
        ax.plot(xs, [r["success_rate"] for r in rs], marker="osv"[i % 3], label=arm, **style)
        bx.plot(xs, [r["mean_total_tokens"] for r in rs], marker="osv"[i % 3], label=f"{arm}: all segments",
                **style)
        bx.plot(xs, [r["mean_peak_context"] for r in rs], marker="x", color=f"C{i}", lw=1.0, ls=":",
                label=f"{arm}: peak context")
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.set_xlabel("chain length (notes to read)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_ylabel("success rate (graded)")
    ax.set_title(f"max_context_tokens {cfg['episode']['max_context_tokens']}", fontsize=9)
    bx.axhline(cfg["episode"]["max_context_tokens"], color="gray", lw=0.8, ls="-.")
    bx.set_yscale("log")
    bx.set_ylabel("byte tokens per episode (mean)")
    bx.set_title("context tokens over all segments, and the largest segment", fontsize=9)
    bx.legend(fontsize=7)
    ax.legend(fontsize=8)
    fig.suptitle("Self-summarization vs truncation on pointer-chain tasks (scripted context-limited policy)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
