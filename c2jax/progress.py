"""Progress reporting that suits where it goes: a tqdm bar on a terminal, plain periodic lines elsewhere.

A tqdm bar redraws itself with carriage returns; written to a file or a pipe (`make demo > log`, CI, a
cluster's job log) every redraw stays, thousands of them. When the stream is not a terminal, `progress`
returns a `LineProgress` instead, which prints one ordinary line at most every `every_s` seconds (and at
the end): the count, rate, ETA and the latest postfix. Both have the same small interface (update,
set_postfix, set_postfix_str, close, context manager), so callers never branch.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any


def _is_terminal(stream: IO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real stream
        return False


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class LineProgress:
    """Plain-line progress for non-terminal output: no carriage returns, one line per `every_s` seconds."""

    def __init__(self, total: int | None = None, *, desc: str = "", initial: int = 0, unit: str = "it",
                 every_s: float = 30.0, file: IO | None = None, clock=time.monotonic):
        self.total, self.desc, self.n, self.unit = total, desc, initial, unit
        self.every_s, self.file, self._clock = every_s, file if file is not None else sys.stderr, clock
        self._start_n, self._t0 = initial, clock()
        self._last_print, self._printed_n = self._t0, initial
        self._postfix = ""
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self._clock()
        if now - self._last_print >= self.every_s:
            self._print(now)

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self._postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self._postfix = str(s)

    def line(self, now: float | None = None) -> str:
        now = self._clock() if now is None else now
        elapsed = max(now - self._t0, 1e-9)
        done = self.n - self._start_n
        rate = done / elapsed
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        parts = [f"{self.desc}: {count} {self.unit}" if self.desc else f"{count} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"{rate:.2f} {self.unit}/s" if rate >= 0.1 else f"{elapsed / max(done, 1):.1f} s/{self.unit}")
        parts.append(f"elapsed {_duration(elapsed)}")
        if self.total and done > 0 and self.n < self.total:
            parts.append(f"eta {_duration((self.total - self.n) / rate)}")
        if self._postfix:
            parts.append(self._postfix)
        return ", ".join(parts)

    def _print(self, now: float) -> None:
        print(self.line(now), file=self.file, flush=True)
        self._last_print, self._printed_n = now, self.n

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.n != self._printed_n:  # the last state, unless the last line already showed it
                self._print(self._clock())

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int | None = None, *, desc: str = "", initial: int = 0, unit: str = "it",
             file: IO | None = None, every_s: float = 30.0):
    """A tqdm bar when `file` (default stderr, where tqdm writes) is a terminal, else a LineProgress."""
    file = file if file is not None else sys.stderr
    if _is_terminal(file):
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=file, dynamic_ncols=True)
    return LineProgress(total, desc=desc, initial=initial, unit=unit, every_s=every_s, file=file)
