"""Tokens/s and MFU of the full pretraining loop (c2jax.data pipeline included) for a model preset,
beside the data pipeline alone, which must run at >= 10x the model's token rate.

    .venv/bin/python -m experiments.bench.pretrain_throughput [--preset small --steps 20 --seq 512 --batch 8]

Prints a table and writes runs/bench/pretrain_throughput.json. MFU uses c2jax.models.flops
training_flops_per_token over the device's datasheet bf16 peak, or on CPU the measured matmul peak.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax

from c2jax.bench_report import write_results
from c2jax.config import from_dict, to_dict
from c2jax.data.config import DataConfig
from c2jax.data.pipeline import build_batches
from c2jax.machine import describe
from c2jax.models.config import preset
from c2jax.train.config import PretrainConfig
from c2jax.train.loop import Trainer
from c2jax.train.metrics import read_metrics


def data_tokens_per_s(data: DataConfig, seq: int, batch: int, batches: int) -> float:
    it = build_batches(data, "train", seq_len=seq, batch_size=batch)
    next(it)  # sources opened, first shuffle buffers filled
    t = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * seq * batch / (time.perf_counter() - t)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from the rate (compile, caches)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--data-batches", type=int, default=200)
    p.add_argument("--out", default="runs/bench/pretrain_throughput.json")
    args = p.parse_args(argv)
    machine = describe()

    data = DataConfig(tokenizer="bytes", seq_len=args.seq, batch_size=args.batch)
    model = preset(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = from_dict(PretrainConfig, {
            "name": "bench", "output_dir": tmp, "model": to_dict(model), "data": to_dict(data), "log_every": 1,
            "progress": False, "phases": [{"name": "main", "steps": args.warmup + args.steps}],
            "mtp_init_step": 0, "checkpoint": {"every": 10**9, "keep_last": 1}, "eval": {"every": 0},
        })
        trainer = Trainer(cfg, eval_sources=None, tensorboard=False)
        t = time.perf_counter()
        trainer.run(stop_after=args.warmup)
        compile_s = time.perf_counter() - t
        t = time.perf_counter()
        trainer.run(stop_after=args.steps)
        loop_s = time.perf_counter() - t
        rows = read_metrics(cfg.run_dir)[-args.steps:]
        trainer.close()
    loop_tps = args.steps * args.seq * args.batch / loop_s
    mfu = sum(r["mfu"] for r in rows) / len(rows) * loop_tps / (sum(r["tokens_per_s"] for r in rows) / len(rows))
    data_tps = data_tokens_per_s(data, args.seq, args.batch, args.data_batches)
    result = {
        "preset": args.preset, "seq_len": args.seq, "batch_size": args.batch, "steps": args.steps,
        "device": jax.devices()[0].device_kind, "loop_tokens_per_s": loop_tps, "mfu": mfu,
        "warmup_s": compile_s, "data_tokens_per_s": data_tps, "data_over_model": data_tps / loop_tps,
        "final_loss": rows[-1]["loss"],
    }
    measures = [("train loop tokens/s (data incl.)", f"{loop_tps:,.0f}"), ("MFU", f"{mfu:.4f}"),
                ("data pipeline alone tokens/s", f"{data_tps:,.0f}"),
                ("data / model token rate", f"{data_tps / loop_tps:.1f}x"), ("warmup (compile) s", f"{compile_s:.1f}")]
    ok = result["data_over_model"] >= 10
    write_results(args.out, [{"measure": m, "value": v} for m, v in measures], columns=["measure", "value"],
                  meta=result, machine=machine, rows_key=None,
                  notes=[f"data pipeline >= 10x the model's token rate: {'yes' if ok else 'NO'}"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
