"""Staleness control: the bound on how old a trained token's policy may be, and admission of new work.

Bound (per token, checked per group before it enters a batch): a group may train at learner version v iff
its oldest sampled token has version >= v - max_staleness. Groups past it are dropped or re-queued and
counted, so the bound is a guarantee, not an aggregate (AReaL and SkyRL bound only the aggregate).
Admission (AReaL's staleness manager, `areal/infra/staleness_manager.py`): at version v at most
(max_staleness + v + 1) * groups_per_step groups may be accepted or running, so generation never runs
more than max_staleness steps ahead of the learner; after a resume `accepted` restarts at v * B.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def oldest_allowed(learner_version: int, max_staleness: int) -> int:
    return learner_version - max_staleness


def is_stale(min_token_version: int, learner_version: int, max_staleness: int) -> bool:
    return min_token_version < oldest_allowed(learner_version, max_staleness)


@dataclass
class StalenessManager:
    max_staleness: int
    groups_per_step: int
    accepted: int = 0  # groups that came back graded (whether or not they were trained)
    running: int = 0
    dropped: int = 0  # groups discarded as too stale
    requeued: int = 0  # groups whose prompt went back to the queue as too stale
    counts: dict = field(default_factory=dict)

    def capacity(self, learner_version: int) -> int:
        """How many more groups may be dispatched now."""
        limit = (self.max_staleness + learner_version + 1) * self.groups_per_step
        return max(0, limit - (self.accepted + self.running))

    def on_dispatch(self) -> None:
        self.running += 1

    def on_return(self, accepted: bool) -> None:
        """A dispatched group came back; `accepted` False (errored, lost) frees its admission slot."""
        self.running -= 1
        self.accepted += bool(accepted)

    def on_stale(self, requeue: bool) -> None:
        """An accepted group was too stale to train: it no longer counts as accepted work."""
        self.accepted -= 1
        if requeue:
            self.requeued += 1
        else:
            self.dropped += 1

    def on_skipped(self) -> None:
        """An accepted group was discarded for another reason (zero variance)."""
        self.accepted -= 1

    def on_resume(self, learner_version: int) -> None:
        self.accepted, self.running = learner_version * self.groups_per_step, 0
