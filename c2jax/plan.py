"""`c2jax plan`: will this model, on this mesh, fit? A dry run from abstract shapes only.

    c2jax plan kimi-k2.5 --devices 64 --mesh fsdp=8,expert=8 --seq 32768 --batch 64

Parameters and Adam moments per device come from the sharding rules applied to every variable's
logical axes (exact; c2jax.info.per_device_memory). Activation memory is an estimate of the peak of a
remat-per-layer training step (the model presets K2.5/V3 use remat_policy="full"), itemised so each
term can be checked by hand:

  layer inputs      L x T x d x bytes(dtype)                     saved for the backward, one per layer
  attention         B_l x S x H x (qk + v) x bytes               full-sequence K/V on every CP rank
                  + 3/4 x B_l x H x S_l x S x 4                  fp32 probabilities of one layer (CP static skip)
  MoE               P x T x d x bytes + C x E_l x (3f + d) x bytes  gathered tokens and expert buffers
  logits            T x V x 4                                     fp32 head output of the fused loss
with T = tokens per device (B_l x S_l), S_l = S / CP, P = expert-parallel degree, C = 1.25 x balanced load.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from c2jax.config import ConfigError, MeshConfig, add_source_arguments, resolve_source
from c2jax.models.config import ModelConfig

ACCELERATORS_GB = {"H200": 141.0, "B200": 180.0, "H100": 80.0}  # HBM per GPU, 1 GB = 1e9 bytes
DEFAULT_SEQ = 32768  # the report's short-context length
WORKSPACE_FRACTION = 0.9  # leave ~10% for XLA workspace, fragmentation, NCCL buffers


@dataclass(frozen=True)
class Plan:
    mesh: dict[str, int]
    tokens_per_device: int
    params_bytes: float
    optimizer_bytes: float
    other_bytes: float
    activation_terms: dict[str, float]

    @property
    def activation_bytes(self) -> float:
        return sum(self.activation_terms.values())

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.optimizer_bytes + self.other_bytes + self.activation_bytes

    def fits(self, gb: float) -> bool:
        return self.total_bytes <= WORKSPACE_FRACTION * gb * 1e9


def parse_mesh(text: str, devices: int | None) -> MeshConfig:
    """'fsdp=8,expert=8' -> MeshConfig; with `devices`, a missing remainder goes to 'data'."""
    sizes: dict[str, int] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--mesh: expected axis=size, got {item!r}")
        try:
            sizes[name.strip()] = int(value)
        except ValueError:
            raise ConfigError(f"--mesh: {name}: size must be an integer, got {value!r}") from None
    unknown = set(sizes) - set(MeshConfig().axis_names)
    if unknown:
        raise ConfigError(f"--mesh: unknown axes {sorted(unknown)}; axes are {MeshConfig().axis_names}")
    if devices is not None and "data" not in sizes and -1 not in sizes.values():
        sizes["data"] = -1
    cfg = MeshConfig(**sizes)
    return cfg.resolve(devices) if devices is not None else cfg


def plan(model: ModelConfig, mesh: MeshConfig, seq_len: int, global_batch: int, rules=None) -> Plan:
    from c2jax.info import per_device_memory
    from c2jax.mesh import param_rules

    sizes = mesh.sizes
    cp = sizes["context"]
    batch_ways = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if seq_len % (2 * cp):
        raise ConfigError(f"seq {seq_len} must divide by 2 x context ({2 * cp}) for the balanced CP layout")
    if global_batch % batch_ways:
        raise ConfigError(f"global batch {global_batch} does not split over data x fsdp x expert = {batch_ways}")
    mem = per_device_memory(model, sizes, rules or param_rules(mesh))
    act = 2 if model.dtype == "bfloat16" else 4
    b_local, s_local = global_batch // batch_ways, seq_len // cp
    tokens = b_local * s_local
    d, h = model.hidden_size, model.num_attention_heads
    ep = sizes["expert"]
    e_local = model.n_routed_experts // ep if model.n_routed_experts else 0
    terms = {
        "layer inputs": model.num_hidden_layers * tokens * d * act,
        "attention K/V": b_local * seq_len * h * (model.qk_head_dim + model.v_head_dim) * act,
        "attention probs": 0.75 * b_local * h * s_local * seq_len * 4 if cp > 1 else
        0.5 * b_local * h * seq_len * seq_len * 4,
        "logits": tokens * model.vocab_size * 4,
    }
    if model.n_routed_experts:
        capacity = math.ceil(1.25 * ep * tokens * model.num_experts_per_tok / model.n_routed_experts)
        f = model.moe_intermediate_size
        terms["MoE tokens + buffers"] = (ep * tokens * d + capacity * e_local * (3 * f + d)) * act
    return Plan(sizes, tokens, mem.params_bytes, mem.optimizer_bytes, mem.non_trainable_bytes, terms)


def format_plan(name: str, p: Plan, seq_len: int, global_batch: int) -> str:
    gb = lambda n: f"{n / 1e9:9.2f} GB"
    mesh = " ".join(f"{k}={v}" for k, v in p.mesh.items())
    lines = [
        f"plan             {name}  mesh {mesh}  ({math.prod(p.mesh.values())} devices)",
        f"step             global batch {global_batch} x seq {seq_len}; {p.tokens_per_device:,} tokens per device",
        f"params           {gb(p.params_bytes)}   (exact, from the sharding rules)",
        f"Adam moments     {gb(p.optimizer_bytes)}   (2 x fp32)",
        f"router bias      {gb(p.other_bytes)}",
    ]
    lines += [f"  act: {k:<21}{gb(v)}   (estimate)" for k, v in p.activation_terms.items()]
    lines.append(f"total            {gb(p.total_bytes)}")
    for acc, cap in ACCELERATORS_GB.items():
        verdict = "fits" if p.fits(cap) else "does NOT fit"
        lines.append(f"{acc:<6} {cap:5.0f} GB   {verdict} (budget {WORKSPACE_FRACTION:.0%} of HBM)")
    return "\n".join(lines)


@dataclass(frozen=True)
class PlanSource:
    """What a config file says to plan: its model and mesh, and the (label, seq, batch) shapes it trains at
    (None: the command line's --seq / --batch)."""
    model: ModelConfig
    mesh: MeshConfig
    shapes: tuple[tuple[str, int | None, int | None], ...]


def load_plan_source(source: str, overrides=()) -> PlanSource:
    """A model preset, a RunConfig YAML, a pretraining YAML (planned per phase, at each phase's sequence
    length and batch) or any other run YAML with `model` and `mesh` sections (e.g. an RL system config, whose
    full schema lives above c2jax; planned at its `engine.max_len` when it has one)."""
    import dataclasses
    from pathlib import Path

    from c2jax.config import RunConfig, _resolve_presets, apply_overrides, from_dict, load_config, load_yaml

    if not Path(source).is_file():
        cfg = load_config(source, overrides)
        return PlanSource(cfg.model, cfg.mesh, (("", None, None),))
    data = load_yaml(source)
    if "phases" in data:
        from c2jax.train.config import load_pretrain_config

        pcfg = load_pretrain_config(source, overrides)
        seq, batch = int(pcfg.data.get("seq_len", 0)) or None, int(pcfg.data.get("batch_size", 0)) or None
        shapes = tuple((f"phase {p.name}", p.seq_len or seq, p.batch_size or batch) for p in pcfg.phases)
        return PlanSource(pcfg.model, pcfg.mesh, shapes)
    if set(data) <= {f.name for f in dataclasses.fields(RunConfig)}:
        cfg = load_config(source, overrides)
        return PlanSource(cfg.model, cfg.mesh, (("", None, None),))
    if "model" not in data:
        raise ConfigError(f"{source}: no `model` section to plan")
    run_keys = {k: data[k] for k in ("name", "seed", "model", "mesh") if k in data}
    run_overrides = [o for o in overrides if o.split("=", 1)[0].split(".", 1)[0] in ("model", "mesh")]
    if len(run_overrides) != len(overrides):
        raise ConfigError("plan applies only model.* and mesh.* overrides to this config: got "
                          f"{[o for o in overrides if o not in run_overrides]}")
    cfg = from_dict(RunConfig, _resolve_presets(apply_overrides(run_keys, run_overrides)))
    max_len = (data.get("engine") or {}).get("max_len")
    label = "engine.max_len" if max_len else ""
    return PlanSource(cfg.model, cfg.mesh, ((label, int(max_len) if max_len else None, None),))


def add_parser(subparsers):
    p = subparsers.add_parser("plan", help="per-device memory of a model on a mesh, and whether it fits")
    add_source_arguments(p, "model preset name or a run YAML file (pretraining: planned per phase)",
                         "dotted overrides, e.g. model.remat_policy=full")
    p.add_argument("--devices", type=int, default=None, help="number of devices (the rest goes to 'data')")
    p.add_argument("--mesh", default=None, help="axis sizes, e.g. fsdp=8,expert=8 (default: the config's mesh)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: each phase's, else the "
                   f"report's {DEFAULT_SEQ // 1024}k)")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: each phase's, "
                   "else one per data-parallel rank)")
    p.add_argument("--json", action="store_true")
    return p


def run(args) -> int:
    import dataclasses
    import json

    src = load_plan_source(resolve_source(args), args.overrides)
    if args.mesh is not None:
        mesh = parse_mesh(args.mesh, args.devices)
        mesh = dataclasses.replace(mesh, param_rules=src.mesh.param_rules,
                                   activation_rules=src.mesh.activation_rules)
    elif args.devices:
        mesh = src.mesh.resolve(args.devices)
    elif -1 in src.mesh.sizes.values():
        raise ConfigError(f"{args.source}: mesh {src.mesh.sizes} has an inferred (-1) axis; pass --devices N "
                          "(or --mesh)")
    else:
        mesh = src.mesh
    if args.devices is not None and mesh.num_devices != args.devices:
        raise ConfigError(f"mesh {mesh.sizes} uses {mesh.num_devices} devices, --devices says {args.devices}")
    sizes = mesh.sizes
    shapes = [(label, args.seq if args.seq is not None else (seq or DEFAULT_SEQ),
               args.batch if args.batch is not None else (batch or sizes["data"] * sizes["fsdp"] * sizes["expert"]))
              for label, seq, batch in src.shapes]
    if args.seq is not None or args.batch is not None:
        shapes = list(dict.fromkeys((("", s, b) for _, s, b in shapes)))  # one plan per distinct shape
    plans, errors = [], []
    for label, seq, batch in shapes:
        try:
            plans.append((label, seq, batch, plan(src.model, mesh, seq, batch)))
        except ConfigError as e:
            if len(shapes) == 1:
                raise
            errors.append(f"{label or args.source} (seq {seq}, batch {batch}): {e}")
    if args.json:
        rows = [dataclasses.asdict(p) | {"label": label, "seq": seq, "batch": batch,
                                          "activation_bytes": p.activation_bytes, "total_bytes": p.total_bytes,
                                          "fits": {a: p.fits(c) for a, c in ACCELERATORS_GB.items()}}
                for label, seq, batch, p in plans]
        print(json.dumps(rows[0] if len(rows) == 1 and not rows[0]["label"] else rows, indent=2))
    else:
        print("\n\n".join((f"== {label}\n" if label else "") + format_plan(args.source, p, seq, batch)
                           for label, seq, batch, p in plans))
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    return 2 if errors else 0
