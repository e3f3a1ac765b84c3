"""The packed RL training batch and a first-fit packer for variable-length (multi-turn) sequences.

Every [B, S] array is aligned on the *input* position t: targets[t] is the token predicted from position t,
and the per-target quantities (loss_mask, advantages, behavior_logprobs, policy_versions) describe that
target token. A multi-turn trajectory is one sequence whose tool-output / user tokens have loss_mask 0; a
self-summarized chain is several sequences that share the chain's advantage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class RLBatch(NamedTuple):
    input_ids: np.ndarray  # [B, S] int32
    targets: np.ndarray  # [B, S] int32, the next token (anything where loss_mask is 0)
    loss_mask: np.ndarray  # [B, S] bool: the target is a sampled (policy) token to train on
    positions: np.ndarray  # [B, S] int32, restarting at 0 for every packed sequence
    segment_ids: np.ndarray  # [B, S] int32, attention stays within a segment (padding: its own id, 0)
    sequence_ids: np.ndarray  # [B, S] int32, batch-global sequence index, -1 on padding
    advantages: np.ndarray  # [B, S] float32 per-token advantage (a sequence's A broadcast, or per token)
    behavior_logprobs: np.ndarray  # [B, S] float32, the sampler's log mu(target)
    policy_versions: np.ndarray  # [B, S] int32, the weight version that sampled the target
    replay_ids: np.ndarray | None = None  # [B, S, L_moe, k] int32: the sampler's experts for input token t
    group_rewards: np.ndarray | None = None  # [num_groups, G] float32 (for zero-variance-group metrics)


def replay_from_model(expert_ids: np.ndarray | None) -> np.ndarray | None:
    """ModelOutput.expert_ids [L_moe, B, S, k] -> the batch layout [B, S, L_moe, k] (None for a dense model:
    nothing to replay)."""
    return None if expert_ids is None else np.moveaxis(np.asarray(expert_ids), 0, 2)


def pack(sequences: Sequence[dict], seq_len: int, num_rows: int | None = None,
         group_rewards: np.ndarray | None = None) -> RLBatch:
    """First-fit pack sequences into rows of `seq_len` tokens.

    Each sequence is a dict with `tokens` [n] and, per token (token j's entries describe token j as a
    sampled token): `loss_mask` [n], `behavior_logprobs` [n], optional `policy_versions` [n] (default 0),
    optional `replay_ids` [n, L_moe, k]; plus `advantage` (scalar, or [n] per token). Token 0 is never a
    target. Sequence i gets sequence_ids i (in input order), whichever row it lands in.
    """
    lengths = [len(s["tokens"]) for s in sequences]
    if any(n > seq_len for n in lengths):
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit rows of seq_len={seq_len}")
    if any(n < 2 for n in lengths):
        raise ValueError("every sequence needs at least 2 tokens (one input, one target)")
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(sequences)), key=lambda i: -lengths[i]):
        row = next((r for r in range(len(rows)) if fill[r] + lengths[i] <= seq_len), None)
        if row is None:
            rows.append([])
            fill.append(0)
            row = len(rows) - 1
        rows[row].append(i)
        fill[row] += lengths[i]
    num_rows = len(rows) if num_rows is None else num_rows
    if len(rows) > num_rows:
        raise ValueError(f"{len(sequences)} sequences need {len(rows)} rows of {seq_len}, only {num_rows} allowed")
    shape = (num_rows, seq_len)
    out = {name: np.zeros(shape, np.int32) for name in ("input_ids", "targets", "positions", "segment_ids",
                                                         "policy_versions")}
    out["sequence_ids"] = np.full(shape, -1, np.int32)
    out["loss_mask"] = np.zeros(shape, bool)
    out["advantages"] = np.zeros(shape, np.float32)
    out["behavior_logprobs"] = np.zeros(shape, np.float32)
    replay = None
    if sequences and sequences[0].get("replay_ids") is not None:
        replay = np.zeros((*shape, *np.shape(sequences[0]["replay_ids"])[1:]), np.int32)
    for r, members in enumerate(rows):
        start = 0
        for seg, i in enumerate(members, start=1):
            s, n = sequences[i], lengths[i]
            sl = slice(start, start + n)
            tokens = np.asarray(s["tokens"], np.int32)
            out["input_ids"][r, sl] = tokens
            out["targets"][r, start:start + n - 1] = tokens[1:]
            out["positions"][r, sl] = np.arange(n)
            out["segment_ids"][r, sl] = seg
            out["sequence_ids"][r, sl] = i
            out["loss_mask"][r, start:start + n - 1] = np.asarray(s["loss_mask"], bool)[1:]
            out["behavior_logprobs"][r, start:start + n - 1] = np.asarray(s["behavior_logprobs"], np.float32)[1:]
            versions = s.get("policy_versions")
            if versions is not None:
                out["policy_versions"][r, start:start + n - 1] = np.asarray(versions, np.int32)[1:]
            adv = np.broadcast_to(np.asarray(s["advantage"], np.float32), (n,))
            out["advantages"][r, start:start + n - 1] = np.where(out["loss_mask"][r, start:start + n - 1],
                                                                 adv[1:], 0.0)
            if replay is not None:
                replay[r, sl] = np.asarray(s["replay_ids"], np.int32)
            start += n
    return RLBatch(**out, replay_ids=replay,
                   group_rewards=None if group_rewards is None else np.asarray(group_rewards, np.float32))
