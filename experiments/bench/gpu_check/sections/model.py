"""Section `model`: the tiny model's loss, logits and every parameter gradient on the default device against
the CPU, with the same experts replayed everywhere (router replay; routing is discontinuous: a near-tie
flipping between devices would otherwise dominate the error and say nothing about the kernels)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from c2jax.models.config import preset
from c2jax.models.transformer import forward, init
from experiments.bench.gpu_check.sections.context import DRY_MODEL, Context, Skip, rel_err, tree_rel_err


@dataclass(frozen=True)
class Problem:
    """One batch, its replayed experts, and the two devices it runs on."""

    ids: np.ndarray
    targets: np.ndarray
    replay: jax.Array  # k distinct experts per token and MoE layer (router replay takes them as given)
    device: jax.Device
    cpu: jax.Device


def run(ctx: Context) -> None:
    cpu = jax.devices("cpu")[0]
    dev = jax.devices()[0]
    batch, seq = ctx.size((2, 256), (1, 32))
    # head dims multiples of 8 (q.k 32, v 16): what cuDNN attention accepts, so bf16 on a GPU runs it
    base = preset("tiny").replace(num_nextn_predict_layers=0, qk_nope_head_dim=24, qk_rope_head_dim=8,
                                  v_head_dim=16, **ctx.size({}, DRY_MODEL))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, base.vocab_size, (batch, seq + 1)).astype(np.int32)
    ctx.set("shape", {"batch": batch, "seq": seq, "preset": "tiny, head dims q.k 32 / v 16", "device": str(dev),
                      "reference": str(cpu), "attention": "device default (GPU: cuDNN for bf16, blockwise for "
                                                          "fp32); CPU: auto (dense at these S)"})
    k, e, layers = base.num_experts_per_tok, base.n_routed_experts, base.num_moe_layers
    replay = jnp.asarray(np.argsort(rng.random((layers, batch, seq, e)), axis=-1)[..., :k].astype(np.int32))
    problem = Problem(ids=tokens[:, :-1], targets=tokens[:, 1:], replay=replay, device=dev, cpu=cpu)
    ref_cfg = base.replace(dtype="float32")
    ref = forward_and_grads(problem, ref_cfg, cpu, "highest")
    variants = {  # name: (cfg, precision, tolerance or None for "no worse than the CPU at the same dtype")
        "fp32_highest": (ref_cfg, "highest", 1e-4),
        "fp32_default_precision": (ref_cfg, "default", 2e-2),
        "bf16": (base.replace(dtype="bfloat16"), "default", None),
        "bf16_moe_mxfp8": (base.replace(dtype="bfloat16", moe_quant="mxfp8"), "default", None),
    }
    for name, (cfg, precision, tol) in variants.items():
        ctx.sub(name, variant, ctx, problem, ref, name, cfg, precision, tol, need_s=ctx.size(8, 2))
    ctx.sub("ep_ragged_a2a", ep_ragged_a2a, ctx, ref_cfg, problem.ids, need_s=ctx.size(10, 2))
    bf = ctx.record["results"].get("bf16")
    if isinstance(bf, dict):
        ctx.headline(f"bf16 grads rel err {bf['grads_err_vs_fp32_ref']:.1e} "
                     f"(CPU {bf['cpu_grads_err_vs_fp32_ref']:.1e})")


@functools.cache
def loss_and_grads(cfg):
    """(jitted value_and_grad of the mean token loss, params, the rest of the state) of `cfg`'s model: one
    jitted function per config, as jit caches its compilations per device."""
    graphdef, params, rest = nnx.split(init(cfg, seed=0), nnx.Param, ...)

    def loss(params, rest, ids, targets, replay):
        m = nnx.merge(graphdef, params, rest)
        out = m(ids, replay_ids=replay, return_mtp=False)
        return jnp.mean(m.token_losses(out.hidden, targets)), (out.logits, out.expert_ids)

    return jax.jit(jax.value_and_grad(loss, has_aux=True)), params, rest


def forward_and_grads(problem: Problem, cfg, device, precision: str):
    """(loss, logits, experts, grads) of `cfg`'s model on `device`, as NumPy float32."""
    f, params, rest = loss_and_grads(cfg)
    args = jax.device_put((params, rest, jnp.asarray(problem.ids), jnp.asarray(problem.targets), problem.replay),
                          device)
    with jax.default_matmul_precision(precision):
        (loss, (logits, experts)), grads = f(*args)
    grads = jax.tree.map(lambda g: np.asarray(g, np.float32), grads)
    return float(loss), np.asarray(logits, np.float32), np.asarray(experts), grads


def variant(ctx: Context, problem: Problem, ref, name: str, cfg, precision: str, tol: float | None) -> dict:
    """One dtype / precision on the device against the CPU at the same one and against the fp32 reference."""
    if name == "fp32_default_precision" and not ctx.gpu:
        raise Skip("needs GPU (on the CPU default fp32 precision is full fp32: fp32_highest covers it)")
    if name == "bf16_moe_mxfp8" and ctx.dry_run:
        raise Skip("dry run: the bf16 variant's code with moe_quant='mxfp8', left out to keep the dry run "
                   "short (the recipe runs on the CPU in tests/test_moe.py and tests/test_kernels.py)")
    d = forward_and_grads(problem, cfg, problem.device, precision)
    # the CPU's default fp32 precision is full fp32: its run would be the reference again
    c = ref if name == "fp32_default_precision" else forward_and_grads(problem, cfg, problem.cpu, precision)
    row = {"loss_device": d[0], "loss_cpu": c[0],
           "logits_err_vs_cpu_same_dtype": rel_err(d[1], c[1]),
           "grads_err_vs_cpu_same_dtype": tree_rel_err(d[3], c[3])[0],
           "logits_err_vs_fp32_ref": rel_err(d[1], ref[1]),
           "grads_err_vs_fp32_ref": tree_rel_err(d[3], ref[3])[0],
           "cpu_logits_err_vs_fp32_ref": rel_err(c[1], ref[1]),
           "cpu_grads_err_vs_fp32_ref": tree_rel_err(c[3], ref[3])[0]}
    finite = bool(np.isfinite(d[1]).all() and all(np.isfinite(g).all() for g in jax.tree.leaves(d[3])))
    ok, detail = verdict(row, tol)
    ctx.check(f"model {name} fwd+grad on {problem.device.platform}", finite and ok, detail)
    return row


def verdict(row: dict, tol: float | None) -> tuple[bool, str]:
    """Whether `variant`'s errors are within bounds, and the check's detail."""
    if tol is not None:
        ok = row["logits_err_vs_cpu_same_dtype"] <= tol and row["grads_err_vs_cpu_same_dtype"] <= tol
        return ok, (f"rel L2 vs CPU: logits {row['logits_err_vs_cpu_same_dtype']:.2e}, grads "
                    f"{row['grads_err_vs_cpu_same_dtype']:.2e} (tol {tol:g})")
    # low precision: the device may differ from the CPU, but must be no further from fp32
    # 3x + 2e-3: room for a GPU kernel keeping more in bf16 (cuDNN's P.V); a real bug is O(1)
    lim_l = 3 * row["cpu_logits_err_vs_fp32_ref"] + 2e-3
    lim_g = 3 * row["cpu_grads_err_vs_fp32_ref"] + 2e-3
    ok = row["logits_err_vs_fp32_ref"] <= lim_l and row["grads_err_vs_fp32_ref"] <= lim_g
    return ok, (f"rel L2 vs fp32 reference: logits {row['logits_err_vs_fp32_ref']:.2e} (<= {lim_l:.2e}: "
                f"3x the CPU's + 2e-3), grads {row['grads_err_vs_fp32_ref']:.2e} (<= {lim_g:.2e})")


def ep_ragged_a2a(ctx: Context, cfg, ids) -> dict:
    """The expert-parallel ragged all-to-all dispatch's loss against the all-gather one's, on a mesh."""
    ctx.needs_gpu("XLA:CPU does not implement ragged-all-to-all; the path is lowered in tests/test_parallel.py")
    if jax.device_count() < 2:
        raise Skip(f"needs >= 2 devices for an expert-parallel mesh, this has {jax.device_count()} "
                   "(its lowering is checked in tests/test_parallel.py)")
    from c2jax.config import MeshConfig
    from c2jax.mesh import activation_rules, make_mesh, shard_state
    from c2jax.models.logical import logical_rules

    experts = 2 if jax.device_count() < 4 else 4
    out = {}
    for impl in ("allgather", "ragged_a2a"):
        graphdef, state = nnx.split(init(cfg.replace(moe_ep_impl=impl), seed=0))
        mesh_cfg = MeshConfig(expert=experts, fsdp=-1)
        mesh = make_mesh(mesh_cfg)

        def loss(state, ids, graphdef=graphdef, mesh=mesh, mesh_cfg=mesh_cfg):
            with logical_rules(mesh, activation_rules(mesh_cfg)):
                return jnp.mean(forward(graphdef, state, ids).logits ** 2)

        with jax.default_matmul_precision("highest"):
            out[impl] = float(jax.jit(loss)(shard_state(state, mesh), jnp.asarray(ids)))
    ctx.check("model EP ragged_a2a loss == allgather loss", abs(out["ragged_a2a"] - out["allgather"])
              <= 1e-4 * abs(out["allgather"]) + 1e-6, str(out))
    return out
