"""Training-step throughput of small presets of two families, `small` (DeepSeek-V3-shaped) and `small-qwen3-moe`:
c2jax (JAX, jitted) vs HF transformers' own class of the same family (DeepseekV3ForCausalLM, Qwen3MoeForCausalLM;
PyTorch eager), same shapes, same batch, same machine, one run, measured alternately within each preset.

A step is forward + backward + AdamW on next-token cross-entropy. MFU is useful model FLOPs
(c2jax.models.flops.training_flops_per_token, no MTP: HF has none) over this machine's measured float32
matmul peak. Prints a table and writes JSON.

    python -m experiments.bench.model_throughput [--preset small,small-qwen3-moe --batch 8 --seq 512 --rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from c2jax.bench_report import write_results
from c2jax.machine import describe
from c2jax.models.config import ModelConfig, preset
from c2jax.models.flops import training_flops_per_token
from c2jax.models.moe_dispatch import resolve_moe_kernel
from c2jax.models.transformer import init


def matmul_peak_flops(n: int = 2048, repeats: int = 10) -> float:
    """Best observed f32 FLOP/s of an n x n x n matmul under XLA on this machine."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def make_jax_step(cfg: ModelConfig, seed: int = 0):
    """Exactly the work of the HF side: forward, backward, AdamW. (c2jax.train.step also computes
    metrics such as the gradient norm, which HF's loop here does not; measured ~5% of a step.)"""
    model = init(cfg, seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(1e-4, weight_decay=0.1)
    opt_state = tx.init(params)

    def loss_fn(params, rest, ids):
        model = nnx.merge(graphdef, nnx.merge_state(params, rest))
        out = model(ids[:, :-1], return_mtp=False)
        return jnp.mean(model.token_losses(out.hidden, ids[:, 1:]))

    @jax.jit
    def step(params, rest, opt_state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, ids)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = {"params": params, "rest": rest, "opt": opt_state}

    def run(ids):
        state["params"], state["opt"], loss = step(state["params"], state["rest"], state["opt"], ids)
        return float(loss)

    return run


def make_torch_step(cfg: ModelConfig, seed: int = 0):
    """transformers' model of the same family and shapes (the config.json c2jax would export), trained the same."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from c2jax.models.hf import config_to_hf

    torch.manual_seed(seed)
    hf = config_to_hf(cfg.replace(num_nextn_predict_layers=0))
    hf_cfg = AutoConfig.for_model(hf.pop("model_type"), **hf, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def run(ids):
        batch = torch.from_numpy(np.asarray(ids)).long()
        out = model(input_ids=batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return run, torch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small,small-qwen3-moe", help="comma-separated presets")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round per framework")
    parser.add_argument("--moe-impl", default=None)
    parser.add_argument("--scan-layers", action="store_true",
                        help="lax.scan over layers (default: unrolled; see below)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default="runs/bench/model_throughput.json")
    args = parser.parse_args(argv)
    machine = describe()

    # Unrolled layers by default: with 4 layers compile time is no concern, and on XLA:CPU the scan's
    # stacked residuals (dynamic-update-slice in, dynamic-slice out) cost time: measured 2.07 s/step with
    # scan vs 1.92 s unrolled (before the MoE's hand-written backward the gap was ~1 s).
    peak = matmul_peak_flops()
    table, result = [], {"batch": args.batch, "seq": args.seq, "scan_layers": args.scan_layers,
                         "tokens_per_step": args.batch * args.seq, "matmul_peak_flops": peak, "presets": {}}
    for name in args.preset.split(","):
        one = measure(name, args, peak)
        result["presets"][name] = one
        table += [{"preset": name, "impl": impl, **row} for impl, row in one["results"].items()]
    result["torch_threads"] = next((r["torch_threads"] for r in result["presets"].values()), None)
    notes = [f"{name}: c2jax / hf tokens/s {one['speedup_vs_hf']:.2f}x" for name, one in result["presets"].items()
             if "speedup_vs_hf" in one]
    print(f"model_throughput: batch={args.batch}x{args.seq}, peak f32 matmul {peak / 1e9:.1f} GFLOP/s")
    write_results(args.out, table, columns=[
        "preset", "impl", ("step_s_median", "step s", ".3f"), ("step_s_min", "best s", ".3f"),
        ("tokens_per_s", "tokens/s", ".0f"), ("mfu", "MFU", ".1%"), ("mfu_best_step", "best MFU", ".1%"),
        ("first_step_s", "first step s", ".1f")], meta=result, machine=machine, rows_key=None, notes=notes)
    return result


def measure(name: str, args, peak: float) -> dict:
    """One preset: c2jax and HF steps alternated over the rounds; per implementation median / best step and MFU."""
    cfg = preset(name).replace(num_nextn_predict_layers=0, scan_layers=args.scan_layers)
    if args.moe_impl:
        cfg = cfg.replace(moe_impl=args.moe_impl)
    cfg = resolve_moe_kernel(cfg)  # the path ("auto" resolved) and kernel the step runs here, as the table records
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, cfg.vocab_size, (args.batch, args.seq + 1), dtype=np.int32) for _ in range(4)]
    tokens_per_step = args.batch * args.seq
    runners = {"c2jax": make_jax_step(cfg)}
    torch_threads = None
    if not args.skip_hf:
        runners["hf"], torch = make_torch_step(cfg)
        torch_threads = torch.get_num_threads()
    compile_s = {}
    for impl, run in runners.items():  # warm-up: compilation for JAX, allocator warm-up for torch
        t = time.perf_counter()
        run(batches[0])
        compile_s[impl] = time.perf_counter() - t
    times = {impl: [] for impl in runners}
    for r in range(args.rounds):
        for impl, run in runners.items():
            for s in range(args.steps):
                t = time.perf_counter()
                run(batches[(r * args.steps + s) % len(batches)])
                times[impl].append(time.perf_counter() - t)
    flops_per_token = training_flops_per_token(cfg, args.seq, include_mtp=False)
    rows = {}
    for impl, ts in times.items():
        median = statistics.median(ts)
        rows[impl] = {
            "step_s_median": median,
            "step_s_min": min(ts),
            "tokens_per_s": tokens_per_step / median,
            "mfu": flops_per_token * tokens_per_step / median / peak,
            # this VM's neighbours make step times vary run to run by up to ~30%: report the best too
            "mfu_best_step": flops_per_token * tokens_per_step / min(ts) / peak,
            "first_step_s": compile_s[impl],
        }
    out = {"family": cfg.hf_model_type, "moe_impl": cfg.moe_impl, "train_flops_per_token": flops_per_token,
           "torch_threads": torch_threads, "results": rows}
    if "hf" in rows:
        out["speedup_vs_hf"] = rows["c2jax"]["tokens_per_s"] / rows["hf"]["tokens_per_s"]
    return out

if __name__ == "__main__":
    main()
