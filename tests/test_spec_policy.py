"""SpeculationPolicy (c2jax.models.inference.spec_policy): when an engine speculates.

Spec:
  * never above max_batch live slots; always at or below it when not adaptive;
  * adaptive, per batch-size bucket (live slots rounded up to a power of two): `warmup` timed speculative
    chunks, then `warmup` timed plain chunks, then the mode with the higher tokens/s (median of its last `window`
    timed chunks, so one stalled chunk does not flip the choice), except one chunk
    of the other mode `reprobe_every` chunks into that phase, with the interval doubling (up to
    `max_reprobe_every`) while probes confirm the choice and starting over when it flips;
  * a mode whose measured rate falls below the other's loses the choice; chunks that compiled are not timed;
  * new weights forget the speculative rate only: speculation is re-measured, plain is not;
  * buckets are independent; bad settings are refused with the setting's name.
"""

from __future__ import annotations

import pytest

from c2jax.models.inference.spec_policy import SpeculationPolicy


def _run(policy, n_live, rates, chunks):
    """Drive `chunks` chunks at n_live: each chosen mode emits `rates[mode]` tokens in one second. -> choices."""
    choices = []
    for _ in range(chunks):
        k = policy.choose(n_live)
        choices.append(k)
        policy.observe(n_live, k, rates["spec" if k else "plain"], 1.0)
    return choices


def test_never_speculates_above_max_batch_and_always_when_not_adaptive():
    policy = SpeculationPolicy(3, max_batch=4, adaptive=False)
    assert [policy.choose(n) for n in (1, 2, 4, 5, 8)] == [3, 3, 3, 0, 0]
    adaptive = SpeculationPolicy(3, max_batch=4)
    assert _run(adaptive, 5, {"spec": 100, "plain": 1}, 10) == [0] * 10
    assert adaptive.report() == {}  # nothing above max_batch is measured


def test_warmup_then_faster_mode_with_backed_off_reprobes():
    policy = SpeculationPolicy(2, max_batch=8, warmup=2, reprobe_every=5, max_reprobe_every=20)
    choices = _run(policy, 1, {"spec": 50, "plain": 80}, 70)
    assert choices[:4] == [2, 2, 0, 0]  # warm-up: speculative first, then plain
    # plain is faster; exploiting from chunk 5 (1-based), speculation is re-probed 5, 10, 20, 20, ... chunks on
    assert [i + 1 for i, k in enumerate(choices) if k and i >= 4] == [10, 20, 40, 60]
    report = policy.report()[1]
    assert report["choice"] == "plain"
    assert report["plain_tokens_per_s"] == 80 and report["speculative_tokens_per_s"] == 50


def test_choice_follows_the_measured_rates():
    policy = SpeculationPolicy(3, max_batch=4, warmup=1, reprobe_every=4, window=3)
    choices = _run(policy, 2, {"spec": 120, "plain": 100}, 8)
    assert choices[:2] == [3, 0] and choices[2:] == [3, 3, 3, 3, 0, 3]  # chunk 3 exploits, chunk 7 re-probes
    # speculation gets slower (the context grew): once most of its last 3 chunks are slow, plain takes over
    choices = _run(policy, 2, {"spec": 40, "plain": 100}, 8)
    assert choices[:2] == [3, 3] and choices[2:5] == [0, 0, 0]
    assert policy.report()[2]["choice"] == "plain"


def test_one_stalled_chunk_does_not_flip_the_choice():
    policy = SpeculationPolicy(3, max_batch=4, warmup=2, reprobe_every=100, window=5)
    _run(policy, 1, {"spec": 80, "plain": 100}, 8)
    assert policy.choose(1) == 0
    policy.observe(1, 0, 10, 1.0)  # a plain chunk that stalled (a pause, a neighbour's burst): 10 tokens/s
    assert [policy.choose(1) for _ in range(3)] == [0, 0, 0]
    assert policy.report()[1]["plain_tokens_per_s"] == 100


def test_new_weights_re_measure_speculation_only():
    policy = SpeculationPolicy(3, max_batch=4, warmup=2, reprobe_every=100)
    _run(policy, 1, {"spec": 50, "plain": 100}, 10)
    assert policy.choose(1) == 0
    policy.weights_changed()  # e.g. an RL step: the new MTP head drafts better
    choices = _run(policy, 1, {"spec": 300, "plain": 100}, 5)
    assert choices == [3, 3, 3, 3, 3]  # two speculative warm-up chunks, no plain warm-up, then speculation wins
    report = policy.report()[1]
    assert report["speculative_tokens_per_s"] == 300 and report["plain_chunks_timed"] == 8


def test_compiling_chunks_are_not_timed():
    policy = SpeculationPolicy(3, max_batch=4, warmup=2)
    k = policy.choose(1)
    policy.observe(1, k, 10, 5.0, compiled=True)  # compilation: not the mode's speed
    assert policy.choose(1) == 3  # still in the speculative warm-up
    assert policy.report()[1]["speculative_chunks_timed"] == 0


def test_batch_sizes_are_measured_separately():
    policy = SpeculationPolicy(3, max_batch=8, warmup=1, reprobe_every=100)
    _run(policy, 1, {"spec": 200, "plain": 100}, 4)
    _run(policy, 3, {"spec": 100, "plain": 300}, 4)  # bucket 4
    assert policy.choose(1) == 3 and policy.choose(4) == 0 and policy.choose(3) == 0
    assert sorted(policy.report()) == [1, 4]
    assert SpeculationPolicy.bucket(5) == SpeculationPolicy.bucket(8) == 8


@pytest.mark.parametrize("kwargs,name", [({"k": 0}, "k"), ({"warmup": 0}, "warmup"),
                                         ({"reprobe_every": 1}, "reprobe_every"), ({"window": 0}, "window"),
                                         ({"max_reprobe_every": 8}, "max_reprobe_every")])
def test_bad_settings_are_refused(kwargs, name):
    args = {"k": 2, "max_batch": 4, **kwargs}
    with pytest.raises(ValueError, match=name):
        SpeculationPolicy(args.pop("k"), args.pop("max_batch"), **args)
