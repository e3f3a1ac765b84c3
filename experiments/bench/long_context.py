"""Training at long context: one forward + backward + AdamW step of a model preset at batch 1 and several
sequence lengths, per remat policy: compile seconds, XLA's temporary bytes (compiled memory analysis), the
process's peak RSS, tokens/s and model FLOP/s counting causal attention (c2jax.models.flops).

    python -m experiments.bench.long_context [--preset small --seqs 2048,8192,32768 --remat full] [--mtp]

`--remat none` (the model's default policy) at 32k needs more memory than a 24 GB machine may have.

What it shows: whether attention's memory and program size stay linear / constant in S (docs/attention.md).
Targets (issue 19, 2 CPU cores, `small`): with remat full, S = 32k within 4 GB of temporaries; compile time
at 32k at most 1.5x that at 2k; model FLOP/s at 32k at least 70% of that at 2k. Prints a table and writes
runs/bench/long_context.json (with the machine it ran on).
"""

from __future__ import annotations

import argparse
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from c2jax.bench_report import Col, write_results
from c2jax.config import apply_overrides, from_dict, to_dict
from c2jax.machine import describe
from c2jax.models.config import ModelConfig, preset
from c2jax.models.flops import param_counts, training_flops_per_token
from c2jax.models.transformer import init
from c2jax.train.step import init_train_state, make_train_step


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def measure(preset_name: str, seq: int, remat: str, steps: int, mtp: bool = False,
            overrides: tuple[str, ...] = ()) -> dict:
    base = preset(preset_name)
    cfg = base.replace(remat_policy=remat, num_nextn_predict_layers=base.num_nextn_predict_layers if mtp else 0,
                       max_position_embeddings=max(seq, base.max_position_embeddings))
    if overrides:  # the config system's dotted overrides, typed and checked (an unknown key names itself)
        cfg = from_dict(ModelConfig, apply_overrides(to_dict(cfg), overrides))
    tx = optax.adamw(1e-4)
    graphdef, state = init_train_state(init(cfg, seed=0), tx)
    step = make_train_step(graphdef, tx, router_bias_rate=1e-3, train_mtp=mtp, mtp_weight=0.1)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, seq + 1)).astype(np.int32)
    batch = {"input_ids": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]),
             "segment_ids": jnp.ones((1, seq), jnp.int32), "positions": jnp.arange(seq, dtype=jnp.int32)[None],
             "loss_mask": jnp.ones((1, seq), jnp.float32)}
    t = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    memory = compiled.memory_analysis()
    temp = int(getattr(memory, "temp_size_in_bytes", -1)) if memory is not None else -1
    state, metrics = compiled(state, batch)  # first run: allocations
    jax.block_until_ready(metrics["loss"])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t)
    step_s = min(times)
    flops = training_flops_per_token(cfg, seq, include_mtp=mtp) * seq
    return {"seq": seq, "remat": remat, "mtp": mtp, "overrides": list(overrides), "params": param_counts(cfg).total,
            "compile_s": compile_s,
            "temp_bytes": temp, "peak_rss_gib": peak_rss_gib(), "step_s": step_s, "tokens_per_s": seq / step_s,
            "model_flops_per_s": flops / step_s, "loss": float(metrics["loss"])}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--seqs", default="2048,8192,32768")
    p.add_argument("--remat", default="full", help="remat policies, comma separated (none: the default policy)")
    p.add_argument("--steps", type=int, default=1, help="timed steps after the first (best is reported)")
    p.add_argument("--mtp", action="store_true", help="keep the preset's MTP module and train it (self-distillation):"
                   " `small` is then 40.4M parameters")
    p.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE",
                   help="model config override, repeatable (e.g. moe_chunk_tokens=8192 loss_chunk_tokens=2048)")
    p.add_argument("--out", default="runs/bench/long_context.json")
    args = p.parse_args(argv)
    try:  # refuse a bad override before anything compiles
        from_dict(ModelConfig, apply_overrides(to_dict(preset(args.preset)), args.model_set))
    except ValueError as e:
        p.error(f"--model-set: {e}")
    machine = describe()
    rows = []
    for remat in args.remat.split(","):
        for seq in (int(s) for s in args.seqs.split(",")):
            row = measure(args.preset, seq, remat, args.steps, args.mtp, tuple(args.model_set))
            rows.append(row)
            print(f"S={seq} remat={remat}: compile {row['compile_s']:.1f} s, {row['tokens_per_s']:.1f} tokens/s",
                  flush=True)
    write_results(args.out, rows, columns=[
        Col("params", "params M", ".1f", scale=1e-6), ("seq", "S"), "remat", ("compile_s", "compile s", ".1f"),
        Col("temp_bytes", "temp GiB", ".2f", scale=2**-30), ("peak_rss_gib", "peak RSS GiB", ".2f"),
        ("tokens_per_s", "tokens/s", ".1f"), Col("model_flops_per_s", "GFLOP/s", ".1f", scale=1e-9)],
        meta={"preset": args.preset}, machine=machine, indent=1)
    out = {"preset": args.preset, "rows": rows, "machine": machine}
    return out


if __name__ == "__main__":
    main()
