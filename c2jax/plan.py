"""`c2jax plan`: will this model, on this mesh, fit? A dry run from abstract shapes only.

    c2jax plan kimi-k2.5 --devices 64 --mesh fsdp=8,expert=8 --seq 32768 --batch 64
    c2jax plan --config experiments/configs/composer2_k2.5.yaml --fit    # smallest device count per GPU kind

The memory model (per device; docs/parallelism.md, "Memory model"):

  state        parameters (`param_dtype`, fp32 masters by default: the forward casts each layer's weights to
               `dtype` as it uses them) and two fp32 Adam moments, sharded as the rules say (exact, from every
               variable's logical axes); `--offload-optimizer` moves the moments to host memory
  gradients    one fp32 gradient per parameter, sharded like it
  gathered     FSDP all-gathers one layer's weights (in `dtype`) at a time: two layers in flight
  saved        what the backward keeps per layer: with remat_policy "full" only the layer's input
               [T, d]; "save_attn_kernel" adds the attention kernel's output and log-sum-exp; otherwise every
               residual of the layer (other policies are planned as "none", an upper bound)
  layer        one layer's backward working set: its residuals and their cotangents, the full-sequence K/V a
               context-parallel rank gathers, and the MoE's dispatch buffers for one chunk of
               `moe_chunk_tokens` (under expert parallelism the exchange of one chunk: ep x its assignments)
  head         the fused LM head + loss: two [chunk, V] fp32 arrays (`loss_chunk_tokens`; [T, V] when
               unchunked), MTP self-distillation four (teacher and student log-probabilities, cotangents)

with T = tokens per device = (global batch / (data x fsdp x expert)) x (seq / context). Checked against XLA's
compiled memory analysis of the real train step on 8 CPU devices (tests/test_plan.py: within 25%).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from functools import lru_cache

import jax.numpy as jnp

from c2jax.config import ConfigError, MeshConfig, add_source_arguments, resolve_source
from c2jax.models.config import ModelConfig

# HBM per GPU, 1 GB = 1e9 bytes (NVIDIA's data sheets: H100 SXM 80 GB, H200 141 GB, B200 180 GB, B300 288 GB)
ACCELERATORS_GB = {"H100": 80.0, "H200": 141.0, "B200": 180.0, "B300": 288.0}
DEFAULT_SEQ = 32768  # the report's short-context length
WORKSPACE_FRACTION = 0.9  # leave ~10% for XLA workspace, fragmentation, NCCL buffers
GPUS_PER_NODE = 8
MOE_CAPACITY = 1.25  # the first capacity bucket (ModelConfig.moe_capacity_factors): a balanced load's buffers


@dataclass(frozen=True)
class Plan:
    mesh: dict[str, int]
    tokens_per_device: int
    params_bytes: float
    optimizer_bytes: float  # on the device (0 when offloaded)
    other_bytes: float
    activation_terms: dict[str, float]
    gradient_bytes: float = 0.0
    gathered_bytes: float = 0.0
    optimizer_host_bytes: float = 0.0  # offloaded Adam moments, in host memory
    notes: tuple[str, ...] = field(default=())

    @property
    def state_bytes(self) -> float:
        """What the train step takes as arguments: parameters, optimizer state, router biases."""
        return self.params_bytes + self.optimizer_bytes + self.other_bytes

    @property
    def activation_bytes(self) -> float:
        return sum(self.activation_terms.values())

    @property
    def step_bytes(self) -> float:
        """What the train step needs beyond its arguments (XLA's temporaries)."""
        return self.gradient_bytes + self.gathered_bytes + self.activation_bytes

    @property
    def total_bytes(self) -> float:
        return self.state_bytes + self.step_bytes

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


@dataclass(frozen=True)
class _Variable:
    path: str
    shape: tuple[int, ...]
    itemsize: int
    axes: tuple[str | None, ...]
    router_bias: bool
    group: str  # "dense_layers", "moe_layers", "mtp" or "" (not per layer)


@lru_cache(maxsize=8)
def _variables(model: ModelConfig) -> tuple[_Variable, ...]:
    """Every variable of the model, from abstract shapes (cached: the search plans one model many times)."""
    from flax import nnx

    from c2jax.models.layers import RouterBias
    from c2jax.models.transformer import abstract_state

    _, state = abstract_state(model)
    out = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        axes = var.get_metadata().get("logical_axes") or (None,) * len(value.shape)
        top = str(path[0])
        out.append(_Variable("/".join(map(str, path)), tuple(value.shape), jnp.dtype(value.dtype).itemsize,
                             tuple(axes), isinstance(var, RouterBias),
                             top if top in ("dense_layers", "moe_layers", "mtp") else ""))
    return tuple(out)


def _state_bytes(model: ModelConfig, sizes: dict[str, int], rules) -> tuple[float, float, float, float]:
    """(params, Adam moments, router biases, the largest group's one-layer weights in `dtype`) per device."""
    from c2jax.sharding_rules import partition_spec, shard_factor

    act = jnp.dtype(model.dtype).itemsize
    params = opt = other = 0.0
    layer_weights: dict[str, float] = {}
    for var in _variables(model):
        size = math.prod(var.shape)
        factor = shard_factor(partition_spec(var.shape, var.axes, sizes, rules), sizes)
        if var.router_bias:
            other += size * var.itemsize / factor
            continue
        params += size * var.itemsize / factor
        opt += 2 * size * 4 / factor
        if var.group:
            per_layer = size / var.shape[0]  # stacked: leading "layers" axis
            expert_split = sizes["expert"] if "experts" in var.axes and var.shape[var.axes.index("experts")] % \
                sizes["expert"] == 0 else 1
            layer_weights[var.group] = layer_weights.get(var.group, 0.0) + per_layer * act / expert_split
    return params, opt, other, max(layer_weights.values(), default=0.0)


def _layer_residuals(model: ModelConfig, tokens: int, kv_tokens: int, moe: bool, ep: int, act: int) -> float:
    """Bytes a layer keeps for its backward over `tokens` tokens (attention over `kv_tokens` keys)."""
    d, h = model.hidden_size, model.num_attention_heads
    qk, v = model.qk_head_dim, model.value_head_dim
    if model.attention_type == "gqa":  # q, its output and softmax statistics; K/V once per K/V head
        attention = tokens * (h * qk + h * v + h + 3 * d) * act
        attention += kv_tokens * model.kv_heads * (qk + v) * act
    else:  # MLA: the latent and the shared RoPE key, then per-head K and V
        attention = tokens * (h * qk + h * v + h + (model.q_lora_rank or 0)
                              + model.kv_lora_rank + model.qk_rope_head_dim + 3 * d) * act
        attention += kv_tokens * h * (qk + v) * act  # K and V (gathered over the sequence under CP)
    if not moe:
        return attention + tokens * (3 * model.intermediate_size + 2 * d) * act
    k, f = model.num_experts_per_tok, model.moe_intermediate_size
    if ep == 1:
        routed = k * (2 * f + d)  # the sorted dispatch's [T*k, 2f] and [T*k, d] residuals
    elif _ep_chunks(model, tokens, ep) > 1:
        routed = d  # rematerialised exchange chunks keep only their inputs
    else:
        routed = ep * k * (2 * f + d)  # the exchange's residuals span every gathered assignment
    return attention + tokens * (routed + 3 * f * model.n_shared_experts + 2 * d + model.n_routed_experts) * act


def _ep_chunks(model: ModelConfig, tokens: int, ep: int) -> int:
    # lazily, like this module's other model imports: importing c2jax.plan does not load flax
    from c2jax.models.expert_parallel import token_chunk_count

    return token_chunk_count(tokens, model.moe_chunk_tokens) if ep > 1 else 1


def plan(model: ModelConfig, mesh: MeshConfig, seq_len: int, global_batch: int, rules=None,
         offload_optimizer: bool = False) -> Plan:
    from c2jax.mesh import param_rules
    from c2jax.models.layers import loss_chunk_tokens

    sizes = mesh.sizes
    cp = sizes["context"]
    batch_ways = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if seq_len % (2 * cp):
        raise ConfigError(f"seq {seq_len} must divide by 2 x context ({2 * cp}) for the balanced CP layout")
    if global_batch % batch_ways:
        raise ConfigError(f"global batch {global_batch} does not split over data x fsdp x expert = {batch_ways}")
    params, opt, other, layer_weights = _state_bytes(model, sizes, rules or param_rules(mesh))
    act = jnp.dtype(model.dtype).itemsize
    b_local, s_local = global_batch // batch_ways, seq_len // cp
    tokens = b_local * s_local
    kv_tokens = b_local * seq_len if cp > 1 else tokens
    d, ep = model.hidden_size, sizes["expert"]
    num_moe = model.num_moe_layers
    num_dense = model.num_hidden_layers - num_moe
    num_mtp = model.num_nextn_predict_layers
    dense_res = _layer_residuals(model, tokens, kv_tokens, False, ep, act)
    moe_res = _layer_residuals(model, tokens, kv_tokens, True, ep, act) if num_moe else 0.0
    mtp_res = _layer_residuals(model, tokens, kv_tokens, True, ep, act) if num_mtp else 0.0  # MTP blocks are MoE
    layers = num_dense + num_moe + num_mtp
    notes = []
    if model.remat_policy == "full":
        saved = layers * tokens * d * act
    elif model.remat_policy == "save_attn_kernel":
        # full, plus the blockwise kernel's output [T, H, Dv] and fp32 log-sum-exp [T, H] per layer (an upper
        # bound where the backend is dense or cuDNN, which keep nothing extra under this policy)
        heads = model.num_attention_heads
        saved = layers * tokens * (d * act + heads * model.value_head_dim * act + heads * 4)
    else:
        saved = num_dense * dense_res + num_moe * moe_res + num_mtp * mtp_res
        if model.remat_policy != "none":
            notes.append(f"remat_policy {model.remat_policy!r} planned as 'none' (an upper bound)")
    working = 2 * max(dense_res, moe_res)
    if num_moe or num_mtp:
        k, f = model.num_experts_per_tok, model.moe_intermediate_size
        chunk = min(tokens, model.moe_chunk_tokens or tokens)
        buffers = 6 * MOE_CAPACITY * chunk * k * max(2 * f, d) * act
        if ep > 1:  # one chunk's exchange: ep x its tokens gathered, and the partial outputs scattered back
            buffers += ep * chunk * 2 * d * act
        working += buffers
    vocab = model.vocab_size
    head_chunk = loss_chunk_tokens(model.loss_chunk_tokens, vocab) or tokens
    head = 2 * min(tokens, head_chunk) * vocab * 4 + 2 * tokens * 4  # logits (then dlogits in place) + one
    if num_mtp:
        head += 4 * min(num_mtp * tokens, head_chunk) * vocab * 4
    terms = {"saved per layer": saved, "layer working set": working, "head + loss": head}
    gradients = params * 4 / jnp.dtype(model.param_dtype).itemsize
    gathered = 2 * layer_weights if sizes["fsdp"] * sizes["expert"] > 1 else 0.0  # FSDP over both
    host = 0.0
    if offload_optimizer:
        host, opt = opt, 0.0
    return Plan(sizes, tokens, params, opt, other, terms, gradients, gathered, host, tuple(notes))


@dataclass(frozen=True)
class CompiledMemory:
    """XLA's compiled memory analysis of one train step (bytes per device)."""
    argument_bytes: int  # train state + batch
    batch_bytes: int
    temp_bytes: int  # XLA's temporaries: what the plan calls step_bytes

    @property
    def state_bytes(self) -> int:
        return self.argument_bytes - self.batch_bytes


def compiled_memory(model: ModelConfig, mesh: MeshConfig, seq_len: int, global_batch: int,
                    train_mtp: bool = False) -> CompiledMemory:
    """Compile the real pretraining step (AdamW, donated state, the run's shardings) for these shapes on this
    process's first mesh.num_devices devices and read XLA's memory analysis; nothing is allocated. The check
    behind `c2jax plan --check` and tests/test_plan.py."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from c2jax.mesh import activation_rules, batch_spec, make_mesh, param_rules, state_shardings
    from c2jax.models.transformer import init
    from c2jax.train.step import BATCH_KEYS, TrainState, make_train_step

    if mesh.num_devices > jax.device_count():
        raise ConfigError(f"--check: mesh {mesh.sizes} needs {mesh.num_devices} devices, this process has "
                          f"{jax.device_count()} (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    device_mesh = make_mesh(mesh, jax.devices()[:mesh.num_devices])
    tx = optax.adamw(1e-4)
    graphdef, params, model_state = nnx.split(nnx.eval_shape(lambda: init(model)), nnx.Param, ...)
    rules = param_rules(mesh)
    param_sh, model_sh = state_shardings(params, device_mesh, rules), state_shardings(model_state, device_mesh, rules)
    replicated = NamedSharding(device_mesh, PartitionSpec())
    opt = jax.eval_shape(tx.init, params)
    # Adam's moments mirror the parameters and shard like them; counts are replicated
    opt_sh = jax.tree.map(lambda leaf: replicated, opt)
    opt_sh = type(opt_sh)(part._replace(mu=param_sh, nu=param_sh) if hasattr(part, "mu") else part
                          for part in opt_sh)
    state_sh = TrainState(replicated, param_sh, model_sh, opt_sh, replicated)
    batch_sh = NamedSharding(device_mesh, batch_spec(device_mesh, activation_rules(mesh)))
    step = make_train_step(graphdef, tx, 1e-3, mtp_weight=0.1, train_mtp=train_mtp, state_shardings=state_sh,
                           batch_sharding=batch_sh, donate=True, mesh=device_mesh, rules=activation_rules(mesh))
    shaped = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
    state = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), jax.tree.map(shaped, params, param_sh),
                       jax.tree.map(shaped, model_state, model_sh), jax.tree.map(shaped, opt, opt_sh),
                       jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated))
    batch = {k: jax.ShapeDtypeStruct((global_batch, seq_len), jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=batch_sh) for k in BATCH_KEYS}
    analysis = step.lower(state, batch).compile().memory_analysis()
    batch_bytes = len(BATCH_KEYS) * global_batch * seq_len * 4 // mesh.num_devices
    return CompiledMemory(int(analysis.argument_size_in_bytes), batch_bytes, int(analysis.temp_size_in_bytes))


def format_plan(name: str, p: Plan, seq_len: int, global_batch: int) -> str:
    gb = lambda n: f"{n / 1e9:9.2f} GB"
    mesh = " ".join(f"{k}={v}" for k, v in p.mesh.items())
    adam = ("(2 x fp32)" if not p.optimizer_host_bytes
            else f"(offloaded: {p.optimizer_host_bytes / 1e9:.2f} GB on the host)")
    lines = [
        f"plan             {name}  mesh {mesh}  ({math.prod(p.mesh.values())} devices)",
        f"step             global batch {global_batch} x seq {seq_len}; {p.tokens_per_device:,} tokens per device",
        f"params           {gb(p.params_bytes)}   (exact, from the sharding rules)",
        f"Adam moments     {gb(p.optimizer_bytes)}   {adam}",
        f"router bias      {gb(p.other_bytes)}",
        f"gradients        {gb(p.gradient_bytes)}   (fp32, sharded like the parameters)",
        f"gathered weights {gb(p.gathered_bytes)}   (FSDP: two layers' weights in flight)",
    ]
    lines += [f"  act: {k:<21}{gb(v)}   (estimate)" for k, v in p.activation_terms.items()]
    lines.append(f"total            {gb(p.total_bytes)}")
    for acc, cap in ACCELERATORS_GB.items():
        verdict = "fits" if p.fits(cap) else "does NOT fit"
        lines.append(f"{acc:<6} {cap:5.0f} GB   {verdict} (budget {WORKSPACE_FRACTION:.0%} of HBM)")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


@dataclass(frozen=True)
class Fit:
    accelerator: str
    devices: int
    mesh: dict[str, int]
    global_batch: int  # the asked batch, or the next multiple of the data-parallel ranks when it does not split
    plan: Plan


def smallest_fit(model: ModelConfig, template: MeshConfig, seq_len: int, global_batch: int, accelerator: str,
                 offload_optimizer: bool = False, max_devices: int = 16384) -> Fit | None:
    """The fewest devices (whole nodes of GPUS_PER_NODE) on which `template` (one axis -1, the one that grows,
    normally fsdp) trains `seq_len` x `global_batch` within `accelerator`'s memory; None up to max_devices.
    A batch that does not split over data x fsdp x expert is raised to the next multiple (one sequence or
    more per data-parallel rank), and the Fit says so."""
    if -1 not in template.sizes.values():
        raise ConfigError(f"--fit needs a mesh with one inferred (-1) axis to grow, got {template.sizes}")
    gb = ACCELERATORS_GB[accelerator]
    fixed = math.prod(v for v in template.sizes.values() if v != -1)
    step = math.lcm(GPUS_PER_NODE, fixed)
    for devices in range(step, max_devices + 1, step):
        mesh = template.resolve(devices)
        sizes = mesh.sizes
        ways = sizes["data"] * sizes["fsdp"] * sizes["expert"]
        batch = -(-global_batch // ways) * ways
        try:
            p = plan(model, mesh, seq_len, batch, offload_optimizer=offload_optimizer)
        except ConfigError:
            continue
        if p.fits(gb):
            return Fit(accelerator, devices, sizes, batch, p)
    return None


def format_fits(name: str, rows: list[tuple[str, int, Fit | None, str]], context_asked: int) -> str:
    lines = [f"smallest device counts for {name} (budget {WORKSPACE_FRACTION:.0%} of HBM, whole nodes of "
             f"{GPUS_PER_NODE})",
             f"{'shape':<20}{'GPU':<6}{'devices':>8}  {'mesh':<56}{'batch':>7}{'GB/device':>11}"]
    for label, seq, fit, accelerator in rows:
        shape = f"{label or 'run'} ({seq // 1024}k)"[:19]
        if fit is None:
            lines.append(f"{shape:<20}{accelerator:<6}{'none':>8}  (does not fit up to the search limit)")
            continue
        mesh = " ".join(f"{k}={v}" for k, v in fit.mesh.items() if v > 1) or "1 device"
        if fit.mesh["context"] != context_asked:
            mesh += f" (context raised from {context_asked})"
        lines.append(f"{shape:<20}{accelerator:<6}{fit.devices:>8}  {mesh:<56}{fit.global_batch:>7}"
                     f"{fit.plan.total_bytes / 1e9:>11.1f}")
    return "\n".join(lines)


def _format_check(p: Plan, xla: CompiledMemory) -> str:
    return (f"\nXLA (compiled here): state {xla.state_bytes / 1e9:.3f} GB (plan {p.state_bytes / 1e9:.3f}), "
            f"temporaries {xla.temp_bytes / 1e9:.3f} GB (plan {p.step_bytes / 1e9:.3f}, "
            f"{p.step_bytes / max(xla.temp_bytes, 1):.2f}x)")


@dataclass(frozen=True)
class PlanSource:
    """What a config file says to plan: its model and mesh, and the (label, seq, batch) shapes it trains at
    (None: the command line's --seq / --batch)."""
    model: ModelConfig
    mesh: MeshConfig
    shapes: tuple[tuple[str, int | None, int | None], ...]
    offload_optimizer: bool = False  # a pretraining config's optimizer.offload


def load_plan_source(source: str, overrides=()) -> PlanSource:
    """A model preset, a RunConfig YAML, a pretraining YAML (planned per phase, at each phase's sequence
    length and batch) or any other run YAML with `model` and `mesh` sections (e.g. an RL system config, whose
    full schema lives above c2jax; planned at its `engine.max_len` when it has one)."""
    import dataclasses
    from pathlib import Path

    from c2jax.config import RunConfig, load, load_yaml

    if not Path(source).is_file():
        cfg = load(RunConfig, source, overrides)
        return PlanSource(cfg.model, cfg.mesh, (("", None, None),))
    data = load_yaml(source)
    if "phases" in data:
        from c2jax.train.config import PretrainConfig

        pcfg = load(PretrainConfig, source, overrides)
        seq, batch = int(pcfg.data.get("seq_len", 0)) or None, int(pcfg.data.get("batch_size", 0)) or None
        shapes = tuple((f"phase {p.name}", p.seq_len or seq, p.batch_size or batch) for p in pcfg.phases)
        return PlanSource(pcfg.model, pcfg.mesh, shapes, pcfg.optimizer.offload)
    if set(data) <= {f.name for f in dataclasses.fields(RunConfig)}:
        cfg = load(RunConfig, data, overrides)
        return PlanSource(cfg.model, cfg.mesh, (("", None, None),))
    if "model" not in data:
        raise ConfigError(f"{source}: no `model` section to plan")
    run_keys = {k: data[k] for k in ("name", "seed", "model", "mesh") if k in data}
    run_overrides = [o for o in overrides if o.split("=", 1)[0].split(".", 1)[0] in ("model", "mesh")]
    if len(run_overrides) != len(overrides):
        raise ConfigError("plan applies only model.* and mesh.* overrides to this config: got "
                          f"{[o for o in overrides if o not in run_overrides]}")
    cfg = load(RunConfig, run_keys, run_overrides)
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
    p.add_argument("--offload-optimizer", action="store_true",
                   help="plan the Adam moments in host memory instead of on the device")
    p.add_argument("--fit", action="store_true", help="for each shape and GPU kind, the fewest devices that fit "
                   "(growing the mesh's -1 axis)")
    p.add_argument("--gpus", default="H200,B200,B300", help="GPU kinds for --fit, of " + ",".join(ACCELERATORS_GB))
    p.add_argument("--check", action="store_true", help="also compile the real train step for these shapes on "
                   "this machine's devices and print XLA's memory analysis next to the plan (small configs)")
    p.add_argument("--json", action="store_true")
    return p


def run(args) -> int:
    import dataclasses
    import json

    src = load_plan_source(resolve_source(args), args.overrides)
    if src.offload_optimizer:
        args.offload_optimizer = True
    if args.fit:
        return run_fit(args, src)
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
            plans.append((label, seq, batch, plan(src.model, mesh, seq, batch,
                                                  offload_optimizer=args.offload_optimizer)))
        except ConfigError as e:
            if len(shapes) == 1:
                raise
            errors.append(f"{label or args.source} (seq {seq}, batch {batch}): {e}")
    checks = {}
    if args.check:
        for label, seq, batch, _ in plans:
            checks[label] = compiled_memory(src.model, mesh, seq, batch)
    if args.json:
        rows = [dataclasses.asdict(p) | {"label": label, "seq": seq, "batch": batch,
                                          "activation_bytes": p.activation_bytes, "step_bytes": p.step_bytes,
                                          "total_bytes": p.total_bytes,
                                          "fits": {a: p.fits(c) for a, c in ACCELERATORS_GB.items()}}
                | ({"xla": dataclasses.asdict(checks[label])} if label in checks else {})
                for label, seq, batch, p in plans]
        print(json.dumps(rows[0] if len(rows) == 1 and not rows[0]["label"] else rows, indent=2))
    else:
        print("\n\n".join((f"== {label}\n" if label else "") + format_plan(args.source, p, seq, batch)
                           + (_format_check(p, checks[label]) if label in checks else "")
                           for label, seq, batch, p in plans))
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    return 2 if errors else 0


def run_fit(args, src: PlanSource) -> int:
    import dataclasses
    import json

    template = parse_mesh(args.mesh, None) if args.mesh is not None else src.mesh
    if args.mesh is not None:
        template = dataclasses.replace(template, param_rules=src.mesh.param_rules,
                                       activation_rules=src.mesh.activation_rules)
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    unknown = [g for g in gpus if g not in ACCELERATORS_GB]
    if unknown:
        raise ConfigError(f"--gpus: unknown {unknown}; known: {sorted(ACCELERATORS_GB)}")
    rows = []
    for label, seq, batch in src.shapes:
        seq = args.seq if args.seq is not None else (seq or DEFAULT_SEQ)
        batch = args.batch if args.batch is not None else (batch or 1)
        for gpu in gpus:
            fit = smallest_fit(src.model, template, seq, batch, gpu, args.offload_optimizer)
            context = template.sizes["context"]
            if fit is None:
                # the mesh's context-parallel degree cannot hold this length on any number of devices (the
                # per-layer activations do not shrink with more FSDP ranks): the fewest devices over larger ones
                found = []
                while seq % (4 * context) == 0 and context < 64:
                    context *= 2
                    grown = dataclasses.replace(template, context=context)
                    found.append(smallest_fit(src.model, grown, seq, batch, gpu, args.offload_optimizer))
                fit = min((f for f in found if f is not None), key=lambda f: f.devices, default=None)
            rows.append((label, seq, fit, gpu))
    if args.json:
        print(json.dumps([{"label": label, "seq": seq, "gpu": gpu,
                           "fit": None if fit is None else {"devices": fit.devices, "mesh": fit.mesh,
                                                            "global_batch": fit.global_batch,
                                                            "total_bytes": fit.plan.total_bytes,
                                                            "plan": dataclasses.asdict(fit.plan)}}
                          for label, seq, fit, gpu in rows], indent=2))
    else:
        print(format_fits(args.source, rows, template.sizes["context"]))
    return 0 if all(fit is not None for _, _, fit, _ in rows) else 2
