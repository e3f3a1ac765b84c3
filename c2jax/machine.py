"""Which machine a performance figure was measured on: CPU model, SIMD level, cores, memory, load.

Speed figures travel badly without this. The `small` preset's training ratio vs Hugging Face was 1.5-1.8x on an
AVX-512 machine and 1.02x on an AVX2-only AMD EPYC (Zen 1), and a loaded 2-core VM shifts both sides' times by
tens of percent. Every benchmark records `describe()` in its JSON (key "machine", with the load at the start
and at the end) and prints `summary_line()` beside its table.

Nothing heavy is imported here, jax neither: its version comes from the installed package's metadata, so a
driver that must not touch the accelerator (experiments/bench/gpu_check) can describe its host too.
`c2jax.bench_report.write_results` is the tail every benchmark ends with: table, this machine, JSON, path.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path
from typing import Any

# Widest first: the first level whose flag is present wins.
_X86_SIMD_LEVELS = (("AVX-512", "avx512f"), ("AVX2", "avx2"), ("AVX", "avx"))
_X86_MACHINES = {"x86_64", "amd64", "i386", "i686", "x86"}


def parse_cpuinfo(text: str, arch: str = "x86_64") -> dict[str, Any]:
    """CPU model, family/model numbers and widest SIMD level from /proc/cpuinfo text (first processor).

    `arch` is platform.machine(); on non-x86 machines the SIMD level is the architecture itself (e.g.
    "aarch64"), since AVX flags do not exist there; "unknown" on x86 without a flags line (no /proc/cpuinfo).
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:  # end of the first processor's block
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    if arch.lower() in _X86_MACHINES:
        simd = next((name for name, flag in _X86_SIMD_LEVELS if flag in flags), "none") if flags else "unknown"
    else:
        simd = arch
    return {"cpu_model": fields.get("model name") or fields.get("Model") or fields.get("Hardware") or None,
            "cpu_vendor": fields.get("vendor_id") or fields.get("CPU implementer") or None,
            "cpu_family": fields.get("cpu family") or None, "cpu_model_number": fields.get("model") or None,
            "simd": simd}


def load_average() -> list[float] | None:
    """1/5/15-minute load average, rounded; None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _memory_total_gib() -> float | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)  # kB
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def describe() -> dict[str, Any]:
    """The machine as a JSON-ready dict. Benchmarks add "load_avg_end" (see `finish`)."""
    arch = platform.machine()
    cpu = parse_cpuinfo(_read("/proc/cpuinfo"), arch)
    if not cpu["cpu_model"]:
        cpu["cpu_model"] = platform.processor() or arch or "unknown CPU"
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    out: dict[str, Any] = {**cpu, "arch": arch, "logical_cores": os.cpu_count(), "affinity_cores": affinity,
                           "memory_gib": _memory_total_gib(), "load_avg_start": load_average(),
                           "platform": platform.platform(), "python": sys.version.split()[0]}
    for name in ("jax", "jaxlib"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def finish(machine: dict[str, Any]) -> dict[str, Any]:
    """Record the load at the end of a measurement in `machine` (in place) and return it."""
    machine["load_avg_end"] = load_average()
    return machine


def _load_str(load: list[float] | None) -> str:
    return "/".join(f"{x:.2f}" for x in load) if load else "n/a"


def summary_line(machine: dict[str, Any] | None = None) -> str:
    """One line, e.g. "AMD EPYC (family 25 model 17, AVX-512), 2 cores, 15.6 GiB, load 0.31/0.25/0.10"."""
    m = machine if machine is not None else describe()
    ids = f"family {m['cpu_family']} model {m['cpu_model_number']}, " if m.get("cpu_family") else ""
    cores = f"{m['logical_cores']} cores"
    if m.get("affinity_cores") not in (None, m.get("logical_cores")):
        cores += f" ({m['affinity_cores']} usable)"
    mem = f", {m['memory_gib']} GiB" if m.get("memory_gib") else ""
    load = f"load {_load_str(m.get('load_avg_start'))}"
    if "load_avg_end" in m:
        load = f"load {_load_str(m.get('load_avg_start'))} at start, {_load_str(m['load_avg_end'])} at end"
    return f"{m['cpu_model']} ({ids}{m['simd']}), {cores}{mem}, {load}"


if __name__ == "__main__":
    print(summary_line())
