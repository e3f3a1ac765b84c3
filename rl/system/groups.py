"""The sample lifecycle's data: a rollout (one episode's sequences and reward), a group of G rollouts of
one prompt with its advantages, and the packed batch built from groups.

A rollout holds one sequence per context segment (self-summarization makes several); every token carries
the sampler's logprob and the policy version that sampled it (-1 on environment tokens) and, with router
replay, the sampler's experts for it (`replay_ids`, an encoded [n, L_moe, k] record, c2jax.rl.harness.replay).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from c2jax.rl.advantages import group_advantages
from c2jax.rl.batch import RLBatch, pack
from c2jax.rl.config import AdvantageConfig, LengthPenaltyConfig
from c2jax.rl.harness.replay import learner_replay_ids
from c2jax.rl.harness.trajectory import decode_array, encode_array


@dataclass
class Rollout:
    sequences: list[dict]  # each {tokens, loss_mask, behavior_logprobs, policy_versions} as lists [+ replay_ids]
    reward: float
    finish_reason: str = ""
    error: str | None = None
    turns: int = 1
    model_tokens: int = 0
    attempts: int = 1
    # the task's verdict before reward shaping (RLConfig.reward: length penalty, auxiliary terms), for agentic
    # episodes; None where the reward is the verdict (target and text tasks). Online evals count successes on it
    correctness: float | None = None
    # the length penalty already subtracted from `reward` (RLConfig.reward.length_penalty), so a group-level gate
    # can give it back (Group.gate_length_penalty)
    length_penalty: float = 0.0
    # sampled tokens inside <think> blocks (the harness counts them; the curriculum's thinking_tokens signal)
    thinking_tokens: int = 0
    # how the episode's environment was made (rl/system/envs.environment_kind: bwrap, oci-image, engine:docker, ...)
    env_kind: str = ""

    @property
    def errored(self) -> bool:
        return self.error is not None

    @property
    def verdict(self) -> float:
        """The task's verdict: `correctness` where the reward was shaped, else the reward itself."""
        return self.reward if self.correctness is None else self.correctness

    def versions(self) -> list[int]:
        return [v for s in self.sequences for v, m in zip(s["policy_versions"], s["loss_mask"]) if m]


def stored_verdict(rollout: dict) -> float:
    """Rollout.verdict of a rollout as stored in groups.jsonl (rows from before `correctness` lack it)."""
    return rollout["reward"] if rollout.get("correctness") is None else rollout["correctness"]


@dataclass
class Group:
    group_id: str
    prompt_id: str
    rollouts: list[Rollout]
    advantages: list[float] = field(default_factory=list)
    attempt: int = 0
    worker: str = ""
    timings: dict = field(default_factory=dict)

    @property
    def rewards(self) -> np.ndarray:
        return np.asarray([r.reward for r in self.rollouts], np.float32)

    @property
    def errored(self) -> bool:
        return any(r.errored for r in self.rollouts)

    @property
    def min_version(self) -> int:
        vs = [v for r in self.rollouts for v in r.versions()]
        return min(vs) if vs else -1

    @property
    def max_version(self) -> int:
        vs = [v for r in self.rollouts for v in r.versions()]
        return max(vs) if vs else -1

    @property
    def num_tokens(self) -> int:
        return sum(r.model_tokens for r in self.rollouts)

    @property
    def zero_variance(self) -> bool:
        rw = self.rewards
        return bool(rw.max() - rw.min() <= 1e-6)

    def gate_length_penalty(self, cfg: LengthPenaltyConfig) -> Group:
        """The group-level part of the length penalty's schedule, applied once when the group is graded: the
        penalty is scaled by min(1, v / anneal_steps) at the sampling policy's version v, and is 0 for a group
        whose verdicts are all equal under the `mixed_groups` gate. Rewards change in place (kept in
        groups.jsonl as trained); the per-episode `resolved` gate was applied when the episode was scored."""
        factor = 1.0 if cfg.anneal_steps == 0 else min(1.0, max(0, self.min_version) / cfg.anneal_steps)
        if cfg.gate == "mixed_groups" and len({r.verdict for r in self.rollouts}) <= 1:
            factor = 0.0
        if factor != 1.0:
            for r in self.rollouts:
                r.reward += (1.0 - factor) * r.length_penalty
                r.length_penalty *= factor
        return self

    def with_advantages(self, cfg: AdvantageConfig) -> Group:
        self.advantages = [float(a) for a in np.asarray(group_advantages(self.rewards[None], cfg))[0]]
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        d["min_version"], d["max_version"] = self.min_version, self.max_version
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Group:
        d = {k: v for k, v in d.items() if k not in ("min_version", "max_version")}
        return cls(**(d | {"rollouts": [Rollout(**r) for r in d["rollouts"]]}))


def sequence(tokens, loss_mask, behavior_logprobs, policy_versions, replay_ids: np.ndarray | None = None) -> dict:
    """One rollout sequence as stored (lists, and the replay record base64-encoded: groups are JSONL)."""
    n = len(tokens)
    if not (len(loss_mask) == len(behavior_logprobs) == len(policy_versions) == n):
        raise ValueError(f"a sequence of {n} tokens has {len(loss_mask)} mask, {len(behavior_logprobs)} logprob "
                         f"and {len(policy_versions)} version entries")
    if replay_ids is not None and len(replay_ids) != n:
        raise ValueError(f"a sequence of {n} tokens has {len(replay_ids)} replay rows")
    return {"tokens": [int(t) for t in tokens], "loss_mask": [int(m) for m in loss_mask],
            "behavior_logprobs": [float(x) for x in behavior_logprobs],
            "policy_versions": [int(v) for v in policy_versions],
            "replay_ids": None if replay_ids is None else encode_array(np.asarray(replay_ids, np.int32))}


def batch_sequences(groups: Sequence[Group], replay: bool = False) -> list[dict]:
    """The learner sequences of the groups, each cut after its last sampled token (environment text after
    it, e.g. a final tool output, is not a target and nothing trained attends to it). With `replay`, each
    carries the sampler's experts for every token (c2jax.rl.harness.replay.learner_replay_ids); a rollout
    without a replay record is an error."""
    out = []
    for g in groups:
        if len(g.advantages) != len(g.rollouts):
            raise ValueError(f"group {g.group_id} has no advantages; call with_advantages first")
        for r, adv in zip(g.rollouts, g.advantages):
            for s in r.sequences:
                mask = np.asarray(s["loss_mask"], bool)
                sampled = np.flatnonzero(mask)
                end = int(sampled[-1]) + 1 if sampled.size else len(mask)
                if end < 2:
                    continue
                seq = {"tokens": np.asarray(s["tokens"], np.int32)[:end], "loss_mask": mask[:end],
                       "behavior_logprobs": np.asarray(s["behavior_logprobs"], np.float32)[:end],
                       "policy_versions": np.asarray(s["policy_versions"], np.int32)[:end],
                       "advantage": adv}
                if replay:
                    if s.get("replay_ids") is None:
                        raise ValueError(f"group {g.group_id}: router replay is on (system.router_replay) but "
                                         "a rollout has no replay record (a sampler without expert ids?)")
                    seq["replay_ids"] = learner_replay_ids(decode_array(s["replay_ids"])[:end], seq["loss_mask"])
                out.append(seq)
    return out


def build_batch(groups: Sequence[Group], seq_len: int, min_rows: int, row_multiple: int = 1,
                replay: bool = False) -> RLBatch:
    """Packs the groups' sequences into [rows, seq_len]; rows = the first of min_rows * 2^k that fits (and
    divides by row_multiple), so a run compiles rl_step for few shapes. Truncates nothing: a sequence
    longer than seq_len is an error naming the limit. `replay`: the batch carries replay_ids."""
    seqs = batch_sequences(groups, replay)
    rows = min_rows
    while True:
        try:
            num_rows = -(-rows // row_multiple) * row_multiple
            return pack(seqs, seq_len, num_rows=num_rows,
                        group_rewards=np.stack([g.rewards for g in groups]) if groups else None)
        except ValueError as e:
            if "allowed" not in str(e) or rows > 1 << 16:
                raise
            rows *= 2
