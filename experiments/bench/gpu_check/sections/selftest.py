"""The two --selftest sections: one raises and one overruns its deadline, each after recording a figure, so
the test sees that the driver keeps what they recorded and runs every section after them."""

from __future__ import annotations

import time

from experiments.bench.gpu_check.sections.context import Context


def run_error(ctx: Context) -> None:
    ctx.set("before_the_error", 1.0)
    raise RuntimeError("deliberate failure (--selftest): the sections after this one must still run")


def run_timeout(ctx: Context) -> None:
    ctx.set("before_the_hang", 1.0)
    time.sleep(3600)  # killed by the driver at the deadline
