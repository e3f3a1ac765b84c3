"""The pure train step: loss goes down, and the router bias follows the sign rule outside the optimizer."""

import jax
import numpy as np
import optax
from flax import nnx

from c2jax.models.config import preset
from c2jax.models.transformer import forward, init
from c2jax.train.step import init_train_state, make_train_step

CFG = preset("tiny").replace(num_nextn_predict_layers=0)


def tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (4, 17), 0, CFG.vocab_size)


def test_router_bias_moves_by_rate_times_sign_of_underload():
    rate = 0.01
    tx = optax.adamw(1e-3, weight_decay=0.1)
    graphdef, state = init_train_state(init(CFG, seed=0), tx)
    batch = tokens()
    counts = np.asarray(forward(graphdef, nnx.merge_state(state.params, state.model_state),
                                batch[:, :-1]).expert_counts, np.float64)
    expected = rate * np.sign(counts.mean(-1, keepdims=True) - counts)
    new_state, _ = make_train_step(graphdef, tx, router_bias_rate=rate)(state, batch)
    bias = new_state.model_state["moe_layers"]["mlp"]["e_score_correction_bias"].get_value()
    np.testing.assert_allclose(np.asarray(bias), expected, atol=1e-7)
    magnitude = np.abs(np.asarray(bias))
    assert np.all(np.isclose(magnitude, 0) | np.isclose(magnitude, rate))
    # and the next step starts from the moved bias: updates accumulate
    newer, _ = make_train_step(graphdef, tx, router_bias_rate=rate)(new_state, batch)
    moved = newer.model_state["moe_layers"]["mlp"]["e_score_correction_bias"].get_value()
    assert np.abs(np.asarray(moved) - np.asarray(bias)).max() <= rate + 1e-7
    assert not np.allclose(moved, bias)


def test_loss_decreases_on_a_repeated_batch():
    tx = optax.adam(3e-3)
    graphdef, state = init_train_state(init(CFG, seed=0), tx)
    step = make_train_step(graphdef, tx)
    batch = tokens(1)
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.2
    assert int(state.step) == 8


def test_z_loss_is_the_mean_squared_log_normaliser_and_its_gradient_is_exact():
    """loss = CE + z * mean_t lse_t^2 (PaLM), lse from the fused head (the logits are never built): value and
    gradients against autodiff through the model's logits."""
    import jax.numpy as jnp

    z = 1e-2
    tx = optax.sgd(1.0)
    graphdef, state = init_train_state(init(CFG, seed=0), tx)
    batch = tokens(2)
    ids, targets = batch[:, :-1], batch[:, 1:]

    def reference(params):
        out = forward(graphdef, nnx.merge_state(params, state.model_state), ids)
        logp = jax.nn.log_softmax(out.logits, -1)
        ce = -jnp.take_along_axis(logp, targets[..., None], -1).mean()
        return ce + z * jnp.mean(jnp.square(jax.nn.logsumexp(out.logits, -1))), ce

    (loss_ref, ce_ref), grads_ref = jax.value_and_grad(reference, has_aux=True)(state.params)
    new_state, metrics = make_train_step(graphdef, tx, z_loss=z)(state, batch)
    np.testing.assert_allclose(metrics["loss"], loss_ref, rtol=1e-6)
    np.testing.assert_allclose(metrics["z_loss"], (loss_ref - ce_ref) / z, rtol=1e-5)
    # SGD with lr 1: the parameter change is minus the gradient
    for new, old, g in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(state.params),
                           jax.tree.leaves(grads_ref), strict=True):
        np.testing.assert_allclose(np.asarray(old) - np.asarray(new), g, rtol=2e-4, atol=1e-7)


def test_optimizer_state_offloaded_to_host_memory_gives_the_same_steps():
    """Adam moments in host memory between steps (pinned_host shardings): the same parameters after two steps
    as on the device, and the moments come back in host memory. (XLA:CPU's memory analysis does not split host
    from device bytes, so what this saves on an accelerator is the planner's figure, not measured here.)"""
    from c2jax.config import MeshConfig
    from c2jax.mesh import make_mesh, place_on_mesh, shard_state
    from c2jax.train.step import TrainState, offload_shardings

    mesh = make_mesh(MeshConfig(fsdp=8))
    tx = optax.adam(1e-2)
    graphdef, state = init_train_state(init(CFG, seed=0), tx)
    params = shard_state(state.params, mesh)
    state = place_on_mesh(TrainState(state.step, params, shard_state(state.model_state, mesh),
                                     jax.jit(tx.init)(params), state.rng), mesh)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    host = shardings._replace(opt_state=offload_shardings(shardings.opt_state))
    batch = tokens(3)
    results = {}
    for name, sh in (("device", shardings), ("host", host)):
        step = make_train_step(graphdef, tx, state_shardings=sh, batch_sharding=None, mesh=mesh, rules={})
        s = jax.device_put(state, sh)
        for _ in range(2):
            s, _ = step(s, batch)
        assert {x.sharding.memory_kind for x in jax.tree.leaves(s.opt_state)} == {
            "pinned_host" if name == "host" else "device"}
        results[name] = s
    on_device, offloaded = results["device"], results["host"]
    for a, b in zip(jax.tree.leaves(on_device.params), jax.tree.leaves(offloaded.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_balancing_loss_equals_transformers_qwen3_moe():
    """models.moe_routing.load_balancing_loss against transformers' own load_balancing_loss_func (Qwen3-MoE's
    router_aux_loss), on the same router logits pooled over layers, with and without padding."""
    import pytest

    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from c2jax.models.moe_routing import load_balancing_loss

    cfg = preset("tiny-qwen3-moe").replace(num_hidden_layers=4)
    graphdef, state = nnx.split(init(cfg, seed=3))
    ids = jax.random.randint(jax.random.key(5), (2, 9), 0, cfg.vocab_size)
    out = forward(graphdef, state, ids, return_mtp=False)
    mask = np.ones((2, 9), np.int64)
    mask[1, 6:] = 0
    logits = tuple(torch.from_numpy(np.asarray(out.router_logits[i]).reshape(-1, cfg.n_routed_experts))
                   for i in range(cfg.num_moe_layers))
    for m in (None, mask):
        want = float(load_balancing_loss_func(logits, cfg.n_routed_experts, cfg.num_experts_per_tok,
                                              None if m is None else torch.from_numpy(m)))
        got = float(load_balancing_loss(cfg, out.router_logits, out.expert_ids, None if m is None else m))
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_every_family_trains_and_qwen3_moe_with_its_aux_loss():
    """The train step on each family's small preset: the loss goes down on a repeated batch; a Qwen3-MoE step with
    router_aux_loss reports the balance loss and its gradient reaches the router."""
    from c2jax.models.config import FAMILY_TINY_PRESETS

    for name in FAMILY_TINY_PRESETS.values():
        cfg = preset(name).replace(num_nextn_predict_layers=0)
        tx = optax.adam(3e-3)
        graphdef, state = init_train_state(init(cfg, seed=0), tx)
        step = make_train_step(graphdef, tx, router_aux_loss=1e-2 if cfg.num_moe_layers else 0.0)
        batch = jax.random.randint(jax.random.key(1), (4, 17), 0, cfg.vocab_size)
        first, metrics = None, None
        for _ in range(6):
            state, metrics = step(state, batch)
            first = float(metrics["loss"]) if first is None else first
        assert float(metrics["loss"]) < first - 0.1, name
        if cfg.num_moe_layers:
            assert float(metrics["router_aux_loss"]) > 0.5, name  # k = 2 at balance: E * sum_e f_e P_e
    cfg = preset("tiny-qwen3-moe")
    tx = optax.sgd(1.0)
    graphdef, state = init_train_state(init(cfg, seed=0), tx)
    batch = jax.random.randint(jax.random.key(2), (2, 9), 0, cfg.vocab_size)
    plain, _ = make_train_step(graphdef, tx)(state, batch)
    _, state = init_train_state(init(cfg, seed=0), tx)
    balanced, _ = make_train_step(graphdef, tx, router_aux_loss=1.0)(state, batch)
    gate = lambda s: np.asarray(s.params["moe_layers"]["mlp"]["gate"].get_value())  # noqa: E731
    assert np.abs(gate(plain) - gate(balanced)).max() > 1e-6


def test_qwen3_moe_trains_with_the_low_precision_moe_recipes():
    """The Composer 2 MoE recipes on the Qwen3-MoE family (the quantized expert GEMMs take any router's Routing):
    the first step's loss is the bf16 step's within the quantization error and training goes down."""
    base = preset("tiny-qwen3-moe")
    batch = jax.random.randint(jax.random.key(3), (4, 17), 0, base.vocab_size)
    first = {}
    for recipe in ("bf16", "mxfp8", "nvfp4_per_token_fwd+mxfp8_bwd"):
        cfg = base.replace(moe_quant=recipe)
        tx = optax.adam(3e-3)
        graphdef, state = init_train_state(init(cfg, seed=0), tx)
        step = make_train_step(graphdef, tx)
        losses = []
        for _ in range(5):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        first[recipe] = losses[0]
        assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, (recipe, losses)
    for recipe in ("mxfp8", "nvfp4_per_token_fwd+mxfp8_bwd"):
        assert abs(first[recipe] - first["bf16"]) < 0.02 * first["bf16"], first
