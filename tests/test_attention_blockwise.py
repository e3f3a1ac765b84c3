"""models/blockwise_attention.py and models/attention_backends.py: blockwise attention's forward against an
independent float64 NumPy masked softmax, its gradients against jax.grad of the dense oracle
(models/dense_attention.py, through the "dense" backend), no NaN on rows that see nothing, a program size
independent of S, and the backend registry (override argument, environment, unknown names, fallback on
refusal).

Tolerance: relative L2 error <= 1e-5 (fp32 throughout; the two fp32 paths differ only in summation order,
observed ~1e-7)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.models import attention_backends as ab
from c2jax.models.blockwise_attention import blockwise_attention

RTOL = 1e-5


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def np_attention(q, k, v, scale, q_seg=None, kv_seg=None, q_pos=None, kv_pos=None, causal=True):
    """Independent reference: float64 masked softmax; a row that sees no key gives zeros."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    num_q, num_k = q.shape[1], k.shape[1]
    q_pos = np.broadcast_to(np.arange(num_q) if q_pos is None else np.asarray(q_pos), (q.shape[0], num_q))
    kv_pos = np.broadcast_to(np.arange(num_k) if kv_pos is None else np.asarray(kv_pos), (q.shape[0], num_k))
    mask = np.ones((q.shape[0], num_q, num_k), bool)
    if causal:
        mask &= kv_pos[:, None, :] <= q_pos[:, :, None]
    if q_seg is not None:
        mask &= np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = np.where(mask[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    total = p.sum(-1, keepdims=True)
    p = p / np.where(total > 0, total, 1)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


# name: (Sq, Sk, Dqk, Dv, causal, block_q, block_k, extras builder)
def _packed(b, sq, sk):
    seg = np.array([[0] * 5 + [1] * 7 + [2] * 4, [3] * 9 + [4] * 7])[:b, :sq]
    return dict(q_segment_ids=seg, kv_segment_ids=seg)


def _padding_rows(b, sq, sk):
    # the last 4 tokens are padding whose query and key segment ids match nothing: those rows see no key
    q_seg = np.array([[0] * 4 + [1] * 4 + [-1] * 4] * b)
    kv_seg = np.where(q_seg < 0, -2, q_seg)
    return dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg)


def _suffix_queries(b, sq, sk):
    return dict(q_positions=np.arange(sk - sq, sk))  # queries are the last tokens of the key sequence


def _packed_positions(b, sq, sk):
    # per-row positions that restart at each document, as a packed batch would give RoPE
    seg = np.array([[0] * 6 + [1] * 6, [0] * 3 + [1] * 9])[:b]
    pos = np.array([list(range(6)) * 2, list(range(3)) + list(range(9))])[:b]
    return dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)


CASES = {
    "causal": (16, 16, 8, 8, True, 4, 4, None),
    "packed": (16, 16, 8, 8, True, 4, 8, _packed),
    "mla_dims": (12, 12, 24, 16, True, 4, 4, None),
    "ragged_length": (13, 13, 8, 8, True, 4, 8, None),
    "length_one": (1, 1, 8, 8, True, 4, 4, None),
    "suffix_queries": (5, 16, 8, 8, True, 4, 4, _suffix_queries),
    "padding_rows": (12, 12, 8, 8, True, 4, 4, _padding_rows),
    "non_causal": (10, 14, 8, 8, False, 4, 4, None),
    "packed_positions": (12, 12, 8, 8, True, 4, 4, _packed_positions),
}


def _inputs(sq, sk, dqk, dv, batch=2, heads=2, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, sq, heads, dqk), jnp.float32)
    k = jax.random.normal(keys[1], (batch, sk, heads, dqk), jnp.float32)
    v = jax.random.normal(keys[2], (batch, sk, heads, dv), jnp.float32)
    cot = jax.random.normal(keys[3], (batch, sq, heads, dv), jnp.float32)
    return q, k, v, cot


def _value_and_grads(fn, q, k, v, cot, extras):
    def loss(q, k, v):
        out = fn(q, k, v, **extras)
        return jnp.sum(out * cot), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def partial_blockwise(bq, bk):
    return lambda q, k, v, **kw: blockwise_attention(q, k, v, block_q=bq, block_k=bk, **kw)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_and_dense_gradients(name):
    assert not jax.config.jax_enable_x64
    sq, sk, dqk, dv, causal, bq, bk, build = CASES[name]
    q, k, v, cot = _inputs(sq, sk, dqk, dv)
    extras = {} if build is None else {n: jnp.asarray(x) for n, x in build(2, sq, sk).items()}
    scale = dqk ** -0.5
    common = dict(scale=scale, causal=causal, **extras)

    out, grads = _value_and_grads(partial_blockwise(bq, bk), q, k, v, cot, common)
    ref_out, ref_grads = _value_and_grads(ab.get("dense").fn, q, k, v, cot, common)

    assert out.shape == (2, sq, 2, dv) and out.dtype == jnp.float32
    golden = np_attention(q, k, v, scale, extras.get("q_segment_ids"), extras.get("kv_segment_ids"),
                          extras.get("q_positions"), extras.get("kv_positions"), causal)
    assert rel_l2(out, golden) <= RTOL
    assert rel_l2(ref_out, golden) <= RTOL  # the oracle itself, on the same contract
    for got, want, wrt in zip(grads, ref_grads, "qkv"):
        assert np.isfinite(np.asarray(got)).all(), f"d{wrt} not finite"
        assert rel_l2(got, want) <= RTOL, f"d{wrt}: {rel_l2(got, want):.2e}"
    if name == "padding_rows":
        np.testing.assert_array_equal(np.asarray(out[:, -4:]), 0)
        np.testing.assert_array_equal(np.asarray(grads[0][:, -4:]), 0)  # dq of rows that see nothing


def test_bf16_inputs():
    """bf16 in, bf16 out and bf16 gradients; fp32 softmax inside, so only input/output rounding separates it
    from the float64 reference (bf16 has an 8-bit mantissa: relative L2 within 1e-2)."""
    q, k, v, cot = _inputs(12, 12, 24, 16)
    seg = jnp.asarray(np.array([[0] * 7 + [1] * 5] * 2))
    low = [x.astype(jnp.bfloat16) for x in (q, k, v, cot)]
    extras = dict(scale=24 ** -0.5, q_segment_ids=seg, kv_segment_ids=seg)
    out, grads = _value_and_grads(partial_blockwise(4, 4), *low, extras)
    _, ref_grads = _value_and_grads(partial_blockwise(4, 4), *(x.astype(jnp.float32) for x in low), extras)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    golden = np_attention(*(x.astype(jnp.float32) for x in low[:3]), 24 ** -0.5, seg, seg)
    assert rel_l2(out.astype(jnp.float32), golden) <= 1e-2
    for got, want in zip(grads, ref_grads):
        assert rel_l2(got.astype(jnp.float32), want) <= 2e-2


def _op_count(seq, block):
    """Operations in the StableHLO of forward + backward (no compile, just lowering)."""
    q = k = v = jax.ShapeDtypeStruct((1, seq, 2, 8), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    def loss(q, k, v, seg):
        out = blockwise_attention(q, k, v, scale=0.3, q_segment_ids=seg, kv_segment_ids=seg,
                                  block_q=block, block_k=block)
        return out.sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, seg).as_text()
    assert f"{seq}x{seq}" not in text  # no S x S array anywhere
    return sum(1 for line in text.splitlines() if " = " in line)


def test_program_size_independent_of_sequence_length():
    assert _op_count(256, 64) == _op_count(2048, 64)


def test_registry_defaults_and_overrides(monkeypatch):
    monkeypatch.delenv(ab.ENV_OVERRIDE, raising=False)
    names = lambda **kw: [b.name for b in ab.candidates(**kw)]
    assert names(platform="cpu") == ["auto"]
    assert names(platform="gpu") == ["cudnn", "blockwise"]
    assert names(platform="tpu") == ["blockwise"]
    assert names(backend="dense", platform="cpu") == ["dense", "blockwise"]
    assert names(backend="blockwise", platform="cpu") == ["blockwise"]
    monkeypatch.setenv(ab.ENV_OVERRIDE, "blockwise")
    assert names(platform="cpu") == ["blockwise"]
    assert names(backend="dense", platform="cpu") == ["dense", "blockwise"]  # the argument wins
    monkeypatch.setenv(ab.ENV_OVERRIDE, "nope")
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'.*choices.*blockwise"):
        ab.candidates(platform="cpu")
    monkeypatch.delenv(ab.ENV_OVERRIDE)
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*auto.*blockwise.*cudnn.*dense"):
        ab.attention(*_inputs(2, 2, 8, 8)[:3], scale=1.0, backend="flash")
    with pytest.raises(ValueError, match="runs on"):
        ab.candidates(backend="cudnn", platform="cpu")


def test_registry_calls_and_falls_back(monkeypatch):
    monkeypatch.delenv(ab.ENV_OVERRIDE, raising=False)
    q, k, v, _ = _inputs(6, 6, 8, 8, batch=1)
    seg = jnp.array([[0, 0, 0, 1, 1, 1]])
    golden = np_attention(q, k, v, 0.5, seg, seg)
    run = jax.jit(lambda q, k, v, seg, backend: ab.attention(q, k, v, scale=0.5, segment_ids=seg, backend=backend),
                  static_argnums=4)
    for backend in ("dense", "blockwise", "auto"):
        assert rel_l2(run(q, k, v, seg, backend), golden) <= RTOL, backend

    def refuse(*args, **kwargs):
        raise NotImplementedError("never")

    monkeypatch.setitem(ab._BACKENDS, "refuses", ab.Backend("refuses", refuse))
    assert rel_l2(run(q, k, v, seg, "refuses"), golden) <= RTOL  # ran blockwise
    # cuDNN's wrapper refuses what jax.nn's cuDNN API cannot express (checked before touching any GPU)
    for kwargs in (dict(q_segment_ids=seg, kv_segment_ids=seg), dict(q_positions=jnp.arange(6))):
        with pytest.raises(NotImplementedError):
            ab.get("cudnn").fn(q, k, v, scale=0.5, **kwargs)
    with pytest.raises(NotImplementedError, match="bf16"):
        ab.get("cudnn").fn(q, k, v, scale=0.5)


# ------------------------------------------------------------------------------------------------
# the model's attention goes through the registry
# ------------------------------------------------------------------------------------------------


def _model_loss_and_grads(backend, monkeypatch, seq):
    from flax import nnx

    from c2jax.models.config import preset
    from c2jax.models.transformer import init

    monkeypatch.setenv(ab.ENV_OVERRIDE, backend)
    model = init(preset("tiny").replace(moe_impl="dense", num_nextn_predict_layers=0), seed=0)
    graphdef, state = nnx.split(model)
    ids = jax.random.randint(jax.random.key(1), (2, seq), 0, 128)
    segments = (jnp.arange(seq)[None] >= jnp.array([[seq // 3], [seq // 2]])).astype(jnp.int32)

    def loss(state):
        out = nnx.merge(graphdef, state)(ids, segment_ids=segments, return_mtp=False)
        return jnp.mean(jax.nn.logsumexp(out.logits, -1) - jnp.take_along_axis(out.logits, ids[..., None], -1)[..., 0])

    step = jax.value_and_grad(loss)
    loops = "while[" in str(jax.make_jaxpr(step)(state))  # blockwise runs lax loops; the dense path none
    value, grads = jax.jit(step)(state)  # traced under this backend
    return value, jax.tree.leaves(grads), loops


def test_transformer_uses_the_registry_blockwise_equals_dense(monkeypatch):
    """The tiny model on packed documents: loss and every parameter gradient with blockwise attention equal
    the dense path's (fp32, 1e-5 relative L2)."""
    seq = 40
    want, want_grads, dense_loops = _model_loss_and_grads("dense", monkeypatch, seq)
    got, got_grads, blockwise_loops = _model_loss_and_grads("blockwise", monkeypatch, seq)
    assert blockwise_loops and not dense_loops  # each run really took its backend
    assert abs(float(got) - float(want)) <= RTOL * abs(float(want))
    for g, w in zip(got_grads, want_grads, strict=True):
        assert rel_l2(g, w) <= RTOL


def test_train_step_program_does_not_grow_with_sequence_length():
    """The whole train step (tiny model, packed documents, default backend) lowers to the same number of
    StableHLO ops at S = 1024 and S = 8192: attention is lax loops over blocks, nothing unrolled per block."""
    import optax

    from c2jax.models.config import preset
    from c2jax.models.transformer import init
    from c2jax.train.step import init_train_state, make_train_step

    graphdef, state = init_train_state(init(preset("tiny").replace(moe_impl="dense"), seed=0), optax.adam(1e-3))
    step = make_train_step(graphdef, optax.adam(1e-3), router_bias_rate=1e-3)

    def op_count(seq):
        spec = jax.ShapeDtypeStruct((1, seq), jnp.int32)
        batch = {"input_ids": spec, "targets": spec, "segment_ids": spec, "positions": spec,
                 "loss_mask": jax.ShapeDtypeStruct((1, seq), jnp.float32)}
        text = step.lower(state, batch).as_text()
        return sum(1 for line in text.splitlines() if " = " in line and ("stablehlo." in line or "call @" in line))

    assert op_count(1024) == op_count(8192)
