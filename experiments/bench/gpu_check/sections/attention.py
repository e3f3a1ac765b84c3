"""Section `attention`: each attention backend's forward and gradients against the dense oracle (fp32 and
bf16, causal and packed documents), then fwd+bwd tokens/s and % of peak at long sequences."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from c2jax.models import attention_backends as ab
from experiments.bench.gpu_check.sections.context import Context, peak_flops, rel_err, timed

# throughput shape (bf16): batch, heads, q.k and v head dims
BT, HT, DQK_T, DV_T = 1, 16, 192, 128


@dataclass(frozen=True)
class Inputs:
    """The equality problem: q, k, v exactly representable in bf16, so one fp32 oracle serves the fp32 and the
    bf16 runs; the output's cotangent; and each case's keyword arguments."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    cotangent: jax.Array
    scale: float
    cases: dict  # case name: keyword arguments of the backend's fn


def run(ctx: Context) -> None:
    b, s, h, dqk, dv = ctx.size((2, 1024, 8, 192, 128), (1, 128, 2, 48, 32))
    inputs = equality_inputs(b, s, h, dqk, dv)
    ctx.set("equality_shape", {"B": b, "S": s, "H": h, "Dqk": dqk, "Dv": dv})
    oracle = {}
    with jax.default_matmul_precision("highest"):
        for case, kw in inputs.cases.items():
            oracle[case] = jax.jit(lambda q, k, v, kw=kw: fwd_bwd(ab.get("dense").fn, inputs, q, k, v, **kw))(
                inputs.q, inputs.k, inputs.v)
    for backend in ("blockwise", "cudnn"):
        for dtype in ("float32", "bfloat16"):
            for case in inputs.cases:
                ctx.sub(f"equality/{backend}/{dtype}/{case}", equality, ctx, inputs, oracle[case], backend, dtype,
                        case, need_s=ctx.size(3, 1))

    seqs = ctx.size((8192, 32768), (256,))
    peak, note = peak_flops(ctx)
    ctx.set("throughput_shape", {"B": BT, "H": HT, "Dqk": DQK_T, "Dv": DV_T, "dtype": "bfloat16", "peak": note,
                                 "flops": "fwd 2 * S(S+1)/2 * H * (Dqk + Dv) (causal), fwd+bwd 3.5x fwd"})
    for s_t in seqs:
        for backend in ("cudnn", "blockwise"):
            r = ctx.sub(f"throughput/S{s_t}/{backend}", throughput, ctx, backend, s_t, peak, need_s=ctx.size(8, 1))
            if isinstance(r, dict) and s_t == seqs[-1]:
                ctx.headline(f"{backend} S={s_t}: {r['tokens_per_s']:,.0f} tok/s fwd+bwd ({r['pct_peak']:.0f}% peak)")


def equality_inputs(b: int, s: int, h: int, dqk: int, dv: int) -> Inputs:
    kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
    q32, k32, v32 = (jax.random.normal(kx, shape, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
                     for kx, shape in ((kq, (b, s, h, dqk)), (kk, (b, s, h, dqk)), (kv, (b, s, h, dv))))
    ct = jax.random.normal(kc, (b, s, h, dv), jnp.float32)
    seg = jnp.asarray(np.repeat(np.arange(4), s // 4)[None].repeat(b, 0), jnp.int32)  # 4 packed documents
    return Inputs(q32, k32, v32, ct, dqk ** -0.5,
                  cases={"causal": {}, "packed": {"q_segment_ids": seg, "kv_segment_ids": seg}})


def fwd_bwd(fn, inputs: Inputs, q, k, v, **kw):
    """(output, (dq, dk, dv)) of `fn` with the inputs' cotangent."""

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, scale=inputs.scale, **kw).astype(jnp.float32) * inputs.cotangent)

    out = fn(q, k, v, scale=inputs.scale, **kw)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return out, grads


def equality(ctx: Context, inputs: Inputs, oracle, backend: str, dtype: str, case: str):
    if backend == "cudnn":
        ctx.needs_gpu("cuDNN flash attention")
    dt = jnp.dtype(dtype)
    q, k, v = (x.astype(dt) for x in (inputs.q, inputs.k, inputs.v))
    fn = ab.get(backend).fn
    kw = inputs.cases[case]
    try:
        with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
            out, grads = jax.jit(lambda q, k, v: fwd_bwd(fn, inputs, q, k, v, **kw))(q, k, v)
    except NotImplementedError as e:  # the backend refuses: attention() would run blockwise
        return f"refused (falls through to blockwise): {str(e)[:160]}"
    ref_out, ref_grads = oracle  # on the same values (bf16-representable inputs)
    errs = {"out": rel_err(out, ref_out), "dq": rel_err(grads[0], ref_grads[0]),
            "dk": rel_err(grads[1], ref_grads[1]), "dv": rel_err(grads[2], ref_grads[2])}
    tol = 1e-4 if dtype == "float32" else 2e-2
    worst = max(errs.values())
    ctx.check(f"attention {backend} {dtype} {case} == dense oracle", worst <= tol and np.isfinite(worst),
              f"worst rel L2 {worst:.2e} (tol {tol:g})")
    return errs


def throughput(ctx: Context, backend: str, s_t: int, peak: float):
    if backend == "cudnn":
        ctx.needs_gpu("cuDNN flash attention")
    kk_ = jax.random.split(jax.random.key(s_t), 4)
    q = jax.random.normal(kk_[0], (BT, s_t, HT, DQK_T), jnp.bfloat16)
    k = jax.random.normal(kk_[1], (BT, s_t, HT, DQK_T), jnp.bfloat16)
    v = jax.random.normal(kk_[2], (BT, s_t, HT, DV_T), jnp.bfloat16)
    cot = jax.random.normal(kk_[3], (BT, s_t, HT, DV_T), jnp.bfloat16)
    fn = ab.get(backend).fn

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, scale=DQK_T ** -0.5).astype(jnp.float32) * cot)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    fwd = jax.jit(lambda q, k, v: fn(q, k, v, scale=DQK_T ** -0.5))
    try:
        t = timed(step, q, k, v, repeats=ctx.size(5, 2))
        tf = timed(fwd, q, k, v, repeats=ctx.size(5, 2))
    except NotImplementedError as e:
        return f"refused: {str(e)[:160]}"
    flops_fwd = 2 * (s_t * (s_t + 1) / 2) * HT * (DQK_T + DV_T) * BT
    return {"fwd_bwd_ms": 1e3 * t, "tokens_per_s": BT * s_t / t, "tflops": 3.5 * flops_fwd / t / 1e12,
            "pct_peak": 100 * 3.5 * flops_fwd / t / peak, "fwd_ms": 1e3 * tf, "fwd_tflops": flops_fwd / tf / 1e12}
