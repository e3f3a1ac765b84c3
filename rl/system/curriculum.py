"""Prompt scheduling: upsample harder prompts, judged by the turns or tokens of their recent rollouts
(Composer 2 sec. 4: harder problems get more samples), and optionally skip zero-variance groups (DAPO's
dynamic sampling: a group whose G rewards are equal has zero advantage everywhere)."""

from __future__ import annotations

import collections

import numpy as np

from c2jax.rl.system.config import CurriculumConfig


class Curriculum:
    def __init__(self, prompt_ids: list[str], cfg: CurriculumConfig, seed: int = 0):
        if not prompt_ids:
            raise ValueError("the curriculum needs at least one prompt")
        self.prompt_ids, self.cfg = list(prompt_ids), cfg
        self.rng = np.random.default_rng(seed)
        self.hardness: dict[str, collections.deque] = {p: collections.deque(maxlen=cfg.window) for p in prompt_ids}
        self.requeued: collections.deque[str] = collections.deque()

    def weights(self) -> np.ndarray:
        """Sampling weights: (1 + h_p / mean h) ** strength, h_p = mean hardness of p's recent groups;
        prompts never seen get the mean, so everything is tried."""
        seen = {p: float(np.mean(h)) for p, h in self.hardness.items() if h}
        if not self.cfg.enabled or not seen:
            return np.full(len(self.prompt_ids), 1.0 / len(self.prompt_ids))
        mean = max(float(np.mean(list(seen.values()))), 1e-9)
        h = np.array([seen.get(p, mean) for p in self.prompt_ids])
        w = (1.0 + h / mean) ** self.cfg.strength
        return w / w.sum()

    def next_prompt(self) -> str:
        if self.requeued:
            return self.requeued.popleft()
        return self.prompt_ids[int(self.rng.choice(len(self.prompt_ids), p=self.weights()))]

    def requeue(self, prompt_id: str) -> None:
        self.requeued.append(prompt_id)

    def observe(self, prompt_id: str, turns: float, tokens: float) -> None:
        if prompt_id in self.hardness:
            self.hardness[prompt_id].append(turns if self.cfg.by == "turns" else tokens)
