"""Tokens/s of the data pipeline alone (c2jax.data.build_batches) on the demo corpus, for the small preset's
batch shapes, with the byte tokenizer and a BPE trained here on the same machine's Python sources.

The pipeline must never bottleneck training: the target is >= 10x the small preset's training-step token
rate (runs/bench/model_throughput.json when present, else the figure in docs/ARCHITECTURE.md).

    python -m experiments.bench.data_throughput [--batches 30] [--bpe-vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from c2jax.bench_report import write_results
from c2jax.data.bpe import corpus_texts, train_bpe
from c2jax.data.config import DataConfig
from c2jax.data.demo_corpus import default_roots
from c2jax.data.pipeline import build_batches
from c2jax.machine import describe

SHAPES = ((8, 512), (16, 2048))
# docs/ARCHITECTURE.md: the small preset's 8x512 training step takes 2.04-2.57 s on a 2-core AVX-512 VM
# (CPU model and load not recorded)
_MODEL_TOKENS_PER_S_FALLBACK = 8 * 512 / 2.04


def model_tokens_per_s() -> tuple[float, str]:
    path = Path("runs/bench/model_throughput.json")
    if path.is_file():
        data = json.loads(path.read_text())
        rates = [v for k, v in _flatten(data) if "tokens_per_s" in k and "c2jax" in k]
        if rates:
            return max(rates), str(path)
    return _MODEL_TOKENS_PER_S_FALLBACK, "docs/ARCHITECTURE.md (fastest median step, 2.04 s for 8x512)"


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield prefix, float(obj)


def measure(cfg: DataConfig, batches: int) -> dict:
    start = time.perf_counter()
    it = build_batches(cfg, "train")
    first = next(it)
    startup = time.perf_counter() - start
    real = loss = 0
    start = time.perf_counter()
    for _ in range(batches):
        b = next(it)
        real += int((b["segment_ids"] > 0).sum())
        loss += int(b["loss_mask"].sum())
    seconds = time.perf_counter() - start
    tokens = batches * first["input_ids"].size
    return {"tokens_per_s": tokens / seconds, "seconds_per_batch": seconds / batches, "startup_s": startup,
            "packing_efficiency": real / tokens, "loss_token_fraction": loss / tokens}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--bpe-vocab", type=int, default=8192, help="the small preset's vocabulary size")
    parser.add_argument("--bpe-corpus-bytes", type=int, default=20_000_000)
    parser.add_argument("--out", default="runs/bench/data_throughput.json")
    args = parser.parse_args(argv)
    machine = describe()

    bpe_dir = Path("runs/bench/bpe_tokenizer")
    start = time.perf_counter()
    train_bpe(corpus_texts(default_roots(), args.bpe_corpus_bytes), args.bpe_vocab, bpe_dir)
    bpe_train_s = time.perf_counter() - start

    model_rate, model_source = model_tokens_per_s()
    rows = []
    for tokenizer in ("bytes", str(bpe_dir / "tokenizer.json")):
        for batch_size, seq_len in SHAPES:
            cfg = DataConfig(tokenizer=tokenizer, seq_len=seq_len, batch_size=batch_size)
            r = measure(cfg, args.batches)
            rows.append({"tokenizer": "bytes" if tokenizer == "bytes" else f"bpe-{args.bpe_vocab}",
                         "batch": batch_size, "seq_len": seq_len, **r, "x_model_rate": r["tokens_per_s"] / model_rate})

    print(f"data pipeline alone, demo corpus (stdlib + site-packages: code 0.7 / docs 0.2 / sft 0.1), "
          f"{args.batches} batches after the first; model rate {model_rate:,.0f} tokens/s from {model_source}")
    write_results(args.out, rows, machine=machine, columns=[
        "tokenizer", "batch", ("seq_len", "seq"), ("tokens_per_s", "tokens/s", ",.0f"),
        ("x_model_rate", "x model", ".1f"),
        ("seconds_per_batch", "s/batch", ".3f"), ("packing_efficiency", "packed", ".3f"),
        ("loss_token_fraction", "loss", ".3f"), ("startup_s", "startup s", ".1f")],
        meta={"model_tokens_per_s": model_rate, "model_rate_source": model_source, "bpe_train_seconds": bpe_train_s,
              "bpe_corpus_bytes": args.bpe_corpus_bytes,
              "min_x_model_rate": float(np.min([r["x_model_rate"] for r in rows]))})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
