"""A live terminal dashboard (rich) of the reconciler: rewards, staleness, queue depths, throughput."""

from __future__ import annotations

import time


class Dashboard:
    def __init__(self, console=None, refresh_s: float = 0.5):
        from rich.console import Console
        from rich.live import Live

        self.console = console or Console()
        self.live = Live(console=self.console, refresh_per_second=4, transient=False)
        self.refresh_s, self._last = refresh_s, 0.0

    def __enter__(self) -> Dashboard:
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def update(self, rec) -> None:
        if time.monotonic() - self._last < self.refresh_s:
            return
        self._last = time.monotonic()
        self.live.update(self.render(rec))

    @staticmethod
    def render(rec):
        from rich.table import Table

        last = rec.history[-1] if rec.history else {}
        c = rec.counts
        t = Table(title=f"c2jax rl  {rec.cfg.name}  ({rec.cfg.system.mode})", show_header=False)
        t.add_column("metric", style="cyan")
        t.add_column("value", justify="right")
        rewards = list(rec.trained_rewards)
        ident = 100 * last.get("sync/identical_fraction", float("nan"))
        rows = [
            ("learner version", f"{rec.version} / {rec.cfg.system.steps}"),
            ("reward (last / mean of 8)", f"{rewards[-1]:.3f} / {sum(rewards[-8:]) / len(rewards[-8:]):.3f}"
             if rewards else "-"),
            ("staleness max / mean (batch)", f"{last.get('staleness/batch_max', 0):.0f} / "
                                             f"{last.get('staleness/batch_mean', 0):.2f}"
                                             f"  (bound {rec.cfg.system.max_staleness})"),
            ("queues: ready / in flight / retry", f"{len(rec.ready)} / {len(rec.inflight)} / {len(rec.retry)}"),
            ("groups: returned / dropped stale / errored / lost",
             f"{c['groups_returned']} / {c['groups_dropped_stale']} / {c['groups_errored']} / {c['groups_lost']}"),
            ("tokens/s, samples/s, steps/s", f"{last.get('throughput/tokens_per_s', 0):.1f}, "
                                             f"{last.get('throughput/samples_per_s', 0):.2f}, "
                                             f"{last.get('throughput/steps_per_s', 0):.3f}"),
            ("learner busy", f"{100 * last.get('learner/busy_fraction', 0):.0f}%"),
            ("weight sync: KiB / identical / latency", f"{last.get('sync/bytes', 0) / 1024:.1f} / {ident:.1f}% / "
                                                       f"{last.get('sync/latency_s', float('nan')):.2f}s"),
        ]
        if rec.eval_history:
            e = rec.eval_history[-1]
            rows.append((f"eval @ v{e['step']}", ", ".join(f"{k} {v:.3f}" for k, v in e.items()
                                                            if k not in ("step", "prompts", "per_prompt"))))
        for r in rows:
            t.add_row(*r)
        return t
