"""Long-horizon tasks: a pointer chain through note files, generated from a seed.

chain(N): N notes under `notes/`, each `filler_lines` lines of filler text with one line `next: <path>` at a
seeded position; the last note holds `answer: <value>` instead. The instruction names the first note only.
The agent reads the notes in order and writes the value to answer.txt: N reads plus one write, and every
read adds about `filler_lines * (line_chars + 8)` tokens (read_file numbers its lines) to the context. So
N sets the horizon and `filler_lines` the context a step costs; a long enough chain does not fit one
context window, which is what experiments/ablations/11_self_summarization measures.

Same Harbor format and the same pytest grader as the ladder (hidden tests/test_answer.py; the reference
writes answer.txt). Note names are random, so the order is only known from the notes' contents. An agent
that searches (`grep next:`) can see every pointer in one call: the family measures how an agent that
reads the chain keeps its state across a long context, not search skill.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from c2jax.rl.tasks.ladder import ANSWER_TEST, write_generated_task
from c2jax.rl.tasks.task import Task

_WORDS = ["amber", "basalt", "canyon", "drift", "ember", "fjord", "glacier", "heron", "island", "jasper", "kestrel",
          "lagoon", "meadow", "nimbus", "oasis", "prairie", "quartz", "ridge", "summit", "tundra", "upland", "valley",
          "willow", "yarrow", "zephyr"]
MAX_FILLER_LINES = 200  # read_file shows 250 lines by default: a note is always read in one call


def _filler_line(rng: random.Random, line_chars: int) -> str:
    """Whole words, at most `line_chars` characters (no colon, so never a `next:` / `answer:` line)."""
    line = rng.choice(_WORDS)
    while True:
        word = rng.choice(_WORDS)
        if len(line) + 1 + len(word) > line_chars:
            return line
        line += " " + word


def chain_instruction(start: str) -> dict[str, str]:
    """The prompts of a chain task; each names the first note as `start` in backticks."""
    return {"terse": f"follow the notes from `{start}` -> answer.txt",
            "issue": f"Start by reading `{start}`. Each note names the note to read after it on a line "
                     f"beginning with `next:`; the last note has a line beginning with `answer:` instead. Follow "
                     f"the chain to its end, write the answer value alone to answer.txt, then call submit.",
            "full": f"The repository holds notes under notes/. Start by reading `{start}`. Each note contains "
                    f"filler text and one line `next: <path>` naming the next note; the last note has a line "
                    f"`answer: <value>` instead. Read the notes in order, then create answer.txt in the "
                    f"repository root containing only the value (plus a newline) and call submit."}


def _chain_task(rng: random.Random, length: int, idx: int, filler_lines: int, line_chars: int):
    names: list[str] = []
    while len(names) < length:
        name = f"notes/{rng.choice(_WORDS)}_{rng.randrange(16**4):04x}.txt"
        if name not in names:
            names.append(name)
    value = f"{rng.choice(_WORDS)}-{rng.randint(1000, 9999)}"
    repo = {"README.md": "Notes workspace.\n"}
    for i, name in enumerate(names):
        lines = [_filler_line(rng, line_chars) for _ in range(filler_lines)]
        key = f"next: {names[i + 1]}" if i + 1 < length else f"answer: {value}"
        lines.insert(rng.randint(0, filler_lines), key)
        repo[name] = "\n".join(lines) + "\n"
    prompts = chain_instruction(names[0])
    task = Task(id=f"chain-{length:03d}-{idx:03d}", instruction=prompts["issue"], repo_dir=None, tests_dir=None,
                prompts=prompts, category="long_horizon/chain",
                difficulty="easy" if length <= 2 else "medium" if length <= 8 else "hard", repo="long_horizon-chain",
                timeout_s=60.0, metadata={"generator": "long_horizon", "chain_length": length, "start": names[0],
                                          "filler_lines": filler_lines, "line_chars": line_chars})
    overlay = {"tests/test_answer.py": ANSWER_TEST.format(expected=value)}
    return task, repo, {**repo, "answer.txt": value + "\n"}, overlay


def build_chain_tasks(out_dir: str | Path, *, seed: int = 0, lengths: Sequence[int] = (2, 4, 8, 16),
                      per_length: int = 2, filler_lines: int = 8, line_chars: int = 60) -> list[Path]:
    """Writes `per_length` chain tasks for each chain length under `out_dir` (ids `chain-NNN-III`); the same
    arguments give the same tasks."""
    if not lengths or any(int(n) < 1 for n in lengths):
        raise ValueError(f"chain lengths must be positive, got {list(lengths)}")
    if not 0 <= filler_lines <= MAX_FILLER_LINES:
        raise ValueError(f"filler_lines must be in [0, {MAX_FILLER_LINES}], got {filler_lines}")
    if line_chars < 8 or per_length < 1:
        raise ValueError(f"line_chars must be >= 8 and per_length >= 1, got {line_chars}, {per_length}")
    written = []
    for length in lengths:
        rng = random.Random(f"{seed}/chain/{int(length)}/{filler_lines}/{line_chars}")
        for idx in range(per_length):
            task, repo, solved, overlay = _chain_task(rng, int(length), idx, filler_lines, line_chars)
            written.append(write_generated_task(task, repo, solved, overlay, out_dir,
                                                f2p=("tests/test_answer.py::test_answer",), seed=seed))
    return written
