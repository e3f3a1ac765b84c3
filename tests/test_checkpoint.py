"""Orbax checkpoints: round trip, restore onto a different mesh, keep policy, corrupt-checkpoint fallback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from c2jax.train.checkpoint import Checkpointer, CorruptCheckpointError
from c2jax.train.config import CheckpointConfig


def _state(scale=1.0):
    return {"step": jnp.asarray(3, jnp.int32),
            "params": {"w": jnp.arange(64.0).reshape(8, 8) * scale, "b": jnp.ones(8) * scale},
            "opt": (jnp.zeros(8), {"count": jnp.asarray(7)})}


def test_round_trip_with_meta_and_keep_policy(tmp_path):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep_last=2, keep_every=4, async_save=True))
    for step in range(1, 9):
        ckpt.save(step, _state(step), {"phase": 1, "data_state": {"index": step}})
    ckpt.wait()
    assert ckpt.steps() == [4, 7, 8]  # the last two, and every 4th
    step, state, meta = ckpt.restore_latest(_state())
    assert step == 8 and meta == {"phase": 1, "data_state": {"index": 8}}
    np.testing.assert_array_equal(state["params"]["w"], _state(8)["params"]["w"])
    assert isinstance(state["opt"], tuple) and int(state["opt"][1]["count"]) == 7
    ckpt.close()


def test_restore_onto_a_different_mesh(tmp_path):
    devices = np.array(jax.devices()[:8])
    mesh_a = jax.sharding.Mesh(devices.reshape(4, 2), ("data", "model"))
    mesh_b = jax.sharding.Mesh(devices.reshape(2, 4), ("data", "model"))
    state = _state()
    state["params"]["w"] = jax.device_put(state["params"]["w"], NamedSharding(mesh_a, PartitionSpec("data", "model")))
    ckpt = Checkpointer(tmp_path, CheckpointConfig(async_save=False))
    ckpt.save(1, state, {})
    target = jax.tree.map(lambda x: x, _state())
    new_layout = NamedSharding(mesh_b, PartitionSpec(None, "data"))
    target["params"]["w"] = jax.device_put(target["params"]["w"] * 0, new_layout)
    _, restored, _ = ckpt.restore_latest(target)
    w = restored["params"]["w"]
    assert w.sharding.spec == PartitionSpec(None, "data") and w.sharding.mesh.shape == mesh_b.shape
    np.testing.assert_array_equal(np.asarray(w), np.arange(64.0).reshape(8, 8))
    ckpt.close()


def test_corrupt_checkpoint_is_reported_and_the_previous_one_used(tmp_path, capsys):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(async_save=False))
    ckpt.save(2, _state(2), {"phase": 0})
    ckpt.save(4, _state(4), {"phase": 0})
    # truncate every array file of step 4, as a dying disk or an interrupted copy would
    for f in (tmp_path / "4" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "metadata" not in f.name:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    with pytest.raises(CorruptCheckpointError, match="corrupt or partial"):
        ckpt.restore(4, _state())
    step, state, _ = ckpt.restore_latest(_state())
    assert step == 2
    np.testing.assert_array_equal(state["params"]["b"], np.ones(8) * 2)
    assert "falling back to the previous checkpoint" in capsys.readouterr().err
    ckpt.close()
