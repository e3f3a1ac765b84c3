"""c2jax.models.inference against the trainer's full-sequence forward (the independent reference here is the
trainer itself: c2jax.models.transformer.forward, already checked against HF transformers in test_hf_parity).

Spec:
  * prefill + latent-cache decode reproduces full-forward logits (fp32, rel err <= 1e-5), YaRN on and off;
  * absorbed decode == expanded decode;
  * sampler logprobs == log_softmax(full-forward logits / T) at the sampled tokens (mean |diff| < 1e-5);
  * continuous batching (more requests than slots) == one-at-a-time, greedy; shared-prefix caching too;
  * weight swap between chunks: the continuation equals a fresh engine on the new weights from the same
    prefix, and every token carries its version;
  * stop ids / stop strings / max tokens; same seed -> same sample regardless of batching;
  * prompts that do not fit the cache window raise ContextWindowExceeded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from c2jax.models.config import FAMILY_TINY_PRESETS, preset
from c2jax.models.inference import (
    ContextWindowExceeded,
    EngineConfig,
    InferenceEngine,
    Request,
    cache_bytes_per_token,
    extend,
    init_cache,
)
from c2jax.models.transformer import forward, init

CFG = preset("tiny")  # YaRN, q LoRA, grouped routing, 1 dense + 2 MoE layers
ENGINE = EngineConfig(slots=2, max_len=64, chunk_steps=4)
SEQ, PROMPT = 12, 5


@pytest.fixture(scope="module")
def model():
    return nnx.split(init(CFG, seed=0))


def _full_logits(cfg, graphdef, state, ids):
    return jax.jit(lambda s, i: forward(graphdef, s, i, return_mtp=False).logits)(state, ids)


def _cached_logits(cfg, graphdef, state, ids, absorbed):
    """Prefill PROMPT tokens (expanded path), then decode the rest one token at a time."""
    run = jax.jit(extend, static_argnames=("cfg", "graphdef", "key_len", "absorbed"))
    batch = ids.shape[0]
    out = run(cfg, graphdef, state, init_cache(cfg, batch, 32), ids[:, :PROMPT], None,
              jnp.zeros(batch, jnp.int32), key_len=32, absorbed=False)
    logits, cache = [out.logits], out.cache
    for t in range(PROMPT, ids.shape[1]):
        out = run(cfg, graphdef, state, cache, ids[:, t:t + 1], None, jnp.full(batch, t, jnp.int32),
                  key_len=32, absorbed=absorbed)
        logits.append(out.logits)
        cache = out.cache
    return jnp.concatenate(logits, axis=1)


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("yarn", [True, False])
def test_cached_decode_equals_full_forward(yarn):
    cfg = CFG if yarn else CFG.replace(rope_scaling=None)
    assert (cfg.rope_scaling is not None) == yarn
    graphdef, state = nnx.split(init(cfg, seed=0))
    ids = jax.random.randint(jax.random.key(1), (2, SEQ), 0, cfg.vocab_size)
    full = _full_logits(cfg, graphdef, state, ids)
    assert _rel(_cached_logits(cfg, graphdef, state, ids, absorbed=True), full) <= 1e-5


def test_absorbed_equals_expanded(model):
    graphdef, state = model
    ids = jax.random.randint(jax.random.key(2), (2, SEQ), 0, CFG.vocab_size)
    absorbed = _cached_logits(CFG, graphdef, state, ids, absorbed=True)
    expanded = _cached_logits(CFG, graphdef, state, ids, absorbed=False)
    assert _rel(absorbed, expanded) <= 1e-5


@pytest.mark.parametrize("backend", ["dense", "blockwise"])
def test_prefill_goes_through_the_attention_registry_and_matches_the_trainer(model, monkeypatch, backend):
    """The prefill (expanded) path calls the attention registry like the trainer: forced to each backend
    (C2JAX_ATTENTION), prefilling a whole sequence gives the trainer's logits, and a prefill in two chunks
    (the second chunk's queries at positions 7.., keys over the cache written so far) gives the same."""
    import dataclasses

    from c2jax.models import attention_backends as registry

    graphdef, state = model
    monkeypatch.setenv(registry.ENV_OVERRIDE, backend)
    calls = []
    chosen = registry.get(backend)
    monkeypatch.setitem(registry._BACKENDS, backend, dataclasses.replace(
        chosen, fn=lambda *a, **k: calls.append(a[0].shape) or chosen.fn(*a, **k)))
    ids = jax.random.randint(jax.random.key(3), (2, SEQ), 0, CFG.vocab_size)
    full = _full_logits(CFG, graphdef, state, ids)
    calls.clear()  # the trainer's forward uses the registry too
    zeros = jnp.zeros(2, jnp.int32)

    def run(cache, tokens, start):  # not jitted: the backend is chosen when it traces
        return extend(CFG, graphdef, state, cache, tokens, None, start, key_len=32, absorbed=False)

    one = run(init_cache(CFG, 2, 32), ids, zeros)
    assert _rel(one.logits, full) <= 1e-5
    first = run(init_cache(CFG, 2, 32), ids[:, :7], zeros)
    second = run(first.cache, ids[:, 7:], zeros + 7)
    assert _rel(jnp.concatenate([first.logits, second.logits], axis=1), full) <= 1e-5
    # every layer's prefill attention went to the chosen backend: [b, T, H, qk_head_dim] queries
    per_run = [(2, SEQ, CFG.num_attention_heads, CFG.qk_head_dim)] * CFG.num_hidden_layers
    assert calls == per_run + [(2, 7, *per_run[0][2:])] * CFG.num_hidden_layers + \
        [(2, SEQ - 7, *per_run[0][2:])] * CFG.num_hidden_layers


def test_latent_cache_is_smaller_than_expanded_kv():
    latent, expanded = cache_bytes_per_token(preset("deepseek-v3"))
    # DeepSeek-V2 sec. 2.1: (d_c + d_R) per layer vs 2 * n_h * d_h; here (512 + 64) vs 128 * (192 + 128)
    assert latent == 61 * 576 * 2 and expanded == 61 * 128 * 320 * 2


def _prompts(n):
    rng = np.random.default_rng(0)
    return [rng.integers(0, CFG.vocab_size, size=int(rng.integers(2, 9))).tolist() for _ in range(n)]


def test_sampler_logprobs_equal_trainer_logprobs(model):
    graphdef, state = model
    engine = InferenceEngine(CFG, graphdef, state, config=ENGINE)
    temperature = 0.7
    reqs = [Request(p, 10, temperature=temperature, seed=i) for i, p in enumerate(_prompts(2))]
    diffs, raw_diffs = [], []
    for req, res in zip(reqs, engine.generate(reqs), strict=True):
        seq = list(req.prompt_ids) + res.token_ids
        padded = jnp.asarray([seq + [0] * (32 - len(seq))], jnp.int32)
        logits = _full_logits(CFG, graphdef, state, padded)[0, len(req.prompt_ids) - 1: len(seq) - 1]
        targets = np.asarray(res.token_ids)[:, None]
        trainer = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits / temperature)), targets, -1)[:, 0]
        raw = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), targets, -1)[:, 0]
        diffs.append(np.abs(trainer - np.asarray(res.logprobs)))
        raw_diffs.append(np.abs(raw - np.asarray(res.raw_logprobs)))
        assert res.expert_ids.shape == (len(res.token_ids), CFG.num_moe_layers, CFG.num_experts_per_tok)
        # router replay: the experts recorded for token j are those the trainer picks at its input position
        replay = forward(graphdef, state, padded, return_mtp=False).expert_ids[:, 0]
        want = np.asarray(replay)[:, len(req.prompt_ids) - 1: len(seq) - 1].transpose(1, 0, 2)
        np.testing.assert_array_equal(np.sort(res.expert_ids, -1), np.sort(want, -1))
    assert np.mean(np.concatenate(diffs)) < 1e-5
    assert np.mean(np.concatenate(raw_diffs)) < 1e-5


def test_continuous_batching_equals_one_at_a_time(model):
    graphdef, state = model
    reqs = [Request(p, 6 + i, temperature=0.0) for i, p in enumerate(_prompts(5))]
    engine = InferenceEngine(CFG, graphdef, state, config=ENGINE)
    batched = engine.generate(reqs)  # 5 requests, 2 slots
    stats = engine.decode_stats  # every decode chunk timed: the device wait is part of the call's wall time
    assert stats["chunks"] >= 3 and 0 < stats["device_wait_s"] <= stats["wall_s"]
    single = InferenceEngine(CFG, graphdef, state, config=ENGINE)
    for req, got in zip(reqs, batched, strict=True):
        want = single.generate([req])[0]
        assert got.token_ids == want.token_ids
        assert len(got.token_ids) == req.max_new_tokens and got.finish_reason == "length"
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_prefix_cache_equals_full_prefill(model):
    graphdef, state = model
    system = [3, 1, 4, 1, 5, 9, 2, 6]
    reqs = [Request(system + tail, 6, temperature=0.0) for tail in ([7], [8, 9, 10], [])]
    plain = InferenceEngine(CFG, graphdef, state, config=ENGINE).generate(reqs)
    cached_engine = InferenceEngine(CFG, graphdef, state, config=ENGINE)
    cached_engine.set_prefix(system)
    cached = cached_engine.generate(reqs)
    for a, b in zip(plain, cached, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_array_equal(a.prompt_expert_ids, b.prompt_expert_ids)


def test_same_seed_same_sample_regardless_of_batching(model):
    graphdef, state = model
    prompt = _prompts(1)[0]
    req = Request(prompt, 8, temperature=1.0, top_p=0.9, top_k=20, seed=123)
    alone = InferenceEngine(CFG, graphdef, state, config=ENGINE).generate([req])[0]
    other = Request(_prompts(3)[2], 8, temperature=1.0, seed=5)
    together = InferenceEngine(CFG, graphdef, state, config=ENGINE).generate([other, req])[1]
    assert alone.token_ids == together.token_ids
    reseeded = InferenceEngine(CFG, graphdef, state, config=ENGINE).generate(
        [Request(prompt, 8, temperature=1.0, top_p=0.9, top_k=20, seed=124)])[0]
    assert reseeded.token_ids != alone.token_ids


def test_weight_swap_mid_generation(model):
    graphdef, old = model
    _, new = nnx.split(init(CFG, seed=1))
    req = Request(_prompts(1)[0], 12, temperature=0.0)
    engine = InferenceEngine(CFG, graphdef, old, config=ENGINE, version=0)
    rid = engine.submit(req)
    engine.step()  # prefill (1 token) + one chunk of 4: five tokens from version 0
    engine.swap_weights(new, version=1)
    while engine.has_work:
        engine.step()
    res = engine.pop_result(rid)
    assert res.policy_versions == [0] * 5 + [1] * 7
    fresh = InferenceEngine(CFG, graphdef, new, config=ENGINE, version=1)
    cont = fresh.generate([Request(list(req.prompt_ids) + res.token_ids[:5], 7, temperature=0.0)])[0]
    assert res.token_ids[5:] == cont.token_ids
    np.testing.assert_allclose(res.logprobs[5:], cont.logprobs, atol=1e-5)


def test_stop_conditions(model):
    graphdef, state = model
    engine = InferenceEngine(CFG, graphdef, state, config=ENGINE, detokenize=lambda ids: "".join(
        chr(65 + t % 26) for t in ids))
    prompt = _prompts(1)[0]
    free = engine.generate([Request(prompt, 10, temperature=0.0)])[0]
    stop_at = 3
    by_id = engine.generate([Request(prompt, 10, stop_token_ids=(free.token_ids[stop_at],), temperature=0.0)])[0]
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[stop_at]) + 1]
    assert by_id.finish_reason == "stop"
    text = "".join(chr(65 + t % 26) for t in free.token_ids)
    by_string = engine.generate([Request(prompt, 10, stop_strings=(text[4:6],), temperature=0.0)])[0]
    assert by_string.finish_reason == "stop" and by_string.token_ids == free.token_ids[: text.index(text[4:6]) + 2]


def test_too_long_is_refused(model):
    graphdef, state = model
    engine = InferenceEngine(CFG, graphdef, state, config=ENGINE)
    with pytest.raises(ContextWindowExceeded, match="cache window of 64"):
        engine.submit(Request([1] * 60, 5))
    with pytest.raises(ContextWindowExceeded):
        engine.set_prefix([1] * 65)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(Request([CFG.vocab_size], 5))


@pytest.mark.parametrize("speculative_k", [0, 3])
def test_group_prompt_prefilled_once(model, speculative_k):
    """A GRPO group (G samples of one prompt, admitted in the same step) runs one prefill; the other G - 1
    slots copy its cache rows and sample their first token from the same logits. Every sample equals the one
    the request gets from its own prefill (same seed, same positions), with a speculative engine too."""
    graphdef, state = model
    prompt = [7, 3, 9, 1, 4, 4, 2]
    group = [Request(prompt, 6, temperature=1.0, seed=s) for s in (0, 1)]
    config = EngineConfig(slots=2, max_len=64, chunk_steps=4, speculative_k=speculative_k, speculative_rounds=2)
    engine = InferenceEngine(CFG, graphdef, state, config=config)
    got = engine.generate(group)
    assert engine.prefill_stats == {"calls": 1, "tokens": len(prompt), "forks": 1}
    alone = InferenceEngine(CFG, graphdef, state, config=config)  # one request at a time: each prefills
    for request, result in zip(group, got, strict=True):
        want = alone.generate([request])[0]
        assert result.token_ids == want.token_ids
        np.testing.assert_allclose(result.logprobs, want.logprobs, atol=1e-5)
        np.testing.assert_array_equal(result.expert_ids, want.expert_ids)
        np.testing.assert_array_equal(result.prompt_expert_ids, want.prompt_expert_ids)
    assert alone.prefill_stats == {"calls": 2, "tokens": 2 * len(prompt), "forks": 0}
    assert got[0].token_ids != got[1].token_ids  # different seeds: different samples


def test_batched_prefill_equals_one_at_a_time(model):
    """Prompts admitted in the same step (different lengths, one padded bucket) run in one prefill call and
    give what each gets from its own prefill: first token, logprobs, prompt experts, continuation."""
    graphdef, state = model
    rng = np.random.default_rng(7)
    reqs = [Request(rng.integers(0, CFG.vocab_size, n).tolist(), 5, temperature=1.0, seed=n) for n in (3, 19)]
    batched = InferenceEngine(CFG, graphdef, state, config=ENGINE)
    got = batched.generate(reqs)
    assert batched.prefill_stats["calls"] == 1 and batched.prefill_stats["tokens"] == 22
    single = InferenceEngine(CFG, graphdef, state, config=ENGINE)
    for req, result in zip(reqs, got, strict=True):
        want = single.generate([req])[0]
        assert result.token_ids == want.token_ids
        np.testing.assert_allclose(result.logprobs, want.logprobs, atol=1e-5)
        np.testing.assert_array_equal(result.prompt_expert_ids, want.prompt_expert_ids)
        assert result.prompt_expert_ids.shape[0] == len(req.prompt_ids)
    assert single.prefill_stats["calls"] == 2


@pytest.mark.parametrize("speculative_k", [0, 3])
def test_chunked_prefill_equals_one_shot(model, speculative_k):
    """With a prefill budget of 4 tokens per step, a 19-token prompt is prefilled in 5 pieces while another
    sequence keeps decoding; its cache rows, first token, prompt experts and greedy continuation equal a
    one-shot prefill's, and the decoding sequence's tokens are unchanged."""
    graphdef, state = model
    rng = np.random.default_rng(11)
    short, long = (rng.integers(0, CFG.vocab_size, n).tolist() for n in (4, 19))
    reqs = [Request(short, 16, temperature=0.0), Request(long, 6, temperature=0.0)]
    extra = dict(speculative_k=speculative_k, speculative_rounds=2)
    oneshot = InferenceEngine(CFG, graphdef, state, config=EngineConfig(slots=2, max_len=64, chunk_steps=4, **extra))
    want = oneshot.generate([reqs[0]]) + oneshot.generate([reqs[1]])
    chunked = InferenceEngine(CFG, graphdef, state, config=EngineConfig(slots=2, max_len=64, chunk_steps=4,
                                                                        prefill_budget=4, **extra))
    first = chunked.submit(reqs[0])
    chunked.step()  # the short prompt is prefilled and decodes
    second = chunked.submit(reqs[1])
    for _ in range(4):  # 4 of the long prompt's 5 pieces, between decode chunks of the short sequence
        chunked.step()
    assert chunked._prefilling and chunked._prefilling[0].progress == 16
    chunked.step()
    assert not chunked._prefilling
    ref = InferenceEngine(CFG, graphdef, state, config=EngineConfig(slots=2, max_len=64, chunk_steps=4, **extra))
    ref.submit(reqs[1])
    ref.step()
    for got_c, ref_c in zip(chunked.cache, ref.cache, strict=True):  # slot 1 vs slot 0: the long prompt's rows
        np.testing.assert_allclose(got_c.latent[1, :19], ref_c.latent[0, :19], rtol=1e-5, atol=1e-6)
    while chunked.has_work:
        chunked.step()
    got = [chunked.pop_result(first), chunked.pop_result(second)]
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        np.testing.assert_array_equal(g.prompt_expert_ids, w.prompt_expert_ids)
    assert chunked.prefill_stats["calls"] == 6 and chunked.prefill_stats["tokens"] == 4 + 19


OTHER_FAMILIES = [name for family, name in FAMILY_TINY_PRESETS.items() if family != "deepseek_v3"]


@pytest.mark.parametrize("name", OTHER_FAMILIES)
def test_every_family_decodes_from_its_cache_as_the_trainer(name):
    """Each family's small preset (Qwen3-MoE, Qwen3, Llama: GQA K/V caches; DeepSeek-V2: MLA latents): prefill +
    one-token decode over the cache reproduces the trainer's full-sequence logits, through both decode paths."""
    cfg = preset(name)
    graphdef, state = nnx.split(init(cfg, seed=0))
    ids = jax.random.randint(jax.random.key(4), (2, SEQ), 0, cfg.vocab_size)
    full = _full_logits(cfg, graphdef, state, ids)
    for absorbed in (True, False):
        assert _rel(_cached_logits(cfg, graphdef, state, ids, absorbed=absorbed), full) <= 1e-5, absorbed


@pytest.mark.parametrize("name", OTHER_FAMILIES)
def test_every_family_samples_with_the_trainers_logprobs_and_experts(name):
    """The engine (continuous batching over 2 slots, shared-prefix caching) on each family: sampled-token logprobs
    equal the trainer's, MoE families record the trainer's experts for router replay, and batched generation equals
    one request at a time."""
    cfg = preset(name)
    graphdef, state = nnx.split(init(cfg, seed=1))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, size=int(rng.integers(2, 9))).tolist() for _ in range(3)]
    reqs = [Request(p, 8, temperature=0.8, seed=i) for i, p in enumerate(prompts)]
    results = InferenceEngine(cfg, graphdef, state, config=ENGINE).generate(reqs)
    for req, res in zip(reqs, results, strict=True):
        seq = list(req.prompt_ids) + res.token_ids
        padded = jnp.asarray([seq + [0] * (32 - len(seq))], jnp.int32)
        out = forward(graphdef, state, padded, return_mtp=False)
        logits = out.logits[0, len(req.prompt_ids) - 1: len(seq) - 1]
        want = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits / 0.8)), np.asarray(res.token_ids)[:, None],
                                  -1)[:, 0]
        assert np.mean(np.abs(want - np.asarray(res.logprobs))) < 1e-5
        if cfg.num_moe_layers:
            experts = np.asarray(out.expert_ids[:, 0])[:, len(req.prompt_ids) - 1: len(seq) - 1].transpose(1, 0, 2)
            np.testing.assert_array_equal(np.sort(res.expert_ids, -1), np.sort(experts, -1))
    one_by_one = [InferenceEngine(cfg, graphdef, state, config=ENGINE).generate([r])[0] for r in reqs]
    assert [r.token_ids for r in results] == [r.token_ids for r in one_by_one]


def test_gqa_cache_holds_only_the_key_value_heads():
    cache, expanded = cache_bytes_per_token(preset("qwen3-30b-a3b"))
    # 48 layers x (k + v) x 4 K/V heads x 128 dims x bf16, against one K/V head per query head (32)
    assert cache == 48 * 2 * 4 * 128 * 2 and expanded == 48 * 32 * 256 * 2


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3-moe"])
def test_decode_over_a_cache_window_equals_the_trainer(name):
    """A decode chunk reading key_len < max_len positions runs over a window of the cache sliced out once and
    written back once (forward.cache_window / cache_merge): with a key bucket of 8 in a 64-position cache the
    window moves to the next bucket between chunks and the chunks write into it in place, and the sampled tokens'
    logprobs and experts are still the trainer's, the tokens those of an engine reading the whole cache."""
    cfg = preset(name)
    graphdef, state = nnx.split(init(cfg, seed=0))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (3, 9, 6)]
    reqs = [Request(p, 14, temperature=0.8, seed=i) for i, p in enumerate(prompts)]
    windowed = InferenceEngine(cfg, graphdef, state, config=EngineConfig(slots=2, max_len=64, chunk_steps=4,
                                                                         key_bucket=8)).generate(reqs)
    whole = InferenceEngine(cfg, graphdef, state, config=ENGINE).generate(reqs)
    assert [r.token_ids for r in windowed] == [r.token_ids for r in whole]
    for req, res in zip(reqs, windowed, strict=True):
        seq = list(req.prompt_ids) + res.token_ids
        out = forward(graphdef, state, jnp.asarray([seq + [0] * (32 - len(seq))], jnp.int32), return_mtp=False)
        logits = out.logits[0, len(req.prompt_ids) - 1: len(seq) - 1]
        want = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits / 0.8)), np.asarray(res.token_ids)[:, None],
                                  -1)[:, 0]
        assert np.mean(np.abs(want - np.asarray(res.logprobs))) < 1e-5
        experts = np.asarray(out.expert_ids[:, 0])[:, len(req.prompt_ids) - 1: len(seq) - 1].transpose(1, 0, 2)
        np.testing.assert_array_equal(np.sort(res.expert_ids, -1), np.sort(experts, -1))
