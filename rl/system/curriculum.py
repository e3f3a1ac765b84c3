"""Prompt scheduling: the report's curriculum and the online pass-rate filter.

Sampling weights: each source gets its share `weight / sum of live sources' weights`; within a source a task's
weight is (1 + h_p / mean h) ** strength, h_p the mean hardness of its recent groups under the stage in force
(`by`: model tokens, turns, or thinking tokens; Composer 2 sec. 4: harder problems get more samples, by those
signals, in later stages); tasks never seen get the source's mean, so everything is tried.

The filter (`curriculum.filter`, off by default): a task whose solve rate over its last `window` groups is <= low
or >= high (never / always solved: its groups carry no gradient under group-relative advantages) stops being
sampled; a dispatch re-probes a filtered task with probability `reprobe_rate`, and a task whose window moves
back inside (low, high) is live again. Also: skip zero-variance groups (DAPO's dynamic sampling)."""

from __future__ import annotations

import collections

import numpy as np

from c2jax.rl.system.config import HARDNESS, CurriculumConfig


class Curriculum:
    def __init__(self, prompt_ids: list[str], cfg: CurriculumConfig, seed: int = 0, *,
                 sources: dict[str, str] | None = None, source_weights: dict[str, float] | None = None,
                 success_threshold: float = 1.0):
        if not prompt_ids:
            raise ValueError("the curriculum needs at least one prompt")
        self.prompt_ids, self.cfg = list(prompt_ids), cfg
        self.rng = np.random.default_rng(seed)
        self.hardness: dict[str, dict[str, collections.deque]] = {
            p: {k: collections.deque(maxlen=cfg.window) for k in HARDNESS} for p in prompt_ids}
        self.requeued: collections.deque[str] = collections.deque()
        self.source_of = {p: (sources or {}).get(p, "") for p in self.prompt_ids}
        labels = list(dict.fromkeys(self.source_of.values()))
        weights = source_weights or {}
        self.source_weights = {s: float(weights.get(s, 1.0)) for s in labels}
        self._index = {s: np.array([i for i, p in enumerate(self.prompt_ids) if self.source_of[p] == s])
                       for s in labels}
        self.success_threshold = success_threshold
        self.solve: dict[str, collections.deque] = {p: collections.deque(maxlen=cfg.filter.window)
                                                     for p in prompt_ids}
        self.filtered: set[str] = set()
        self.events: list[dict] = []  # filter decisions since the caller last took them (take_events)
        self.counts = collections.Counter()

    # weights ------------------------------------------------------------------------------------------
    def _hardness_weights(self, idx: np.ndarray, by: str, strength: float) -> np.ndarray:
        ids = [self.prompt_ids[i] for i in idx]
        seen = {p: float(np.mean(self.hardness[p][by])) for p in ids if self.hardness[p][by]}
        if not self.cfg.enabled or not seen or strength == 0:
            return np.full(len(ids), 1.0 / len(ids))
        mean = max(float(np.mean(list(seen.values()))), 1e-9)
        h = np.array([seen.get(p, mean) for p in ids])
        w = (1.0 + h / mean) ** strength
        return w / w.sum()

    def weights(self, step: int = 0) -> np.ndarray:
        """Sampling weights over `prompt_ids` at learner step `step` (filtered tasks get 0, unless every task
        of every source is filtered: then the filter is ignored)."""
        by, strength = self.cfg.stage(step)
        live = np.array([p not in self.filtered for p in self.prompt_ids])
        if not live.any():
            live[:] = True
        out = np.zeros(len(self.prompt_ids))
        shares = {s: w for s, w in self.source_weights.items() if live[self._index[s]].any()}
        total = sum(shares.values())
        for s, w in shares.items():
            idx = self._index[s][live[self._index[s]]]
            out[idx] = (w / total) * self._hardness_weights(idx, by, strength)
        return out

    def next_prompt(self, step: int = 0) -> str:
        if self.requeued:
            return self.requeued.popleft()
        if self.filtered and self.cfg.filter.reprobe_rate and len(self.filtered) < len(self.prompt_ids) \
                and self.rng.random() < self.cfg.filter.reprobe_rate:
            self.counts["reprobes"] += 1
            pool = sorted(self.filtered)
            return pool[int(self.rng.integers(len(pool)))]
        return self.prompt_ids[int(self.rng.choice(len(self.prompt_ids), p=self.weights(step)))]

    def requeue(self, prompt_id: str) -> None:
        self.requeued.append(prompt_id)

    # observations -------------------------------------------------------------------------------------
    def observe(self, prompt_id: str, turns: float, tokens: float, thinking_tokens: float = 0.0,
                solve_rate: float | None = None) -> None:
        """One returned group of `prompt_id`: its mean turns, model tokens, thinking tokens and, for the
        filter, the fraction of its samples that solved the task."""
        if prompt_id not in self.hardness:
            return
        for key, value in (("turns", turns), ("tokens", tokens), ("thinking_tokens", thinking_tokens)):
            self.hardness[prompt_id][key].append(float(value))
        if solve_rate is None or not self.cfg.filter.enabled:
            return
        fc = self.cfg.filter
        window = self.solve[prompt_id]
        window.append(float(solve_rate))
        rate = float(np.mean(window))
        extreme = len(window) >= fc.min_groups and (rate <= fc.low or rate >= fc.high)
        if extreme and prompt_id not in self.filtered:
            self.filtered.add(prompt_id)
            self.counts["filtered"] += 1
            self.events.append({"event": "filtered", "prompt_id": prompt_id, "source": self.source_of[prompt_id],
                                "solve_rate": rate, "groups": len(window)})
        elif not extreme and prompt_id in self.filtered:
            self.filtered.discard(prompt_id)
            self.counts["reinstated"] += 1
            self.events.append({"event": "reinstated", "prompt_id": prompt_id, "source": self.source_of[prompt_id],
                                "solve_rate": rate, "groups": len(window)})

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    def live_counts(self) -> dict[str, tuple[int, int]]:
        """source label -> (tasks live, tasks filtered)."""
        out = {}
        for s, idx in self._index.items():
            ids = [self.prompt_ids[i] for i in idx]
            n_f = sum(p in self.filtered for p in ids)
            out[s] = (len(ids) - n_f, n_f)
        return out
