"""`c2jax info`: model size, training FLOPs and per-device memory, from abstract shapes only.

Nothing is allocated: the model is built under `jax.eval_shape` (c2jax.models.transformer.abstract_state),
so this runs for the 1T-parameter preset on a laptop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
from flax import nnx

from c2jax.models.config import ModelConfig
from c2jax.models.flops import param_counts, training_flops_per_token
from c2jax.models.layers import RouterBias
from c2jax.models.transformer import abstract_state
from c2jax.sharding_rules import DEFAULT_PARAM_RULES, partition_spec, shard_factor

ADAM_MOMENTS = 2  # mu and nu, kept in float32 whatever the parameter dtype


@dataclass(frozen=True)
class MemoryReport:
    params_bytes: float  # per device
    optimizer_bytes: float  # per device, Adam moments
    non_trainable_bytes: float  # per device: router biases
    largest_unsharded: tuple[str, tuple[int, ...]] | None  # biggest array left whole on every device

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.optimizer_bytes + self.non_trainable_bytes


def per_device_memory(cfg: ModelConfig, mesh_shape: dict[str, int], rules=DEFAULT_PARAM_RULES) -> MemoryReport:
    _, state = abstract_state(cfg)
    params = opt = other = 0.0
    largest, largest_size = None, 0
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        axes = var.get_metadata().get("logical_axes") or (None,) * len(value.shape)
        spec = partition_spec(value.shape, axes, mesh_shape, rules)
        factor = shard_factor(spec, mesh_shape)
        nbytes = value.size * jnp.dtype(value.dtype).itemsize / factor
        if isinstance(var, RouterBias):
            other += nbytes
            continue
        params += nbytes
        opt += ADAM_MOMENTS * value.size * 4 / factor
        if factor == 1 and value.size > largest_size:
            largest, largest_size = ("/".join(map(str, path)), tuple(value.shape)), value.size
    return MemoryReport(params, opt, other, largest)


def _human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def report(cfg: ModelConfig, mesh_shape: dict[str, int], seq_len: int) -> dict:
    counts = param_counts(cfg)
    mem = per_device_memory(cfg, mesh_shape)
    return {
        "total_params": counts.total,
        "active_params": counts.active,
        "embedding_params": counts.embedding,
        "mtp_params": counts.mtp,
        "train_flops_per_token": training_flops_per_token(cfg, seq_len),
        "seq_len": seq_len,
        "mesh": dict(mesh_shape),
        "devices": math.prod(mesh_shape.values()),
        "per_device_params_bytes": mem.params_bytes,
        "per_device_adam_bytes": mem.optimizer_bytes,
        "per_device_router_bias_bytes": mem.non_trainable_bytes,
        "per_device_total_bytes": mem.total_bytes,
        "largest_unsharded": mem.largest_unsharded,
    }


def format_report(name: str, r: dict) -> str:
    mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items())
    lines = [
        f"model            {name}",
        f"total params     {_human(r['total_params'])}  ({r['total_params']:,})",
        f"active params    {_human(r['active_params'])}  per token (top-k routed experts)",
        f"  embedding      {_human(r['embedding_params'])}   mtp modules {_human(r['mtp_params'])}",
        f"train FLOPs      {_human(r['train_flops_per_token'])}FLOP per token at seq {r['seq_len']} "
        "(3 x forward, causal attention)",
        f"mesh             {mesh}  ({r['devices']} devices)",
        f"per device       params {_gib(r['per_device_params_bytes'])} + Adam {_gib(r['per_device_adam_bytes'])}"
        f" + router bias {_gib(r['per_device_router_bias_bytes'])} = {_gib(r['per_device_total_bytes'])}",
    ]
    if r["largest_unsharded"]:
        path, shape = r["largest_unsharded"]
        lines.append(f"largest replicated array  {path} {shape}")
    return "\n".join(lines)


def add_parser(subparsers):
    from c2jax.config import add_source_arguments

    p = subparsers.add_parser("info", help="parameter counts, FLOPs per token and per-device memory")
    add_source_arguments(p, "model preset name or a run YAML file",
                         "dotted overrides, e.g. mesh.expert=8 model.num_hidden_layers=4")
    p.add_argument("--seq", type=int, default=4096, help="sequence length for attention FLOPs")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    import json

    from c2jax.config import ConfigError, resolve_source
    from c2jax.plan import load_plan_source

    src = load_plan_source(resolve_source(args), args.overrides)
    mesh_shape = src.mesh.sizes
    if -1 in mesh_shape.values():
        raise ConfigError(f"mesh {mesh_shape} has an inferred (-1) axis; `c2jax plan --devices N` resolves it")
    r = report(src.model, mesh_shape, args.seq)
    print(json.dumps(r, indent=2) if args.json else format_report(args.source, r))
    return 0


__all__ = ["per_device_memory", "report", "format_report", "add_parser", "run"]
