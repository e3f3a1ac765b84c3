"""Online-eval scores from a [prompts, K] matrix of rewards (K samples of each held-out prompt)."""

from __future__ import annotations

import numpy as np


def avg_at_1(rewards: np.ndarray) -> float:
    """Expected reward of one sample: the mean over prompts and samples (avg@K estimates avg@1)."""
    rewards = np.asarray(rewards, np.float64)
    return float(rewards.mean()) if rewards.size else float("nan")


def best_of_k(rewards: np.ndarray) -> float:
    """Mean over prompts of the best of the K samples' rewards (pass@K for 0/1 rewards)."""
    rewards = np.asarray(rewards, np.float64)
    return float(rewards.max(axis=1).mean()) if rewards.size else float("nan")
