"""Per-sandbox memory and process-count caps: cgroup v1 or v2 (detected), else rlimits.

Cgroups are created *below the calling process's own cgroup*, so sandboxes stay inside whatever
accounting the host already applies to us. Each sandbox gets one group per controller; a command
joins it before bwrap starts (`launcher_prefix`), so even bwrap's own setup is accounted.

Fallback (no writable cgroup): RLIMIT_AS for memory. There is no process-count fallback: measured
running as host root, RLIMIT_NPROC is not enforced inside bwrap's user namespace (40 forks passed a
limit of 20), so without a pids cgroup a fork bomb is bounded only by the wall timeout.
RLIMIT_FSIZE, RLIMIT_NOFILE and RLIMIT_CORE=0 are always applied.

A CPU quota (`Limits.cpus`, a task's Harbor `cpus`) needs the cpu controller too (cgroup v1
`cpu.cfs_quota_us`, v2 `cpu.max`); where it is not writable there is no CPU cap, as before.
"""

from __future__ import annotations

import shlex
import uuid
from dataclasses import dataclass
from pathlib import Path

from c2jax.rl.sandbox.base import Limits

_V1_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CgroupLayout:
    version: int  # 1 or 2
    memory_parent: Path
    pids_parent: Path
    cpu_parent: Path | None = None  # None: no writable cpu controller, so `Limits.cpus` is not enforced


def _own_paths() -> dict[str, str]:
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            paths[c] = path.lstrip("/")
    return paths


def _writable_dir(p: Path) -> bool:
    probe = p / f"c2jax-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


def detect_cgroups() -> CgroupLayout | None:
    """The cgroup layout sandboxes can use here, or None (then rlimits are the only caps)."""
    try:
        own = _own_paths()
    except OSError:
        return None
    if "memory" in own and "pids" in own:  # v1 (possibly hybrid with a v2 'unified' mount)
        mem, pids = _V1_ROOT / "memory" / own["memory"], _V1_ROOT / "pids" / own["pids"]
        if (mem / "memory.limit_in_bytes").exists() and _writable_dir(mem) and _writable_dir(pids):
            cpu = _V1_ROOT / "cpu" / own["cpu"] if "cpu" in own else None
            usable = cpu is not None and (cpu / "cpu.cfs_quota_us").exists() and _writable_dir(cpu)
            return CgroupLayout(1, mem, pids, cpu if usable else None)
        return None
    if "" in own and (_V1_ROOT / "cgroup.controllers").exists():  # pure v2
        parent = _V1_ROOT / own[""]
        try:
            enabled = (parent / "cgroup.subtree_control").read_text().split()
        except OSError:
            return None
        if {"memory", "pids"} <= set(enabled) and _writable_dir(parent):
            return CgroupLayout(2, parent, parent, parent if "cpu" in enabled else None)
    return None


_CPU_PERIOD_US = 100_000


def _cpu_quota_us(cpus: float) -> int:
    if not cpus > 0:
        raise ValueError(f"Limits.cpus must be positive, got {cpus}")
    return max(1000, int(cpus * _CPU_PERIOD_US))  # the kernel's minimum quota is 1 ms


class SandboxCgroup:
    """The cgroup(s) of one sandbox. `procs_files` are what a child writes its pid into."""

    def __init__(self, layout: CgroupLayout, name: str, limits: Limits):
        self.dirs: list[Path] = []
        if layout.version == 1:
            mem, pids = layout.memory_parent / name, layout.pids_parent / name
            mem.mkdir()
            self.dirs.append(mem)
            pids.mkdir()
            self.dirs.append(pids)
            (mem / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
            swap = mem / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limits.memory_bytes))
            (pids / "pids.max").write_text(str(limits.max_processes))
            if limits.cpus is not None and layout.cpu_parent is not None:
                cpu = layout.cpu_parent / name
                cpu.mkdir()
                self.dirs.append(cpu)
                (cpu / "cpu.cfs_period_us").write_text(str(_CPU_PERIOD_US))
                (cpu / "cpu.cfs_quota_us").write_text(str(_cpu_quota_us(limits.cpus)))
        else:
            group = layout.memory_parent / name
            group.mkdir()
            self.dirs.append(group)
            (group / "memory.max").write_text(str(limits.memory_bytes))
            if (group / "memory.swap.max").exists():
                (group / "memory.swap.max").write_text("0")
            (group / "pids.max").write_text(str(limits.max_processes))
            if limits.cpus is not None and layout.cpu_parent is not None:
                (group / "cpu.max").write_text(f"{_cpu_quota_us(limits.cpus)} {_CPU_PERIOD_US}")
        self.cpu_limited = limits.cpus is not None and layout.cpu_parent is not None
        self.procs_files = [str(d / "cgroup.procs") for d in self.dirs]

    def remove(self) -> None:
        for d in self.dirs:
            try:
                d.rmdir()
            except OSError:
                pass  # a process that is still exiting; the kernel frees it when empty
        self.dirs = []


def launcher_prefix(limits: Limits, cgroup: SandboxCgroup | None) -> list[str]:
    """argv to put before bwrap: a POSIX sh that joins `cgroup`, sets the rlimits and execs bwrap.

    A prefix rather than a subprocess preexec_fn: a preexec function forces a full fork of the (large)
    Python parent instead of vfork, which measured 15-25 ms more per command here. Shell builtins only
    (`echo`, `ulimit`), so the prefix costs one sh exec. `ulimit -f` counts 512-byte blocks in POSIX
    sh (dash; bash when run as sh); `-v` counts KiB.
    """
    steps = [f"echo $$ > {shlex.quote(p)}" for p in (cgroup.procs_files if cgroup else [])]
    steps += [f"ulimit -f {max(1, limits.file_size_bytes // 512)}", f"ulimit -n {limits.max_open_files}",
              "ulimit -c 0"]
    if cgroup is None:
        steps.append(f"ulimit -v {max(1, limits.memory_bytes // 1024)}")
    return ["/bin/sh", "-c", " && ".join(steps) + ' && exec "$@"', "c2jax-launch"]
