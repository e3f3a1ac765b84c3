"""Per-sample results and the append-only JSONL store that makes a run resumable.

One line per finished (task, sample), written, flushed and fsynced before the next job is reported
done, so a crash (kill -9, power loss) loses at most the episodes that were still running and a line
being written; `read` skips a torn last line. A rerun reads the store and only runs the pairs that are
not in it. `run.json` next to the store pins the suite fingerprint: resuming against a changed suite
is refused rather than mixing results of two different task sets.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

SCHEMA = "c2jax.eval.sample/1"


@dataclass
class SampleResult:
    task_id: str
    sample: int
    category: str
    resolved: bool
    status: str  # the grader's status (c2jax.rl.tasks.grading.STATUSES) or a behaviour grader's
    reward: float = 0.0
    finish_reason: str = ""  # the episode's
    error: str | None = None  # agent / sandbox failure text, if the episode or grade crashed
    patch: str = ""  # the agent's final diff
    final_message: str = ""
    selector_score: float = 0.0  # best-of-K selector (visible tests passed, or a model score)
    completion_tokens: int = 0
    input_tokens: int = 0  # sum over turns of the context the model read (no cache discount)
    tool_output_tokens: int = 0
    thinking_tokens: int = 0  # sampled inside <think> blocks (part of completion_tokens)
    tokens_estimated: bool = False  # counts from characters / 4 where the agent reported none
    turns: int = 0
    tool_calls: int = 0
    wall_s: float = 0.0  # episode + selector + grading
    episode_s: float = 0.0
    grade_s: float = 0.0
    model_s: float = 0.0  # time inside the agent (sampling / API calls)
    tool_s: float = 0.0
    grade: dict[str, Any] = field(default_factory=dict)  # GradeResult.to_dict() or behaviour details
    schema: str = SCHEMA

    @property
    def key(self) -> tuple[str, int]:
        return (self.task_id, self.sample)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SampleResult:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"unknown sample schema {d.get('schema')!r}; expected {SCHEMA!r}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class ResultStore:
    """Thread-safe append-only JSONL of SampleResults."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._repair_torn_tail()

    def _repair_torn_tail(self) -> None:
        """Cut a partial last line (a crash mid-write) so the next append starts on a fresh line."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data[: data.rfind(b"\n") + 1]
            self.path.write_bytes(keep)

    def read(self) -> list[SampleResult]:
        if not self.path.exists():
            return []
        out = []
        lines = self.path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                out.append(SampleResult.from_dict(json.loads(line)))
            except json.JSONDecodeError as e:
                if number != len(lines):
                    raise ValueError(f"{self.path}:{number}: not valid JSON ({e.msg})") from None
        return out

    def done(self) -> set[tuple[str, int]]:
        return {r.key for r in self.read()}

    def append(self, result: SampleResult) -> None:
        line = json.dumps(result.to_dict(), ensure_ascii=False) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


def check_run_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    """Writes out_dir/run.json on the first run; on a resume, refuses a different suite or sample count."""
    path = out_dir / "run.json"
    if path.exists():
        old = json.loads(path.read_text())
        for key in ("suite_fingerprint", "label"):
            if old.get(key) != manifest.get(key):
                raise ValueError(f"{out_dir} holds a run with a different {key} ({old.get(key)!r} vs "
                                 f"{manifest.get(key)!r}); use a new --out directory")
        # which tasks ran without the network they permit (allow_network): results must not mix both
        if "network_restricted" in old and old["network_restricted"] != manifest.get("network_restricted"):
            raise ValueError(f"{out_dir} holds a run whose tasks had other network access (allow_network "
                             f"changed: offline then {sorted(old['network_restricted'])}, now "
                             f"{sorted(manifest.get('network_restricted') or {})}); use a new --out directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1))
