"""Documents -> token chunks -> packed training rows. Pure functions of numpy arrays.

A document becomes `[bos] + tokens + [eos]` with a per-token *trained* flag (0 on SFT prompts and on the
chat template's non-assistant parts, 1 elsewhere). Rows hold seq_len + 1 tokens so that inputs and
targets are one shift apart; a document longer than a row is cut into chunks that overlap by one token,
so every token after the first is a target exactly once:

    tokens  [t0 .. tS] [tS .. t2S] [t2S .. ]       (chunk k starts where chunk k-1's last target is)

First-fit packing (Grain) fills rows with chunks and numbers them 1, 2, ... (segment ids; 0 = padding),
positions restart at 0 in each chunk. `row_features` turns one packed row into model inputs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

import numpy as np

from c2jax.data.tokenizer import Tokenizer


def document_hash(doc: dict) -> bytes:
    """sha256 of a document's content (text, prompt/completion or messages; not its path or language)."""
    content = {k: doc[k] for k in ("text", "prompt", "completion", "messages") if k in doc}
    return hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=False).encode()).digest()


def split_of(doc: dict, heldout_fraction: float) -> Literal["train", "eval"]:
    """Held-out rule: eval iff the first 8 bytes of sha256(content), read as a fraction of 2^64, fall
    below `heldout_fraction`. It depends on content only, so duplicates share a split."""
    return "eval" if int.from_bytes(document_hash(doc)[:8], "big") < heldout_fraction * 2.0 ** 64 else "train"


# A plain-text chat template (ChatML's markers as text, so that any tokenizer encodes it).
def _turn_header(role: str) -> str:
    return f"<|im_start|>{role}\n"


_TURN_END = "<|im_end|>\n"


def _pieces(doc: dict) -> list[tuple[str, int]]:
    """(text, trained) segments of a document, in order."""
    if "text" in doc:
        return [(doc["text"], 1)]
    if "prompt" in doc:
        return [(doc["prompt"], 0), (doc["completion"], 1)]
    pieces = []
    for m in doc["messages"]:
        trained = int(m["role"] == "assistant")
        pieces += [(_turn_header(m["role"]), 0), (m["content"] + _TURN_END, trained)]
    return pieces


def tokenize_document(doc: dict, tokenizer: Tokenizer, add_bos: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(ids [N] int32, trained [N] int8): [bos] + pieces + [eos]; eos is trained iff the last piece is."""
    pieces = _pieces(doc)
    encoded = tokenizer.encode_arrays([text for text, _ in pieces])
    ids, flags = [], []
    if add_bos and tokenizer.bos_id is not None:
        ids.append(np.array([tokenizer.bos_id], np.int32))
        flags.append(np.zeros(1, np.int8))
    for (_, trained), piece in zip(pieces, encoded):
        ids.append(piece)
        flags.append(np.full(len(piece), trained, np.int8))
    ids.append(np.array([tokenizer.eos_id], np.int32))
    flags.append(np.full(1, pieces[-1][1] if pieces else 1, np.int8))
    return np.concatenate(ids), np.concatenate(flags)


def chunk(ids: np.ndarray, trained: np.ndarray, row_len: int) -> list[dict[str, np.ndarray]]:
    """Chunks of at most `row_len` tokens overlapping by one; a chunk with no target (1 token) is dropped."""
    if row_len < 2:
        raise ValueError(f"row_len must be >= 2 (seq_len >= 1), got {row_len}")
    step = row_len - 1
    return [{"tokens": ids[s:s + row_len], "trained": trained[s:s + row_len]}
            for s in range(0, max(len(ids) - 1, 0), step)]


def row_features(row: dict[str, np.ndarray], pad_id: int, completion_only: bool) -> dict[str, np.ndarray]:
    """One packed row of S + 1 tokens -> the model's [S] inputs.

    loss_mask[i] = 1 iff input i is a real token, target i is in the same chunk (not a boundary or
    padding) and, with `completion_only`, target i is a trained token."""
    tokens, segments = row["tokens"], row["tokens_segment_ids"]
    real = segments != 0
    tokens = np.where(real, tokens, pad_id).astype(np.int32)
    inputs_seg = segments[:-1]
    mask = (inputs_seg != 0) & (segments[1:] == inputs_seg)
    if completion_only:
        mask &= row["trained"][1:] > 0
    return {
        "input_ids": tokens[:-1],
        "targets": tokens[1:],
        "segment_ids": inputs_seg.astype(np.int32),
        "positions": np.where(real[:-1], row["tokens_positions"][:-1], 0).astype(np.int32),
        "loss_mask": mask.astype(np.float32),
    }


def stack_rows(rows: list[dict[str, np.ndarray]], batch_size: int, pad_id: int) -> dict[str, np.ndarray]:
    """[B, S] arrays; a short final batch is filled with empty rows (loss_mask 0) to keep shapes static."""
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    missing = batch_size - len(rows)
    if missing > 0:
        for k, v in batch.items():
            fill = pad_id if k in ("input_ids", "targets") else 0
            batch[k] = np.concatenate([v, np.full((missing, *v.shape[1:]), fill, v.dtype)])
    return batch


__all__ = ["chunk", "document_hash", "row_features", "split_of", "stack_rows", "tokenize_document"]
