"""MTP speculative decoding vs plain decoding: acceptance rate, tokens/s, speed-up, the draft's cost.

The `small` preset (one MTP module) is first trained by the pretraining step (`make_train_step`, CE + the MTP
self-distillation KL) for `--train-steps` steps on c2jax.train.synthetic.MarkovSource (every token has
`--branching` equally likely successors), so the MTP head drafts what the main model would say. Prompts are
documents of the same chain. For each batch size, temperature and k: an engine with `speculative_k = k`
(speculation forced on at that batch) against the same engine with speculation off, same requests.
  tokens/s      B * N / wall time of the generation, prefill included (compilation excluded: one warm-up
                run per shape)
  acceptance    drafts kept / drafts proposed
  tokens/round  tokens emitted per verify pass (1 + kept drafts, the bonus included)
  draft cost    one MTP step (module + head, T = 1) over one main-model decode step, same batch
Writes runs/bench/speculative.json; prints the machine's load (the numbers move with it).

  .venv/bin/python experiments/bench/speculative.py [--batches 1 4 8] [--ks 1 2 3] [--train-steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from c2jax.machine import describe, finish, summary_line  # noqa: E402
from c2jax.models.config import preset  # noqa: E402
from c2jax.models.inference import EngineConfig, InferenceEngine, Request, init_cache  # noqa: E402
from c2jax.models.inference.forward import extend, init_mtp_cache, mtp_step, prepare  # noqa: E402
from c2jax.models.transformer import init  # noqa: E402
from c2jax.train.step import init_train_state, make_train_step  # noqa: E402
from c2jax.train.synthetic import MarkovSource  # noqa: E402


def train(cfg, steps: int, branching: int, seed: int = 0, cache: str | None = None):
    """(model, source, metrics): `steps` pretraining steps with the MTP self-distillation loss on. With `cache`
    (an .npz path), weights trained earlier with the same settings are loaded instead of retrained."""
    source = MarkovSource(cfg.vocab_size, seq_len=128, batch_size=8, seed=seed, branching=branching, doc_len=128)
    model = init(cfg, seed=seed)
    graphdef, state = nnx.split(model)
    tag = f"{steps}-{branching}-{seed}"
    if cache and Path(cache).exists():
        saved = np.load(cache)
        if str(saved["tag"]) == tag:
            leaves = [jnp.asarray(saved[f"leaf{i}"]) for i in range(len(jax.tree.leaves(state)))]
            state = jax.tree.unflatten(jax.tree.structure(state), leaves)
            print(f"  loaded the trained weights from {cache}", flush=True)
            return nnx.merge(graphdef, state), source, json.loads(str(saved["metrics"]))
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, max(steps, 21), 3e-4), weight_decay=0.0)
    graphdef, ts = init_train_state(model, tx, seed)
    step = jax.jit(make_train_step(graphdef, tx, router_bias_rate=1e-3, mtp_weight=1.0, train_mtp=True),
                   donate_argnums=0)
    metrics = {}
    t0 = time.perf_counter()
    for i in range(steps):
        ts, m = step(ts, next(source))
        if i % 25 == 0 or i == steps - 1:
            metrics = {k: float(v) for k, v in m.items() if np.ndim(v) == 0}
            print(f"  train step {i}: " + " ".join(f"{k} {v:.3f}" for k, v in sorted(metrics.items())), flush=True)
    metrics["train_s"] = time.perf_counter() - t0
    model = nnx.merge(graphdef, ts.params, ts.model_state)
    if cache:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        leaves = {f"leaf{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(nnx.split(model)[1]))}
        np.savez(cache, tag=tag, metrics=json.dumps(metrics), **leaves)
    return model, source, metrics


def chain_prompts(source: MarkovSource, batch: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(batch):
        t = int(rng.integers(1, source.vocab))
        row = [t]
        for _ in range(length - 1):
            t = int(source.successors[t, rng.integers(source.successors.shape[1])])
            row.append(t)
        prompts.append(row)
    return prompts


def run(graphdef, state, cfg, prompts, new_tokens, temperature, k, chunk_steps):
    config = EngineConfig(slots=len(prompts), max_len=len(prompts[0]) + new_tokens + 4 * chunk_steps,
                          chunk_steps=chunk_steps, speculative_k=k,
                          speculative_rounds=max(1, chunk_steps // (k + 1)) if k else 4,
                          speculative_max_batch=len(prompts))
    reqs = [Request(p, new_tokens, temperature=temperature, seed=i) for i, p in enumerate(prompts)]
    InferenceEngine(cfg, graphdef, state, config=config).generate(reqs)  # compile every shape
    engine = InferenceEngine(cfg, graphdef, state, config=config)
    ids = [engine.submit(r) for r in reqs]
    t0 = time.perf_counter()
    while engine.has_work:  # the first step prefills the batch, then every step decodes one chunk
        engine.step()
    total = time.perf_counter() - t0
    results = [engine.pop_result(i) for i in ids]
    stats = engine.spec_stats
    return {"tokens_per_s": sum(len(r.token_ids) for r in results) / total, "total_s": total,
            "acceptance": engine.acceptance_rate,
            "tokens_per_round": (stats["accepted"] + stats["rounds"]) / stats["rounds"] if stats["rounds"] else None,
            "tokens": [r.token_ids for r in results]}


def draft_cost(graphdef, state, cfg, batch: int, length: int, reps: int = 20) -> dict:
    """Seconds of one main-model decode step and of one MTP draft step (module + head) at this batch."""
    prepared = prepare(graphdef, state)
    key_len = length
    tokens = jnp.ones((batch, 1), jnp.int32)
    start = jnp.full(batch, length // 2, jnp.int32)
    main = jax.jit(lambda s, c: extend(cfg, graphdef, s, c, tokens, None, start, key_len=key_len).logits)
    hidden = jnp.ones((batch, 1, cfg.hidden_size), jnp.dtype(cfg.dtype))

    def mtp(s, c):
        return mtp_step(cfg, prepare(graphdef, s), 0, c[0], hidden, tokens, None, start, key_len=key_len)[1]

    mtp = jax.jit(mtp)
    del prepared
    out = {}
    for name, fn, cache in (("main_step_s", main, init_cache(cfg, batch, length)),
                            ("draft_step_s", mtp, init_mtp_cache(cfg, batch, length))):
        fn(state, cache).block_until_ready()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(state, cache).block_until_ready()
            times.append(time.perf_counter() - t0)
        out[name] = float(np.median(times))
    out["draft_over_main"] = out["draft_step_s"] / out["main_step_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--chunk-steps", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--branching", type=int, default=2)
    ap.add_argument("--cache", default="runs/bench/speculative_small_mtp.npz", help="trained weights ('' = none)")
    ap.add_argument("--out", default="runs/bench/speculative.json")
    args = ap.parse_args(argv)
    machine = describe()
    cfg = preset("small")
    print(f"training small ({cfg.num_nextn_predict_layers} MTP module) for {args.train_steps} steps", flush=True)
    model, source, train_metrics = train(cfg, args.train_steps, args.branching, cache=args.cache or None)
    graphdef, state = nnx.split(model)
    rows = []
    for batch in args.batches:
        prompts = chain_prompts(source, batch, args.prompt, seed=batch)
        cost = draft_cost(graphdef, state, cfg, batch, args.prompt + args.new)
        for temperature in args.temperatures:
            plain = run(graphdef, state, cfg, prompts, args.new, temperature, 0, args.chunk_steps)
            for k in args.ks:
                spec = run(graphdef, state, cfg, prompts, args.new, temperature, k, args.chunk_steps)
                same = spec["tokens"] == plain["tokens"] if temperature == 0 else None
                row = {"batch": batch, "temperature": temperature, "k": k,
                       "plain_tokens_per_s": plain["tokens_per_s"],
                       "spec_tokens_per_s": spec["tokens_per_s"],
                       "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
                       "acceptance": spec["acceptance"], "tokens_per_round": spec["tokens_per_round"],
                       "greedy_identical": same, **cost}
                rows.append(row)
                print(row, flush=True)
    pays = [r["batch"] for r in rows if r["speedup"] > 1.0]
    print(f"\nsmall preset, fp32, {jax.devices()[0].platform}, MTP trained {args.train_steps} steps "
          f"(mtp_agree {train_metrics.get('mtp_agree', float('nan')):.3f}), prompt {args.prompt}, new {args.new}")
    print(f"{'batch':>5} {'T':>4} {'k':>2} | {'plain tok/s':>11} {'spec tok/s':>10} {'speed-up':>8} | "
          f"{'accept':>6} {'tok/round':>9} | {'draft/main':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['temperature']:>4.1f} {r['k']:>2} | {r['plain_tokens_per_s']:>11.1f} "
              f"{r['spec_tokens_per_s']:>10.1f} {r['speedup']:>7.2f}x | {r['acceptance']:>6.2f} "
              f"{r['tokens_per_round']:>9.2f} | {r['draft_over_main']:>10.2f}")
    print(f"largest batch where some k paid: {max(pays) if pays else None}")
    machine = finish(machine)
    print(f"machine: {summary_line(machine)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "preset": "small", "prompt_tokens": args.prompt, "new_tokens": args.new, "chunk_steps": args.chunk_steps,
        "train_steps": args.train_steps, "branching": args.branching, "train_metrics": train_metrics,
        "machine": machine, "rows": rows, "largest_batch_that_paid": max(pays) if pays else None}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
