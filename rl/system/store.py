"""Group-level checkpoints: graded groups (sequences, advantages, policy versions) appended to JSONL,
flushed and fsynced before the reconciler moves on, and "trained at step s" markers. On restart the
groups not trained by the restored learner step come back as ready work (Composer 2 sec. 5: "sequences
with advantages tagged with policy versions are written to NFS"; OpenRLHF #1322: save what was consumed,
not what was yielded).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from c2jax.rl.system.groups import Group


class GroupStore:
    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.groups_path = self.directory / "groups.jsonl"
        self.events_path = self.directory / "events.jsonl"
        self._groups = open(self.groups_path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._events = open(self.events_path, "a", encoding="utf-8")  # noqa: SIM115

    @staticmethod
    def _append(f, obj: dict) -> None:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())

    def put(self, group: Group) -> None:
        self._append(self._groups, group.to_dict())

    def mark_trained(self, group_ids: list[str], step: int) -> None:
        self._append(self._events, {"event": "trained", "step": step, "groups": group_ids})

    def mark(self, group_id: str, event: str, **info) -> None:
        """dropped / skipped / errored: terminal states that are not trained."""
        self._append(self._events, {"event": event, "groups": [group_id], **info})

    def note(self, event: str, **info) -> None:
        """A run event that concerns no group (a learner restart)."""
        self._append(self._events, {"event": event, "groups": [], **info})

    def pending(self, learner_step: int) -> list[Group]:
        """Groups persisted but neither trained at a step <= learner_step nor terminally dropped."""
        done: set[str] = set()
        for obj in _read_jsonl(self.events_path):
            if obj["event"] != "trained" or obj["step"] <= learner_step:
                done.update(obj["groups"])
        return [g for g in (Group.from_dict(o) for o in _read_jsonl(self.groups_path)) if g.group_id not in done]

    def close(self) -> None:
        self._groups.close()
        self._events.close()


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}:{i + 1}: corrupt line (not the torn last line of a crash)") from None
    return out
