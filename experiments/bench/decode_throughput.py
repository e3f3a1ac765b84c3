"""Decode throughput and time-to-first-token: c2jax InferenceEngine vs HF transformers `generate`.

Same model (the `small` preset, random weights, converted to DeepseekV3ForCausalLM through c2jax.models.hf), same
machine, same shapes: batch B of prompts of P tokens, N new tokens each, greedy, no early stop.
  ttft_s      wall time until every sequence of the batch has its first token (prefill of the batch)
  tokens/s    B * N / (wall time of the whole generation)
Also the cache bytes per token: latent (kv_lora_rank + qk_rope_head_dim per layer) vs expanded per-head K/V.
Compilation is excluded (one warm-up generation per shape). Writes runs/bench/decode_throughput.json.

  .venv/bin/python experiments/bench/decode_throughput.py [--batches 1 8 32] [--prompt 64] [--new 64]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from c2jax.machine import describe, finish, summary_line  # noqa: E402
from c2jax.models.config import preset  # noqa: E402
from c2jax.models.inference import EngineConfig, InferenceEngine, Request, cache_bytes_per_token  # noqa: E402
from c2jax.models.transformer import init  # noqa: E402


def bench_engine(model, prompts, new_tokens, chunk_steps):
    graphdef, state = nnx.split(model)
    cfg = model.cfg
    batch = len(prompts)
    config = EngineConfig(slots=batch, max_len=len(prompts[0]) + new_tokens + chunk_steps, chunk_steps=chunk_steps)
    engine = InferenceEngine(cfg, graphdef, state, config=config)
    reqs = [Request(p, new_tokens, temperature=0.0) for p in prompts]
    engine.generate(reqs)  # compile every shape used below
    ids = [engine.submit(r) for r in reqs]
    start = time.perf_counter()
    while engine.has_work:  # the first step prefills the whole batch, then every step decodes one chunk
        engine.step()
    total = time.perf_counter() - start
    results = [engine.pop_result(i) for i in ids]
    assert all(len(r.token_ids) == new_tokens for r in results)
    ttft_engine = InferenceEngine(cfg, graphdef, state, config=config)
    ttft_engine.generate([Request(p, 1, temperature=0.0) for p in prompts])  # warm
    t0 = time.perf_counter()
    ttft_engine.generate([Request(p, 1, temperature=0.0) for p in prompts])
    ttft = time.perf_counter() - t0
    return {"tokens_per_s": batch * new_tokens / total, "ttft_s": ttft, "total_s": total}


def bench_hf(model, prompts, new_tokens):
    import torch
    from transformers import DeepseekV3ForCausalLM

    from c2jax.models.hf import save_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        hf = DeepseekV3ForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval()
    ids = torch.tensor(np.asarray(prompts), dtype=torch.long)
    mask = torch.ones_like(ids)

    def run(n):
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0, eos_token_id=None)

    run(2)  # warm-up
    t0 = time.perf_counter()
    run(1)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = run(new_tokens)
    total = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new_tokens
    return {"tokens_per_s": len(prompts) * new_tokens / total, "ttft_s": ttft, "total_s": total,
            "torch_threads": torch.get_num_threads()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--chunk-steps", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="runs/bench/decode_throughput.json")
    args = ap.parse_args(argv)
    machine = describe()

    cfg = preset("small").replace(num_nextn_predict_layers=0)  # MTP is not used for decoding
    model = init(cfg, seed=0)
    rng = np.random.default_rng(0)
    latent, expanded = cache_bytes_per_token(cfg)
    rows = []
    for batch in args.batches:
        prompts = rng.integers(1, cfg.vocab_size, size=(batch, args.prompt)).tolist()
        ours = bench_engine(model, prompts, args.new, args.chunk_steps)
        hf = None if args.skip_hf else bench_hf(model, prompts, args.new)
        rows.append({"batch": batch, "c2jax": ours, "hf": hf,
                     "speedup": None if hf is None else ours["tokens_per_s"] / hf["tokens_per_s"]})
        print(f"batch {batch}: c2jax {ours}  hf {hf}", flush=True)

    print(f"\nsmall preset, prompt {args.prompt}, new {args.new}, fp32, {jax.devices()[0].platform}")
    print(f"{'batch':>5} | {'c2jax tok/s':>11} {'ttft s':>8} | {'HF tok/s':>9} {'ttft s':>8} | {'speedup':>7}")
    for r in rows:
        hf = r["hf"] or {"tokens_per_s": float("nan"), "ttft_s": float("nan")}
        print(f"{r['batch']:>5} | {r['c2jax']['tokens_per_s']:>11.1f} {r['c2jax']['ttft_s']:>8.3f} | "
              f"{hf['tokens_per_s']:>9.1f} {hf['ttft_s']:>8.3f} | {(r['speedup'] or float('nan')):>7.2f}x")
    print(f"cache bytes/token (fp32, all layers): latent {latent}, expanded K/V {expanded} "
          f"({expanded / latent:.1f}x larger)")
    print(f"machine: {summary_line(finish(machine))}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "preset": "small", "prompt_tokens": args.prompt, "new_tokens": args.new, "chunk_steps": args.chunk_steps,
        "machine": machine,
        "cache_bytes_per_token": {"latent": latent, "expanded_kv": expanded}, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
