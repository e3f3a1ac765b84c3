"""Logical axis -> mesh axis rules, as data, and the partition spec they give one array.

The model names every parameter dimension (models/layers.py); these rules say which mesh axis, if
any, shards it. A dimension is sharded only if the mesh axis divides it, and a mesh axis is used at
most once per array (first dimension wins), so any rules give a valid spec for any shape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec

# Composer 2 trains with FSDP + expert parallelism + context parallelism (no tensor parallelism):
# experts go to 'expert'; every other weight is sharded over all data-parallel devices, 'fsdp' and
# 'expert' together (expert-parallel ranks are data-parallel for the dense part of the model), and over
# 'context' too: context-parallel ranks hold the same weights, so sharding parameters, gradients and Adam
# moments over them divides the state by CP for one more all-gather axis (ZeRO-3 over every axis but
# 'data', which stays plain replication); 'tensor' is available for heads / MLP widths when a mesh has it.
DEFAULT_PARAM_RULES: dict[str, str | tuple[str, ...] | None] = {
    "layers": None,
    "vocab": "tensor",
    "embed": ("fsdp", "expert", "context"),
    "mtp_in": ("fsdp", "expert", "context"),
    "q_lora": ("fsdp", "expert", "context"),  # FSDP needs a dimension on every weight: q_b_proj has no embed axis
    "kv_lora": ("fsdp", "expert", "context"),
    "heads": "tensor",
    "kv_heads": "tensor",  # GQA's K/V heads (fewer than the query heads)
    "head_dim": None,
    "mlp": "tensor",
    "experts": "expert",
    "expert_mlp": "tensor",
    "norm": None,
}


# Activations (models/logical.py names them): tokens are split over every data-parallel axis, the
# expert axis included (EP ranks hold different tokens; models/expert_parallel.py exchanges them), and
# the sequence over 'context'. "experts" is the expert dimension of MoE weights as seen by the
# expert-parallel shard_map: it must name the same axis as DEFAULT_PARAM_RULES["experts"].
DEFAULT_ACTIVATION_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp", "expert"),
    "seq": "context",
    "embed": None,
    "vocab": "tensor",
    "experts": "expert",
}


def _as_tuple(mesh_axes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def partition_spec(shape: Sequence[int], logical_axes: Sequence[str | None], mesh_shape: Mapping[str, int],
                   rules: Mapping[str, object] = DEFAULT_PARAM_RULES) -> PartitionSpec:
    if len(shape) != len(logical_axes):
        raise ValueError(f"shape {tuple(shape)} and logical axes {tuple(logical_axes)} differ in rank")
    used: set[str] = set()
    spec = []
    for dim, name in zip(shape, logical_axes):
        if name is not None and name not in rules:
            raise KeyError(f"no sharding rule for logical axis {name!r}; known: {sorted(rules)}")
        chosen = []
        for axis in _as_tuple(rules.get(name)) if name is not None else ():
            size = mesh_shape.get(axis, 1)
            if axis in used or size == 1:
                continue
            if dim % (math.prod(mesh_shape[a] for a in chosen) * size) == 0:
                chosen.append(axis)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def shard_factor(spec: PartitionSpec, mesh_shape: Mapping[str, int]) -> int:
    """How many devices one array is split across under `spec`."""
    return math.prod(mesh_shape[a] for entry in spec for a in _as_tuple(entry))
