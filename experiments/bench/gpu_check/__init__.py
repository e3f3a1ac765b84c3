"""The prepared GPU check (issue 24): every device-only path compiled, checked against a reference and timed
in one call on a lent H200, in under 8 minutes; `--dry-run` runs the same code at tiny shapes on the CPU (the
test suite does, tests/test_gpu_check.py), so the script is known to work before a device is ever lent.

    python -m experiments.bench.gpu_check [--dry-run] [--sections model,attention] [--budget-s 450] [--out DIR]

Writes gpu_check.json, gpu_check.md and gpu_check.log to --out (default: $OUT when set, else
runs/bench/gpu_check). docs/gpu_check.md says how to run it on a lent device and what each section measures.

`runner` is the driver (no JAX import: it never touches the GPU itself; each section runs in its own
subprocess with a deadline); `sections/` holds the measurements, one module per section over a shared
`Context` (sections/context.py).
"""
