"""Tool-use SFT data made on the fly: the scripted oracle agent solves TRAIN ladder tasks through the real
harness (tools in a sandbox, graded by the task's hidden tests), and every assistant turn becomes one
prompt/completion JSONL record, rendered exactly as the sampler sees it.

    prompt      <|im_start|>system\\n{system prompt listing the tools}<|im_end|>\\n<|im_start|>user\\n{task}
                <|im_end|>\\n ... <|im_start|>assistant\\n          (everything before the assistant turn)
    completion  <tool_call>\\n{"name": "write_file", "arguments": {...}}\\n</tool_call>
                (the data pipeline appends the tokenizer's eos, which is <|im_end|>, the sampler's stop token;
                its tokenizer keeps only the markers the renderer inserts by id special: see demo/tokenizer.py)

The loss mask of the SFT phase (`loss_mask: completion`) trains only the completion.
"""

from __future__ import annotations

import json
from pathlib import Path

from c2jax.rl.eval.agents import oracle_turns
from c2jax.rl.harness import EpisodeConfig, EpisodeTask, ScriptedAgent, default_registry, run_episode
from c2jax.rl.harness.chat_format import message_body, render_messages_text
from c2jax.rl.tasks.grading import grade
from c2jax.rl.tasks.patches import split_patch
from c2jax.rl.tasks.task import Task


def added_files(patch: str) -> dict[str, str] | None:
    """{path: content} when the patch only creates new files (the `answer`/`lookup` rungs), else None."""
    files = {}
    for path, section in split_patch(patch):
        lines = section.splitlines(keepends=True)
        if not any(line.startswith("--- /dev/null") for line in lines):
            return None
        body, in_hunk = [], False
        for line in lines:
            if line.startswith("@@"):
                in_hunk = True
            elif in_hunk and line.startswith("+"):
                body.append(line[1:])
            elif in_hunk and line.startswith("\\ No newline"):
                body[-1] = body[-1].rstrip("\n")
        files[path] = "".join(body)
    return files or None


def direct_oracle_turns(task: Task) -> list[list[dict]]:
    """The shortest correct tool use for the task: a turn reading the files the task names as needed
    (`metadata["reads"]`: the `lookup` rung's settings.ini), then one turn writing the reference's new files
    (`write_file`); for tasks that edit existing files, c2jax.rl.eval's patch-applying oracle."""
    files = added_files(task.solution_patch or "")
    if files is None:
        return oracle_turns(task)
    reads = [[{"name": "read_file", "arguments": {"path": p}} for p in task.metadata.get("reads", ())]]
    writes = [[{"name": "write_file", "arguments": {"path": p, "content": c}} for p, c in sorted(files.items())]]
    return [turn for turn in reads + writes if turn]


def wrong_field_turns(task: Task) -> list[list[dict]]:
    """The imperfect teacher's turns: the oracle's, except that the answer file holds the task's distractor (the
    `echo` sender, the `lookup` key) instead of the answer: it copies the wrong word, and the hidden test fails."""
    distractor = task.metadata.get("distractor")
    if distractor is None:
        raise ValueError(f"task {task.id} names no distractor: the imperfect teacher needs one (ladder echo/lookup)")
    return [[{**call, "arguments": {**call["arguments"], "content": f"{distractor}\n"}}
             if call["name"] == "write_file" else call for call in turn] for turn in direct_oracle_turns(task)]


def sft_records(messages: list[dict]) -> list[dict]:
    """One {prompt, completion} record per assistant turn of a conversation (OpenAI-style messages)."""
    records = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            records.append({"prompt": render_messages_text(messages[:i], add_generation_prompt=True),
                            "completion": message_body(m)})
    return records


def write_transcripts(tasks: list[Task], out: Path, episode: EpisodeConfig, sandbox_factory, *,
                      prompt_level: str = "terse", grade_first: int = 8, seed: int = 0,
                      conversations_out: Path | None = None, teacher_error: float = 0.0) -> dict:
    """Runs the oracle on every task, writes `out` (JSONL of prompt/completion) and returns statistics.
    The first `grade_first` episodes are graded by the task's tests: an oracle that fails is an error, and so is
    an erring episode that passes.
    `teacher_error`: the fraction of episodes (drawn per task from `seed`) in which the teacher copies the wrong
    word (`wrong_field_turns`): SFT then imitates an imperfect agent, as SFT on a weaker model's transcripts does.
    `conversations_out`: also a JSONL of each episode's messages ({task_id, messages}, one line per segment)."""
    import contextlib
    import random

    if not 0.0 <= teacher_error < 1.0:
        raise ValueError(f"teacher_error must be in [0, 1), got {teacher_error}")
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"teacher/{seed}")
    n_records, graded, resolved, finish, erring = 0, 0, 0, {}, 0
    with out.open("w") as f, (conversations_out.open("w") if conversations_out else contextlib.nullcontext()) as conv:
        for i, task in enumerate(tasks):
            errs = rng.random() < teacher_error
            erring += errs
            turns = wrong_field_turns(task) if errs else direct_oracle_turns(task)
            agent = ScriptedAgent(turns, name="scripted-oracle", tools_in_system_prompt=True)
            with sandbox_factory(task.repo_dir) as sandbox:
                traj = run_episode(agent, sandbox, EpisodeTask(task.id, task.prompt(prompt_level)),
                                   default_registry(), episode, seed=seed + i)
            if traj.finish_reason == "error":
                raise RuntimeError(f"oracle episode on {task.id} failed:\n{traj.error}")
            finish[traj.finish_reason] = finish.get(traj.finish_reason, 0) + 1
            if i < grade_first:
                result = grade(task, traj.final_diff or None, sandbox_factory)
                graded += 1
                resolved += int(result.resolved)
                if result.resolved == errs:
                    raise RuntimeError(f"the scripted {'erring teacher' if errs else 'oracle'} "
                                       f"{'solved' if errs else 'did not solve'} {task.id}: {result.status}")
            for seg in traj.segments:
                if conv is not None:
                    conv.write(json.dumps({"task_id": task.id, "messages": seg.messages}) + "\n")
                for rec in sft_records(seg.messages):
                    f.write(json.dumps({**rec, "task_id": task.id}) + "\n")
                    n_records += 1
    return {"tasks": len(tasks), "records": n_records, "oracle_graded": graded, "oracle_resolved": resolved,
            "teacher_error": teacher_error, "erring_episodes": erring, "finish_reasons": finish}
