"""Logical axes map onto a real mesh without touching model code, and sharding never changes results."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType

from c2jax.mesh import shard_state
from c2jax.models.config import preset
from c2jax.models.logical import constrain, logical_rules
from c2jax.models.transformer import forward, init
from c2jax.sharding_rules import DEFAULT_PARAM_RULES

ACTIVATION_RULES = {"batch": ("data", "fsdp"), "seq": None, "embed": None, "vocab": None}


def test_sharded_forward_on_eight_devices_matches_single_device():
    assert len(jax.devices()) == 8, "conftest sets 8 fake CPU devices"
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "expert"), axis_types=(AxisType.Auto,) * 3)
    cfg = preset("tiny")
    model = init(cfg, seed=0)
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(0), (4, 16), 0, cfg.vocab_size)
    expected = forward(graphdef, state, tokens).logits

    sharded = shard_state(state, mesh, DEFAULT_PARAM_RULES)
    experts = sharded["moe_layers"]["mlp"]["gate_up_proj"].get_value()
    assert experts.sharding.spec[1] == "expert"  # [layers, experts, embed, expert_mlp]
    assert len(experts.addressable_shards) == 8 and experts.addressable_shards[0].data.shape[1] == 4

    with logical_rules(mesh, ACTIVATION_RULES):
        got = jax.jit(lambda s, t: forward(graphdef, s, t).logits)(sharded, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5, atol=2e-6)


def test_constrain_is_identity_without_rules_and_checks_rank():
    x = jnp.ones((2, 3))
    assert constrain(x, ("batch", "embed")) is x
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with logical_rules(mesh, {"batch": "data"}):
        try:
            constrain(x, ("batch",))
        except ValueError as e:
            assert "rank" in str(e)
        else:
            raise AssertionError("rank mismatch was not reported")
