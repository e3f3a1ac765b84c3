"""Mesh construction from config, and a sharded train step on 8 fake devices (FSDP x EP x data)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from c2jax.config import ConfigError, MeshConfig
from c2jax.mesh import make_mesh, shard_state
from c2jax.models.config import preset
from c2jax.models.transformer import init
from c2jax.train.step import init_train_state, make_train_step

CFG = preset("tiny").replace(num_nextn_predict_layers=0)


def test_mesh_has_every_configured_axis_and_checks_device_count():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, expert=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 2, "context": 1, "tensor": 1}
    with pytest.raises(ConfigError, match="needs 4 devices, 8 available"):
        make_mesh(MeshConfig(fsdp=4))


def test_sharded_train_step_matches_the_single_device_step():
    tx = optax.adamw(1e-3, weight_decay=0.1)
    tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, CFG.vocab_size)
    graphdef, state = init_train_state(init(CFG, seed=0), tx)
    step = make_train_step(graphdef, tx, router_bias_rate=1e-2)
    ref_state, ref_metrics = step(state, tokens)

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, expert=2))
    sharded = state._replace(params=shard_state(state.params, mesh), model_state=shard_state(state.model_state, mesh),
                             opt_state=tx.init(shard_state(state.params, mesh)))
    experts = sharded.params["moe_layers"]["mlp"]["gate_up_proj"].get_value()
    assert experts.sharding.spec[1] == "expert"
    new_state, metrics = step(sharded, tokens)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    got, want = (jax.tree.leaves(nnx.to_pure_dict(s.params)) for s in (new_state, ref_state))
    for a, b in zip(got, want):
        # Adam normalises each update, so near-zero gradients turn reduction-order noise into up to ~1%
        # of one step (lr = 1e-3): compare to 2% of a step
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5)
    bias = new_state.model_state["moe_layers"]["mlp"]["e_score_correction_bias"].get_value()
    ref_bias = ref_state.model_state["moe_layers"]["mlp"]["e_score_correction_bias"].get_value()
    np.testing.assert_array_equal(np.asarray(bias), np.asarray(ref_bias))  # global counts, not one shard's
