"""Multi-process JAX: one process per host, `jax.distributed.initialize` before anything else, and the
pieces a multi-process training loop needs (which rows of a global batch this process loads, global arrays
from process-local rows, a JSON all-gather, "am I process 0").

Launch recipes (every process runs the same command; docs/parallelism.md shows the mesh each builds and
tests/test_multihost.py runs the plain-environment one and the SLURM one over loopback):

    # SLURM, one process per host: JAX detects address, count and index from srun's environment
    srun --nodes=8 --ntasks-per-node=1 --gpus-per-node=8 \\
        c2jax pretrain --config experiments/configs/composer2_k2.5.yaml distributed.enabled=true
    # anything else: tell process i where process 0 listens
    JAX_COORDINATOR_ADDRESS=node0:1234 JAX_NUM_PROCESSES=8 JAX_PROCESS_ID=$i \\
        c2jax pretrain --config ... distributed.enabled=true

After initialize, `jax.devices()` lists every process's devices (8 hosts x 8 GPUs = 64) and
`c2jax.mesh.make_mesh` lays the mesh over all of them; each process loads only the rows of each batch its
own devices hold (`DataShard`) and `global_batch` assembles the global array from them.

Failure: every process sends heartbeats to the coordination service (in process 0). When a process dies, the
others abort (SIGABRT, from JAX's C++ client) within about `heartbeat_timeout_s` with "The following tasks
are unhealthy (stopped sending heartbeats)"; when process 0 dies, the others abort at once ("Failed to send
RPC to coordination service"). Collectives on CPU (gloo) would otherwise wait forever on the dead peer.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import numpy as np

from c2jax.config import ConfigError, DistributedConfig


def initialize(cfg: DistributedConfig) -> bool:
    """Initialise multi-process JAX if `cfg.enabled`; returns whether it did. Call once, first thing
    (before anything asks JAX for its devices)."""
    if not cfg.enabled:
        return False
    kwargs = {}
    address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    if address:
        kwargs["coordinator_address"] = address
    num = cfg.num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0"))
    pid = cfg.process_id if cfg.process_id >= 0 else int(os.environ.get("JAX_PROCESS_ID", "-1"))
    if num:
        kwargs["num_processes"] = num
    if pid >= 0:
        kwargs["process_id"] = pid
    if cfg.local_device_ids:
        kwargs["local_device_ids"] = list(cfg.local_device_ids)
    if address and (not num or pid < 0):
        raise ConfigError("distributed: with a coordinator address, num_processes and process_id are needed "
                          "(config or JAX_NUM_PROCESSES / JAX_PROCESS_ID)")
    # cross-process collectives on CPU need an implementation; gloo is the default from jax 0.5 on, "none"
    # (collectives fail) before; GPUs and TPUs ignore the setting
    if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs, initialization_timeout=cfg.initialization_timeout_s,
                               heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    print(f"c2jax.distributed: process {jax.process_index()} of {jax.process_count()}, "
          f"{jax.local_device_count()} of {jax.device_count()} devices local; a process silent for "
          f"{cfg.heartbeat_timeout_s} s is declared dead and the job aborts", file=sys.stderr, flush=True)
    return True


def is_primary() -> bool:
    """Process 0: the one that writes metrics, TensorBoard, console output and the resolved config."""
    return jax.process_index() == 0


@dataclass(frozen=True)
class DataShard:
    """This process's part of a global batch: `rows` of every `global_rows` (sorted global row indices its
    devices hold), data shard `index` of `count`. Processes whose devices hold the same rows (replicas of
    the batch, e.g. a context or tensor axis across processes) share one data shard and must load the same
    rows."""

    index: int
    count: int
    rows: tuple[int, ...]
    global_rows: int

    @property
    def local_rows(self) -> int:
        return len(self.rows)


def data_shard(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...], row_axis: int = 0) -> DataShard:
    """Which rows (along `row_axis`) of a global batch of `global_shape`, laid out by `sharding`, this
    process loads, and which data shard that is. Raises ConfigError when processes would need overlapping
    but different rows (no row partition over processes exists)."""
    per_process: dict[int, set[int]] = {}
    for device, index in sharding.devices_indices_map(tuple(global_shape)).items():
        rows = range(global_shape[row_axis])[index[row_axis]]
        per_process.setdefault(device.process_index, set()).update(rows)
    groups = sorted({tuple(sorted(r)) for r in per_process.values()})
    seen: set[int] = set()
    for g in groups:
        if seen & set(g) or len(g) != len(groups[0]):
            raise ConfigError(f"batch sharding {sharding}: processes hold overlapping or unequal sets of rows "
                              f"({[list(g) for g in groups]}); choose a mesh whose batch axes split rows evenly "
                              "over processes")
        seen |= set(g)
    mine = tuple(sorted(per_process[jax.process_index()]))
    return DataShard(groups.index(mine), len(groups), mine, global_shape[row_axis])


def global_batch(local: Mapping[str, np.ndarray], sharding: jax.sharding.Sharding, shard: DataShard,
                 row_axis: int = 0) -> dict[str, jax.Array]:
    """Global arrays from this process's rows (`shard.local_rows` along `row_axis`; every other axis whole):
    `jax.make_array_from_process_local_data` puts each local device's slice in place."""
    out = {}
    for name, x in local.items():
        x = np.asarray(x)
        if x.shape[row_axis] != shard.local_rows:
            raise ValueError(f"batch[{name!r}]: this process loads {shard.local_rows} rows of each global "
                             f"batch of {shard.global_rows}, got an array of shape {x.shape}")
        shape = x.shape[:row_axis] + (shard.global_rows,) + x.shape[row_axis + 1:]
        out[name] = jax.make_array_from_process_local_data(sharding, x, shape)
    return out


def allgather_json(obj) -> list:
    """[obj of process 0, obj of process 1, ...] on every process (a collective: all processes call it)."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.array([len(data)], np.int32))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(data)] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(gathered, lengths)]

