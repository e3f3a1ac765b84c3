"""Running one command with a wall timeout that kills its whole process group, and capped output.

Output is read as it is produced (never buffered unboundedly): each stream keeps its first half-cap
bytes and a rolling last half-cap bytes; what falls between is replaced by a marker. A command that
prints more than `Limits.output_kill_bytes` on one stream is killed, so a flood costs at most that much
reading rather than running until the timeout.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

from c2jax.rl.sandbox.base import ExecResult, Limits

TIMEOUT_EXIT_CODE = 124
_READ_CHUNK = 1 << 16


class _CappedStream:
    def __init__(self, cap: int):
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap:  # trim lazily so the flood path stays cheap
                del self.tail[: len(self.tail) - self.tail_cap]

    def text(self) -> tuple[str, bool]:
        tail = bytes(self.tail[-self.tail_cap:]) if self.tail_cap else b""
        kept = len(self.head) + len(tail)
        if kept >= self.total:
            return (bytes(self.head) + tail).decode("utf-8", errors="replace"), False
        marker = f"\n[... {self.total - kept} bytes of output omitted ...]\n"
        head = bytes(self.head).decode("utf-8", errors="replace")
        return head + marker + tail.decode("utf-8", errors="replace"), True


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_captured(argv: Sequence[str], *, limits: Limits, timeout_s: float, cwd: str | None = None,
                 env: dict[str, str] | None = None, stdin: str | None = None,
                 preexec_fn: Callable[[], None] | None = None) -> ExecResult:
    """Runs `argv` in a new session; on timeout or output flood, SIGKILLs the whole process group."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        list(argv), cwd=cwd, env=env, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=preexec_fn)
    streams = {proc.stdout.fileno(): _CappedStream(limits.output_bytes),
               proc.stderr.fileno(): _CappedStream(limits.output_bytes)}
    pending = memoryview(stdin.encode("utf-8")) if stdin is not None else None
    deadline = t0 + timeout_s
    timed_out = flooded = False
    sel = selectors.DefaultSelector()
    for fd in streams:
        sel.register(fd, selectors.EVENT_READ)
    if pending is not None:  # fed as the command reads it, so a large stdin never blocks us
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    try:
        while sel.get_map():
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(remaining, 0.5)):
                if key.fd not in streams:
                    try:
                        pending = pending[os.write(key.fd, pending[:_READ_CHUNK]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the command stopped reading; the rest is dropped
                        pending = pending[len(pending):]
                    if not pending:
                        sel.unregister(key.fd)
                        proc.stdin.close()
                    continue
                data = os.read(key.fd, _READ_CHUNK)
                if not data:
                    sel.unregister(key.fd)
                    continue
                stream = streams[key.fd]
                stream.feed(data)
                if stream.total > limits.output_kill_bytes:
                    flooded = True
            if flooded:
                break
            if proc.poll() is not None and sel.get_map():
                # The main process exited; children that kept the pipes open are killed with the group
                # (LocalSandbox only: inside bwrap the pid namespace already took them down).
                _kill_group(proc)
        if not (timed_out or flooded):  # both pipes closed, but the command itself may still run
            try:
                proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        sel.close()
        if timed_out or flooded:
            _kill_group(proc)
        proc.wait()
        _kill_group(proc)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()
    (out, cut_out), (err, cut_err) = (s.text() for s in streams.values())  # stdout, stderr
    code = TIMEOUT_EXIT_CODE if timed_out else proc.returncode
    return ExecResult(exit_code=code, stdout=out, stderr=err, timed_out=timed_out,
                      truncated=cut_out or cut_err or flooded, wall_s=time.perf_counter() - t0)

