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
