"""Step time of the `small` preset on 1, 2, 4, 8 devices (same global batch), and the bytes each mesh
moves per step, read off the compiled HLO (every all-gather / reduce-scatter / all-reduce / all-to-all
/ collective-permute, result shapes summed; layers are unrolled so each collective appears as often as
it runs).

On CPU the devices are fake (--xla_force_host_platform_device_count=8 on one machine's cores), so the
times show overheads, not speed-ups; the byte counts are what a real mesh would move. On a GPU host the
same script runs on real devices.

    python -m experiments.bench.parallel_scaling [--steps 3] [--seq 256] [--batch 8]
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and \
        os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse
import dataclasses
import re
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from c2jax.bench_report import Col, write_results
from c2jax.config import MeshConfig
from c2jax.machine import describe
from c2jax.mesh import activation_rules, batch_shardings, jit_sharded, make_mesh, place_on_mesh, shard_state
from c2jax.models.config import preset
from c2jax.models.transformer import init

MESHES = {
    1: [dict()],
    2: [dict(fsdp=2)],
    4: [dict(fsdp=2, expert=2), dict(fsdp=4)],
    8: [dict(fsdp=2, expert=2, context=2), dict(fsdp=2, expert=4), dict(expert=4, context=2), dict(data=8)],
}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute",
               "ragged-all-to-all")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}
_OP = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"(f32|bf16|f16|s32|u32|s8|u8|pred|f64|s64)\[([\d,]*)\]")


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes of every collective's result in compiled HLO text, by kind (per device)."""
    totals = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo.splitlines():
        m = _OP.search(line)
        if not m or "-done" in line:
            continue
        for dtype, dims in _SHAPE.findall(m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            totals[m.group(2)] += n * _DTYPE_BYTES[dtype]
    return {k: v for k, v in totals.items() if v}


def build_step(graphdef, tx):
    def step(state, batch):
        params, rest, opt_state = state

        def loss_fn(params):
            model = nnx.merge(graphdef, params, rest)
            out = model(batch["input_ids"], segment_ids=batch["segment_ids"], return_mtp=False)
            return model.token_losses(out.hidden, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), rest, opt_state), {"loss": loss}
    return step


def run_mesh(cfg, sizes: dict, steps: int, seq: int, batch_size: int):
    mesh_cfg = MeshConfig(**sizes)
    devices = jax.devices()[: mesh_cfg.num_devices]
    mesh = make_mesh(mesh_cfg, devices)
    graphdef, params, rest = nnx.split(init(cfg, seed=0), nnx.Param, ...)
    tx = optax.adamw(1e-3)
    params, rest = shard_state(params, mesh), shard_state(rest, mesh)
    opt_state = place_on_mesh(jax.jit(tx.init)(params), mesh)
    state = (params, rest, opt_state)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    ids = jax.random.randint(jax.random.key(0), (batch_size, seq + 1), 0, cfg.vocab_size)
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:],
             "segment_ids": jnp.ones((batch_size, seq), jnp.int32)}
    rules = activation_rules(mesh_cfg)
    step = jit_sharded(build_step(graphdef, tx), mesh, rules, shardings, batch_shardings(batch, mesh, rules))
    batch = jax.device_put(batch, batch_shardings(batch, mesh, rules))
    compiled = step.lower(state, batch).compile()
    comm = collective_bytes(compiled.as_text())
    state, m = compiled(state, batch)  # warm-up
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = compiled(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return {"mesh": {k: v for k, v in mesh_cfg.sizes.items() if v > 1} or {"single": 1},
            "devices": mesh_cfg.num_devices, "step_s": statistics.median(times),
            "tokens_per_s": batch_size * seq / statistics.median(times), "loss": float(m["loss"]),
            "comm_bytes_per_device": comm, "comm_total_mb": sum(comm.values()) / 1e6}


def _mesh_str(mesh: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in mesh.items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default="runs/bench/parallel_scaling.json")
    args = p.parse_args(argv)
    machine = describe()
    # unrolled layers: each collective of each layer appears in the HLO, so byte counts are per step
    cfg = dataclasses.replace(preset("small"), scan_layers=False, num_nextn_predict_layers=0)
    rows = []
    for count, meshes in MESHES.items():
        if count > len(jax.devices()):
            continue
        for sizes in meshes:
            r = run_mesh(cfg, sizes, args.steps, args.seq, args.batch)
            rows.append(r)
            print(f"{r['devices']} devices, {_mesh_str(r['mesh'])}: {r['step_s'] * 1e3:.1f} ms a step", flush=True)
    write_results(args.out, rows, columns=[
        "devices", Col("mesh", fmt=_mesh_str),
        Col("step_s", "step ms", ".1f", scale=1e3), ("tokens_per_s", "tokens/s", ".0f"),
        ("comm_total_mb", "comm MB/device", ".1f"),
        Col("comm_bytes_per_device", "by kind (MB)",
            lambda c: ", ".join(f"{k} {v / 1e6:.1f}" for k, v in c.items()) or "-")],
        meta={"backend": jax.default_backend(), "preset": "small", "seq": args.seq, "global_batch": args.batch},
        rows_key="results", machine=machine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
