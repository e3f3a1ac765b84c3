"""Progress output: a tqdm bar on a terminal; periodic plain lines (no carriage returns) anywhere else."""

import io
import os
import pty

from c2jax.progress import LineProgress, progress


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_plain_lines_at_most_every_period_and_at_the_end():
    out, clock = io.StringIO(), FakeClock()
    bar = LineProgress(100, desc="train", unit="step", every_s=30, file=out, clock=clock)
    for _ in range(100):
        clock.t += 1.0  # one step a second: a line at 30 s, 60 s, 90 s, then the closing one
        bar.update()
        bar.set_postfix(loss="1.234")
    bar.close()
    bar.close()  # idempotent
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 4
    assert lines[0] == "train: 30/100 step (30%), 1.00 step/s, elapsed 30s, eta 1m10s, loss=1.234"
    assert lines[-1].startswith("train: 100/100 step (100%), 1.00 step/s, elapsed 1m40s")


def test_slow_steps_read_as_seconds_per_step_and_resume_counts_from_initial():
    out, clock = io.StringIO(), FakeClock()
    with LineProgress(10, desc="eval", unit="ep", initial=4, every_s=30, file=out, clock=clock) as bar:
        clock.t = 40.0
        bar.update()
        clock.t = 50.0
        bar.update()  # 10 s after the last line: printed by close only
    assert out.getvalue().splitlines() == [
        "eval: 5/10 ep (50%), 40.0 s/ep, elapsed 40s, eta 3m20s",
        "eval: 6/10 ep (60%), 25.0 s/ep, elapsed 50s, eta 1m40s",
    ]
    out = io.StringIO()
    LineProgress(3, file=out).close()  # nothing happened: nothing printed
    assert out.getvalue() == ""


def test_progress_picks_by_where_the_output_goes():
    assert isinstance(progress(5, file=io.StringIO()), LineProgress)
    leader, follower = pty.openpty()
    with open(follower, "w") as tty:
        bar = progress(5, desc="x", file=tty)
        assert not isinstance(bar, LineProgress)  # a real tqdm bar on a terminal
        bar.update()
        bar.close()
    os.close(leader)
