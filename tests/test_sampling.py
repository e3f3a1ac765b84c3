"""The sampler's primitives against NumPy: first_argmax is jnp.argmax; draw() samples softmax(logits) exactly
(chi-square against the exact distribution, and never an excluded token); sample() follows temperature and
greedy rows in a mixed batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

from c2jax.models.inference.sampling import SamplingParams, draw, first_argmax, sample, token_keys


def _pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value; cells expected fewer than 5 times are pooled into one bin."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chi2.sf(float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), keep.sum() - 1))


def test_first_argmax_is_argmax_with_ties_to_the_first_index():
    rng = np.random.default_rng(0)
    logits = rng.integers(-3, 3, size=(64, 300)).astype(np.float32)  # many ties
    logits[5] = -np.inf
    logits[5, 299] = 0.0
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(logits))), np.argmax(logits, axis=-1))


@pytest.mark.parametrize("vocab", [10, 300])  # one partial block; two full blocks and a partial one
def test_draw_samples_softmax_and_never_an_excluded_token(vocab):
    """40,000 draws per row from 2 rows of logits with a third of the tokens excluded (-inf): chi-square p-value
    > 1e-4 against softmax, < 1e-6 against softmax at temperature 2 (a sampler that ignores the logits'
    scale fails), and no draw ever lands on an excluded token."""
    n = 40_000
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(2, vocab)) * 2).astype(np.float32)
    excluded = rng.random((2, vocab)) < 1 / 3
    excluded[:, 0] = False
    logits[excluded] = -np.inf
    rows = np.repeat(np.arange(2), n)
    keys = token_keys(jnp.asarray(rows, jnp.uint32), jnp.asarray(np.arange(2 * n), jnp.uint32))
    tokens = np.asarray(jax.jit(draw)(keys, jnp.asarray(logits[rows])))
    for row in range(2):
        drawn = tokens[rows == row]
        assert not excluded[row, drawn].any()
        counts = np.bincount(drawn, minlength=vocab)
        exact = np.asarray(jax.nn.softmax(jnp.asarray(logits[row])))
        hotter = np.asarray(jax.nn.softmax(jnp.asarray(logits[row] / 2)))
        assert _pvalue(counts, exact) > 1e-4
        assert _pvalue(counts, hotter) < 1e-6


def test_draw_with_one_allowed_token_always_draws_it():
    logits = np.full((4, 700), -np.inf, np.float32)
    logits[np.arange(4), [0, 127, 128, 699]] = [3.0, -50.0, 0.0, 80.0]
    keys = token_keys(jnp.arange(4, dtype=jnp.uint32), jnp.arange(4, dtype=jnp.uint32))
    np.testing.assert_array_equal(np.asarray(draw(keys, jnp.asarray(logits))), [0, 127, 128, 699])


def test_sample_mixes_greedy_and_sampled_rows():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(4, 50)), jnp.float32)
    params = SamplingParams(jnp.asarray([0.0, 1.0, 0.0, 1.0]), jnp.ones(4), jnp.zeros(4, jnp.int32),
                            jnp.arange(4, dtype=jnp.uint32))
    out = jax.jit(sample)(logits, params, jnp.arange(4))
    argmax = np.argmax(np.asarray(logits), -1)
    assert out.tokens[0] == argmax[0] and out.tokens[2] == argmax[2]
    expected = np.asarray(jax.nn.log_softmax(logits))[np.arange(4), np.asarray(out.tokens)]
    np.testing.assert_allclose(np.asarray(out.logprobs), expected, rtol=1e-6)
    # a sampled row draws: over 64 positions of flat-ish logits it does not always give the argmax
    flat = jnp.broadcast_to(logits[1] * 0.1, (64, 50))
    hot = SamplingParams(jnp.ones(64), jnp.ones(64), jnp.zeros(64, jnp.int32), jnp.zeros(64, jnp.uint32))
    assert len(set(np.asarray(jax.jit(sample)(flat, hot, jnp.arange(64)).tokens).tolist())) > 1
    # all greedy: the draw is skipped, tokens are the argmax
    greedy = params._replace(temperature=jnp.zeros(4))
    np.testing.assert_array_equal(np.asarray(jax.jit(sample)(logits, greedy, jnp.arange(4)).tokens), argmax)
