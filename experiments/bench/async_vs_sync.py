"""Async vs sync RL throughput on the same CPU budget: samples/s, tokens/s, steps/s, learner busy fraction
and mean / max staleness, at bounded staleness, in one run. Real InferenceEngine samplers and the rl_step
learner on local Ray, the single-turn target task; `env.delay_s` emulates the sandbox/grader time of an
agentic rollout (what asynchrony overlaps) and `env.delay_sigma` its spread (log-normal around the median).

Two token profiles by default (PROFILES: generation-heavy "short", prefill-heavy "agentic"; "agentic_wide" is
the agentic one at 16 groups a step) x two latency scenarios, each sync then async with identical actors
and settings:
- constant (sigma 0): asynchrony can only overlap the learner step with rollouts;
- heavy-tailed (sigma 1): real test suites' run times vary by orders of magnitude; a synchronous step waits
  for the slowest of its batch's rollouts, an asynchronous run keeps every rollout slot busy meanwhile.

    python -m experiments.bench.async_vs_sync [--steps 24] [--delay 0.3] [--sigmas 0,1]
        [--profiles short,agentic] [key=value ...]

Prints a table and writes runs/bench/async_vs_sync.json.

    python -m experiments.bench.async_vs_sync --group-episodes G [--turns 3]

instead times one agentic group on a rollout worker's sampler (EnginePolicy, the tiny model over the
byte tokenizer, harness episodes without tools in a local sandbox): its G episodes one after another,
then concurrently (one thread each, sharing the engine's slots), as RolloutWorker runs them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from c2jax.bench_report import write_results
from c2jax.machine import describe

# The tiny preset widened to hidden 512, so one rl_step (~0.25 s alone, ~0.5 s beside the samplers) is
# comparable to generating a step's batch (~0.25 s for 4 groups x 8 samples x 16 tokens on one engine), as on
# a cluster where training and sampling are both heavy.
BASE = ["model.preset=tiny", "model.vocab_size=16", "model.hidden_size=512", "model.num_hidden_layers=4",
        "model.num_nextn_predict_layers=0", "model.moe_impl=dense", "model.n_group=1", "model.topk_group=1",
        "rl.learning_rate=3e-3", "rl.loss.constant_normalizer=256", "env.gen_len=16", "env.prompt_len=2",
        "system.seq_len=24", "system.group_size=8", "system.groups_per_step=4", "engine.slots=32",
        "engine.max_len=32", "engine.chunk_steps=4", "engine.key_bucket=32", "engine.min_prompt_bucket=2",
        "resume=false", "dashboard=false", "checkpoint.every=1000", "system.num_rollout_workers=2",
        "system.groups_per_worker=4"]


# Token profiles of a step's samples. "short": a 2-token prompt, 16 sampled tokens (generation-heavy, like
# single-turn reasoning). "agentic": a 64-token context, 8 sampled tokens, as in agentic RL where most of a
# trajectory is tool output the sampler only prefills but the learner runs forward and backward over.
_AGENTIC = ["env.prompt_len=64", "env.gen_len=8", "system.seq_len=72", "engine.max_len=80",
            "engine.key_bucket=80", "engine.min_prompt_bucket=64"]
# "agentic_wide": the agentic profile with 16 groups a step. The staleness bound admits (bound + 1) x
# groups_per_step groups in flight (48 here, 12 at 4 groups a step), enough to cover a heavy latency tail
# and keep the learner fed; each rollout worker runs 24 groups at once on a 64-slot engine.
PROFILES = {
    "short": [],
    "agentic": _AGENTIC,
    "agentic_wide": [*_AGENTIC, "system.groups_per_step=16", "system.groups_per_worker=24", "engine.slots=64"],
}


def measure(mode: str, steps: int, delay: float, staleness: int, out_dir: Path, extra: list[str],
            warmup: int, sigma: float = 0.0) -> dict:
    from c2jax.config import load
    from c2jax.rl.system.config import RLSystemConfig
    from c2jax.rl.system.reconciler import run_system

    cfg = load(RLSystemConfig, None, [*BASE, f"system.mode={mode}", f"system.steps={steps}", f"env.delay_s={delay}",
                                    f"env.delay_sigma={sigma}", f"system.max_staleness={staleness}",
                                    f"output_dir={out_dir}",
                                    f"name={mode}-{int(time.time())}", *extra])
    out = run_system(cfg)
    hist = out["history"]
    # the first steps include start-up, compilation (learner, prefill buckets of in-flight re-prefills) and,
    # in async mode, draining the queue filled while the learner compiled: rates are over the steady state
    warm = hist[warmup:]
    dt = warm[-1]["time/wall_s"] - hist[warmup - 1]["time/wall_s"]
    samples = sum(r["tokens_trained"] for r in warm) / (cfg.env.gen_len)
    tokens = sum(r["tokens_trained"] for r in warm)
    busy = sum(r["learner/step_s"] for r in warm) / dt
    return {"mode": mode, "delay_s": delay, "delay_sigma": sigma, "steps": len(warm), "wall_s": dt,
            "samples_per_s": samples / dt,
            "tokens_per_s": tokens / dt, "steps_per_s": len(warm) / dt, "learner_busy": busy,
            "staleness_mean": float(np.mean([r["staleness/batch_mean"] for r in warm])),
            "staleness_max": int(max(r["staleness/batch_max"] for r in warm)),
            "dropped_stale": out["counts"].get("groups_dropped_stale", 0),
            "reward_first": hist[0]["reward/mean"], "reward_last": hist[-1]["reward/mean"],
            "sync_kib_per_step": float(np.mean([r["sync/bytes"] for r in warm]) / 1024)}


def measure_group(group: int, turns: int, repeats: int = 2) -> dict:
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from c2jax.config import load
    from c2jax.rl.harness import (
        ChatRenderer,
        EpisodeConfig,
        EpisodeTask,
        SamplerAgent,
        ToolRegistry,
        run_episode,
    )
    from c2jax.rl.sandbox import LocalSandbox
    from c2jax.rl.system.actors import BackendTokenPolicy
    from c2jax.rl.system.backends import EnginePolicy, flatten_weights
    from c2jax.rl.system.config import RLSystemConfig
    from c2jax.rl.system.envs import byte_tokenizer

    cfg = load(RLSystemConfig, None, ["model.preset=tiny", "model.vocab_size=264", "model.num_nextn_predict_layers=0",
                                    "model.moe_impl=dense", f"engine.slots={max(group, 2)}", "engine.max_len=512",
                                    "engine.chunk_steps=8", "engine.key_bucket=128", "engine.min_prompt_bucket=64"])
    renderer = ChatRenderer(byte_tokenizer())
    backend = EnginePolicy(cfg, renderer.decode)
    from flax import nnx

    from c2jax.models.transformer import init
    backend.load(flatten_weights(*nnx.split(init(cfg.model, 0), nnx.Param, ...)[1:]), 0)
    policy = BackendTokenPolicy(backend, lambda: None)
    ecfg = EpisodeConfig(max_turns=turns, max_new_tokens_per_turn=32, max_context_tokens=512,
                         end_on_no_tool_calls=False, system_instructions="You are a coding agent. " * 4)
    repo = Path(tempfile.mkdtemp()) / "repo"
    repo.mkdir()
    (repo / "a.txt").write_text("a\n")

    def episode(i):
        agent = SamplerAgent(policy, renderer)
        agent.tools_in_system_prompt = False
        with LocalSandbox(repo, allow_unisolated=True) as sb:
            return run_episode(agent, sb, EpisodeTask("t", "Fix the bug in a.txt."), ToolRegistry([]), ecfg,
                               seed=i).num_model_tokens

    def sequential():
        return sum(episode(i) for i in range(group))

    def concurrent():
        with ThreadPoolExecutor(group) as pool:
            return sum(pool.map(episode, range(group)))

    sequential(), concurrent()  # compile every prompt bucket and the decode chunk
    out = {"group": group, "turns": turns}
    for name, fn in (("sequential", sequential), ("concurrent", concurrent)):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            tokens = fn()
            times.append(time.perf_counter() - t0)
        out[f"{name}_s"], out[f"{name}_tokens"] = min(times), tokens
    out["speedup"] = out["sequential_s"] / out["concurrent_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=0, help="steps left out of the rates (0: max_staleness + 2)")
    ap.add_argument("--delay", type=float, default=0.3,
                    help="median emulated environment seconds per rollout (grading a ladder task: ~0.35 s, "
                         "experiments/bench/env_throughput.py)")
    ap.add_argument("--sigmas", default="0,1", help="latency spreads to run (log-normal sigma; 0: constant)")
    ap.add_argument("--profiles", default="short,agentic", help=f"token profiles to run: {', '.join(PROFILES)}")
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--group-episodes", type=int, default=0, help="time one agentic group of G episodes instead")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    machine = describe()
    if args.group_episodes:
        res = measure_group(args.group_episodes, args.turns)
        write_results(Path(args.out) / "rl_group_concurrency.json",
                      [{"episodes": name, "seconds": res[f"{name}_s"], "tokens": res[f"{name}_tokens"]}
                       for name in ("sequential", "concurrent")],
                      title=f"one group of {res['group']} episodes, {res['turns']} turns",
                      notes=[f"concurrent / sequential: {res['speedup']:.2f}x faster"], meta=res, machine=machine,
                      rows_key=None, indent=1)
        return

    from c2jax.rl.system.cluster import init_ray, shutdown_ray

    sigmas = [float(x) for x in args.sigmas.split(",")]
    profiles = args.profiles.split(",")
    unknown = set(profiles) - set(PROFILES)
    if unknown:
        raise SystemExit(f"unknown --profiles {sorted(unknown)}; expected some of {sorted(PROFILES)}")
    warmup = args.warmup or args.max_staleness + 2
    if args.steps <= warmup + 1:
        raise SystemExit(f"--steps {args.steps} leaves no steady-state steps after {warmup} warm-up steps")
    init_ray(num_cpus=args.num_cpus)
    out_dir = Path(args.out)
    rows = []
    try:
        for profile in profiles:
            for sigma in sigmas:
                for mode in ("sync", "async"):
                    row = measure(mode, args.steps, args.delay, args.max_staleness, out_dir / "async_vs_sync_runs",
                                  [*PROFILES[profile], *args.overrides], warmup, sigma)
                    rows.append({"profile": profile, **row})
                    print(f"{profile} sigma {sigma:g} {mode}: {row['samples_per_s']:.1f} samples/s, learner busy "
                          f"{row['learner_busy']:.0%}", flush=True)
    finally:
        shutdown_ray()
    speedups, notes = {}, []
    for profile in profiles:
        for sigma in sigmas:
            sync, asyn = (next(r for r in rows if r["profile"] == profile and r["delay_sigma"] == sigma
                               and r["mode"] == m) for m in ("sync", "async"))
            key = f"{profile}, sigma={sigma:g}"
            speedups[key] = asyn["samples_per_s"] / sync["samples_per_s"]
            notes.append(f"{key}: async / sync samples/s = {speedups[key]:.2f}x, async learner busy "
                         f"{asyn['learner_busy']:.0%}, staleness mean {asyn['staleness_mean']:.2f} "
                         f"max {asyn['staleness_max']}")
    write_results(out_dir / "async_vs_sync.json", rows, columns=[
        "profile", "delay_sigma", "mode", "samples_per_s", "tokens_per_s", "steps_per_s", "learner_busy",
        "staleness_mean", "staleness_max", "dropped_stale", "sync_kib_per_step", "reward_first", "reward_last"],
                  title=f"RL throughput: env delay median {args.delay}s/rollout, max_staleness "
                        f"{args.max_staleness}, steps {warmup + 1}..{args.steps}, {args.num_cpus} CPUs",
                  notes=notes, meta={"config": vars(args), "base_overrides": BASE,
                                     "profiles": {p: PROFILES[p] for p in profiles}, "async_over_sync": speedups},
                  rows_key="results", machine=machine, indent=1)


if __name__ == "__main__":
    main()
