"""MTP speculative decoding vs plain decoding: acceptance rate, tokens/s, speed-up, the draft's cost.

The `small` preset (one MTP module) is first trained by the pretraining step (`make_train_step`, CE + the MTP
self-distillation KL) for `--train-steps` steps on c2jax.train.synthetic.MarkovSource (every token has
`--branching` equally likely successors), so the MTP head drafts what the main model would say. Prompts are
documents of the same chain. For each batch size, temperature and k: an engine with `speculative_k = k`
(speculation forced on at that batch), the same engine with speculation off, and the adaptive engine (the
default: it speculates only where it measured speculation faster, spec_policy.py), same requests.
  tokens/s      B * N / wall time of the generation, prefill included (compilation excluded: one warm-up
                run per shape)
  auto/best     the adaptive engine's tokens/s over the better of plain and forced speculation
  auto spec%    share of the adaptive engine's chunks that speculated (its re-probes included)
  acceptance    drafts kept / drafts proposed
  tokens/round  tokens emitted per verify pass (1 + kept drafts, the bonus included)
  round/step    one speculative round (k draft steps + a (k+1)-token verify + the rule + MTP cache upkeep) over
                one plain decode step, both measured in a lax.scan of 8 (spec_decode_chunk, decode_chunk);
                tokens/round over it is the speed-up the device work allows (the host loop aside)
  draft step    (round at k - round at k = 0) / k over a plain step: one MTP step plus one more verify token
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

from c2jax.bench_report import Col, write_results  # noqa: E402
from c2jax.machine import describe  # noqa: E402
from c2jax.models.config import preset  # noqa: E402
from c2jax.models.inference import EngineConfig, InferenceEngine, Request, init_cache  # noqa: E402
from c2jax.models.inference.forward import init_mtp_cache, unstack  # noqa: E402
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


def _engine_config(prompts, new_tokens, k, chunk_steps, adaptive=False):
    return EngineConfig(slots=len(prompts), max_len=len(prompts[0]) + new_tokens + 4 * chunk_steps,
                        chunk_steps=chunk_steps, speculative_k=k,
                        speculative_rounds=max(1, chunk_steps // (k + 1)) if k else 4,
                        speculative_max_batch=len(prompts), speculative_adaptive=adaptive)


def _generate(engine, reqs):
    ids = [engine.submit(r) for r in reqs]
    before = dict(engine.spec_stats)
    t0 = time.perf_counter()
    while engine.has_work:  # the first step prefills the batch, then every step decodes one chunk
        engine.step()
    total = time.perf_counter() - t0
    results = [engine.pop_result(i) for i in ids]
    stats = {key: engine.spec_stats[key] - before[key] for key in before}
    chunks = stats["spec_chunks"] + stats["plain_chunks"]
    return {"tokens_per_s": sum(len(r.token_ids) for r in results) / total, "total_s": total,
            "acceptance": stats["accepted"] / stats["drafted"] if stats["drafted"] else None,
            "tokens_per_round": (stats["accepted"] + stats["rounds"]) / stats["rounds"] if stats["rounds"] else None,
            "spec_chunk_share": stats["spec_chunks"] / chunks if chunks else None,
            "tokens": [r.token_ids for r in results]}


def compare(graphdef, state, cfg, prompts, new_tokens, temperature, k, chunk_steps, repeats):
    """Plain, speculative (forced on) and adaptive generation (the engine's default: per chunk, the mode that
    measured faster at this batch size) of the same requests, alternated `repeats` times (the machine's load
    drifts; alternating exposes all to it alike); the median run of each. Each engine lives across the runs,
    as a rollout server's does: the adaptive one keeps what it measured (its warm-up is in the first run)."""
    reqs = [Request(p, new_tokens, temperature=temperature, seed=i) for i, p in enumerate(prompts)]
    engines = {"plain": _engine_config(prompts, new_tokens, 0, chunk_steps),
               "spec": _engine_config(prompts, new_tokens, k, chunk_steps),
               "auto": _engine_config(prompts, new_tokens, k, chunk_steps, adaptive=True)}
    engines = {name: InferenceEngine(cfg, graphdef, state, config=c) for name, c in engines.items()}
    for engine in engines.values():
        _generate(engine, reqs)  # compile every shape (and the adaptive engine's warm-up)
    runs = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            runs[name].append(_generate(engine, reqs))
    med = {name: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for name, rs in runs.items()}
    med["auto"]["report"] = engines["auto"].spec_policy.report()
    return med["plain"], med["spec"], med["auto"]


def round_costs(graphdef, state, cfg, batch: int, ks, length: int, rounds: int = 8, reps: int = 5) -> dict:
    """Milliseconds per round of spec_decode_chunk at each k (k = 0: a plain step plus the MTP cache upkeep)
    and per plain decode step (steps.decode_chunk), all slots live, `rounds` rounds per call."""
    from c2jax.models.inference.sampling import SamplingParams
    from c2jax.models.inference.speculative import init_spec_state, spec_decode_chunk
    from c2jax.models.inference.steps import SlotState, decode_chunk

    graphdef, state = unstack(graphdef, state)  # as the engine runs them
    sampling = SamplingParams(jnp.zeros(batch), jnp.ones(batch), jnp.zeros(batch, jnp.int32),
                              jnp.zeros(batch, jnp.uint32))
    stop = jnp.full((batch, 4), -1, jnp.int32)
    key_len = -(-(length // 2 + rounds * (max(ks) + 1) + 1) // 64) * 64

    def slots():
        return SlotState(jnp.ones(batch, jnp.int32), jnp.full(batch, length // 2, jnp.int32),
                         jnp.ones(batch, bool), jnp.full(batch, 10_000, jnp.int32))

    def timed(fn):
        jax.block_until_ready(fn())
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) / rounds * 1e3

    out = {"plain_step_ms": timed(lambda: decode_chunk(cfg, graphdef, state, init_cache(cfg, batch, length),
                                                       slots(), stop, sampling, steps=rounds, key_len=key_len))}
    for k in (0, *ks):
        out[f"round_k{k}_ms"] = timed(lambda k=k: spec_decode_chunk(
            cfg, graphdef, state, init_cache(cfg, batch, length), init_mtp_cache(cfg, batch, length), slots(),
            init_spec_state(cfg, batch), stop, sampling, rounds=rounds, k=k, key_len=key_len))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--chunk-steps", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=3)
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
        costs = round_costs(graphdef, state, cfg, batch, args.ks, args.prompt + args.new + 64)
        print(f"batch {batch}: {costs}", flush=True)
        for temperature in args.temperatures:
            for k in args.ks:
                plain, spec, auto = compare(graphdef, state, cfg, prompts, args.new, temperature, k,
                                            args.chunk_steps, args.repeats)
                same = spec["tokens"] == plain["tokens"] == auto["tokens"] if temperature == 0 else None
                cost = {"plain_step_ms": costs["plain_step_ms"], "round_ms": costs[f"round_k{k}_ms"],
                        "round_over_plain_step": costs[f"round_k{k}_ms"] / costs["plain_step_ms"],
                        "draft_step_over_plain_step": (costs[f"round_k{k}_ms"] - costs["round_k0_ms"])
                        / k / costs["plain_step_ms"]}
                row = {"batch": batch, "temperature": temperature, "k": k,
                       "plain_tokens_per_s": plain["tokens_per_s"],
                       "spec_tokens_per_s": spec["tokens_per_s"],
                       "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
                       "auto_tokens_per_s": auto["tokens_per_s"],
                       "auto_over_best": auto["tokens_per_s"] / max(plain["tokens_per_s"], spec["tokens_per_s"]),
                       "auto_spec_chunk_share": auto["spec_chunk_share"], "auto_policy": auto["report"],
                       "acceptance": spec["acceptance"], "tokens_per_round": spec["tokens_per_round"],
                       "greedy_identical": same, **cost}
                rows.append(row)
                print(row, flush=True)
    pays = [r["batch"] for r in rows if r["speedup"] > 1.0]
    paid = max(pays) if pays else None
    print()
    write_results(args.out, rows, title=f"small preset, fp32, {jax.devices()[0].platform}, MTP trained "
                  f"{args.train_steps} steps (train mtp_acceptance "
                  f"{train_metrics.get('mtp_acceptance', float('nan')):.3f}), prompt {args.prompt}, new {args.new}",
                  columns=[
        "batch", ("temperature", "T", ".1f"), "k", ("plain_tokens_per_s", "plain tok/s", ".1f"),
        ("spec_tokens_per_s", "spec tok/s", ".1f"), ("speedup", "speed-up", "{:.2f}x"),
        ("auto_tokens_per_s", "auto tok/s", ".1f"), ("auto_over_best", "auto/best", "{:.2f}x"),
        ("auto_spec_chunk_share", "auto spec%", ".0%"), ("acceptance", "accept", ".2f"),
        ("tokens_per_round", "tok/round", ".2f"), ("round_over_plain_step", "round/step", ".2f"),
        Col("tokens_per_round", "tok/round / (round/step)", ".2f",
            lambda r: r["tokens_per_round"] / r["round_over_plain_step"])],
        notes=[f"largest batch where some k paid: {paid}"], machine=machine,
        meta={"preset": "small", "prompt_tokens": args.prompt, "new_tokens": args.new,
              "chunk_steps": args.chunk_steps, "train_steps": args.train_steps, "branching": args.branching,
              "train_metrics": train_metrics, "largest_batch_that_paid": paid})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
