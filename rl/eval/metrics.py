"""Evaluation metrics as pure functions of per-sample outcomes: no I/O, no sandboxes.

Each task is run K times (samples). With n samples of which c succeed:

    avg@1     = mean over tasks of c / n                                   (CursorBench: accuracy over passes)
    pass@k    = E_tasks[ 1 - C(n-c, k) / C(n, k) ]                         (Chen et al. 2021, eq. 1)
    pass^k    = E_tasks[ C(c, k) / C(n, k) ]                               (all k succeed; Yao et al. 2024, tau-bench)
    best-of-k = E_tasks[ E_{S subset, |S|=k} success(argmax_{i in S} score_i) ]

All three k-metrics are unbiased estimators over the uniformly random k-subsets of the n samples, so
they use every sample rather than the first k. Confidence intervals come from a percentile bootstrap
that resamples tasks (the unit of variance of a benchmark; samples of one task are correlated).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import numpy as np


def _check(n: int, c: int, k: int) -> None:
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"n, c, k must be ints, got {n!r}, {c!r}, {k!r}")
    if n <= 0 or not 0 <= c <= n:
        raise ValueError(f"need n > 0 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models
    Trained on Code", eq. 1), in the numerically stable product form of their Fig. 3:

        C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)

    which never forms a binomial coefficient, so it stays exact in float64 for n in the millions."""
    _check(n, c, k)
    if n - c < k:  # every k-subset holds a success
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k: the probability that k samples drawn without replacement all succeed,
    C(c, k) / C(n, k) = prod_{i=0}^{k-1} (c - i) / (n - i) (tau-bench's pass^k, Yao et al. 2024).
    It measures reliability: pass^1 = c/n, and it falls with k unless a task always succeeds."""
    _check(n, c, k)
    if c < k:
        return 0.0
    i = np.arange(k, dtype=np.float64)
    return float(np.prod((c - i) / (n - i)))


def best_of_k(successes: Sequence[bool], scores: Sequence[float], k: int) -> float:
    """Expected success of the sample a selector picks from k random samples of the n.

    The selector picks the highest score, breaking ties uniformly at random. Group the samples by
    score, highest first; a group of g samples below s higher-scored ones holds the pick exactly when
    the k-subset avoids those s and meets the group, and then each member present is equally likely:

        best-of-k = sum_groups [(C(n-s, k) - C(n-s-g, k)) / C(n, k)] * (successes in group / g)

    A perfect selector (score = success) gives pass@k; a constant score gives avg@1 (c/n), so the
    estimate says how much of the pass@k headroom a real selector recovers."""
    n = len(successes)
    if len(scores) != n:
        raise ValueError(f"{n} successes but {len(scores)} scores")
    _check(n, sum(bool(s) for s in successes), k)
    groups: dict[float, list[bool]] = {}
    for ok, score in zip(successes, scores):
        score = float(score)
        if math.isnan(score):
            raise ValueError("selector scores must not be NaN")
        groups.setdefault(score, []).append(bool(ok))
    total, above = 0.0, 0
    for score in sorted(groups, reverse=True):
        members = groups[score]
        g = len(members)
        p_top = _subset_ratio(n - above, n, k) - _subset_ratio(n - above - g, n, k)
        total += p_top * sum(members) / g
        above += g
    return total


def _subset_ratio(m: int, n: int, k: int) -> float:
    """C(m, k) / C(n, k) = prod_{i<k} (m - i) / (n - i): the chance a random k-subset of n items lies
    inside a fixed m of them (the same stable product form as pass@k)."""
    if m < k:
        return 0.0
    i = np.arange(k, dtype=np.float64)
    return float(np.prod((m - i) / (n - i)))


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("mean of an empty sequence")
    return float(sum(values) / len(values))


def bootstrap_ci(values: Sequence[float], *, n_boot: int = 2000, alpha: float = 0.05, seed: int = 0,
                 stat: Callable[[np.ndarray], float] = np.mean) -> tuple[float, float]:
    """Percentile bootstrap (Efron & Tibshirani 1993, ch. 13) of `stat` over `values` (one per task):
    resample the tasks with replacement `n_boot` times, return the alpha/2 and 1-alpha/2 quantiles."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"bootstrap needs a non-empty 1-D sequence of per-task values, got shape {x.shape}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if n_boot <= 0:
        raise ValueError(f"n_boot must be positive, got {n_boot}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    if stat is np.mean:
        boots = x[idx].mean(axis=1)
    else:
        boots = np.array([stat(x[row]) for row in idx])
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def hierarchical_bootstrap_ci(groups: Sequence[Sequence[float]], *, n_boot: int = 2000, alpha: float = 0.05,
                              seed: int = 0) -> tuple[float, float]:
    """Two-level percentile bootstrap of the grand mean over `groups` (one sequence of per-task values per seed):
    resample the seeds with replacement, then the tasks within each drawn seed, and average the drawn seeds'
    means (each seed weighs the same). Its interval covers both the seed-to-seed and the task sampling
    variation (Davison & Hinkley 1997, sec. 3.8, "case resampling at both stages")."""
    arrays = [np.asarray(g, dtype=np.float64) for g in groups]
    if not arrays or any(a.ndim != 1 or a.size == 0 for a in arrays):
        raise ValueError("hierarchical bootstrap needs at least one seed, each with a non-empty 1-D sequence of "
                         "per-task values")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if n_boot <= 0:
        raise ValueError(f"n_boot must be positive, got {n_boot}")
    rng = np.random.default_rng(seed)
    n = len(arrays)
    seeds = rng.integers(0, n, size=(n_boot, n))
    boots = np.zeros(n_boot)
    for s, a in enumerate(arrays):  # every pick of seed s draws its own resample of s's tasks
        picks = seeds == s
        sums = np.zeros(picks.shape)
        sums[picks] = a[rng.integers(0, a.size, size=(int(picks.sum()), a.size))].mean(axis=1)
        boots += sums.sum(axis=1)
    boots /= n
    lo, hi = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def cost_usd(input_tokens: float, output_tokens: float, *, input_per_m: float, output_per_m: float) -> float:
    """Inference cost in dollars at list prices per million tokens (Composer 2 Standard: $0.50 / $2.50,
    report §1); cached-input discounts are not modelled."""
    return input_tokens / 1e6 * input_per_m + output_tokens / 1e6 * output_per_m


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")
