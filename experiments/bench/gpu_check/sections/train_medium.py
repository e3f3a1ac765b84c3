"""Section `train_medium`: the `medium` preset's training step (fwd + bwd + AdamW + router-bias update) in
bf16: tokens/s and MFU at S = 4k and 32k, retried once with full remat where no remat runs out of memory."""

from __future__ import annotations

import math
import statistics
import time

import jax.numpy as jnp
import numpy as np
import optax

from c2jax.models.config import preset
from c2jax.models.flops import training_flops_per_token
from c2jax.models.transformer import init
from c2jax.train.step import init_train_state, make_train_step
from experiments.bench.gpu_check.sections.context import DRY_MODEL, Context, peak_flops, timed_steps


def run(ctx: Context) -> None:
    peak, note = peak_flops(ctx)
    name = ctx.size("medium", "tiny")
    runs = ctx.size(((4096, 4), (32768, 1)), ((64, 2),))  # dry run: one length (the loop is the same)
    ctx.set("setup", {"preset": name, "dtype": "bfloat16 compute, float32 params", "peak": note,
                      "step": "c2jax.train.step.make_train_step: fwd + bwd + AdamW + router-bias update, no MTP"})
    for seq, batch in runs:
        r = ctx.sub(f"S{seq}", with_remat_retry, ctx, name, seq, batch, peak, need_s=ctx.size(25, 2))
        if isinstance(r, dict):
            ctx.headline(f"S={seq}: {r['tokens_per_s']:,.0f} tok/s, MFU {r['mfu_pct']:.1f}%")
            ctx.target(f"{name} training MFU at S={seq}", r["mfu_pct"], 35.0, "%")
        else:
            ctx.target(f"{name} training MFU at S={seq}", None, 35.0, "%")


def with_remat_retry(ctx: Context, name: str, seq: int, batch: int, peak: float) -> dict:
    try:
        return step_rate(ctx, name, seq, batch, peak)
    except Exception as e:  # noqa: BLE001 - out of memory at remat none: retry with remat full once
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        ctx.set(f"S{seq}_remat_none", f"out of memory: {str(e)[:200]}")
        return step_rate(ctx, name, seq, batch, peak, remat="full")


def step_rate(ctx: Context, name: str, seq: int, batch: int, peak: float, remat: str = "none") -> dict:
    base = preset(name)
    cfg = base.replace(dtype="bfloat16", num_nextn_predict_layers=0, remat_policy=remat, **ctx.size({}, DRY_MODEL),
                       max_position_embeddings=max(seq, base.max_position_embeddings))
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
    ctx.check(f"train {name} S={seq} loss finite", math.isfinite(loss), f"loss {loss:.4g}")
    return {"batch": batch, "remat": remat, "compile_s": compile_s, "step_s": step_s,
            "tokens_per_s": tokens / step_s, "mfu_pct": 100 * fpt * tokens / step_s / peak,
            "train_flops_per_token": fpt, "xla_temp_GiB": None if temp is None else temp / 2**30, "loss": loss}
