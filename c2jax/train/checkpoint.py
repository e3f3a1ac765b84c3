"""Orbax checkpoints of the whole run: TrainState (params, optimizer, router biases, RNG, step) plus a
JSON `meta` item (phase, data-iterator state, counters). Saves are async; a step directory only
appears once Orbax has committed it, so a kill -9 mid-save leaves the previous checkpoint as latest.

Layout: <run>/checkpoints/<step>/{state/ (OCDBT arrays), meta/ (JSON)}. The state is stored as a nested
dict keyed by pytree path (e.g. params/moe_layers/mlp/...), restored into the caller's abstract state,
whose shardings decide the placement, so a checkpoint written on one mesh restores onto another.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from c2jax.train.config import CheckpointConfig


def path_key_name(k) -> str:
    """One element of a pytree key path (dict key, attribute name or sequence index) as a string."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def to_nested(tree) -> dict[str, Any]:
    """Pytree -> nested dict {path element: ...} of its leaves (names readable in the checkpoint)."""
    out: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        node = out
        names = [path_key_name(k) for k in path]
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = leaf
    return out


def from_nested(nested: dict[str, Any], like) -> Any:
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    leaves = []
    for path, _ in paths:
        node = nested
        for k in path:
            node = node[path_key_name(k)]
        leaves.append(node)
    return jax.tree_util.tree_unflatten(treedef, leaves)


class CorruptCheckpointError(RuntimeError):
    pass


# Orbax's replica-parallel save splits every replicated shard among its replicas, one jitted slice per
# piece; for small arrays (norms, biases, counters, optimizer scalars) each slice costs a compile, far
# more than it saves (13 s per save of the tiny test model on a 2 x 2 CPU mesh). Only split slices >= 1 MiB.
_MIN_REPLICA_SLICE_BYTES = 1 << 20
_handler_registered = False


def _register_array_handler() -> None:
    global _handler_registered
    if not _handler_registered:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=_MIN_REPLICA_SLICE_BYTES),
            override=True)
        _handler_registered = True


class Checkpointer:
    def __init__(self, directory: str | Path, cfg: CheckpointConfig):
        self.directory = Path(directory).absolute()
        _register_array_handler()
        keep = [policies.LatestN(cfg.keep_last)]
        if cfg.keep_every:
            keep.append(policies.EveryNSteps(cfg.keep_every))
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=cfg.async_save, cleanup_tmp_directories=True,
            preservation_policy=policies.AnyPreservationPolicy(keep),
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def save(self, step: int, state, meta: dict[str, Any]) -> None:
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(to_nested(state)), meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore(self, step: int, abstract_state):
        """Restore `step` into the structure/shardings of `abstract_state` (a tree of arrays or
        jax.ShapeDtypeStruct). Raises CorruptCheckpointError naming the step and the cause."""
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            abstract_state)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(to_nested(target)), meta=ocp.args.JsonRestore()))
            state = from_nested(out["state"], abstract_state)
        except Exception as e:  # Orbax/TensorStore raise many types for truncated or missing files
            raise CorruptCheckpointError(
                f"checkpoint {self.directory / str(step)} is corrupt or partial: {type(e).__name__}: {e}"
            ) from e
        return state, dict(out["meta"])

    def restore_latest(self, abstract_state):
        """(step, state, meta) of the newest checkpoint that restores cleanly, or None if there is none.
        A bad checkpoint is reported on stderr and the previous one is tried."""
        for step in reversed(self.steps()):
            try:
                state, meta = self.restore(step, abstract_state)
                return step, state, meta
            except CorruptCheckpointError as e:
                print(f"warning: {e}; falling back to the previous checkpoint", file=sys.stderr)
        return None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
