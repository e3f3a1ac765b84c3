"""MTP speculative decoding (c2jax.models.inference.speculative) against plain decoding.

Spec:
  * greedy speculative decoding emits exactly plain greedy decoding's tokens, with the plain path's logprobs
    and routed expert ids (from the main model's verify pass), with a random MTP head (drafts mostly rejected)
    and with a constructed one (drafts mostly kept), under continuous batching;
  * at temperature 1, and at temperature 0.7 with top-k, the emitted tokens are distributed exactly as the main
    model's sampler: chi-square test of the joint distribution of the first two emitted tokens (8192 samples,
    both the accept and the reject branch exercised) against the exact distribution computed with the
    trainer's forward; the same samples must reject a nearby wrong distribution, so the test has power;
  * above `speculative_max_batch` live slots a chunk is plain decoding, and speculation resumes when slots free
    up, with the same greedy tokens;
  * after a weight swap the drafts come from the new MTP weights, and nothing recompiles;
  * the adaptive engine (speculation chosen per chunk from measured tokens/s) switches between speculative and
    plain chunks within one sequence and still emits plain greedy decoding's tokens, logprobs and expert ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.stats import chi2

from c2jax.models.config import preset
from c2jax.models.inference import EngineConfig, InferenceEngine, Request, init_cache
from c2jax.models.inference.forward import init_mtp_cache, mtp_write, prepare
from c2jax.models.inference.sampling import SamplingParams, sampling_logits
from c2jax.models.inference.speculative import (
    init_spec_state,
    prefill_slot_spec,
    spec_decode_chunk,
    speculative_accept,
)
from c2jax.models.inference.steps import SlotState
from c2jax.models.transformer import forward, init

CFG = preset("tiny")  # one MTP module
# speculation forced on (at most speculative_max_batch live slots): what these tests exercise is the rounds
ENGINE = EngineConfig(slots=2, max_len=64, chunk_steps=4, speculative_k=3, speculative_rounds=2,
                      speculative_adaptive=False)


def _scaled(state, scale: dict[str, float]):
    """state with every leaf whose path contains one of `scale`'s names multiplied by its factor."""
    def f(path, leaf):
        key = jax.tree_util.keystr(path)
        for name, factor in scale.items():
            if name in key:
                return leaf * factor
        return leaf
    return jax.tree_util.tree_map_with_path(f, state)


def bigram_draft(state, cfg, *, trunk: float, head: float = 1.0):
    """Weights whose MTP module drafts well: the MTP block's output projections are zero and eh_proj passes
    the token embedding through, so the draft is the head applied to the embedding of the token it is fed,
    which is exactly the main model when its layers' output projections are zero too (trunk = 0); trunk in
    (0, 1] scales the trunk's output projections (the main model drifts away from the draft); head scales
    the LM head (peakier distributions)."""
    state = _scaled(state, {"['mtp']['block']['self_attn']['o_proj']": 0.0, "['mtp']['block']['mlp']['down_proj']": 0.0,
                            "['mtp']['block']['mlp']['shared_experts']['down_proj']": 0.0})
    state = _scaled(state, {"layers']['self_attn']['o_proj']": trunk, "layers']['mlp']['down_proj']": trunk,
                            "layers']['mlp']['shared_experts']['down_proj']": trunk, "['lm_head']": head})
    d = cfg.hidden_size
    eye = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))])[None]
    state["mtp"]["eh_proj"][...] = eye.astype(state["mtp"]["eh_proj"][...].dtype)
    return state


@pytest.fixture(scope="module")
def model():
    return nnx.split(init(CFG, seed=0))


def _requests(temperature=0.0, n=3, new=12):
    rng = np.random.default_rng(0)
    return [Request(rng.integers(0, CFG.vocab_size, 5 + 2 * i).tolist(), new + i, temperature=temperature)
            for i in range(n)]


@pytest.mark.parametrize("draft", ["random", "constructed"])
def test_greedy_speculative_equals_plain(model, draft):
    graphdef, state = model
    if draft == "constructed":
        state = bigram_draft(state, CFG, trunk=0.5, head=20.0)
    plain = InferenceEngine(CFG, graphdef, state, config=EngineConfig(slots=2, max_len=64, chunk_steps=4))
    spec = InferenceEngine(CFG, graphdef, state, config=ENGINE)
    reqs = _requests()
    want, got = plain.generate(reqs), spec.generate(reqs)  # 3 requests, 2 slots: continuous batching
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
        np.testing.assert_allclose(b.raw_logprobs, a.raw_logprobs, atol=1e-5)
        np.testing.assert_array_equal(b.expert_ids, a.expert_ids)
        assert b.finish_reason == a.finish_reason and len(b.token_ids) == len(a.token_ids)
    assert spec.spec_stats["spec_chunks"] > 0 and spec.spec_stats["plain_chunks"] == 0
    rate = spec.acceptance_rate
    if draft == "constructed":
        assert rate > 0.5, rate  # the accept path (and the bonus token) is what produced most tokens
    else:
        assert rate < 0.5, rate  # mostly the reject path


def _exact_pairs(cfg, graphdef, state, prompt, params_row):
    """Exact joint distribution [V, V] of the next two tokens under the sampler (temperature, top-k)."""
    v = cfg.vocab_size
    filtered = lambda logits: jax.nn.softmax(sampling_logits(  # noqa: E731
        logits, SamplingParams(*(jnp.repeat(a, logits.shape[0]) for a in params_row))), axis=-1)
    ids = jnp.asarray([prompt + [t] for t in range(v)], jnp.int32)
    logits = jax.jit(lambda s, i: forward(graphdef, s, i, return_mtp=False).logits)(state, ids)
    first = filtered(logits[:1, -2])[0]
    second = filtered(logits[:, -1])
    return np.asarray(first[:, None] * second, np.float64)


def _speculative_pairs(cfg, graphdef, state, prompt, params_row, n, k):
    """n independent samples (seeds 0..n-1) of the first two tokens emitted by speculative rounds after
    `prompt`, all n sequences decoded as slots of one spec_decode_chunk call. Returns (pairs [n, 2], rate)."""
    length = 32
    prefix = jnp.asarray([prompt[:-1] + [0] * (8 - len(prompt) + 1)], jnp.int32)
    one = SamplingParams(*(a[:1] for a in params_row))
    out, mtp, spec = prefill_slot_spec(cfg, graphdef, state, init_cache(cfg, 1, length),
                                       init_mtp_cache(cfg, 1, length), init_spec_state(cfg, 1), prefix,
                                       jnp.asarray([len(prompt) - 1]), jnp.zeros(1, jnp.int32),
                                       jnp.zeros(1, jnp.int32), one, jnp.asarray([prompt[-1]]), key_len=length)
    tile = lambda tree: jax.tree.map(lambda a: jnp.repeat(a, n, axis=0), tree)  # noqa: E731
    slots = SlotState(jnp.full(n, prompt[-1], jnp.int32), jnp.full(n, len(prompt) - 1, jnp.int32),
                      jnp.ones(n, bool), jnp.full(n, 100, jnp.int32))
    sampling = SamplingParams(*(jnp.repeat(a, n) for a in params_row[:3]), jnp.arange(n, dtype=jnp.uint32))
    *_, res = spec_decode_chunk(cfg, graphdef, state, tile(out.cache), tile(mtp), slots, tile(spec),
                                jnp.full((n, 4), -1, jnp.int32), sampling, rounds=2, k=k, key_len=length)
    tokens = np.asarray(res.out.tokens).transpose(1, 0, 2).reshape(n, -1)
    valid = np.asarray(res.out.valid).transpose(1, 0, 2).reshape(n, -1)
    order = np.argsort(~valid, axis=1, kind="stable")[:, :2]  # the first two emitted tokens, in order
    assert valid.sum(1).min() >= 2
    rate = float(np.asarray(res.accepted).sum() / np.asarray(res.drafted).sum())
    return np.take_along_axis(tokens, order, axis=1), rate


def _chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value; cells expected < 5 times are pooled into one bin."""
    expected = probs.ravel() * counts.sum()
    counts = counts.ravel()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return float(chi2.sf(stat, keep.sum() - 1))


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 4)])
def test_speculative_sampling_matches_main_model_distribution(temperature, top_k):
    """Criterion: p-value > 1e-4 against the exact joint of the first two emitted tokens (a correct sampler
    fails this 1 time in 10^4), and p-value < 1e-6 against the same model at 1.3x the temperature (a sampler
    off by that much cannot pass). Acceptance strictly between 15% and 95%: both branches of the rule ran."""
    cfg = CFG.replace(vocab_size=16)
    graphdef, state = nnx.split(init(cfg, seed=3))
    state = bigram_draft(state, cfg, trunk=1.0, head=30.0)
    prompt = [3, 1, 4, 1, 5]
    n = 8192
    params = lambda t: (jnp.asarray([t], jnp.float32), jnp.ones(1, jnp.float32),  # noqa: E731
                        jnp.asarray([top_k], jnp.int32), jnp.zeros(1, jnp.uint32))
    pairs, rate = _speculative_pairs(cfg, graphdef, state, prompt, params(temperature), n, k=2)
    counts = np.zeros((cfg.vocab_size, cfg.vocab_size))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    exact = _exact_pairs(cfg, graphdef, state, prompt, params(temperature))
    wrong = _exact_pairs(cfg, graphdef, state, prompt, params(temperature * 1.3))
    assert 0.15 < rate < 0.95, rate
    assert _chi_square_pvalue(counts, exact) > 1e-4
    assert _chi_square_pvalue(counts, wrong) < 1e-6
    if top_k:
        assert counts[exact == 0].sum() == 0  # nothing outside the top-k set is ever emitted


def test_speculation_turns_off_above_max_batch_and_resumes(model):
    graphdef, state = model
    state = bigram_draft(state, CFG, trunk=0.5, head=20.0)
    plain = InferenceEngine(CFG, graphdef, state, config=EngineConfig(slots=2, max_len=64, chunk_steps=4))
    spec = InferenceEngine(CFG, graphdef, state, config=EngineConfig(
        slots=2, max_len=64, chunk_steps=4, speculative_k=3, speculative_rounds=2, speculative_max_batch=1,
        speculative_adaptive=False))
    reqs = [Request([5, 6, 7, 8], 4, temperature=0.0), Request([9, 10, 11], 30, temperature=0.0)]
    want, got = plain.generate(reqs), spec.generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    # two live slots > 1: plain chunks (that keep the MTP cache current); then one slot: speculative
    assert spec.spec_stats["plain_chunks"] > 0 and spec.spec_stats["spec_chunks"] > 0
    # the MTP cache of the long request (slot 1), written by the prefill, plain steps, speculative rounds and
    # rejected drafts then rolled back, equals module 0's entries computed from the final sequence with the
    # trainer's forward at every position that has a next token
    seq = list(reqs[1].prompt_ids) + got[1].token_ids
    trunk = forward(graphdef, state, jnp.asarray([seq]), return_mtp=False)
    prepared = prepare(graphdef, state)
    ref = mtp_write(CFG, prepared, 0, init_mtp_cache(CFG, 1, 64)[0], prepared.model.norm(trunk.hidden[:, :-1]),
                    jnp.asarray([seq[1:]]), None, jnp.zeros(1, jnp.int32))
    settled = len(seq) - 1
    for got_c, ref_c in zip(spec.mtp_cache[0], ref, strict=True):
        np.testing.assert_allclose(got_c[1, :settled], ref_c[0, :settled], rtol=1e-4, atol=1e-5)


def test_adaptive_engine_switches_modes_and_matches_plain(model):
    graphdef, state = model
    state = bigram_draft(state, CFG, trunk=0.5, head=20.0)
    plain = InferenceEngine(CFG, graphdef, state, config=EngineConfig(slots=2, max_len=64, chunk_steps=4))
    # warm-up runs 2 timed chunks of each mode, then every 2nd chunk of a batch size runs the other mode: both
    # kinds of chunk alternate inside each sequence, whichever mode this machine measures faster
    spec = InferenceEngine(CFG, graphdef, state, config=EngineConfig(
        slots=2, max_len=64, chunk_steps=4, speculative_k=3, speculative_rounds=2, speculative_reprobe_every=2))
    reqs = [Request([5, 6, 7, 8], 40, temperature=0.0), Request([9, 10, 11], 44, temperature=0.0)]
    want, got = plain.generate(reqs), spec.generate(reqs)
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
        np.testing.assert_array_equal(b.expert_ids, a.expert_ids)
    assert spec.spec_stats["plain_chunks"] >= 2 and spec.spec_stats["spec_chunks"] >= 2
    report = spec.spec_policy.report()[2]  # two live slots most of the time
    assert report["speculative_chunks_timed"] >= 2 and report["plain_chunks_timed"] >= 2
    assert report["speculative_tokens_per_s"] > 0 and report["plain_tokens_per_s"] > 0
    assert report["choice"] in ("speculative", "plain")


@pytest.mark.parametrize("recompute", [True, False])
def test_weight_swap_drafts_with_new_mtp_weights_without_recompiling(model, recompute):
    graphdef, old = model
    new = bigram_draft(old, CFG, trunk=0.0, head=20.0)  # its draft is exactly its main model
    engine = InferenceEngine(CFG, graphdef, old, config=ENGINE)
    req = Request([1, 2, 3, 4, 5], 30, temperature=0.0)
    rid = engine.submit(req)
    engine.step()
    engine.step()
    before = dict(engine.spec_stats)
    assert before["accepted"] < before["drafted"] / 2  # random MTP head: mostly rejected
    compiles = spec_decode_chunk._cache_size()
    engine.swap_weights(new, version=1, recompute_cache=recompute)
    engine.step()
    assert spec_decode_chunk._cache_size() == compiles  # same shapes: no recompilation
    after = {key: engine.spec_stats[key] - before[key] for key in before}
    assert after["drafted"] > 0 and after["accepted"] == after["drafted"]  # the new MTP weights drafted
    while engine.pop_result(rid) is None:
        engine.step()
    assert spec_decode_chunk._cache_size() == compiles


def test_rejection_rule_emits_target_distribution_at_every_row():
    """speculative_accept alone, on fixed target rows p_1..p_4 and draft rows q_1..q_3 (vocab 8, k = 3), with
    200,000 independent rounds: the token at row j, among the rounds that emit it (all j drafts before it kept),
    is distributed as p_j: row 0 (kept draft or residual), rows 1-2, and row 3 (bonus only). Criterion per
    row: chi-square p-value > 1e-4 against p_j, and < 1e-6 against q_j (returning drafts unchanged fails)."""
    vocab, k, n = 8, 3, 200_000
    rng = np.random.default_rng(0)
    p_logits = jnp.asarray(rng.normal(size=(k + 1, vocab)) * 1.5, jnp.float32)
    q_logits = jnp.asarray(rng.normal(size=(k, vocab)) * 1.5, jnp.float32)
    keys = jax.random.split(jax.random.key(123), k)
    drafts = jnp.stack([jax.random.categorical(keys[j], q_logits[j], shape=(n,)) for j in range(k)], 1)
    params = SamplingParams(jnp.ones(n), jnp.ones(n), jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.uint32))
    verdict = jax.jit(speculative_accept)(jnp.broadcast_to(p_logits, (n, k + 1, vocab)),
                                          jnp.broadcast_to(q_logits, (n, k, vocab)), drafts, params,
                                          jnp.full(n, 10, jnp.int32))
    tokens, accepted = np.asarray(verdict.tokens), np.asarray(verdict.accepted)
    p, q = np.asarray(jax.nn.softmax(p_logits)), np.asarray(jax.nn.softmax(q_logits))
    for j in range(k + 1):
        emitted = accepted >= j
        assert emitted.sum() > 2000, (j, emitted.sum())
        counts = np.bincount(tokens[emitted, j], minlength=vocab)
        assert _chi_square_pvalue(counts, p[j]) > 1e-4, j
        if j < k:
            assert _chi_square_pvalue(counts, q[j]) < 1e-6, j
    rate = accepted.mean() / k
    assert 0.2 < rate < 0.9, rate
