"""Build a device mesh from `MeshConfig`, and the shardings of state and batches on it.

Axis types are Auto on purpose: GSPMD propagates shardings from the parameters and the batch through
the model, so model code carries no `out_sharding` annotations; the few places that need explicit
collectives (expert and context parallelism) use `jax.shard_map` with specs derived from the same
logical rules (models/expert_parallel.py, models/attention.py), and layer boundaries are pinned with
`c2jax.models.logical.constrain`. Explicit axes would make every ambiguous op in the model name its output
sharding, which buys nothing here that the shard_map islands do not already give.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from c2jax.config import ConfigError, MeshConfig
from c2jax.sharding_rules import DEFAULT_ACTIVATION_RULES, DEFAULT_PARAM_RULES, partition_spec


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with every MeshConfig axis (size-1 axes included, so rules can name them), Auto axis
    types; a -1 axis takes the devices the others leave."""
    devices = list(jax.devices() if devices is None else devices)
    try:
        cfg = cfg.resolve(len(devices))
    except ConfigError as e:
        raise ConfigError(f"mesh: {e}") from None
    return jax.make_mesh(cfg.shape, cfg.axis_names, axis_types=(AxisType.Auto,) * len(cfg.shape),
                         devices=devices)


def param_rules(cfg: MeshConfig | None = None) -> dict:
    return {**DEFAULT_PARAM_RULES, **(cfg.param_rules if cfg else {})}


def activation_rules(cfg: MeshConfig | None = None) -> dict:
    return {**DEFAULT_ACTIVATION_RULES, **(cfg.activation_rules if cfg else {})}


def state_shardings(state, mesh: Mesh, rules: Mapping[str, object] = DEFAULT_PARAM_RULES):
    """NamedSharding for every leaf of a pytree of nnx Variables (by their `logical_axes` metadata);
    other leaves (optimizer counts, scalars) are replicated. Works on abstract (eval_shape) state."""
    mesh_shape = dict(mesh.shape)

    def one(var):
        if isinstance(var, nnx.Variable):
            value = var.get_value()
            axes = var.get_metadata().get("logical_axes") or (None,) * len(value.shape)
            return var.replace(NamedSharding(mesh, partition_spec(value.shape, axes, mesh_shape, rules)))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_state(state: nnx.State, mesh: Mesh, rules: Mapping[str, object] = DEFAULT_PARAM_RULES) -> nnx.State:
    """Place every variable of `state` according to its `logical_axes` metadata and `rules`."""
    shardings = state_shardings(state, mesh, rules)
    return jax.tree.map(lambda v, s: v.replace(jax.device_put(v.get_value(), s.get_value())), state, shardings,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_spec(mesh: Mesh, rules: Mapping[str, object] = DEFAULT_ACTIVATION_RULES) -> PartitionSpec:
    """[B, S] arrays: batch over the axes of logical "batch", sequence over those of "seq"."""
    def axes(name):
        target = rules.get(name)
        names = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        names = tuple(a for a in names if mesh.shape.get(a, 1) > 1)
        return None if not names else names[0] if len(names) == 1 else names

    return PartitionSpec(axes("batch"), axes("seq"))


def batch_shardings(batch: Mapping[str, object], mesh: Mesh,
                    rules: Mapping[str, object] = DEFAULT_ACTIVATION_RULES) -> dict:
    """A NamedSharding per batch entry: [B, S, ...] arrays as `batch_spec`, [B] ones over the batch axes."""
    spec = batch_spec(mesh, rules)

    def one(x):
        ndim = len(x.shape)
        if ndim == 0:
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, PartitionSpec(*spec[:ndim]))

    return {k: one(v) for k, v in batch.items()}


def jit_sharded(step_fn, mesh: Mesh, rules: Mapping[str, object], state_shardings, batch_shardings,
                donate: bool = True):
    """jax.jit of `step_fn(state, batch) -> (state, metrics)` with explicit in/out shardings, the state
    donated, and the logical activation rules installed while it traces (so layers constrain their
    activations and switch to their expert-/context-parallel forms)."""
    from c2jax.models.logical import logical_rules

    def traced(state, batch):
        with logical_rules(mesh, rules):
            return step_fn(state, batch)

    return jax.jit(traced, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, NamedSharding(mesh, PartitionSpec())),
                   donate_argnums=(0,) if donate else ())


def place_on_mesh(tree, mesh: Mesh):
    """Arrays of `tree` not already laid out on `mesh` (scalars such as step and optimizer counts, made on
    one device) are replicated over it, so one jitted step sees every input on the same devices."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            return x
        return jax.device_put(x, replicated)

    return jax.tree.map(one, tree)
