"""Section `moe_mxfp8`: the MoE layer against the report's MXFP8 claim.

The claim (Cursor's kernels blog, Composer 1 era; the project's reference notes, composer2.md sec. 6.3 and
kernels.md sec. 3.4): with MXFP8 MoE kernels, "3.5x faster MoE layer forward and backward, 1.5x end to end on B200
against their BF16 setup" (MegaBlocks in BF16; their table: fwd 25.96 -> 9.45 ms, bwd 59.17 -> 17.04 ms). So the
ratio is time(BF16 MoE layer fwd + bwd) / time(MXFP8 MoE layer fwd + bwd), same model, same device.

Measured here: one MoE layer (models/moe.py: router, dispatch, SwiGLU routed experts, shared expert), forward +
backward (grouped_gemm.moe_fwd_bwd_seconds: gradients of every parameter and of the input), at the `medium`
preset's shapes (d 1024, expert FFN 512, 32 experts, top-4, one shared expert, its 4096-token dispatch chunks) over
the training step's 16,384 tokens (S 4096 x B 4), bf16 compute with fp32 master weights. Every row names its
moe_impl (none relies on ModelConfig's default, which picks the path for the device):

    bf16            moe_impl="sorted", moe_quant="bf16": our BF16 setup (sort + capacity-bucketed einsum)
    mxfp8           moe_impl="sorted", moe_quant="mxfp8" (kernels/qlinear.py on capacity buffers: MXFP8 E4M3 in
                    fprop, dgrad and wgrad)
    grouped bf16    moe_impl="grouped" with the bf16 grouped GEMM the registry picks here (resolve_moe_kernel,
                    recorded), the fastest bf16 candidate, so the speed-up is also given over the best bf16 layer
    grouped mxfp8   moe_impl="grouped", moe_quant="mxfp8": the same dispatch as grouped bf16 on the block-scaled
                    kernels (kernels/grouped_qlinear.py: fused permute + MXFP8 quantize, the registry's
                    grouped_matmul_mx, recorded: pallas_triton on a GPU, the xla reference on the CPU)

The target is the claim's ratio on the same dispatch path, >= 3.5x, twice: bf16 / mxfp8 (sorted) and grouped bf16 /
grouped mxfp8 (the block-scaled grouped kernels, the closest to the report's MXFP8 kernels); in `speedup`,
`speedup_over_best_bf16` divides the fastest bf16 layer by the fastest MXFP8 one. TFLOP/s count useful FLOPs
against the bf16 peak.

Budget (GPU deadline 60 s, runner.py; estimates, not measured on a GPU yet): process start and JAX init ~10 s,
then four single-layer compiles of a few seconds each and 10 timed calls of a few ms: ~10 s a row (need_s), so
~50 s. Dry run: the same four rows at `tiny`-like shapes (d 64, expert FFN 32, 8 experts, top-2, 64 tokens); the
grouped rows run the CPU's kernels (xla, and the xla MX reference).
"""

from __future__ import annotations

from c2jax.models.config import ConfigError, preset
from c2jax.models.moe_dispatch import resolve_moe_kernel
from experiments.bench.gpu_check.sections.context import Context, Skip, peak_flops
from experiments.bench.gpu_check.sections.grouped_gemm import moe_fwd_bwd_flops, moe_fwd_bwd_seconds

CLAIM = 3.5
ROWS = {"bf16": {"moe_impl": "sorted", "moe_quant": "bf16"},
        "mxfp8": {"moe_impl": "sorted", "moe_quant": "mxfp8"},
        "grouped bf16": {"moe_impl": "grouped", "moe_quant": "bf16", "moe_kernel": None},
        "grouped mxfp8": {"moe_impl": "grouped", "moe_quant": "mxfp8", "moe_kernel": None}}
MXFP8_ROWS = ("mxfp8", "grouped mxfp8")


def run(ctx: Context) -> None:
    peak, note = peak_flops(ctx)
    base = preset("medium").replace(dtype="bfloat16", num_nextn_predict_layers=0)
    if ctx.dry_run:
        base = base.replace(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                            n_group=1, topk_group=1, moe_capacity_factors=(2.0,))
    tokens = ctx.size(4 * 4096, 64)
    ctx.set("setup", {"layer": "models/moe.py MoE, forward + backward (params and input gradients)",
                      "shape": {"tokens": tokens, "d": base.hidden_size, "f": base.moe_intermediate_size,
                                "experts": base.n_routed_experts, "top_k": base.num_experts_per_tok,
                                "shared": base.n_shared_experts, "chunk_tokens": base.moe_chunk_tokens},
                      "peak": note, "claim": "3.5x faster MoE layer forward and backward (MXFP8 vs their BF16 "
                                             "setup, B200; Cursor kernels blog)"})
    ms = {}
    for label, fields in ROWS.items():
        r = ctx.sub(label, layer_rate, ctx, base.replace(**fields), tokens, peak, need_s=ctx.size(10, 1))
        if isinstance(r, dict):
            ms[label] = r["ms"]
    same, grouped = ratio(ms, "bf16", "mxfp8"), ratio(ms, "grouped bf16", "grouped mxfp8")
    bf16_rows = {k: v for k, v in ms.items() if k not in MXFP8_ROWS}
    fp8_rows = {k: v for k, v in ms.items() if k in MXFP8_ROWS}
    fastest_bf16, fastest_fp8 = (min(rows, key=rows.get, default=None) for rows in (bf16_rows, fp8_rows))
    ctx.set("speedup", {"mxfp8_over_bf16_same_path": same, "grouped_mxfp8_over_grouped_bf16": grouped,
                        "speedup_over_best_bf16": ratio(ms, fastest_bf16, fastest_fp8),
                        "fastest_bf16": fastest_bf16, "fastest_mxfp8": fastest_fp8})
    if same is not None:
        ctx.headline(f"MoE layer fwd+bwd (sorted): bf16 {ms['bf16']:.3g} ms, MXFP8 {ms['mxfp8']:.3g} ms: "
                     f"{same:.2f}x (report {CLAIM}x)")
    if grouped is not None:
        ctx.headline(f"MoE layer fwd+bwd (grouped): bf16 {ms['grouped bf16']:.3g} ms, MXFP8 "
                     f"{ms['grouped mxfp8']:.3g} ms: {grouped:.2f}x (report {CLAIM}x)")
    ctx.target("MoE layer fwd+bwd speed-up, MXFP8 over bf16 (report: '3.5x faster MoE layer forward and backward' "
               "on B200 against their BF16 setup)", same, CLAIM, "x")
    ctx.target("MoE layer fwd+bwd speed-up, grouped MXFP8 over grouped bf16 (moe_impl grouped: the block-scaled "
               "grouped kernels; report: 3.5x)", grouped, CLAIM, "x")


def ratio(ms: dict, slow: str | None, fast: str | None) -> float | None:
    """ms[slow] / ms[fast], None where either row did not measure."""
    a, b = ms.get(slow), ms.get(fast)
    return a / b if a and b else None

def layer_rate(ctx: Context, cfg, tokens: int, peak: float) -> dict:
    try:
        cfg = resolve_moe_kernel(cfg)  # moe_impl="grouped": the kernel the layer runs here; others unchanged
    except ConfigError as e:
        raise Skip(f"the kernel registry refuses the grouped path at these shapes: {e}") from None
    t = moe_fwd_bwd_seconds(cfg, tokens, repeats=ctx.size(10, 2))
    flops = moe_fwd_bwd_flops(cfg, tokens)
    return {"ms": 1e3 * t, "tflops": flops / t / 1e12, "pct_peak_bf16": 100 * flops / t / peak,
            "moe_impl": cfg.moe_impl, "moe_quant": cfg.moe_quant,
            "moe_kernel_ran": cfg.moe_kernel or f"none (moe_impl={cfg.moe_impl!r} does not use the registry)"}
