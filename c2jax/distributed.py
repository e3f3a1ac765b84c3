"""Multi-host start-up: one JAX process per host, `jax.distributed.initialize` before anything else.

Launch recipe (GPU cluster, one process per host, every host runs the same command):

    # SLURM: srun detects everything
    srun --nodes=8 --ntasks-per-node=1 --gpus-per-node=8 \\
        c2jax pretrain --config experiments/configs/composer2_k2.5.yaml distributed.enabled=true
    # anything else: tell process i where process 0 listens
    JAX_COORDINATOR_ADDRESS=node0:1234 JAX_NUM_PROCESSES=8 JAX_PROCESS_ID=$i \\
        c2jax pretrain --config ... distributed.enabled=true

After initialize, `jax.devices()` lists every host's devices (8 hosts x 8 GPUs = 64) and
`c2jax.mesh.make_mesh` lays the mesh over all of them; each process feeds only its addressable
shard of the batch (see `local_batch_slice`).
"""

from __future__ import annotations

import os

import jax

from c2jax.config import ConfigError, DistributedConfig


def initialize(cfg: DistributedConfig) -> bool:
    """Initialise multi-host JAX if `cfg.enabled`; returns whether it did. Call once, first thing."""
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
    jax.distributed.initialize(**kwargs)
    return True


def local_batch_slice(global_batch: int) -> slice:
    """The rows of a global batch this process loads: contiguous, process_index-th of process_count."""
    count, index = jax.process_count(), jax.process_index()
    if global_batch % count:
        raise ConfigError(f"global batch {global_batch} does not split over {count} processes")
    per = global_batch // count
    return slice(index * per, (index + 1) * per)
