"""The transformer as a pure function: masking, packing, scan vs unrolled, remat, replay, state split."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from c2jax.models.config import ConfigError, ModelConfig, preset
from c2jax.models.layers import RouterBias
from c2jax.models.transformer import abstract_state, forward, init

TINY = preset("tiny")


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def tiny_model():
    return init(TINY, seed=0)


@functools.cache
def _jitted_forward(graphdef):
    return jax.jit(lambda state, tokens, kwargs: forward(graphdef, state, tokens, **kwargs))


def run(model, tokens, **kwargs):
    """model(tokens, **kwargs), jitted: eager op-by-op dispatch of the whole model costs ~2.5x the compile."""
    graphdef, state = nnx.split(model)
    return _jitted_forward(graphdef)(state, tokens, kwargs)


def ids(batch=2, seq=12, seed=0, vocab=TINY.vocab_size):
    return jax.random.randint(jax.random.key(seed), (batch, seq), 0, vocab)


def test_output_shapes(tiny_model):
    out = run(tiny_model, ids())
    c = TINY
    assert out.logits.shape == (2, 12, c.vocab_size) and out.logits.dtype == jnp.float32
    assert out.expert_ids.shape == (c.num_moe_layers, 2, 12, c.num_experts_per_tok)
    assert out.expert_counts.shape == (c.num_moe_layers, c.n_routed_experts)
    assert out.mtp_logits.shape == (c.num_nextn_predict_layers, 2, 12, c.vocab_size)
    # every token is routed to exactly k distinct experts in every MoE layer
    assert int(out.expert_counts.sum()) == c.num_moe_layers * 2 * 12 * c.num_experts_per_tok
    sorted_ids = np.sort(np.asarray(out.expert_ids), -1)
    assert (np.diff(sorted_ids, axis=-1) > 0).all()


def test_causal_future_tokens_do_not_change_past_logits(tiny_model):
    a = ids(1, 12, seed=1)
    b = a.at[:, 8:].set((a[:, 8:] + 7) % TINY.vocab_size)
    la, lb = run(tiny_model, a).logits, run(tiny_model, b).logits
    np.testing.assert_allclose(la[:, :8], lb[:, :8], atol=1e-6)
    assert not np.allclose(la[:, 8:], lb[:, 8:])


def test_packed_documents_do_not_attend_across_boundaries(tiny_model):
    doc1, doc2 = ids(1, 5, seed=2), ids(1, 7, seed=3)
    packed = jnp.concatenate([doc1, doc2], axis=1)
    segment_ids = jnp.array([[1] * 5 + [2] * 7])
    positions = jnp.array([list(range(5)) + list(range(7))])
    out = run(tiny_model, packed, positions=positions, segment_ids=segment_ids)
    alone = run(tiny_model, doc2)
    np.testing.assert_allclose(out.logits[:, 5:], alone.logits, atol=1e-5)


def test_scan_and_unrolled_layers_agree_in_forward_and_gradient():
    tokens = ids()
    models = {scan: init(TINY.replace(scan_layers=scan), seed=0) for scan in (True, False)}

    def loss(model):
        return jnp.mean(model(tokens).logits ** 2)

    outs = {scan: nnx.jit(nnx.value_and_grad(loss))(m) for scan, m in models.items()}
    assert abs(float(outs[True][0]) - float(outs[False][0])) < 1e-6
    for a, b in zip(jax.tree.leaves(outs[True][1]), jax.tree.leaves(outs[False][1])):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("policy", ["full", "dots", "save_attn_out"])  # save_attn_kernel: below
def test_remat_policies_leave_gradients_unchanged(policy):
    tokens = ids()

    def grads(cfg):
        model = init(cfg, seed=0)
        return nnx.jit(nnx.grad(lambda m: jnp.mean(m(tokens).logits ** 2)))(model)

    ref, got = grads(TINY), grads(TINY.replace(remat_policy=policy))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        assert rel_err(b, a) < 1e-5


def test_save_attn_kernel_keeps_the_blockwise_forward_out_of_the_recompute(monkeypatch):
    """remat_policy "save_attn_kernel" keeps the attention kernel's output and log-sum-exp: gradients equal the
    un-rematerialised ones, and the differentiated program runs the blockwise forward loop once per layer
    (under "full" the backward runs it again to rebuild its residuals)."""
    from c2jax.models import attention_backends as ab

    monkeypatch.setenv(ab.ENV_OVERRIDE, "blockwise")
    tokens = ids()

    def grad_fn(cfg):
        graphdef, state = nnx.split(init(cfg, seed=0))
        return jax.grad(lambda st: jnp.mean(nnx.merge(graphdef, st)(tokens).logits ** 2)), state

    ref_fn, state = grad_fn(TINY)
    keep_fn, _ = grad_fn(TINY.replace(remat_policy="save_attn_kernel"))
    full_fn, _ = grad_fn(TINY.replace(remat_policy="full"))
    for a, b in zip(jax.tree.leaves(jax.jit(ref_fn)(state)), jax.tree.leaves(jax.jit(keep_fn)(state))):
        assert rel_err(b, a) < 1e-5
    loops = {name: str(jax.make_jaxpr(fn)(state)).count("while[") for name, fn in
             (("none", ref_fn), ("kept", keep_fn), ("full", full_fn))}
    assert loops["kept"] == loops["none"] < loops["full"], loops


def test_router_replay_reproduces_the_forward_pass(tiny_model):
    tokens = ids()
    out = run(tiny_model, tokens)
    replayed = run(tiny_model, tokens, replay_ids=out.expert_ids)
    np.testing.assert_allclose(replayed.logits, out.logits, atol=1e-6)
    np.testing.assert_array_equal(replayed.expert_ids, out.expert_ids)
    # replaying other experts changes the output: the ids are really used
    shifted = (out.expert_ids + 1) % TINY.n_routed_experts
    assert not np.allclose(run(tiny_model, tokens, replay_ids=shifted).logits, out.logits)


def test_forward_is_a_pure_jittable_function_of_split_state(tiny_model):
    graphdef, state = nnx.split(tiny_model)
    tokens = ids()
    jitted = jax.jit(lambda s, t: forward(graphdef, s, t).logits)
    np.testing.assert_allclose(jitted(state, tokens), tiny_model(tokens).logits, atol=1e-5)


def test_router_bias_is_state_but_never_a_trainable_parameter(tiny_model):
    params = nnx.state(tiny_model, nnx.Param)
    biases = nnx.state(tiny_model, RouterBias)
    assert len(jax.tree.leaves(biases)) >= 2  # MoE stack + MTP block
    assert not any("e_score_correction_bias" in "/".join(map(str, p)) for p, _ in nnx.to_flat_state(params))
    # an AdamW step with weight decay on every Param leaves the bias exactly where it was
    model = init(TINY, seed=0)
    nnx.update(model, jax.tree.map(lambda b: b + 0.5, nnx.state(model, RouterBias)))
    opt = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.5), wrt=nnx.Param)

    @nnx.jit
    def adamw_step(model, opt):
        loss = lambda m: jnp.mean(m(ids()).logits ** 2)
        opt.update(model, nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Param))(model))

    adamw_step(model, opt)
    for leaf in jax.tree.leaves(nnx.state(model, RouterBias)):
        np.testing.assert_array_equal(leaf, 0.5)


def test_every_parameter_has_logical_axes_matching_its_rank():
    _, state = abstract_state(preset("deepseek-v3"))
    for path, var in nnx.to_flat_state(state):
        axes = var.get_metadata().get("logical_axes")
        assert axes is not None, path
        assert len(axes) == len(var.get_value().shape), (path, axes)


def test_bias_shifts_selection_but_not_combine_weights(tiny_model):
    """With a huge bias on expert 0 it is always selected, yet its weight comes from the raw score."""
    from c2jax.models.moe_routing import route

    cfg = TINY.replace(n_group=1, topk_group=1)
    x = jax.random.normal(jax.random.key(0), (16, cfg.hidden_size))
    w = jax.random.normal(jax.random.key(1), (cfg.hidden_size, cfg.n_routed_experts)) * 0.1
    bias = jnp.zeros(cfg.n_routed_experts).at[0].set(100.0)
    r = route(cfg, x, w, bias)
    assert (np.asarray(r.expert_ids) == 0).any(axis=-1).all()
    scores = jax.nn.sigmoid(x @ w)
    picked = jnp.take_along_axis(scores, r.expert_ids, -1)
    expected = picked / picked.sum(-1, keepdims=True) * cfg.routed_scaling_factor
    np.testing.assert_allclose(r.weights, expected, rtol=1e-6)


def test_bfloat16_compute_runs_and_stays_close_to_float32():
    tokens = ids()
    f32 = run(init(TINY, seed=0), tokens).logits
    bf16 = run(init(TINY.replace(dtype="bfloat16"), seed=0), tokens).logits
    assert bf16.dtype == jnp.float32  # the head accumulates in float32
    assert rel_err(bf16, f32) < 5e-2


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(num_experts_per_tok=9, n_routed_experts=8), "num_experts_per_tok"),
        (dict(n_group=3), "n_group"),
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
        (dict(topk_group=3, n_group=2), "topk_group"),
        (dict(first_k_dense_replace=5, num_hidden_layers=3), "first_k_dense_replace"),
        (dict(moe_impl="magic"), "moe_impl"),
        (dict(q_lora_rank=0), "q_lora_rank"),
    ],
)
def test_inconsistent_configs_are_rejected_naming_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**TINY.__dict__, **changes})
