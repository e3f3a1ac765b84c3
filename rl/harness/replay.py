"""Router replay records: for every token of a transcript, the experts the sampler routed it to when it
ran that token as an input (Composer 2 report sec. 5).

The learner forwards whole transcripts (prompt, tool outputs, sampled tokens) and replays, at every
input position t, the sampler's experts for token t. The inference engine reports two kinds:

- `prompt_expert_ids` [len(prompt), L_moe, k]: the prefill of a turn's prompt, one row per prompt token;
- `expert_ids` [n, L_moe, k]: row j is the forward pass that produced sampled token j, whose input is
  the previous token (row 0: the last prompt token, row j >= 1: sampled token j - 1).

So a turn with prompt length p fills positions [0, p) from the prefill (tokens already recorded by an
earlier turn keep their first record: the turn that sampled them ran them first), and sampled token j
at position p + j gets `expert_ids[j + 1]`. The last sampled token of a turn is run as an input only by
the next turn's prefill, which records it together with the environment tokens (tool outputs, role
headers) appended in between. Tokens after the last turn (the final sampled token, a trailing
`<|im_end|>\\n` or tool output) never went through the sampler: they are `UNSEEN` (-1) in the record.
They come after every sampled token, so nothing the learner trains on attends to them: the system cuts
the environment tail off learner sequences (c2jax.rl.system.groups.batch_sequences), and `learner_replay_ids`
gives the one position left, the final sampled token as an input (its output predicts nothing), the last
recorded row, so the learner has valid expert ids everywhere. That position is the only one where the
learner's `replay/override_fraction` can count a replayed expert the sampler did not choose.
"""

from __future__ import annotations

import numpy as np

UNSEEN = -1


class ReplayRecorder:
    """Per-position sampler experts of one growing token transcript (one segment)."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray | None] = []
        self.complete = True  # False once a turn came without experts: the segment has no replay record

    def record_turn(self, num_prompt: int, prompt_expert_ids: np.ndarray | None, expert_ids: np.ndarray | None,
                    num_sampled: int) -> None:
        """A turn sampled `num_sampled` tokens after a prompt of the transcript's first `num_prompt` tokens."""
        if prompt_expert_ids is None or (expert_ids is None and num_sampled > 0):
            self.complete = False
            return
        prompt_expert_ids = np.asarray(prompt_expert_ids)
        if prompt_expert_ids.shape[0] != num_prompt:
            raise ValueError(f"prompt_expert_ids has {prompt_expert_ids.shape[0]} rows for a prompt of "
                             f"{num_prompt} tokens")
        if num_prompt < len(self.rows):
            raise ValueError(f"a prompt of {num_prompt} tokens is shorter than the {len(self.rows)} tokens "
                             "already recorded: the transcript must only grow")
        self.rows.extend([None] * (num_prompt - len(self.rows)))
        for i, row in enumerate(self.rows):
            if row is None:
                self.rows[i] = prompt_expert_ids[i]
        if num_sampled:
            expert_ids = np.asarray(expert_ids)
            if expert_ids.shape[0] != num_sampled:
                raise ValueError(f"expert_ids has {expert_ids.shape[0]} rows for {num_sampled} sampled tokens")
            self.rows.extend(expert_ids[1:])
            self.rows.append(None)  # run as an input only by the next turn's prefill

    def array(self, num_tokens: int) -> np.ndarray | None:
        """[num_tokens, L_moe, k] int32, UNSEEN rows for tokens the sampler never ran; None when a turn
        had no experts (a dense model, or a policy that does not report them) or nothing was sampled."""
        known = [r for r in self.rows if r is not None]
        if not self.complete or not known:
            return None
        if len(self.rows) > num_tokens:
            raise ValueError(f"{len(self.rows)} replay rows for a transcript of {num_tokens} tokens")
        out = np.full((num_tokens, *np.shape(known[0])), UNSEEN, np.int32)
        for i, r in enumerate(self.rows):
            if r is not None:
                out[i] = r
        return out


def single_turn_replay(prompt_expert_ids: np.ndarray, expert_ids: np.ndarray, num_sampled: int) -> np.ndarray:
    """The record of prompt + sampled tokens of one generation (the last sampled token UNSEEN)."""
    rec = ReplayRecorder()
    rec.record_turn(len(prompt_expert_ids), prompt_expert_ids, expert_ids, num_sampled)
    out = rec.array(len(prompt_expert_ids) + num_sampled)
    if out is None:
        raise ValueError("single_turn_replay needs prompt and sampled experts")
    return out


def learner_replay_ids(replay_ids: np.ndarray, loss_mask) -> np.ndarray:
    """The record as the learner's replay ids [n, L_moe, k]: every token up to the last sampled one must
    have been run by the sampler (else ValueError: replaying invented experts would be silent garbage);
    the UNSEEN tail after it (tokens nothing trained attends to) repeats the last recorded row."""
    replay_ids = np.asarray(replay_ids, np.int32)
    mask = np.asarray(loss_mask, bool)
    if replay_ids.shape[0] != mask.shape[0]:
        raise ValueError(f"replay_ids has {replay_ids.shape[0]} rows for {mask.shape[0]} tokens")
    seen = (replay_ids >= 0).all(axis=tuple(range(1, replay_ids.ndim)))
    sampled = np.flatnonzero(mask)
    need = int(sampled[-1]) if sampled.size else 0  # positions [0, need) feed trained logprobs
    missing = np.flatnonzero(~seen[:need])
    if missing.size:
        raise ValueError(f"no sampler experts for token {int(missing[0])} (of {len(mask)}), which precedes a "
                         "sampled token: the record is incomplete")
    if not seen.any():
        raise ValueError("the replay record has no sampler experts at all")
    last = int(np.flatnonzero(seen)[-1])
    if seen[: last + 1].all() and last + 1 < len(seen):
        replay_ids = replay_ids.copy()
        replay_ids[last + 1:] = replay_ids[last]
    elif not seen.all():
        hole = int(np.flatnonzero(~seen)[0])
        raise ValueError(f"no sampler experts for token {hole} (of {len(mask)}) before recorded ones")
    return replay_ids
