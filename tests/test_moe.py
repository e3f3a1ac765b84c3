"""The MoE layer: routing semantics and the three dispatch paths (sorted, ragged, dense) agreeing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from c2jax.models.config import ConfigError, preset
from c2jax.models.moe import MoE
from c2jax.models.moe_dispatch import capacity_buckets
from c2jax.models.moe_routing import route

TINY = preset("tiny")
IMPLS = ("sorted", "ragged", "dense")


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make(cfg, seed=0):
    return nnx.split(MoE(cfg, nnx.Rngs(params=seed)))


def inputs(cfg, batch=2, seq=24, seed=1):
    return jax.random.normal(jax.random.key(seed), (batch, seq, cfg.hidden_size))


def with_config(cfg):
    """A graph definition running `cfg` (the module keeps its config in the graph definition, not in the state):
    merged with the state of `make(other)`, that layer's parameters run by `cfg`'s dispatch path."""
    return nnx.split(nnx.eval_shape(lambda: MoE(cfg, nnx.Rngs(params=0))))[0]


def value_and_grads(cfg, graphdef, state, x, replay_ids=None):
    """Forward output and gradients w.r.t. every parameter and the input, for a fixed random cotangent, with the
    layer run by `cfg`."""
    graphdef = with_config(cfg)
    cot = jax.random.normal(jax.random.key(7), x.shape)

    def loss(params, rest, x):
        y, _ = nnx.merge(graphdef, params, rest)(x, replay_ids)
        return jnp.sum(y * cot), y

    params, rest = nnx.split_state(state, nnx.Param, ...)
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))(params, rest, x)
    return y, grads


@pytest.mark.parametrize("cfg", [TINY, TINY.replace(n_group=1, topk_group=1, n_shared_experts=0)],
                         ids=["grouped", "ungrouped"])
def test_dispatch_paths_agree_in_forward_and_gradients(cfg):
    graphdef, state = make(cfg)
    x = inputs(cfg)
    results = {impl: value_and_grads(cfg.replace(moe_impl=impl), graphdef, state, x) for impl in IMPLS}
    y_ref, g_ref = results["dense"]
    for impl in ("sorted", "ragged"):
        y, g = results[impl]
        assert rel_err(y, y_ref) < 1e-5, impl
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
            assert rel_err(a, b) < 1e-5, impl


def test_sorted_is_dropless_when_every_token_picks_the_same_experts():
    """All tokens forced onto experts 0..k-1 overflow every capacity bucket but the last (C = T)."""
    cfg = TINY
    graphdef, state = make(cfg)
    x = inputs(cfg, 2, 16)
    tokens = 2 * 16
    assert capacity_buckets(cfg, tokens)[-1] == tokens
    replay = jnp.broadcast_to(jnp.arange(cfg.num_experts_per_tok, dtype=jnp.int32),
                              (2, 16, cfg.num_experts_per_tok))
    y_ref, g_ref = value_and_grads(cfg.replace(moe_impl="dense"), graphdef, state, x, replay)
    y, g = value_and_grads(cfg.replace(moe_impl="sorted"), graphdef, state, x, replay)
    assert rel_err(y, y_ref) < 1e-5
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        assert rel_err(a, b) < 1e-5


def assert_same(result, reference, tol=1e-5):
    (y, g), (y_ref, g_ref) = result, reference
    assert rel_err(y, y_ref) < tol
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        assert rel_err(a, b) < tol


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_overflow_bucket_run_one_expert_at_a_time_equals_the_batched_bucket(recipe):
    """The last bucket (C = T) runs expert by expert when smaller buckets exist and its buffer exceeds
    moe_overflow_loop_bytes (0 here: always); with a single bucket, or a small buffer, it is one batched einsum.
    Same rows, same GEMM operands: the three agree, quantized recipes included."""
    cfg = TINY.replace(n_group=1, topk_group=1, moe_quant=recipe)
    graphdef, state = make(cfg)
    x = inputs(cfg, 2, 16)
    replay = jnp.broadcast_to(jnp.arange(cfg.num_experts_per_tok, dtype=jnp.int32) * 3,
                              (2, 16, cfg.num_experts_per_tok))  # experts 0 and 3 take every token
    looped = cfg.replace(moe_capacity_factors=(1.25,), moe_overflow_loop_bytes=0)
    small_buffer = cfg.replace(moe_capacity_factors=(1.25,))  # [E, 32, 2f] fp32 is far below the default
    batched = cfg.replace(moe_capacity_factors=(100.0,))
    assert len(capacity_buckets(looped, 32)) == 2 and capacity_buckets(batched, 32) == (32,)
    reference = value_and_grads(batched, graphdef, state, x, replay)
    assert_same(value_and_grads(looped, graphdef, state, x, replay), reference, 1e-6)
    assert_same(value_and_grads(small_buffer, graphdef, state, x, replay), reference, 1e-6)


def test_overflow_loop_setting_is_validated():
    with pytest.raises(ConfigError, match="moe_overflow_loop_bytes"):
        TINY.replace(moe_overflow_loop_bytes=-1)


@pytest.mark.parametrize("forced", [False, True], ids=["routed", "overflowing"])
def test_chunked_dispatch_equals_one_dispatch(forced):
    """moe_chunk_tokens=10 over 48 tokens: 5 chunks of 10, the last padded with 2 tokens that select no
    expert; each chunk picks its own capacity bucket. Forward and every gradient equal the dense oracle."""
    cfg = TINY.replace(n_group=1, topk_group=1)
    graphdef, state = make(cfg)
    x = inputs(cfg)
    replay = None
    if forced:
        replay = jnp.broadcast_to(jnp.arange(cfg.num_experts_per_tok, dtype=jnp.int32),
                                  (2, 24, cfg.num_experts_per_tok))
    reference = value_and_grads(cfg.replace(moe_impl="dense"), graphdef, state, x, replay)
    assert_same(value_and_grads(cfg.replace(moe_chunk_tokens=10), graphdef, state, x, replay), reference)
    assert_same(value_and_grads(cfg.replace(moe_chunk_tokens=12), graphdef, state, x, replay), reference)


def test_chunked_dispatch_of_a_slice_of_the_experts_equals_one_dispatch():
    """Expert parallelism's path: only experts [first, first + E_local) held, other assignments contribute 0."""
    from c2jax.models.moe_dispatch import dispatch_sorted

    cfg = TINY.replace(n_group=1, topk_group=1)
    graphdef, state = make(cfg)
    model = nnx.merge(graphdef, state)
    flat = inputs(cfg).reshape(-1, cfg.hidden_size)
    routing = route(cfg, flat, model.gate[...], model.e_score_correction_bias[...])
    gate_up, down = model.gate_up_proj[...][2:6], model.down_proj[...][2:6]

    def run(chunk):
        fn = lambda x, gu, dn: dispatch_sorted(cfg.replace(moe_chunk_tokens=chunk), x, routing, gu, dn, 2)
        cot = jax.random.normal(jax.random.key(5), flat.shape)
        return jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=(0, 1, 2))(flat, gate_up, down)

    one, chunked = run(0), run(7)
    assert rel_err(chunked[0], one[0]) < 1e-6
    for a, b in zip(chunked[1], one[1], strict=True):
        assert rel_err(a, b) < 1e-5


def test_capacity_buckets_are_increasing_and_end_at_the_token_count():
    cfg = preset("small").replace(moe_capacity_factors=(1.0, 1.25, 1.5, 2.0))
    buckets = capacity_buckets(cfg, 4096)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == 4096
    assert buckets[0] == 4096 * cfg.num_experts_per_tok // cfg.n_routed_experts


def test_router_replay_reproduces_selection_and_keeps_router_gradient():
    cfg = TINY
    graphdef, state = make(cfg)
    x = inputs(cfg)
    model = nnx.merge(graphdef, state)
    _, routing = model(x)
    replay = routing.expert_ids.reshape(2, 24, -1)
    y_live, g_live = value_and_grads(cfg, graphdef, state, x)
    y_replay, g_replay = value_and_grads(cfg, graphdef, state, x, replay)
    np.testing.assert_allclose(y_replay, y_live, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g_replay), jax.tree.leaves(g_live), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(g_replay[0]["gate"][...]).max()) > 0  # router weights still learn


def test_routing_counts_sum_to_tokens_times_k_and_experts_are_distinct():
    cfg = TINY
    graphdef, state = make(cfg)
    flat = inputs(cfg).reshape(-1, cfg.hidden_size)
    model = nnx.merge(graphdef, state)
    r = route(cfg, flat, model.gate[...], model.e_score_correction_bias[...])
    assert int(r.counts.sum()) == flat.shape[0] * cfg.num_experts_per_tok
    np.testing.assert_array_equal(np.bincount(np.asarray(r.expert_ids).ravel(), minlength=cfg.n_routed_experts),
                                  np.asarray(r.counts))
    assert (np.diff(np.sort(np.asarray(r.expert_ids), -1), axis=-1) > 0).all()


def test_group_limited_routing_selects_only_from_the_top_groups():
    cfg = TINY.replace(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)
    graphdef, state = make(cfg)
    flat = inputs(cfg).reshape(-1, cfg.hidden_size)
    model = nnx.merge(graphdef, state)
    bias = jax.random.normal(jax.random.key(3), (cfg.n_routed_experts,))
    r = route(cfg, flat, model.gate[...], bias)
    per_group = cfg.n_routed_experts // cfg.n_group
    choice = np.asarray(jax.nn.sigmoid(r.logits) + bias).reshape(-1, cfg.n_group, per_group)
    group_score = np.sort(choice, -1)[..., -2:].sum(-1)
    top_groups = np.argsort(-group_score, -1)[:, : cfg.topk_group]
    groups = np.asarray(r.expert_ids) // per_group
    for t in range(flat.shape[0]):
        assert set(groups[t]) <= set(top_groups[t])


def test_bias_changes_selection_but_not_the_weights_of_selected_experts():
    cfg = TINY.replace(n_group=1, topk_group=1)
    graphdef, state = make(cfg)
    flat = inputs(cfg).reshape(-1, cfg.hidden_size)
    model = nnx.merge(graphdef, state)
    w = model.gate[...]
    zero = route(cfg, flat, w, jnp.zeros(cfg.n_routed_experts))
    bias = jnp.zeros(cfg.n_routed_experts).at[cfg.n_routed_experts - 1].set(10.0)
    biased = route(cfg, flat, w, bias)
    assert (np.asarray(biased.expert_ids) == cfg.n_routed_experts - 1).any(-1).all()
    # weights depend only on the unbiased scores of the selected experts
    scores = jax.nn.sigmoid(biased.logits)
    g = jnp.take_along_axis(scores, biased.expert_ids, -1)
    expected = g / g.sum(-1, keepdims=True) * cfg.routed_scaling_factor
    np.testing.assert_allclose(biased.weights, expected, rtol=1e-6)
    assert not np.array_equal(np.asarray(zero.expert_ids), np.asarray(biased.expert_ids))


def test_grouped_moe_path_runs_the_registry_kernels_and_equals_ragged_dot():
    """moe_impl="grouped": the MoE's grouped GEMMs through kernels/dispatch (cfg.moe_kernel). Each kernel, the
    Pallas Triton one in its interpreter on CPU, gives the ragged_dot path's loss and gradients within 1e-6 of
    their scale (fp32; the kernels block the K reduction differently, so not bit for bit)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from c2jax.models.config import preset
    from c2jax.models.transformer import forward, init

    cfg = preset("tiny").replace(num_nextn_predict_layers=0, moe_impl="ragged")
    _, state = nnx.split(init(cfg, 0))
    ids = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)

    def value_and_grads(c):
        graphdef = nnx.split(nnx.eval_shape(lambda: init(c, 0)))[0]
        f = jax.value_and_grad(lambda s: jnp.mean(forward(graphdef, s, ids, return_mtp=False).logits ** 2))
        value, grads = jax.jit(f)(state)
        return float(value), jax.tree.leaves(grads)

    want, want_grads = value_and_grads(cfg)
    for kernel, tol in (("pallas_triton", 1e-6), ("xla", 1e-6)):
        got, grads = value_and_grads(cfg.replace(moe_impl="grouped", moe_kernel=kernel))
        assert abs(got - want) <= tol * abs(want)
        worst = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads, want_grads, strict=True))
        assert worst <= tol * max(float(jnp.max(jnp.abs(b))) for b in want_grads), kernel


def _forward(cfg, graphdef, state, x, replay_ids=None):
    """The MoE layer's output run by `cfg` without autodiff (sorted: the FORWARD_OP registry call)."""
    graphdef = with_config(cfg)
    return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, replay_ids)[0])(state, x)


def _primitives(cfg, graphdef, state, x, replay_ids=None):
    graphdef = with_config(cfg)
    return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, replay_ids)[0]).lower(state, x).as_text()


@pytest.mark.parametrize("load", ["routed", "skewed", "all_on_k_experts"])
def test_forward_without_gradients_runs_tiles_of_the_actual_load_and_equals_the_dense_oracle(load):
    """Not differentiated, the sorted path on CPU loops over experts and 32-row tiles of their sorted rows (no
    lax.switch over capacity buckets): 256 tokens x 2 over 8 experts, routed, with two experts taking half the
    assignments (the C = T bucket of the einsum), and with every token on experts 0 and 1. Equal to the dense
    oracle, and to the bucketed einsum the override selects."""
    cfg = TINY.replace(n_group=1, topk_group=1)
    graphdef, state = make(cfg)
    x = inputs(cfg, 4, 64)
    k, rng = cfg.num_experts_per_tok, np.random.default_rng(0)
    replay = None
    if load == "skewed":
        first = rng.choice([0, 1, *range(cfg.n_routed_experts)], size=(4, 64))
        replay = jnp.asarray(np.stack([first, (first + 1 + rng.integers(0, cfg.n_routed_experts - 1, first.shape))
                                       % cfg.n_routed_experts], -1).astype(np.int32))
    elif load == "all_on_k_experts":
        replay = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (4, 64, k))
    text = _primitives(cfg, graphdef, state, x, replay)
    assert "stablehlo.while" in text and "stablehlo.case" not in text
    reference = _forward(cfg.replace(moe_impl="dense"), graphdef, state, x, replay)
    assert rel_err(_forward(cfg, graphdef, state, x, replay), reference) < 1e-6
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("C2JAX_KERNEL_IMPL", "moe_sorted_forward=bucketed")
        assert "stablehlo.case" in _primitives(cfg, graphdef, state, x, replay)
        assert rel_err(_forward(cfg, graphdef, state, x, replay), reference) < 1e-6


def test_tiled_forward_of_a_slice_of_the_experts_and_in_chunks_equals_one_dispatch():
    """Expert parallelism's local slice (assignments to other experts contribute 0) and moe_chunk_tokens chunks
    (padding tokens select no expert) through the tiled forward."""
    from c2jax.models.moe_dispatch import dispatch_dense, dispatch_sorted

    cfg = TINY.replace(n_group=1, topk_group=1)
    graphdef, state = make(cfg)
    model = nnx.merge(graphdef, state)
    flat = inputs(cfg, 4, 100).reshape(-1, cfg.hidden_size)
    routing = route(cfg, flat, model.gate[...], model.e_score_correction_bias[...])
    gate_up, down = model.gate_up_proj[...], model.down_proj[...]
    local = (routing.expert_ids >= 2) & (routing.expert_ids < 6)
    want = dispatch_dense(flat, routing._replace(weights=jnp.where(local, routing.weights, 0)), gate_up, down)
    for chunk in (0, 150):
        c = cfg.replace(moe_chunk_tokens=chunk)
        fn = jax.jit(lambda x, gu, dn, c=c: dispatch_sorted(c, x, routing, gu, dn, 2))
        assert "stablehlo.while" in fn.lower(flat, gate_up[2:6], down[2:6]).as_text()
        assert rel_err(fn(flat, gate_up[2:6], down[2:6]), want) < 1e-6, chunk


def test_tiled_forward_steps_aside_at_decode_sizes_and_for_quantized_experts():
    """Under two 32-row tiles per expert (decode and short prefill sizes) one padded einsum over all experts is faster,
    and quantized recipes scale weights per expert: both run the bucketed einsum."""
    cfg = TINY.replace(n_group=1, topk_group=1)
    graphdef, state = make(cfg)
    assert "stablehlo.case" in _primitives(cfg, graphdef, state, inputs(cfg, 4, 16))  # 64 tokens: 16 per expert
    big = inputs(cfg, 4, 64)
    assert "stablehlo.case" in _primitives(cfg.replace(moe_quant="mxfp8"), *make(cfg.replace(moe_quant="mxfp8")), big)


H100, B200 = "NVIDIA H100 80GB HBM3", "NVIDIA B200"


@pytest.mark.parametrize("device, quant, path, kernel", [
    (None, "bf16", "sorted", None),  # CPU: the registry's only grouped GEMM is the XLA fallback
    (("gpu", H100), "bf16", "grouped", "mosaic_sm90"),
    (("gpu", H100), "mxfp8", "grouped", "pallas_triton"),
    (("gpu", B200), "bf16", "grouped", "pallas_triton"),
    (("gpu", H100), "nvfp4_per_token_fwd+mxfp8_bwd", "grouped", "pallas_triton"),  # Composer 2's recipe
    (("gpu", H100), "mxfp8_floor", "sorted", None),  # not a grouped recipe (MOE_QUANT_GROUPED): the sorted path
    (("tpu", "TPU v5p"), "bf16", "sorted", None),
])
def test_auto_moe_impl_runs_the_grouped_kernels_where_the_device_has_them(device, quant, path, kernel):
    """moe_impl="auto" (the default) takes the grouped path through the kernel registry where its grouped GEMM has a
    device kernel, the sorted einsum elsewhere; resolve_moe_kernel writes the path and kernel into the config."""
    import contextlib

    from c2jax.kernels import dispatch
    from c2jax.models.moe_dispatch import moe_path, resolve_moe_kernel

    cfg = preset("medium").replace(dtype="bfloat16", moe_quant=quant)
    assert cfg.moe_impl == "auto"
    with dispatch.target(*device) if device else contextlib.nullcontext():
        assert moe_path(cfg) == path
        resolved = resolve_moe_kernel(cfg)
    assert (resolved.moe_impl, resolved.moe_kernel) == (path, kernel)


def test_auto_moe_impl_follows_the_kernel_override(monkeypatch):
    """$C2JAX_KERNEL_IMPL naming an interpretable kernel, or a config naming one, chooses the grouped path on CPU too;
    naming the XLA fallback for the op keeps auto on the sorted path."""
    from c2jax.kernels import dispatch
    from c2jax.models.moe_dispatch import moe_path, resolve_moe_kernel

    assert moe_path(TINY) == "sorted"
    assert moe_path(TINY.replace(moe_kernel="xla")) == "grouped"
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "grouped_matmul=pallas_triton")
    assert resolve_moe_kernel(TINY).moe_impl == "grouped" and resolve_moe_kernel(TINY).moe_kernel == "pallas_triton"
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "grouped_matmul=xla")
    with dispatch.target("gpu", H100):
        assert moe_path(TINY) == "sorted"


def test_auto_moe_layer_runs_the_path_it_resolves_to(monkeypatch):
    """The layer itself resolves "auto" while tracing: on CPU it runs the sorted path (equal to it bit for bit), with
    the override naming a grouped kernel it runs the registry's grouped GEMM."""
    import c2jax.kernels.grouped_gemm as grouped_gemm
    from c2jax.kernels import dispatch

    graphdef, state = make(TINY)
    x = inputs(TINY)
    auto = nnx.merge(graphdef, state)(x)[0]
    sorted_ = nnx.merge(with_config(TINY.replace(moe_impl="sorted")), state)(x)[0]
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(sorted_))
    calls = []
    real = grouped_gemm.grouped_matmul
    monkeypatch.setattr(grouped_gemm, "grouped_matmul", lambda *a, **k: calls.append(k.get("impl")) or real(*a, **k))
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "grouped_matmul=xla")
    nnx.merge(graphdef, state)(x)
    assert not calls  # the XLA fallback named: still the sorted path
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "grouped_matmul=pallas_triton")
    grouped = nnx.merge(graphdef, state)(x)[0]
    assert calls and set(calls) == {None}  # the override decides (impl=None: the registry's choice)
    assert rel_err(grouped, sorted_) < 1e-5
