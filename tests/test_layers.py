"""Hand-written backward passes (custom_vjp) against plain autodiff of the same math."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from c2jax.models.config import preset
from c2jax.models.dense_attention import attention_mask, dot_product_attention
from c2jax.models.layers import (
    lm_head_cross_entropy,
    lm_head_loss,
    loss_chunk_tokens,
    softmax_cross_entropy,
    swiglu,
    swiglu_bias,
)
from c2jax.models.transformer import init


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def normal(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape)


def assert_same_value_and_grads(f, reference, args, argnums, tol=1e-5):
    cot_shape = jax.eval_shape(reference, *args).shape
    cot = normal(99, cot_shape)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) * cot)

    v, g = jax.jit(jax.value_and_grad(loss(f), argnums))(*args)
    v_ref, g_ref = jax.jit(jax.value_and_grad(loss(reference), argnums))(*args)
    assert rel_err(v, v_ref) < tol
    for a, b in zip(g, g_ref, strict=True):
        assert rel_err(a, b) < tol


def test_softmax_cross_entropy_matches_log_softmax():
    logits, labels = normal(0, (6, 5, 37), 3.0), jax.random.randint(jax.random.key(1), (6, 5), 0, 37)

    def reference(logits):
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(logp, labels[..., None], -1)[..., 0]

    assert_same_value_and_grads(lambda lg: softmax_cross_entropy(lg, labels), reference, (logits,), (0,))


def test_lm_head_cross_entropy_matches_head_then_loss():
    h, w = normal(0, (24, 16)), normal(1, (16, 50), 0.3)
    labels = jax.random.randint(jax.random.key(2), (24,), 0, 50)

    def reference(h, w):
        return -jnp.take_along_axis(jax.nn.log_softmax(h @ w, -1), labels[:, None], -1)[:, 0]

    assert_same_value_and_grads(lambda h, w: lm_head_cross_entropy(h, w, labels), reference, (h, w), (0, 1))


@pytest.mark.parametrize("chunk", [0, 8, 7, 24, 100], ids=["one-pass", "3-chunks", "4-chunks-padded", "T", "over-T"])
def test_lm_head_loss_and_lse_match_head_then_loss_in_any_chunking(chunk):
    """Both outputs (CE and the log-sum-exp that feeds the z-loss) and their gradients under independent
    cotangents, for every chunking: one pass, chunks dividing T = 24, chunks needing padding, chunk >= T."""
    h, w = normal(0, (24, 16)), normal(1, (16, 50), 0.3)
    labels = jax.random.randint(jax.random.key(2), (24,), 0, 50)
    g_loss, g_lse = normal(3, (24,)), normal(4, (24,))

    def objective(fn):
        def f(h, w):
            loss, lse = fn(h, w)
            return jnp.sum(loss * g_loss + lse * g_lse)
        return f

    def reference(h, w):
        logits = h @ w
        lse = jax.nn.logsumexp(logits, -1)
        return lse - jnp.take_along_axis(logits, labels[:, None], -1)[:, 0], lse

    v, g = jax.jit(jax.value_and_grad(objective(lambda h, w: lm_head_loss(h, w, labels, chunk)), (0, 1)))(h, w)
    v_ref, g_ref = jax.value_and_grad(objective(reference), (0, 1))(h, w)
    assert rel_err(v, v_ref) < 1e-6
    for a, b in zip(g, g_ref, strict=True):
        assert rel_err(a, b) < 1e-5


def test_loss_chunk_auto_keeps_fp32_logits_of_a_chunk_within_256_mib():
    assert loss_chunk_tokens(None, 8192) == 8192  # small: 32k tokens go in 4 chunks of 256 MiB
    assert loss_chunk_tokens(None, 163840) == 1024  # K2.5's vocabulary: the 1024-token floor
    assert loss_chunk_tokens(0, 8192) == 0 and loss_chunk_tokens(3000, 8192) == 3000


def test_swiglu_matches_autodiff():
    x, wg, wu, wd = normal(0, (20, 16)), normal(1, (16, 24)), normal(2, (16, 24)), normal(3, (24, 16))

    def reference(x, wg, wu, wd):
        return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd

    assert_same_value_and_grads(swiglu, reference, (x, wg, wu, wd), (0, 1, 2, 3))
    # mlp_bias (Llama): the same backward plus the biases' cotangents
    bg, bu, bd = normal(4, (24,)), normal(5, (24,)), normal(6, (16,))

    def reference_bias(x, wg, wu, wd, bg, bu, bd):
        return (jax.nn.silu(x @ wg + bg) * (x @ wu + bu)) @ wd + bd

    assert_same_value_and_grads(swiglu_bias, reference_bias, (x, wg, wu, wd, bg, bu, bd), tuple(range(7)))


@pytest.mark.parametrize("causal_block", [None, 4, 5])
@pytest.mark.parametrize("packed", [False, True])
def test_attention_matches_autodiff_of_masked_softmax(packed, causal_block):
    """causal_block 5 does not divide S = 12 and must fall back to one block."""
    b, s, h, dqk, dv, scale = 2, 12, 3, 8, 5, 0.37
    q, k, v = normal(0, (b, s, h, dqk)), normal(1, (b, s, h, dqk)), normal(2, (b, s, h, dv))
    segments = jnp.array([[0] * 5 + [1] * 7, [0] * 12]) if packed else None
    mask = attention_mask(segments, b, s)

    def reference(q, k, v):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)

    assert_same_value_and_grads(lambda q, k, v: dot_product_attention(q, k, v, mask, scale, causal_block),
                                reference,
                                (q, k, v), (0, 1, 2))


@pytest.mark.parametrize("tied,chunk", [(False, 0), (True, 0), (False, 5)], ids=["untied", "tied", "chunked"])
def test_token_losses_equal_cross_entropy_of_the_logits(tied, chunk):
    cfg = preset("tiny").replace(tie_word_embeddings=tied, num_nextn_predict_layers=0, loss_chunk_tokens=chunk)
    graphdef, params, rest = nnx.split(init(cfg), nnx.Param, ...)
    ids = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)

    def losses(params, fused):
        model = nnx.merge(graphdef, params, rest)
        out = model(ids[:, :-1])
        if fused:
            return model.token_losses(out.hidden, ids[:, 1:]).mean()
        logp = jax.nn.log_softmax(out.logits, -1)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean()

    v, g = jax.value_and_grad(losses)(params, True)
    v_ref, g_ref = jax.value_and_grad(losses)(params, False)
    assert rel_err(v, v_ref) < 1e-6
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        assert rel_err(a, b) < 1e-5
