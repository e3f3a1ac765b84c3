"""Task suites as RL training distributions: `env.kind: suite` reads `env.sources` (TaskSourceConfig) into one
`TaskSet`: the train tasks the curriculum samples, the held-out tasks the online eval scores, each tagged with
its source and category.

A source is any suite `c2jax eval` runs (a directory of task directories in our, Harbor's or Terminal-Bench 1's
layout; a pinned c2bench directory; SWE-bench instances with their repositories or images; rl/eval/suite.py
`load_suite`) or a generated ladder (written as task directories under the run dir, then loaded like any
other). `env.kind: ladder` is the suite of one ladder source. Splits are deterministic and disjoint: by a hash
of the task id, the source's own metadata, an explicit id list, or the whole source; train tasks whose content
(prompt and starting files) equals a held-out task's are left out, so a held-out score is never a memorised
answer. Held-out tasks are ordered round-robin over categories, so the first `env.eval_prompts` cover every
category evenly.

Task directories reach environment workers by path (`env.task_transfer: path`, checked on each worker at
start) or packed once into the Ray object store (`ship`) and unpacked on each worker (`ShippedTasks`).
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import tempfile
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from c2jax.rl.system.config import EnvConfig, LadderSourceConfig, TaskSourceConfig


class SuiteSourceError(ValueError):
    """A task source cannot be used as a training distribution; the message names the source."""


@dataclass(frozen=True)
class SuiteTask:
    id: str  # unique within the run
    source: str  # TaskSourceConfig.label
    category: str
    split: str  # "train" | "held_out"
    instruction: str  # the prompt at env.prompt_level
    task: object  # the c2jax.rl.tasks.Task (its id may differ from `id` when two sources share one)


@dataclass
class TaskSet:
    train: dict[str, SuiteTask] = field(default_factory=dict)  # in sampling order
    held_out: dict[str, SuiteTask] = field(default_factory=dict)  # round-robin over categories
    weights: dict[str, float] = field(default_factory=dict)  # source label -> sampling weight
    notes: list[str] = field(default_factory=list)  # what loading left out, and why

    @property
    def all(self) -> dict[str, SuiteTask]:
        return {**self.train, **self.held_out}

    def tasks(self) -> dict:
        """task id -> Task, for the environment workers."""
        return {tid: st.task for tid, st in self.all.items()}

    def summary(self) -> dict:
        """Per source and category: train / held-out task counts."""
        out: dict = defaultdict(lambda: {"train": 0, "held_out": 0})
        for st in self.all.values():
            out[f"source/{st.source}"][st.split] += 1
            out[f"category/{st.category}"][st.split] += 1
        return dict(out)


def held_out_by_hash(task_id: str, fraction: float) -> bool:
    """Deterministic, seed-free: a task stays on its side when other tasks are added or removed."""
    return int(hashlib.sha256(task_id.encode()).hexdigest()[:12], 16) / 16 ** 12 < fraction


def task_content(task, level: str) -> tuple:
    """What makes two tasks the same task for contamination: the prompt and the starting files (the repository
    tree's hash; an image task's image reference)."""
    from c2jax.rl.eval.suite import tree_sha256

    if task.repo_dir is not None and Path(task.repo_dir).is_dir():
        files = tree_sha256(Path(task.repo_dir))
    else:
        env = task.environment
        files = str(getattr(env, "image", None) or getattr(env, "dockerfile", None) or task.id)
    return task.prompt(level), files


def round_robin(tasks: list[SuiteTask]) -> list[SuiteTask]:
    """Interleaves categories (in order of first appearance), keeping each category's order."""
    by_cat: dict[str, list[SuiteTask]] = {}
    for t in tasks:
        by_cat.setdefault(t.category, []).append(t)
    out, i = [], 0
    while len(out) < len(tasks):
        out += [lst[i] for lst in by_cat.values() if i < len(lst)]
        i += 1
    return out


def _ladder_tasks(lc: LadderSourceConfig, directory: Path, seed: int):
    """(train, held-out) Tasks of a generated ladder, in the ladder's own order (rl/system/envs.ladder_splits)."""
    from c2jax.rl.system.envs import ladder_splits
    from c2jax.rl.tasks.task import load_task, with_changes

    cfg = EnvConfig(kind="ladder", rungs=lc.rungs, per_rung=lc.per_rung, lookup_keys=lc.lookup_keys)
    train, held = ladder_splits(cfg, directory, seed)
    return ([load_task(p) for p in train.values()],
            [with_changes(load_task(p), id=tid) for tid, p in held.items()])


def _path_tasks(src: TaskSourceConfig):
    from c2jax.rl.eval.suite import SuiteError, load_suite

    try:
        tasks = load_suite(src.path, repos=src.repos, image_store=src.image_store or None)
    except (SuiteError, OSError) as e:
        raise SuiteSourceError(f"task source {src.label} ({src.path}): {e}") from None
    return tasks


def _split(src: TaskSourceConfig, tasks: list) -> tuple[list, list]:
    if src.split == "train":
        return tasks, []
    if src.split == "held_out":
        return [], tasks
    if src.held_out_ids:
        path = Path(src.held_out_ids)
        if not path.is_file():
            raise SuiteSourceError(f"task source {src.label}: held_out_ids {path} does not exist")
        ids = {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}
        unknown = ids - {t.id for t in tasks}
        if unknown:
            raise SuiteSourceError(f"task source {src.label}: held_out_ids names tasks the source does not hold: "
                                   f"{sorted(unknown)[:5]}")
        return [t for t in tasks if t.id not in ids], [t for t in tasks if t.id in ids]
    if src.split == "metadata":
        splits = {str(t.metadata.get("split", "")) for t in tasks}
        if not splits <= {"train", "eval"}:
            raise SuiteSourceError(f"task source {src.label}: split=metadata needs every task's split to be train "
                                   f"or eval, found {sorted(splits)}")
        return ([t for t in tasks if t.metadata.get("split") == "train"],
                [t for t in tasks if t.metadata.get("split") == "eval"])
    held = [t for t in tasks if held_out_by_hash(t.id, src.held_out_fraction)]
    return [t for t in tasks if not held_out_by_hash(t.id, src.held_out_fraction)], held


def ladder_source(env: EnvConfig) -> TaskSourceConfig:
    """`env.kind: ladder` as a suite: one generated ladder source from env.rungs / per_rung / lookup_keys."""
    return TaskSourceConfig(ladder=LadderSourceConfig(rungs=env.rungs, per_rung=env.per_rung,
                                                      lookup_keys=env.lookup_keys), name="ladder")


def load_taskset(env: EnvConfig, run_dir: Path, seed: int) -> TaskSet:
    """The run's TaskSet from `env.sources` (or the ladder of `env.kind: ladder`, built under run_dir/tasks)."""
    sources = (ladder_source(env),) if env.kind == "ladder" else env.sources
    level = env.prompt_level
    loaded = []  # (source, train tasks, held-out tasks)
    notes = []
    for src in sources:
        if src.ladder is not None:
            directory = run_dir / "tasks" if env.kind == "ladder" else run_dir / "tasks" / src.label
            train, held = _ladder_tasks(src.ladder, directory, seed)
        else:
            tasks = _path_tasks(src)
            if src.categories:
                tasks = [t for t in tasks if t.category in src.categories]
                if not tasks:
                    raise SuiteSourceError(f"task source {src.label}: no task of categories {list(src.categories)}")
            unsupported = [t for t in tasks if not t.supported]
            if unsupported and len(unsupported) == len(tasks):
                raise SuiteSourceError(f"task source {src.label}: none of its {len(tasks)} tasks can run here, e.g. "
                                       f"{unsupported[0].id}: {unsupported[0].unsupported_reason}")
            if unsupported:
                notes.append(f"{src.label}: {len(unsupported)} unsupported task(s) left out, e.g. {unsupported[0].id}: "
                             f"{unsupported[0].unsupported_reason}")
                tasks = [t for t in tasks if t.supported]
            train, held = _split(src, tasks)
            if src.max_tasks:
                train = sorted(train, key=lambda t: t.id)[: src.max_tasks]
        loaded.append((src, train, held))
    out = TaskSet(weights={src.label: src.weight for src in sources}, notes=notes)
    seen_ids: set[str] = set()

    def unique(task, src, suffix: str = "") -> str:
        """Train ids keep their names (first come, first served; a later source's clash gets its name as a
        prefix); a held-out id that clashes takes the ladder's -heldout suffix first."""
        candidates = [task.id] + ([f"{task.id}{suffix}"] if suffix else []) + [f"{src.label}/{task.id}{suffix}"]
        tid = next((c for c in candidates if c not in seen_ids), None)
        if tid is None:
            raise SuiteSourceError(f"task source {src.label}: task id {task.id} occurs twice")
        if tid != task.id:
            notes.append(f"{src.label}: task id {task.id} is taken by an earlier source; this one is {tid}")
        seen_ids.add(tid)
        return tid

    held_content = {task_content(t, level) for _, _, held in loaded for t in held}
    for src, train, held in loaded:
        kept = 0
        for t in train:
            if held_content and task_content(t, level) in held_content:
                continue
            tid = unique(t, src)
            out.train[tid] = SuiteTask(tid, src.label, src.category or t.category, "train", t.prompt(level), t)
            kept += 1
        if kept < len(train):
            notes.append(f"{src.label}: {len(train) - kept} train task(s) equal to a held-out task left out")
        if not kept and not held:
            raise SuiteSourceError(f"task source {src.label} holds no usable task")
    if not out.train:
        raise SuiteSourceError("the task sources hold no train task (every task is held out or left out); "
                               "lower held_out_fraction or add a source with split: train")
    from c2jax.rl.system.envs import HELDOUT_SUFFIX

    held_all = []
    for src, _, held in loaded:
        for t in held:
            held_all.append(SuiteTask(unique(t, src, HELDOUT_SUFFIX), src.label, src.category or t.category,
                                      "held_out", t.prompt(level), t))
    # a source with only held-out tasks is eval-only: its weight means nothing
    live = {st.source for st in out.train.values()}
    out.weights = {label: w for label, w in out.weights.items() if label in live}
    out.held_out = {st.id: st for st in round_robin(held_all)}
    return out


# --------------------------------------------------------------------------------------- task transfer
def pack_task_dir(path: Path) -> bytes:
    """A task directory as a gzip tar (paths relative to it; symlinks kept as links)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        tar.add(str(path), arcname=".", filter=lambda ti: None if "__pycache__" in ti.name else ti)
    return buf.getvalue()


def ship_tasks(tasks: dict) -> dict:
    """task id -> ("shipped", Ray object ref of the packed directory, id) for `env.task_transfer: ship`: each
    directory is put into the object store once; workers unpack it (ShippedTasks). Only task directories ship:
    a task without one (SWE-bench instances over a repos directory or an image store) needs a shared path."""
    import ray

    out = {}
    for tid, task in tasks.items():
        if task.path is None or not Path(task.path).is_dir():
            raise SuiteSourceError(f"task {tid} has no task directory (a SWE-bench instance?), so "
                                   "env.task_transfer=ship cannot send it; put its repositories or image store on "
                                   "a path every node sees and use task_transfer=path")
        out[tid] = ("shipped", ray.put(pack_task_dir(Path(task.path))), task.id)
    return out


class ShippedTasks:
    """On an environment worker: unpacks a shipped task directory on first use into a private temp dir and
    loads it there (the task keeps its run-wide id)."""

    def __init__(self):
        self._root = Path(tempfile.mkdtemp(prefix="c2jax-tasks-"))
        self._lock = threading.Lock()
        self.unpacked = 0

    def load(self, tid: str, ref, own_id: str):
        import ray

        from c2jax.rl.tasks.task import load_task, with_changes

        with self._lock:
            dest = self._root / hashlib.sha256(tid.encode()).hexdigest()[:16]
            if not dest.is_dir():
                data = ray.get(ref)
                tmp = dest.with_suffix(".part")
                tmp.mkdir(parents=True)
                with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                    tar.extractall(tmp, filter="tar")
                tmp.rename(dest)
                self.unpacked += 1
        task = load_task(dest)
        return task if task.id == tid else with_changes(task, id=tid)


def unseen_paths(tasks: dict) -> list[str]:
    """The task paths this process cannot see (env.task_transfer: path on a node without the shared storage)."""
    missing = []
    for tid, task in tasks.items():
        if isinstance(task, tuple):
            continue
        for p in (getattr(task, "path", None), getattr(task, "repo_dir", None)):
            if p is not None and not Path(p).exists():
                missing.append(f"{tid}: {p}")
                break
    return missing
