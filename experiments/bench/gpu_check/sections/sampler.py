"""Section `sampler`: greedy decode tokens/s of the inference engine at batch 1/8/32 and the bandwidth they
use (a byte model of one decode step against the measured copy bandwidth), then MTP speculative decoding:
its equality with plain greedy decoding and its speed-up at batch 1."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from flax import nnx

from c2jax.models.config import preset
from c2jax.models.inference import EngineConfig, InferenceEngine, Request, cache_bytes_per_token
from c2jax.models.transformer import init
from experiments.bench.gpu_check.sections.context import DRY_MODEL, Context, Skip, copy_bandwidth


@dataclasses.dataclass(frozen=True)
class Setup:
    """This section's model and generation lengths."""

    cfg: object
    graphdef: object
    state: object
    prompt_len: int
    new: int
    chunk: int
    spec_k: int

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.new + 2 * self.chunk + self.spec_k + 1  # room for a speculative round


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Bytes read per decode step: every non-expert weight + the routed experts a batch of b touches in
    expectation + b embedding rows + the latent cache read."""

    weights: int  # non-expert parameters, MTP excluded (plain decoding does not read them)
    experts: int
    embed_row: int
    latent_per_token: int
    routed_share: float  # k / E: the share of the experts one token routes to

    def at(self, b: int, mean_len: float) -> float:
        touched = 1 - (1 - self.routed_share) ** b
        return self.weights + touched * self.experts + b * self.embed_row + b * mean_len * self.latent_per_token


def run(ctx: Context) -> None:
    name = ctx.size("medium", "tiny")
    # with its MTP module (medium has one): unused by plain decoding, the draft model of speculative decoding
    # dry run: fp32, where speculative greedy must equal plain greedy exactly (checked by the speed run below)
    dtype = ctx.size("bfloat16", "float32")
    cfg = preset(name).replace(num_nextn_predict_layers=1, dtype=dtype, **ctx.size({}, DRY_MODEL))
    prompt_len, new, chunk = ctx.size((128, 64, 16), (8, 8, 4))
    batches = ctx.size((1, 8, 32), (1,))
    graphdef, state = nnx.split(init(cfg, seed=0))
    setup = Setup(cfg, graphdef, state, prompt_len, new, chunk, spec_k=2)
    ctx.set("setup", {"preset": name, "dtype": f"{dtype} compute, float32 params", "prompt": prompt_len,
                      "new_tokens": new, "chunk_steps": chunk, "greedy": True,
                      "bytes_model": "per decode step: every non-expert weight + the routed experts a batch of b "
                                     "touches in expectation (1 - (1 - k/E)^b of them) + b embedding rows + the "
                                     "latent cache read (b x mean length x cache bytes/token)"})
    bw = ctx.sub("copy_GBps", lambda: copy_bandwidth(ctx.size(1 << 30, 8 << 20)) / 1e9, need_s=2)
    step_bytes = decode_step_bytes(cfg, state)
    rng = np.random.default_rng(0)
    prompts_by_batch = {b: rng.integers(1, cfg.vocab_size, size=(b, prompt_len)).tolist() for b in (*batches, 1)}
    outputs = {}  # batch: plain greedy outputs
    for b in batches:
        r = ctx.sub(f"batch{b}", plain_decode, setup, prompts_by_batch[b], step_bytes, bw, outputs,
                    need_s=ctx.size(10, 1))
        if isinstance(r, dict):
            ctx.headline(f"b={b}: {r['decode_tokens_per_s']:,.0f} tok/s"
                         + (f" ({r['bandwidth_utilisation_pct']:.0f}% bw)" if "bandwidth_utilisation_pct" in r else ""))
    # MTP speculative decoding: equality on the tiny preset (cheap to compile), speed on this section's model
    tiny = preset("tiny").replace(**DRY_MODEL) if ctx.dry_run else preset("tiny")
    few = rng.integers(1, tiny.vocab_size, size=(ctx.size(2, 1), 16)).tolist()
    ctx.sub("mtp_speculative/equality", speculation_equality, ctx, setup, tiny, few, need_s=ctx.size(10, 1))
    r = ctx.sub("mtp_speculative/speed_batch1", speculation_speed, ctx, setup, prompts_by_batch[1], outputs,
                need_s=ctx.size(15, 1))
    if isinstance(r, dict):
        ctx.headline(f"MTP speculation b=1: {r['speedup']:.2f}x, acceptance {r['acceptance_rate']}")


def decode_step_bytes(cfg, state) -> StepBytes:
    weight_bytes, expert_bytes, embed_row_bytes = 0, 0, 0
    for path, leaf in nnx.to_flat_state(nnx.filter_state(state, nnx.Param)):
        value = leaf.get_value()
        axes = leaf.get_metadata().get("logical_axes", ())
        if "experts" in axes and "expert_mlp" in axes:
            expert_bytes += value.nbytes
        elif path[0] == "embed_tokens":
            embed_row_bytes = value.nbytes // value.shape[0]
        elif path[0] == "mtp":  # not read by plain decoding
            continue
        else:
            weight_bytes += value.nbytes
    latent_bytes, _ = cache_bytes_per_token(cfg)
    return StepBytes(weight_bytes, expert_bytes, embed_row_bytes, latent_bytes,
                     cfg.num_experts_per_tok / cfg.n_routed_experts)


def plain_decode(s: Setup, prompts, step_bytes: StepBytes, bw: float | None, outputs: dict) -> dict:
    """Greedy decoding of `prompts` (one batch): rates, and the step's bytes as a share of the copy bandwidth.
    Keeps the outputs in `outputs[batch]` for the speculative run to compare with."""
    b = len(prompts)
    config = EngineConfig(slots=b, max_len=s.max_len, chunk_steps=s.chunk)
    decode_rate, rate, ttft, outputs[b], _ = engine_rates(s.cfg, s.graphdef, s.state, prompts, s.new, config)
    per_step = b / decode_rate
    step = step_bytes.at(b, mean_len=s.prompt_len + s.new / 2)
    r = {"tokens_per_s": rate, "decode_tokens_per_s": decode_rate, "ttft_s": ttft,
         "decode_step_ms": 1e3 * per_step, "bytes_per_step_GB": step / 1e9,
         "effective_GBps": step / per_step / 1e9}
    if bw:
        r["bandwidth_utilisation_pct"] = 100 * r["effective_GBps"] / bw
    return r


def speculation_equality(ctx: Context, s: Setup, tiny, few) -> dict:
    if s.cfg.dtype == "float32":
        raise Skip("this section's model is fp32 here: the speed run below checks the same equality on it")
    return mtp_speculation_equal(ctx, tiny, few, ctx.size(32, 8), 4)


def speculation_speed(ctx: Context, s: Setup, prompts1, outputs: dict) -> dict:
    plain = ctx.record["results"].get("batch1")
    if not isinstance(plain, dict):
        raise Skip("needs the batch-1 plain decoding figure of this section, which did not run")
    config = EngineConfig(slots=1, max_len=s.max_len, chunk_steps=s.chunk, speculative_k=s.spec_k,
                          speculative_rounds=4, speculative_max_batch=1, speculative_adaptive=False)
    spec = engine_rates(s.cfg, s.graphdef, s.state, prompts1, s.new, config)
    if s.cfg.dtype == "float32":  # exact arithmetic up to rounding: greedy speculation is plain greedy
        ctx.check("sampler MTP speculative greedy == plain greedy (fp32)", spec[3] == outputs[1],
                  f"1 x {s.new} tokens, k = {s.spec_k}")
    return {"batch": 1, "k": s.spec_k, "plain_decode_tokens_per_s": plain["decode_tokens_per_s"],
            "speculative_decode_tokens_per_s": spec[0], "speedup": spec[0] / plain["decode_tokens_per_s"],
            "acceptance_rate": spec[4].acceptance_rate,
            "note": "random weights: the acceptance (and so the speed-up) of a trained model will differ"}


def engine_rates(cfg, graphdef, state, prompts, new, config):
    """(decode tokens/s excluding the first token's time, tokens/s, ttft s, outputs, engine) of a greedy
    generation; compiled first."""
    engine = InferenceEngine(cfg, graphdef, state, config=config)
    reqs = [Request(p, new, temperature=0.0) for p in prompts]
    first = [Request(p, 1, temperature=0.0) for p in prompts]
    engine.generate(reqs)  # compile every shape used below
    engine.generate(first)
    t0 = time.perf_counter()
    engine.generate(first)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    total = time.perf_counter() - t0
    assert all(len(r.token_ids) == new for r in out)
    b = len(prompts)
    decode_s = max(total - ttft, 1e-9)
    return b * (new - 1) / decode_s, b * new / total, ttft, [r.token_ids for r in out], engine


def speculative_engines(cfg, prompts, new, chunk, k=2):
    """(plain, speculative) `engine_rates` of one model with an MTP module, greedy."""
    if "speculative_k" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        raise Skip("MTP speculative decoding is not implemented (EngineConfig has no speculative_k)")
    cfg = cfg.replace(num_nextn_predict_layers=max(cfg.num_nextn_predict_layers, 1))
    graphdef, state = nnx.split(init(cfg, seed=0))
    base = dict(slots=len(prompts), max_len=len(prompts[0]) + new + 2 * chunk + k + 1, chunk_steps=chunk)
    plain = engine_rates(cfg, graphdef, state, prompts, new, EngineConfig(**base))
    spec = engine_rates(cfg, graphdef, state, prompts, new, EngineConfig(
        **base, speculative_k=k, speculative_rounds=4, speculative_max_batch=len(prompts),
        speculative_adaptive=False))  # forced on: this measures speculation itself
    return plain, spec


def mtp_speculation_equal(ctx: Context, cfg, prompts, new, chunk):
    """Greedy speculative decoding emits exactly plain greedy decoding (models/inference/speculative.py):
    checked in fp32 at the highest matmul precision, where the one-pass verify and the step-by-step decode
    agree to rounding (in bf16 a near-tie may flip and the sequences part, which says nothing)."""
    with jax.default_matmul_precision("highest"):
        plain, spec = speculative_engines(cfg.replace(dtype="float32"), prompts, new, chunk)
    same = plain[3] == spec[3]
    agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(plain[3], spec[3])]
    ctx.check("sampler MTP speculative greedy == plain greedy (fp32)", same,
              f"{len(prompts)} x {new} tokens; tokens equal before the first difference: {agree}")
    return {"outputs_equal": same, "equal_prefix_tokens": agree, "acceptance_rate": spec[4].acceptance_rate}
