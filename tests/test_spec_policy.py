"""SpeculationPolicy (c2jax.models.inference.spec_policy): when an engine speculates.

Spec:
  * never above max_batch live slots; always at or below it when not adaptive;
  * adaptive, per batch-size bucket (live slots rounded up to a power of two): `warmup` timed speculative
    chunks, then `warmup` timed plain chunks, then the mode with the higher smoothed tokens/s, except every
    `reprobe_every`-th chunk of the bucket, which runs the other mode;
  * a mode whose measured rate falls below the other's loses the choice; chunks that compiled are not timed;
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


def test_warmup_then_faster_mode_with_periodic_reprobe():
    policy = SpeculationPolicy(2, max_batch=8, warmup=2, reprobe_every=5)
    choices = _run(policy, 1, {"spec": 50, "plain": 80}, 20)
    assert choices[:4] == [2, 2, 0, 0]  # warm-up: speculative first, then plain
    # plain is faster: plain everywhere except chunk numbers 5, 10, 15, 20 (1-based), which re-probe speculation
    assert [i + 1 for i, k in enumerate(choices) if k and i >= 4] == [5, 10, 15, 20]
    report = policy.report()[1]
    assert report["choice"] == "plain"
    assert report["plain_tokens_per_s"] == 80 and report["speculative_tokens_per_s"] == 50


def test_choice_follows_the_measured_rates():
    policy = SpeculationPolicy(3, max_batch=4, warmup=1, reprobe_every=4, smoothing=0.5)
    choices = _run(policy, 2, {"spec": 120, "plain": 100}, 8)
    assert choices[:2] == [3, 0] and choices[2] == 3 and choices[3] == 0  # chunk 4 re-probes plain
    # speculation gets slower (e.g. acceptance fell after a weight swap): its average falls below plain's
    choices = _run(policy, 2, {"spec": 40, "plain": 100}, 8)
    assert choices[-4:-1] == [0, 0, 0]
    assert policy.report()[2]["choice"] == "plain"


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
                                         ({"reprobe_every": 1}, "reprobe_every"), ({"smoothing": 0.0}, "smoothing")])
def test_bad_settings_are_refused(kwargs, name):
    args = {"k": 2, "max_batch": 4, **kwargs}
    with pytest.raises(ValueError, match=name):
        SpeculationPolicy(args.pop("k"), args.pop("max_batch"), **args)
