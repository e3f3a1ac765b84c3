"""Build a device mesh from `MeshConfig` and place model state on it by logical-axis rules."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding

from c2jax.config import ConfigError, MeshConfig
from c2jax.sharding_rules import DEFAULT_PARAM_RULES, partition_spec


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with every MeshConfig axis (size-1 axes included, so rules can name them), Auto axis types:
    GSPMD propagates shardings through the model, and model code stays free of out_sharding annotations."""
    devices = list(jax.devices() if devices is None else devices)
    if cfg.num_devices != len(devices):
        raise ConfigError(
            f"mesh: {dict(zip(cfg.axis_names, cfg.shape))} needs {cfg.num_devices} devices, {len(devices)} available"
        )
    return jax.make_mesh(cfg.shape, cfg.axis_names, axis_types=(AxisType.Auto,) * len(cfg.shape),
                         devices=devices)


def shard_state(state: nnx.State, mesh: Mesh, rules: Mapping[str, object] = DEFAULT_PARAM_RULES) -> nnx.State:
    """Place every variable of `state` according to its `logical_axes` metadata and `rules`."""
    mesh_shape = dict(mesh.shape)

    def place(var):
        value = var.get_value()
        axes = var.get_metadata().get("logical_axes") or (None,) * value.ndim
        sharding = NamedSharding(mesh, partition_spec(value.shape, axes, mesh_shape, rules))
        return var.replace(jax.device_put(value, sharding))

    return jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
