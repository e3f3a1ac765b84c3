"""Section `train_medium`: the `medium` preset's training step (fwd + bwd + AdamW + router-bias update) in bf16:
tokens/s and MFU at S = 4k and 32k on the sort + capacity-einsum path (moe_impl="sorted"), retried once with full
remat where no remat runs out of memory; and the same step at S = 4k for each MoE kernel choice on this device.

Every row names its moe_impl (SORTED, `Choice.moe`); none relies on ModelConfig's default, which picks the path
for the device ("auto"). `step_rate` refuses a row that does not name one.

Kernel rows: `kernels/<label>` (one sub-measurement each) and a one-line summary per row under `by_kernel`:

    sorted               the `S4096` row itself (moe_impl="sorted": sort + capacity-bucketed batched einsum)
    grouped <kernel>     moe_impl="grouped" with each grouped GEMM the kernel registry accepts on this device
                         (kernels/dispatch.py: every implementation native to this platform and device kind, auto
                         or not: mosaic_sm90 on Hopper, pallas_triton, xla, ragged_dot, jax_triton where it is
                         installed), the registry's own default first
    sorted mxfp8         moe_impl="sorted", moe_quant="mxfp8" (kernels/qlinear.py on capacity buffers)
    grouped mxfp8        moe_impl="grouped", moe_quant="mxfp8": the MXFP8 recipe on expert-sorted rows
                         (kernels/grouped_qlinear.py: fused permute + quantize, the registry's block-scaled grouped
                         GEMM grouped_matmul_mx: pallas_triton on a GPU, the xla reference on the CPU)
    ragged               moe_impl="ragged" (lax.ragged_dot)

Each row records `moe_kernel_ran`: models.moe_dispatch.resolve_moe_kernel of the config the step was built from,
which the step then runs for every expert GEMM (no registry for sorted / ragged). An implementation that is not
native here is skipped with the device it needs: on the CPU (dry run) pallas_triton, mosaic_sm90 and jax_triton
(the registry would only interpret the first two, which tests/test_grouped_path.py does; jax_triton has no
interpreter); one the registry refuses at these shapes is skipped with the refusal.

Targets: MFU at each S, and the report's "1.5x end to end" twice: sorted mxfp8 / sorted tokens/s (only the
recipe differs) and grouped mxfp8 / sorted tokens/s (the block-scaled kernels against the bf16 default path).

Budget (GPU deadline 180 s, runner.py; the seconds are estimates, not measured on a GPU yet): a row's cost is the
step's compile (the scanned 12-layer step, with the sorted path's capacity-bucket switch in forward and backward),
estimated at ~20 s on the H200 (need_s), plus the state's init and 1 + 3 steps, each well under a second at 16k
tokens. So every kernel runs at S = 4096 x B 4 only (its compile does not depend on S; at S 32768 the rows would
only add out-of-memory retries), and only the sorted path runs at S 32768. Rows in order of value: S4096 sorted
(~25 s), the registry's default grouped kernel (~20), sorted mxfp8 (~20), grouped mxfp8 (~20), S32768 sorted (~25,
~50 with its remat retry), ragged (~20), the other grouped kernels (~20 each: on an H200 pallas_triton, xla,
ragged_dot, jax_triton when carried): ~200-235 s in all, so the last two or three rows (the other grouped
kernels, the XLA fallback and the ragged_dot oracle last) are the ones a slow compile pushes past the deadline;
they are then recorded as skipped with the seconds left, never dropped. The dry run (CPU, `tiny` with one MoE
layer, S 64 x B 2) takes the same path for the kernels the CPU runs natively: sorted, grouped xla and ragged_dot,
sorted mxfp8, grouped mxfp8 (the xla MX reference), ragged.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np
import optax

from c2jax.kernels import dispatch
from c2jax.kernels.grouped_gemm import OP
from c2jax.models.config import ConfigError, ModelConfig, preset
from c2jax.models.flops import training_flops_per_token
from c2jax.models.moe_dispatch import resolve_moe_kernel
from c2jax.models.transformer import init
from c2jax.train.step import init_train_state, make_train_step
from experiments.bench.gpu_check.sections.context import DRY_MODEL, Context, Skip, peak_flops, timed_steps

KERNEL_SEQ, KERNEL_BATCH = 4096, 4  # every kernel row's shape on the GPU (module docstring)
ROW_NEED_S = 20  # a kernel row's estimated seconds on the H200 (module docstring)
SORTED = {"moe_impl": "sorted"}  # the S rows' path (named: the config's default moe_impl is the device's choice)
MXFP8_LABELS = ("sorted mxfp8", "grouped mxfp8")  # the MXFP8 rows, run right after the default grouped kernel


@dataclass(frozen=True)
class Choice:
    """One MoE kernel choice: its row label, the ModelConfig fields it sets, why it cannot run here (or None)."""

    label: str
    moe: dict = field(default_factory=dict)
    unavailable: str | None = None


def run(ctx: Context) -> None:
    peak, note = peak_flops(ctx)
    name = ctx.size("medium", "tiny")
    runs = ctx.size(((4096, 4), (32768, 1)), ((64, 2),))  # dry run: one length (the loop is the same)
    kseq, kbatch = ctx.size((KERNEL_SEQ, KERNEL_BATCH), runs[0])
    ctx.set("setup", {"preset": name, "dtype": "bfloat16 compute, float32 params", "peak": note,
                      "step": "c2jax.train.step.make_train_step: fwd + bwd + AdamW + router-bias update, no MTP",
                      "kernel_rows": f"S {kseq} x B {kbatch}, one per MoE kernel choice (module docstring)"})
    choices = kernel_choices(ctx, medium_config(ctx, name, kseq))
    n_first = 1 + len(MXFP8_LABELS)  # the registry's default grouped kernel and the MXFP8 rows come first
    first, rest = choices[:n_first], choices[n_first:]
    summary: dict[str, str] = {}
    rates: dict[str, float] = {}

    for i, (seq, batch) in enumerate(runs):
        r = ctx.sub(f"S{seq}", with_remat_retry, ctx, name, seq, batch, peak, SORTED, "", need_s=ctx.size(25, 2))
        if isinstance(r, dict):
            ctx.headline(f"S={seq}: {r['tokens_per_s']:,.0f} tok/s, MFU {r['mfu_pct']:.1f}%")
            ctx.target(f"{name} training MFU at S={seq}", r["mfu_pct"], 35.0, "%")
        else:
            ctx.target(f"{name} training MFU at S={seq}", None, 35.0, "%")
        if i == 0:  # the default path's row of the kernel table, then the first kernel rows before S = 32k
            summarise(ctx, summary, rates, "sorted", r, f"S{seq}")
            for choice in first:
                kernel_row(ctx, name, kseq, kbatch, peak, choice, summary, rates)
    for choice in rest:
        kernel_row(ctx, name, kseq, kbatch, peak, choice, summary, rates)

    if rates:
        best = max(rates, key=rates.get)
        ctx.headline(f"best MoE kernel at S={kseq}: {best}, {rates[best]:,.0f} tok/s")
    base, fp8, grouped_fp8 = rates.get("sorted"), rates.get("sorted mxfp8"), rates.get("grouped mxfp8")
    ctx.target(f"{name} training step, MXFP8 MoE / bf16 tokens/s (report: 1.5x end to end on B200, MXFP8 MoE "
               "kernels vs their BF16 setup)", fp8 / base if base and fp8 else None, 1.5, "x")
    ctx.target(f"{name} training step, grouped mxfp8 / sorted bf16 tokens/s (the block-scaled grouped kernels vs "
               "the bf16 sort + capacity-einsum path; report: 1.5x end to end on B200)",
               grouped_fp8 / base if base and grouped_fp8 else None, 1.5, "x")


def medium_config(ctx: Context, name: str, seq: int, remat: str = "none", **moe) -> ModelConfig:
    base = preset(name)
    return base.replace(dtype="bfloat16", num_nextn_predict_layers=0, remat_policy=remat, **ctx.size({}, DRY_MODEL),
                        max_position_embeddings=max(seq, base.max_position_embeddings), **moe)


def kernel_choices(ctx: Context, cfg: ModelConfig) -> list[Choice]:
    """The kernel rows in the order they run (module docstring): the registry's default grouped kernel, sorted
    mxfp8, grouped mxfp8, ragged, then every other grouped GEMM implementation, available here or with the reason
    it is not. Every choice names its moe_impl."""
    platform, kind = dispatch.current_device()
    try:
        default = resolve_moe_kernel(cfg.replace(moe_impl="grouped", moe_kernel=None)).moe_kernel
    except ConfigError as e:
        default = None
        ctx.set("registry_default", f"none: {e}")
    else:
        ctx.set("registry_default", default)
    grouped = []
    for impl in dispatch.implementations(OP):
        grouped.append(Choice(f"grouped {impl.name}", {"moe_impl": "grouped", "moe_kernel": impl.name},
                              unavailable(impl, platform, kind)))
    grouped.sort(key=lambda c: c.moe["moe_kernel"] != default)  # stable: the default first, then registry order
    mxfp8 = [Choice("sorted mxfp8", {**SORTED, "moe_quant": "mxfp8"}),
             Choice("grouped mxfp8", {"moe_impl": "grouped", "moe_quant": "mxfp8", "moe_kernel": None})]
    assert tuple(c.label for c in mxfp8) == MXFP8_LABELS
    return [grouped[0], *mxfp8, Choice("ragged", {"moe_impl": "ragged"}), *grouped[1:]]


def unavailable(impl: dispatch.Implementation, platform: str, kind: str) -> str | None:
    """Why the registry cannot run `impl` natively on (platform, kind), naming the device it needs; None if it can."""
    if not impl.native(platform, kind):
        kinds = "/".join(impl.device_kinds)
        needs = "GPU" if platform not in impl.platforms else f"a {kinds} device"
        if needs == "GPU" and kinds:
            needs += f" ({kinds})"
        how = ("the registry would only interpret it here, as tests/test_grouped_path.py does"
               if impl.interpretable else "it has no interpreter")
        here = platform + (f" {kind!r}" if kind and kind != platform else "")
        return f"needs {needs}: this is {here}; {how}"
    if impl.name == "jax_triton":
        try:
            import jax_triton  # noqa: F401
        except ImportError as e:
            return f"jax-triton is not installed here ({e}); docs/gpu_check.md says how to carry it"
    return None


def kernel_row(ctx: Context, name: str, seq: int, batch: int, peak: float, choice: Choice, summary: dict,
               rates: dict) -> None:
    key = f"kernels/{choice.label}"
    if choice.unavailable:
        ctx.set(key, f"skipped: {choice.unavailable}")
        summary[choice.label] = f"skipped: {choice.unavailable}"
        ctx.set("by_kernel", summary)
        return
    r = ctx.sub(key, with_remat_retry, ctx, name, seq, batch, peak, choice.moe, choice.label,
                need_s=ctx.size(ROW_NEED_S, 2))
    summarise(ctx, summary, rates, choice.label, r, key)


def summarise(ctx: Context, summary: dict, rates: dict, label: str, r, key: str) -> None:
    """One line of the `by_kernel` table: tokens/s, MFU and the kernel that ran, or where the row's reason is."""
    if isinstance(r, dict):
        rates[label] = r["tokens_per_s"]
        summary[label] = (f"{r['tokens_per_s']:,.0f} tok/s, MFU {r['mfu_pct']:.1f}%, step {1e3 * r['step_s']:.1f} ms, "
                          f"kernel ran: {r['moe_kernel_ran']}")
    else:
        summary[label] = f"not measured: see {key.replace('/', '.')}"
    ctx.set("by_kernel", summary)


def with_remat_retry(ctx: Context, name: str, seq: int, batch: int, peak: float, moe: dict, label: str) -> dict:
    """The step's rate at remat none; where that runs out of memory, once more at remat full. `moe`: the kernel
    choice's ModelConfig fields, naming moe_impl; `label` its row (empty: an S row on the sorted path)."""
    try:
        return step_rate(ctx, name, seq, batch, peak, moe, label)
    except Exception as e:  # noqa: BLE001 - out of memory at remat none: retry with remat full once
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        where = f"kernels/{label}_remat_none" if label else f"S{seq}_remat_none"
        ctx.set(where, f"out of memory: {str(e)[:200]}")
        return step_rate(ctx, name, seq, batch, peak, moe, label, remat="full")


def step_rate(ctx: Context, name: str, seq: int, batch: int, peak: float, moe: dict, label: str,
              remat: str = "none") -> dict:
    if "moe_impl" not in moe:  # the config's default path depends on the device: every row names its own
        raise ValueError(f"row {label or f'S{seq}'!r} does not name its moe_impl: {moe}")
    cfg = medium_config(ctx, name, seq, remat, **moe)
    try:  # the kernel the step runs (moe_impl="grouped"); the config unchanged otherwise
        cfg = resolve_moe_kernel(cfg)
    except ConfigError as e:
        raise Skip(f"the kernel registry refuses it at these shapes: {e}") from None
    tx = optax.adamw(1e-4)
    graphdef, state = init_train_state(init(cfg, seed=0), tx)
    step = make_train_step(graphdef, tx, router_bias_rate=1e-3, donate=True)
    ids = np.random.default_rng(seq).integers(0, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
    data = {"input_ids": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]),
            "segment_ids": jnp.ones((batch, seq), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)),
            "loss_mask": jnp.ones((batch, seq), jnp.float32)}
    t0 = time.perf_counter()
    compiled = step.lower(state, data).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
    state, metrics, _, times = timed_steps(compiled, state, data, ctx.size(3, 1))
    step_s = statistics.median(times)
    tokens = batch * seq
    fpt = training_flops_per_token(cfg, seq, include_mtp=False)
    loss = float(metrics["loss"])
    ctx.check(f"train {name} S={seq}{' ' + label if label else ''} loss finite", math.isfinite(loss),
              f"loss {loss:.4g}")
    return {"batch": batch, "remat": remat, "moe_impl": cfg.moe_impl, "moe_quant": cfg.moe_quant,
            "moe_kernel_ran": cfg.moe_kernel or f"none (moe_impl={cfg.moe_impl!r} does not use the registry)",
            "compile_s": compile_s, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "mfu_pct": 100 * fpt * tokens / step_s / peak, "train_flops_per_token": fpt,
            "xla_temp_GiB": None if temp is None else temp / 2**30, "loss": loss}
