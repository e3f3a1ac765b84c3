"""Logical-axis sharding constraints on activations, configured from outside the model.

Model code names the axes of key activations (`constrain(x, ("batch", "seq", "embed"))`). With no
rules installed this is the identity; the parallelism layer installs a mesh and a logical -> mesh-axis
mapping with `logical_rules(...)`, and the same model code then emits sharding constraints.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_RULES: contextvars.ContextVar[tuple[Mesh, Mapping[str, object]] | None] = contextvars.ContextVar(
    "c2jax_logical_rules", default=None
)


@contextlib.contextmanager
def logical_rules(mesh: Mesh, rules: Mapping[str, object]):
    """Within this context, `constrain` maps logical names through `rules` (name -> mesh axis/axes/None)."""
    token = _RULES.set((mesh, dict(rules)))
    try:
        yield
    finally:
        _RULES.reset(token)


def partition_spec(axes, rules: Mapping[str, object]) -> PartitionSpec:
    return PartitionSpec(*(None if a is None else rules.get(a) for a in axes))


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    active = _RULES.get()
    if active is None:
        return x
    if len(axes) != x.ndim:
        raise ValueError(f"logical axes {axes} do not match an array of rank {x.ndim}")
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, partition_spec(axes, rules)))


def active_mesh_axes(name: str) -> tuple[Mesh, tuple[str, ...]] | None:
    """(mesh, the mesh axes of size > 1 that logical axis `name` maps to), or None when there are none.

    Layers that need explicit collectives (expert and context parallelism under `jax.shard_map`) ask
    this instead of naming mesh axes themselves, so the model stays mesh-agnostic."""
    active = _RULES.get()
    if active is None:
        return None
    mesh, rules = active
    target = rules.get(name)
    axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    axes = tuple(a for a in axes if mesh.shape[a] > 1)
    return (mesh, axes) if axes else None


def batch_axes() -> tuple[str, ...]:
    """Mesh axes (size > 1) that shard the batch dimension of activations, under the active rules."""
    found = active_mesh_axes("batch")
    return () if found is None else found[1]
