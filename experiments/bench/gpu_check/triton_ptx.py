"""The raw Triton kernels (c2jax.kernels.jax_triton_grouped: the bf16 grouped GEMM and the MXFP8 one on
`tl.dot_scaled`) compiled by Triton to PTX for sm_90a and sm_100a on this machine, no GPU needed, and the PTX
checked for the architecture's tensor-core MMA (Hopper: wgmma; Blackwell: tcgen05, block-scaled mxf8f6f4 for
MXFP8), so a kernel that stopped compiling, or fell back to FMA loops, is found without a device.

Part of `gpu_check --lower-only` when the triton package is importable. It is not a project dependency (its wheel
installs about 1 GB), so `make test` reports this stage as skipped; to run it here:
    python -m venv /tmp/triton-venv && /tmp/triton-venv/bin/pip install triton
    PYTHONPATH=.:/tmp/triton-venv/lib/python3.11/site-packages python -m experiments.bench.gpu_check --lower-only
(the project's own venv interpreter; the extra path only adds triton). What it cannot show: that the kernels run
correctly or fast, which jax-triton on a CUDA jaxlib and a lent device do (gpu_check's grouped_gemm section).
"""

from __future__ import annotations

import os
import tempfile
import time

CAPABILITIES = (90, 100)


def run() -> dict:
    """{"skipped": why} without triton; else {"triton": version, "kernels": [one row per kernel and capability]}
    with ok = the PTX targets sm_{cc}a and holds the expected MMA instruction."""
    # a fresh cache: every kernel is compiled here, not read back from an earlier run's ~/.triton/cache
    before = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, set to silence its warning
        try:
            import triton
        except ImportError as e:
            return {"skipped": f"triton is not installed ({e}); see experiments/bench/gpu_check/triton_ptx.py"}
        try:
            return {"triton": triton.__version__, "kernels": _compile_all()}
        finally:
            if before is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = before


def _compile_all() -> list[dict]:
    from c2jax.kernels.jax_triton_grouped import compile_to_ptx

    rows = []
    for cc in CAPABILITIES:
        start = time.perf_counter()
        try:
            compiled = compile_to_ptx(cc)
        except Exception as e:  # a compile error is this stage's finding
            rows.append({"name": f"triton/*/sm_{cc}a", "ok": False, "seconds": time.perf_counter() - start,
                         "error": f"{type(e).__name__}: {e}"[:2000]})
            continue
        seconds = (time.perf_counter() - start) / len(compiled)
        for name, result in compiled.items():
            ok = result["has_mma"] and result["target"] == f".target sm_{cc}a"
            rows.append({"name": f"triton/{name}/sm_{cc}a", "ok": ok, "seconds": seconds, "target": result["target"],
                         "mma": result["mma"], "has_mma": result["has_mma"], "ptx_chars": len(result["ptx"]),
                         "cubin_bytes": result["cubin_bytes"]})
    return rows


def print_rows(report: dict) -> None:
    if "skipped" in report:
        print(f"skip triton -> PTX: {report['skipped']}", flush=True)
        return
    for row in report["kernels"]:
        mark = "ok  " if row["ok"] else "FAIL"
        detail = row.get("error") or (f"{row['target']}, {row['mma']} {'found' if row['has_mma'] else 'MISSING'}, "
                                      f"PTX {row['ptx_chars']:,} chars, cubin {row['cubin_bytes']:,} B")
        print(f"{mark} {row['name']:<48} {row['seconds']:6.1f} s  {detail}", flush=True)
