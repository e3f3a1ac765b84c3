"""The copy probe: does the model put its next-token mass on the word it must copy, during SFT?

Both demo rungs are solved only by copying a word from the context (docs/demo_regime.md). The probe takes the
scripted oracle's reference turn on each HELD-OUT task, cut just before the answer word (`"content": "`), and
scores the next token twice: as the answer and as the task's distractor (the echo sender, the lookup key, the
word the imperfect teacher copies instead). Its two NLLs are eval sources of the SFT phase, so the SFT curve in
metrics.jsonl / TensorBoard shows the step at which copying forms: a model that does not copy puts about 1/16
on the right value (NLL ~ ln 16 = 2.77; its answers are drawn from the 16-word value vocabulary), one that
copies much more.

Rows are scored exactly as the data pipeline trains them (c2jax.data.packing.tokenize_document: the same BOS,
the prompt and completion tokenized as separate pieces), with one scored position per row.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

PREFIX_MARK = '"content": "'


def probe_records(reference_jsonl: Path, answers: dict[str, str], distractors: dict[str, str | None]) -> list[dict]:
    """{task_id, prefix, answer, distractor} per reference turn that writes a task's answer: `prefix` is the
    turn's prompt plus its completion up to the answer word. Tasks without a distractor are left out."""
    rows = []
    for rec in map(json.loads, reference_jsonl.read_text().splitlines()):
        tid = rec["task_id"]
        answer, distractor = answers.get(tid), distractors.get(tid)
        if answer is None or not distractor:
            continue
        at = rec["completion"].find(PREFIX_MARK + json.dumps(answer)[1:-1] + '"')
        if at < 0:
            continue  # a turn before the one that writes the answer (reading settings.ini)
        cut = at + len(PREFIX_MARK)
        rows.append({"task_id": tid, "prefix": rec["prompt"] + rec["completion"][:cut],
                     "answer": answer.strip(), "distractor": distractor})
    return rows


def probe_batch(rows: list[dict], tokenizer, word: str, seq_len: int) -> dict[str, np.ndarray]:
    """One batch of every row ([len(rows), seq_len]): the data pipeline's fields, the loss mask on the first
    token of `rows[i][word]` ("answer" or "distractor") only."""
    from c2jax.data.packing import tokenize_document

    if word not in ("answer", "distractor"):
        raise ValueError(f"word must be 'answer' or 'distractor', got {word!r}")
    n = len(rows)
    batch = {"input_ids": np.zeros((n, seq_len), np.int32), "targets": np.zeros((n, seq_len), np.int32),
             "segment_ids": np.zeros((n, seq_len), np.int32), "positions": np.zeros((n, seq_len), np.int32),
             "loss_mask": np.zeros((n, seq_len), np.float32)}
    for i, row in enumerate(rows):
        ids, trained = tokenize_document({"prompt": row["prefix"], "completion": row[word]}, tokenizer)
        first = int(np.argmax(trained))  # the word's first token; trained is 0 on the BOS and the prompt
        if first == 0 or first > seq_len:
            raise ValueError(f"{row['task_id']}: the probe prefix is {first} tokens, longer than seq_len {seq_len}")
        length = first  # inputs up to the token before the word; its target is the word's first token
        batch["input_ids"][i, :length] = ids[:length]
        batch["targets"][i, :length] = ids[1:length + 1]
        batch["segment_ids"][i, :length] = 1
        batch["positions"][i, :length] = np.arange(length)
        batch["loss_mask"][i, length - 1] = 1.0
    return batch


def probe_sources(rows: list[dict], tokenizer, seq_len: int) -> dict[str, Callable[[], Iterator[dict]]]:
    """Trainer eval sources {copy_answer, copy_distractor}: one batch each, built once."""
    batches = {f"copy_{w}": probe_batch(rows, tokenizer, w, seq_len) for w in ("answer", "distractor")}
    return {name: (lambda b=b: iter([b])) for name, b in batches.items()}


def formation_step(curve: list[dict], threshold: float = 1.0) -> int | None:
    """The first SFT step of `curve` ({sft_step, copy_answer} rows) at which the held-out answer NLL is below
    `threshold` (P(answer) > e^-1 = 0.37, against 1/16 for a model that does not copy); None when it never is."""
    for row in sorted(curve, key=lambda r: r["sft_step"]):
        if row["copy_answer"] < threshold:
            return int(row["sft_step"])
    return None
