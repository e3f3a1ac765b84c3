"""Decode throughput and time-to-first-token: c2jax InferenceEngine vs HF transformers `generate`.

Same model (the `small` and `small-qwen3-moe` presets, random weights, converted through c2jax.models.hf to
transformers' class of the family: DeepseekV3ForCausalLM, Qwen3MoeForCausalLM), same machine, same shapes: batch B
of prompts of P tokens, N new tokens each, greedy, no early stop.
  ttft_s      wall time until every sequence of the batch has its first token (prefill of the batch)
  tokens/s    B * N / (wall time of the whole generation)
Also the cache bytes per token: MLA's latent (kv_lora_rank + qk_rope_head_dim per layer) or GQA's K/V heads, vs
one K/V per query head.
Compilation is excluded (one warm-up generation per shape). Writes runs/bench/decode_throughput.json.

Roofline, per batch size (steady-state decode: every slot live, no prefill in the timed chunks):
  step_ms       wall time of the engine's decode chunks / decode steps run
  bytes/step    weights every step reads (attention, dense MLP, shared experts, router, norms, the LM head, the
                embedding rows of the batch) + the routed experts actually touched (distinct experts per MoE layer
                in the recorded expert ids of the batch's tokens at that step) + the latent cache positions read
  MBU           bytes/step / step time, over the best streaming bandwidth measured in this run (a jitted
                reduction over an array of the same size as bytes/step, and a NumPy copy of it counted read +
                write: the faster of the two)
  MFU           useful FLOPs/step (projections, absorbed attention over the positions read, the chosen experts,
                the head; no padding) / step time, over a jitted 2048^3 fp32 GEMM timed in this run
  host %        the engine's decode_stats: 1 - (time waiting for the device's chunk outputs) / (wall time of the
                decode calls), i.e. building inputs, dispatch and recording tokens, while the device idles

  .venv/bin/python experiments/bench/decode_throughput.py [--preset small,small-qwen3-moe] [--batches 1 8 32]
      [--prompt 64] [--new 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from c2jax.bench_report import Col, render_table, write_results  # noqa: E402
from c2jax.machine import describe  # noqa: E402
from c2jax.models.config import preset  # noqa: E402
from c2jax.models.inference import EngineConfig, InferenceEngine, Request, cache_bytes_per_token  # noqa: E402
from c2jax.models.inference.forward import unstack  # noqa: E402
from c2jax.models.transformer import init  # noqa: E402


def timed(fn, *args, repeats: int) -> float:
    """Median wall seconds of fn(*args), warmed first (as experiments/bench/moe_kernels.py's helper; not
    imported from there so that this file also runs as a plain script)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def streaming_bandwidth(nbytes: int) -> dict:
    """Bytes/s of the fastest ways this machine streams `nbytes` in this process: a jitted reduction reading
    an array that size (XLA, all threads) and a NumPy copy (read + write counted)."""
    rows = max(1, nbytes // 4 // 1024)
    a = jax.numpy.ones((rows, 1024), jax.numpy.float32)
    read = jax.jit(lambda a: a.sum(0))
    t_read = timed(read, a, repeats=20)
    host = np.ones(rows * 1024, np.float32)
    dst = np.empty_like(host)
    t_copy = timed(np.copyto, dst, host, repeats=20)
    xla_read, numpy_copy = a.nbytes / t_read, 2 * host.nbytes / t_copy
    return {"bytes": int(a.nbytes), "xla_read_gb_s": xla_read / 1e9, "numpy_copy_gb_s": numpy_copy / 1e9,
            "roofline_gb_s": max(xla_read, numpy_copy) / 1e9}


def gemm_peak() -> float:
    """FLOP/s of a jitted 2048^3 fp32 matmul: the compute roofline MFU is quoted against."""
    n = 2048
    a = jax.numpy.ones((n, n), jax.numpy.float32)
    mm = jax.jit(lambda a: a @ a)
    return 2 * n**3 / timed(mm, a, repeats=10)


def decode_flops_per_token(cfg, key_len: int) -> float:
    """Useful FLOPs of one decode token: projections, attention over key_len positions (absorbed MLA, or GQA over
    its K/V heads), dense MLP, router, the chosen + shared experts, the LM head (multiply-adds x 2)."""
    d, h, r, dr = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    if cfg.attention_type == "gqa":
        hd, kv = cfg.gqa_head_dim, cfg.kv_heads
        attn = d * h * hd + 2 * d * kv * hd + 2 * h * hd * key_len + h * hd * d
    else:
        q = d * cfg.q_lora_rank + cfg.q_lora_rank * h * (dn + dr) if cfg.q_lora_rank else d * h * (dn + dr)
        attn = q + d * (r + dr) + h * dn * r + h * (r + dr) * key_len + h * key_len * r + h * r * dv + h * dv * d
    expert = 3 * d * cfg.moe_intermediate_size
    moe = d * cfg.n_routed_experts + (cfg.num_experts_per_tok + cfg.n_shared_experts) * expert
    dense_mlp = 3 * d * cfg.intermediate_size
    layers = cfg.num_hidden_layers * attn + cfg.num_dense_layers * dense_mlp + cfg.num_moe_layers * moe
    return 2.0 * (layers + d * cfg.vocab_size)


def _is_routed(path, leaf) -> bool:
    """A routed experts' stack: [E, ., .] gate_up_proj / down_proj of an MoE layer (not its shared experts)."""
    keys = [str(getattr(k, "key", k)) for k in path]
    return leaf.ndim == 3 and "shared_experts" not in keys and ("gate_up_proj" in keys or "down_proj" in keys)


def weight_bytes(weights) -> tuple[int, list[int]]:
    """(bytes every decode step reads besides routed experts and embedding rows, bytes of one routed expert per
    MoE layer) from `unstack`'s per-layer state."""
    fixed, per_expert = 0, []
    for layer in weights.layers:
        expert = 0
        for path, leaf in jax.tree_util.tree_leaves_with_path(layer):
            if _is_routed(path, leaf):
                expert += leaf.nbytes // leaf.shape[0]
            else:
                fixed += leaf.nbytes
        if expert:
            per_expert.append(expert)
    fixed += weights.head_vd.nbytes + weights.model["norm"]["weight"][...].nbytes
    return fixed, per_expert


def greedy_engine(model, prompts, new_tokens, chunk_steps):
    """An engine with one slot per prompt and room for new_tokens (+ one chunk), and its greedy requests."""
    config = EngineConfig(slots=len(prompts), max_len=len(prompts[0]) + new_tokens + chunk_steps,
                          chunk_steps=chunk_steps)
    engine = InferenceEngine(model.cfg, *nnx.split(model), config=config)
    return engine, [Request(p, new_tokens, temperature=0.0) for p in prompts]


def decode_roofline(model, prompts, new_tokens, chunk_steps, peak_flops):
    """Steady-state decode of len(prompts) slots: step time, bytes and FLOPs per step, MBU, MFU, host share."""
    engine, reqs = greedy_engine(model, prompts, new_tokens, chunk_steps)
    cfg, config = model.cfg, engine.config
    batch, prompt_len = len(prompts), len(prompts[0])
    engine.generate(reqs)  # compile
    ids = [engine.submit(r) for r in reqs]
    engine.step()  # prefill and the first chunk, not timed
    chunks, key_lens = 0, []
    before = dict(engine.decode_stats)
    t0 = time.perf_counter()
    while engine.has_work:
        # cache length before chunk c (c >= 1) is prompt + c * chunk_steps; the engine reads that + one chunk
        needed = prompt_len + (chunks + 2) * chunk_steps
        key_lens.append(min(config.max_len, -(-needed // config.key_bucket) * config.key_bucket))
        engine.step()
        chunks += 1
    wall = time.perf_counter() - t0
    results = [engine.pop_result(i) for i in ids]
    steps = chunks * chunk_steps
    step_s = wall / steps
    spent = {key: engine.decode_stats[key] - before[key] for key in before}
    host_share = 1.0 - spent["device_wait_s"] / spent["wall_s"]
    # distinct routed experts per MoE layer and decode step (token j >= 1 of every result came from a decode step)
    experts = np.stack([r.expert_ids[1:] for r in results], axis=1)  # [steps, batch, L_moe, k]
    item = np.dtype(cfg.dtype).itemsize
    distinct = np.array([[len(np.unique(experts[j, :, layer])) for layer in range(experts.shape[2])]
                         for j in range(experts.shape[0])]).mean(axis=0)  # [L_moe]
    # what the engine reads: its per-layer weights and the [V, d] head
    fixed, per_expert = weight_bytes(unstack(engine.graphdef, engine.state)[1])
    key_len = float(np.mean(key_lens))
    cache_read = batch * key_len * cache_bytes_per_token(cfg)[0]
    routed = float(np.dot(distinct, per_expert))
    step_bytes = fixed + batch * cfg.hidden_size * item + routed + cache_read
    flops = batch * decode_flops_per_token(cfg, int(round(key_len)))
    bandwidth = streaming_bandwidth(int(step_bytes))
    return {"batch": batch, "step_ms": 1e3 * step_s, "decode_tokens_per_s": batch / step_s,
            "bytes_per_step": step_bytes, "bytes": {"fixed": fixed, "routed_experts": routed, "cache": cache_read},
            "distinct_experts_per_layer": distinct.tolist(), "mean_key_len": key_len,
            "achieved_gb_s": step_bytes / step_s / 1e9, "bandwidth": bandwidth,
            "mbu": step_bytes / step_s / (bandwidth["roofline_gb_s"] * 1e9),
            "flops_per_step": flops, "achieved_gflop_s": flops / step_s / 1e9, "mfu": flops / step_s / peak_flops,
            "host_fraction": host_share, "wall_s": wall}


def engine_runner(model, prompts, new_tokens, chunk_steps):
    """A function that times one greedy generation of `prompts` and one prefill-only pass (compiled here)."""
    engine, reqs = greedy_engine(model, prompts, new_tokens, chunk_steps)
    batch = len(prompts)
    firsts = [Request(p, 1, temperature=0.0) for p in prompts]
    engine.generate(reqs)  # compile every shape used below
    engine.generate(firsts)

    def run():
        ids = [engine.submit(r) for r in reqs]
        start = time.perf_counter()
        while engine.has_work:  # the first step prefills the whole batch, then every step decodes one chunk
            engine.step()
        total = time.perf_counter() - start
        results = [engine.pop_result(i) for i in ids]
        assert all(len(r.token_ids) == new_tokens for r in results)
        t0 = time.perf_counter()
        engine.generate(firsts)
        ttft = time.perf_counter() - t0
        return {"tokens_per_s": batch * new_tokens / total, "ttft_s": ttft, "total_s": total}

    return run


def hf_runner(model, prompts, new_tokens):
    """The same for HF transformers' own class of the family (DeepseekV3ForCausalLM, Qwen3MoeForCausalLM, ...)
    .generate on the converted weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from c2jax.models.hf import save_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    ids = torch.tensor(np.asarray(prompts), dtype=torch.long)
    mask = torch.ones_like(ids)

    def generate(n):
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0, eos_token_id=None)

    generate(2)  # warm-up

    def run():
        t0 = time.perf_counter()
        generate(1)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = generate(new_tokens)
        total = time.perf_counter() - t0
        assert out.shape[1] == ids.shape[1] + new_tokens
        return {"tokens_per_s": len(prompts) * new_tokens / total, "ttft_s": ttft, "total_s": total,
                "torch_threads": torch.get_num_threads()}

    return run


def _median_run(runs: list[dict]) -> dict:
    out = {key: float(np.median([r[key] for r in runs])) for key in ("tokens_per_s", "ttft_s", "total_s")}
    out["runs"] = runs
    return out


def paired(model, prompts, new_tokens, chunk_steps, repeats: int, skip_hf: bool):
    """c2jax and HF alternated `repeats` times (this machine's speed drifts between runs; pairs share it):
    medians of each, and the median of the per-pair ratios."""
    ours_run = engine_runner(model, prompts, new_tokens, chunk_steps)
    hf_run = None if skip_hf else hf_runner(model, prompts, new_tokens)
    ours, hf = [], []
    for _ in range(repeats):
        ours.append(ours_run())
        if hf_run is not None:
            hf.append(hf_run())
    if not hf:
        return _median_run(ours), None, None, None
    speedup = float(np.median([o["tokens_per_s"] / h["tokens_per_s"] for o, h in zip(ours, hf, strict=True)]))
    ttft_ratio = float(np.median([o["ttft_s"] / h["ttft_s"] for o, h in zip(ours, hf, strict=True)]))
    return _median_run(ours), _median_run(hf), speedup, ttft_ratio


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small,small-qwen3-moe", help="comma-separated presets")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--chunk-steps", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-roofline", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="alternated c2jax / HF runs per batch size (medians)")
    ap.add_argument("--out", default="runs/bench/decode_throughput.json")
    args = ap.parse_args(argv)
    machine = describe()

    rows, roofline, caches = [], [], {}
    peak = None if args.skip_roofline else gemm_peak()
    for name in args.preset.split(","):
        cfg = preset(name).replace(num_nextn_predict_layers=0)  # MTP is not used for decoding
        model = init(cfg, seed=0)
        rng = np.random.default_rng(0)
        caches[name] = dict(zip(("cache", "expanded_kv"), cache_bytes_per_token(cfg), strict=True))
        for batch in args.batches:
            prompts = rng.integers(1, cfg.vocab_size, size=(batch, args.prompt)).tolist()
            ours, hf, speedup, ttft_ratio = paired(model, prompts, args.new, args.chunk_steps, args.repeats,
                                                   args.skip_hf)
            rows.append({"preset": name, "batch": batch, "c2jax": ours, "hf": hf, "speedup": speedup,
                         "ttft_ratio": ttft_ratio})
            print(f"{name} batch {batch}: c2jax {ours['tokens_per_s']:.1f} tok/s ttft {ours['ttft_s']:.3f} s; "
                  f"speedup {speedup} ttft ratio {ttft_ratio}", flush=True)
            if peak is not None:
                roofline.append({"preset": name, **decode_roofline(model, prompts, args.new, args.chunk_steps,
                                                                   peak)})

    notes = []
    if roofline:
        notes.append("\n" + render_table(roofline, [
            "preset", "batch", ("step_ms", "step ms", ".2f"), Col("bytes_per_step", "MB/step", ".1f", scale=1e-6),
            ("achieved_gb_s", "GB/s", ".1f"), ("bandwidth.roofline_gb_s", "roof GB/s", ".1f"), ("mbu", "MBU", ".0%"),
            ("achieved_gflop_s", "GFLOP/s", ".1f"), ("mfu", "MFU", ".1%"),
            Col("host_fraction", "host %", ".1f", scale=100),
            Col("distinct_experts_per_layer", "distinct experts/layer", lambda xs: " ".join(f"{x:.1f}" for x in xs))],
            title=f"decode roofline (steady state; fp32 GEMM peak measured {peak / 1e9:.0f} GFLOP/s)"))
    for name, c in caches.items():
        notes.append(f"{name}: cache bytes/token (fp32, all layers) {c['cache']}, one K/V per query head "
                     f"{c['expanded_kv']} ({c['expanded_kv'] / c['cache']:.1f}x larger)")
    print()
    write_results(args.out, rows, columns=[
        "preset", "batch", ("c2jax.tokens_per_s", "c2jax tok/s", ".1f"), ("c2jax.ttft_s", "ttft s", ".3f"),
        ("hf.tokens_per_s", "HF tok/s", ".1f"), ("hf.ttft_s", "ttft s", ".3f"), ("speedup", "speedup", "{:.2f}x"),
        ("ttft_ratio", "ttft/HF", "{:.2f}x")],
        title=f"prompt {args.prompt}, new {args.new}, fp32, {jax.devices()[0].platform}; medians "
              f"of {args.repeats} alternated runs; ratios are medians of the per-pair ratios",
        notes=notes, machine=machine,
        meta={"presets": args.preset.split(","), "prompt_tokens": args.prompt, "new_tokens": args.new,
              "chunk_steps": args.chunk_steps, "repeats": args.repeats, "cache_bytes_per_token": caches,
              "gemm_peak_gflop_s": None if peak is None else peak / 1e9, "roofline": roofline})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
