"""When to speculate: a per-batch-size choice between MTP speculative rounds and plain decode steps, made from
the emitted tokens per second each mode measured on this engine.

Whether speculation pays depends on the device, the model's shape, the live batch and the draft's acceptance,
which drifts as RL changes the weights; a fixed threshold measured once is wrong somewhere (docs/inference.md:
on a 2-core CPU at `small` a round costs more than its tokens save even at batch 1). So the engine measures
both modes as it runs, separately for each batch-size bucket (live slots rounded up to a power of two):

  warm-up   the first `warmup` timed chunks of a bucket speculate, the next `warmup` run plain
  exploit   then each chunk runs the mode with the higher rate: the median tokens / second of its last
            `window` timed chunks (a median, so one stalled chunk, a GC pause or a neighbour's burst on a shared
            machine, does not flip the choice)
  re-probe  `reprobe_every` chunks into the exploit phase the other mode runs once, so a mode that became
            faster (the context grew, the batch's prompts changed) is noticed; while probes keep confirming the
            choice the interval doubles, up to `max_reprobe_every` chunks (steady-state cost: one chunk in that
            many in the slower mode), and it starts over when the choice flips
  new weights  `weights_changed()` forgets the speculative rate (the acceptance depends on the weights; a plain
            step's speed does not), so the next chunks of every bucket re-measure speculation

A chunk whose call compiled a new shape is not timed (compilation is not the mode's speed). Above
`max_batch` live slots a chunk never speculates. Token streams do not depend on the choice: a plain chunk in a
speculative engine keeps the MTP cache current, and both modes sample the main model's distribution.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Bucket:
    spec_rates: deque = field(default_factory=deque)  # tokens/s of the last `window` timed speculative chunks
    plain_rates: deque = field(default_factory=deque)
    spec_timed: int = 0  # chunks timed in each mode
    plain_timed: int = 0
    chunks: int = 0  # chunks chosen for this bucket (timed or not)
    favourite: bool | None = None  # the mode the last exploiting chunk chose (True: speculative)
    interval: int = 0  # chunks between re-probes (doubles while probes confirm the favourite)
    next_probe: int = 0  # chunk number of the next re-probe


class SpeculationPolicy:
    def __init__(self, k: int, max_batch: int, *, adaptive: bool = True, warmup: int = 2, reprobe_every: int = 16,
                 max_reprobe_every: int = 256, window: int = 5):
        if k <= 0:
            raise ValueError(f"SpeculationPolicy needs k >= 1 drafts, got {k}")
        if warmup < 1 or reprobe_every < 2:
            raise ValueError(f"warmup must be >= 1 and reprobe_every >= 2, got {warmup}, {reprobe_every}")
        if max_reprobe_every < reprobe_every:
            raise ValueError(f"max_reprobe_every ({max_reprobe_every}) must be >= reprobe_every ({reprobe_every})")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.k, self.max_batch, self.adaptive = k, max_batch, adaptive
        self.warmup, self.reprobe_every, self.window = warmup, reprobe_every, window
        self.max_reprobe_every = max_reprobe_every
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(n_live: int) -> int:
        """Live slots rounded up to a power of two: rates are compared within a bucket."""
        return 1 << max(0, n_live - 1).bit_length()

    def choose(self, n_live: int) -> int:
        """Drafts per round for the next chunk: `k`, or 0 for plain decode steps."""
        if n_live > self.max_batch:
            return 0
        if not self.adaptive:
            return self.k
        b = self._buckets.setdefault(self.bucket(n_live), _Bucket())
        b.chunks += 1
        if b.spec_timed < self.warmup:
            return self.k
        if b.plain_timed < self.warmup:
            return 0
        favourite = self._rate(b.spec_rates) >= self._rate(b.plain_rates)
        if favourite != b.favourite:  # first exploiting chunk, or the choice flipped: probe again soon
            b.favourite, b.interval = favourite, self.reprobe_every
            b.next_probe = b.chunks + b.interval
        elif b.chunks >= b.next_probe:  # re-probe the other mode once; back off while it keeps losing
            b.interval = min(2 * b.interval, self.max_reprobe_every)
            b.next_probe = b.chunks + b.interval
            favourite = not favourite
        return self.k if favourite else 0

    def weights_changed(self) -> None:
        """New weights: forget every bucket's speculative rate (the drafts' acceptance changed), so speculation is
        re-measured (`warmup` timed chunks) before the next choice; the plain rate is kept."""
        for b in self._buckets.values():
            b.spec_rates.clear()
            b.spec_timed, b.favourite = 0, None

    def observe(self, n_live: int, k: int, tokens: int, seconds: float, *, compiled: bool = False) -> None:
        """Record a chunk run with `k` drafts (0: plain) at `n_live` live slots: `tokens` emitted in `seconds`
        (dispatch to outputs on the host). Compiling chunks and chunks above max_batch are not timed."""
        if not self.adaptive or compiled or n_live > self.max_batch or seconds <= 0:
            return
        b = self._buckets.setdefault(self.bucket(n_live), _Bucket())
        rates = b.spec_rates if k else b.plain_rates
        rates.append(tokens / seconds)
        if len(rates) > self.window:
            rates.popleft()
        if k:
            b.spec_timed += 1
        else:
            b.plain_timed += 1

    @staticmethod
    def _rate(rates) -> float | None:
        return statistics.median(rates) if rates else None

    def report(self) -> dict[int, dict]:
        """Per batch-size bucket: each mode's rate (median of its recent chunks), chunks timed, the current choice."""
        out = {}
        for size, b in sorted(self._buckets.items()):
            spec, plain = self._rate(b.spec_rates), self._rate(b.plain_rates)
            warm = b.spec_timed >= self.warmup and b.plain_timed >= self.warmup
            choice = "warm-up" if not warm else ("speculative" if spec >= plain else "plain")
            out[size] = {"speculative_tokens_per_s": spec, "plain_tokens_per_s": plain,
                         "speculative_chunks_timed": b.spec_timed, "plain_chunks_timed": b.plain_timed,
                         "choice": choice}
        return out
