"""The dropless dispatch paths of the DeepSeek-V3 MoE: routed tokens through their experts, over one set of
parameters and one device's tokens (models/expert_parallel.py runs them across an expert-parallel group).

Dispatch paths (`ModelConfig.moe_impl`):
  sorted  sort assignments by expert, gather them into an [E, C, d] buffer and run one batched einsum.
          C is chosen at run time from a few static buckets (`moe_capacity_factors` x the balanced load,
          then T, the hard bound since a token picks an expert at most once) with `lax.switch`, so no
          token is ever dropped and a balanced batch pays only ~1.25x the useful FLOPs. The default;
          its backward is written by hand (see `_sorted_experts`). With `ModelConfig.moe_quant` other
          than "bf16", its six expert GEMMs (fprop, dgrad, wgrad of both FCs) run through
          c2jax.kernels.qlinear, each operand quantized along that GEMM's contraction axis (docs/kernels.md).
          Not differentiated (prefill, eval, RL scoring), it runs the registry op `moe_sorted_forward`: on CPU a
          loop over experts and 32-128-row tiles of their sorted rows (no capacity padding, so a skewed router
          costs what its tokens cost), the bucketed einsum elsewhere and at decode sizes.
  ragged  `jax.lax.ragged_dot` over the sorted rows. Exact grouped GEMM semantics; XLA:CPU lowers it
          to a dense masked matmul (~E x the FLOPs), so it is an oracle on CPU and a candidate on GPU.
  dense   every expert on every token, combined with a [T, E] weight matrix. The simplest oracle.
  grouped the ragged path's grouped GEMMs run by the kernel registry (kernels/grouped_gemm.py, `moe_kernel`; a
          custom VJP whose dlhs runs the registry too). `resolve_moe_kernel(cfg)` names the kernel it will run here;
          tests/test_grouped_path.py checks each one against `ragged` in the training, RL and sampling steps.
          `resolve_loaded_moe_kernel` re-resolves the kernel a run written on another device names.
"""

from __future__ import annotations

import functools
import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from c2jax.kernels import dispatch, grouped_qlinear, qlinear
from c2jax.models.config import MOE_QUANT_GROUPED, ConfigError, ModelConfig
from c2jax.models.layers import swiglu_act_grads
from c2jax.models.moe_routing import Routing


def _swiglu_experts(h: jnp.ndarray, gate_up: jnp.ndarray, down: jnp.ndarray) -> jnp.ndarray:
    """[E, C, d] -> [E, C, d] through each expert's SwiGLU."""
    gu = jnp.einsum("ecd,edf->ecf", h, gate_up.astype(h.dtype))
    gate, up = jnp.split(gu, 2, axis=-1)
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, down.astype(h.dtype))


def dispatch_dense(x, routing: Routing, gate_up, down):
    """Oracle: y_t = sum_e G[t, e] * expert_e(x_t), with G zero off the selected experts."""
    num_experts = gate_up.shape[0]
    combine = jnp.zeros((x.shape[0], num_experts), jnp.float32).at[
        jnp.arange(x.shape[0])[:, None], routing.expert_ids].add(routing.weights)
    all_out = _swiglu_experts(jnp.broadcast_to(x, (num_experts, *x.shape)), gate_up, down)
    return jnp.einsum("te,etd->td", combine.astype(x.dtype), all_out)


def _sort_assignments(expert_ids: jnp.ndarray, num_experts: int):
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignment indices grouped by expert
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    starts = jnp.cumsum(counts) - counts
    return flat, order, counts, starts


def _grouped_ffn(x, routing: Routing, gate_up, down, gemm, first_expert=None):
    """Expert-sorted rows through [gate | up] and down as grouped GEMMs `gemm(lhs, rhs, group_sizes, src)`,
    scattered back and combined by the routing weights. The first GEMM's rows are x[src] (the token of each sorted
    assignment), passed as (x, src) so a kernel may gather them itself (the fused permute + quantize); the second's
    are its lhs (src None). With `first_expert` (expert parallelism), gate_up / down hold experts first_expert ..
    first_expert + E_local - 1 only: the other assignments sort after every local group, past sum(group_sizes),
    where every grouped GEMM gives zeros, so they add nothing here (another rank computes them)."""
    k, num_local = routing.expert_ids.shape[1], gate_up.shape[0]
    ids = routing.expert_ids
    if first_expert is not None:
        ids = ids - first_expert
        ids = jnp.where((ids >= 0) & (ids < num_local), ids, num_local)
    _, order, counts, _ = _sort_assignments(ids, num_local + (first_expert is not None))
    counts = counts[:num_local]
    gu = gemm(x, gate_up.astype(x.dtype), counts, order // k)
    gate, up = jnp.split(gu, 2, axis=-1)
    out_sorted = gemm(jax.nn.silu(gate) * up, down.astype(x.dtype), counts, None)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(x.shape[0], k, -1)
    return jnp.einsum("tkd,tk->td", out, routing.weights.astype(x.dtype))


def _gathered(gemm):
    """A grouped GEMM gemm(lhs, rhs, group_sizes) in _grouped_ffn's form: the rows x[src] gathered by XLA first."""
    return lambda x, rhs, group_sizes, src: gemm(x if src is None else x[src], rhs, group_sizes)


def dispatch_ragged(x, routing: Routing, gate_up, down):
    """Grouped GEMM over expert-sorted rows with jax.lax.ragged_dot."""
    return _grouped_ffn(x, routing, gate_up, down, _gathered(jax.lax.ragged_dot))


def dispatch_grouped(cfg: ModelConfig, x, routing: Routing, gate_up, down, first_expert=None):
    """The ragged path with its grouped GEMMs run by the kernel registry (cfg.moe_kernel); under
    moe_quant="mxfp8" the quantized grouped linear of c2jax.kernels.grouped_qlinear (fused permute + MXFP8 quantize,
    block-scaled grouped GEMM, qlinear's recipe). `first_expert`: as in `_grouped_ffn` (expert parallelism)."""
    return _grouped_ffn(x, routing, gate_up, down, grouped_gemm_fn(cfg), first_expert)


def grouped_gemm_fn(cfg: ModelConfig):
    """The grouped GEMM `gemm(x, rhs, group_sizes, src)` (as `_grouped_ffn` calls it) of moe_impl="grouped": the
    registry's bf16 grouped GEMM, or the quantized grouped linear of cfg.moe_quant."""
    if cfg.moe_quant == "bf16":
        return _gathered(partial(_registry_grouped_matmul, cfg.moe_kernel))
    return partial(grouped_qlinear.grouped_linear, grouped_quant(cfg))


def dispatch_local(cfg: ModelConfig, x, routing: Routing, gate_up, down, first_expert=None):
    """One device's routed experts on the path `moe_path(cfg)` names: grouped or sorted (what expert parallelism
    runs on each rank; `first_expert`: the rank's first expert, None when it holds them all)."""
    if moe_path(cfg) == "grouped":
        return dispatch_grouped(cfg, x, routing, gate_up, down, first_expert)
    return dispatch_sorted(cfg, x, routing, gate_up, down, first_expert)


def moe_path(cfg: ModelConfig) -> str:
    """The dispatch path cfg.moe_impl runs on the device kernels are chosen for (kernels.dispatch.current_device:
    this process's, or the lowering target's): the named one, or for "auto" "grouped" where the kernel registry's
    grouped GEMM for cfg has a device kernel (the first implementation it picks for the model's GEMMs is not the XLA
    fallback: Mosaic GPU / Pallas Triton on GPUs, or one $C2JAX_KERNEL_IMPL names; or cfg.moe_kernel names one)
    and cfg.moe_quant runs on the grouped path (MOE_QUANT_GROUPED); "sorted" otherwise (CPU, TPU, FLOOR MXFP8,
    per-tensor NVFP4, DeepSeek FP8), whose capacity einsum beats the XLA grouped fallback there."""
    if cfg.moe_impl != "auto":
        return cfg.moe_impl
    return _auto_path(cfg, *dispatch.current_device(), dispatch.env_override(_grouped_op(cfg)))


@functools.lru_cache(maxsize=256)
def _auto_path(cfg: ModelConfig, platform: str, kind: str, override: str | None) -> str:
    if cfg.moe_quant not in MOE_QUANT_GROUPED:
        return "sorted"
    if cfg.moe_kernel is not None:  # naming a grouped kernel chooses the grouped path
        return "grouped"
    try:
        kernel = resolve_moe_kernel(cfg.replace(moe_impl="grouped")).moe_kernel
    except ConfigError:  # no grouped kernel accepts this model's GEMMs here
        return "sorted"
    return "sorted" if kernel == "xla" else "grouped"


def grouped_quant(cfg: ModelConfig) -> grouped_qlinear.GroupedQuant:
    """The quantized grouped path's kernels for `cfg`: `moe_kernel` names the block-scaled grouped GEMM
    (grouped_matmul_mx), and the fused permute + quantize runs the implementation of the same name where the
    permute_quantize_mx op has one (pallas_triton, xla), else the registry's choice for the device. Under
    moe_quant="nvfp4_per_token_fwd+mxfp8_bwd" `moe_kernel` names the forward's NVFP4 grouped GEMM
    (grouped_matmul_nvfp4) and the backward's MXFP8 one (grouped_matmul_mx); its forward quantizes the tokens per
    token and gathers the codes (no permute kernel), the backward quantizes unpermuted operands."""
    from c2jax.kernels.permute import OP as PERMUTE_OP

    recipe = qlinear.get_recipe(cfg.moe_quant, cfg.moe_quant_division)
    names = {i.name for i in dispatch.implementations(PERMUTE_OP)}
    permute = cfg.moe_kernel if cfg.moe_kernel in names else None
    return grouped_qlinear.GroupedQuant(recipe, gemm=cfg.moe_kernel, permute=permute)


def _grouped_op(cfg: ModelConfig) -> str:
    """The registry op that `moe_kernel` names an implementation of: the bf16 or the block-scaled grouped GEMM (the
    forward's: NVFP4 under an NVFP4 forward, whose backward's MXFP8 GEMM runs the implementation of the same name)."""
    from c2jax.kernels.grouped_gemm import MX_OP, NVFP4_OP, OP

    if cfg.moe_quant == "bf16":
        return OP
    return NVFP4_OP if grouped_qlinear.nvfp4_forward(qlinear.get_recipe(cfg.moe_quant)) else MX_OP


def resolve_moe_kernel(cfg: ModelConfig, num_tokens: int = 128) -> ModelConfig:
    """`cfg` with `moe_kernel` set to the grouped GEMM the kernel registry runs for moe_impl="grouped" on this device
    (kernels.dispatch.current_device(): this process's, or `dispatch.target`'s while lowering for another): the
    implementation `cfg.moe_kernel` names, else the one $C2JAX_KERNEL_IMPL names for the op, else the first native
    one that accepts all four expert GEMMs of this model at `cfg.dtype` (forward of [gate | up] and down, and
    their dlhs in the backward; an implementation may refuse a dtype or shape, e.g. mosaic_sm90 takes bf16 with
    K % 64 and N % 128 == 0). The op is grouped_matmul, or under moe_quant="mxfp8" the block-scaled
    grouped_matmul_mx (pallas_triton needs K % 32 == 0), whose fused permute + quantize `grouped_quant` derives
    from the name and is checked here too. A run that writes this config and runs it runs exactly that kernel for
    every GEMM. moe_impl="auto" is first replaced by the path it takes here (`moe_path`), so the resolved config
    names the path and kernel that ran. Other moe_impl values do not use the registry: `cfg` is returned unchanged.
    ConfigError when the named kernel cannot run here or every candidate refuses a GEMM. `num_tokens` only sizes the
    abstract operands traced."""
    if cfg.moe_impl == "auto":
        cfg = cfg.replace(moe_impl=moe_path(cfg))
    if cfg.moe_impl != "grouped":
        return cfg
    rows, d, f = num_tokens * cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    op, nvfp4 = _grouped_op(cfg), cfg.moe_quant != "bf16" and grouped_qlinear.nvfp4_forward(
        qlinear.get_recipe(cfg.moe_quant))
    gemm = _grouped_gemm_call if cfg.moe_quant == "bf16" else _mx_gemm_call
    # gate_up and down forward, then dlhs = dout @ rhs^T of each
    fwd, dlhs = ((d, 2 * f), (f, d)), ((2 * f, d), (d, f))
    try:
        if nvfp4:  # the forward's NVFP4 GEMMs choose the name; the backward's MXFP8 GEMMs must take it too
            from c2jax.kernels.grouped_gemm import MX_OP

            name = dispatch.choose(op, *[_nvfp4_gemm_call(cfg, rows, k, n) for k, n in fwd], impl=cfg.moe_kernel)
            dispatch.choose(MX_OP, *[_mx_gemm_call(cfg, rows, k, n) for k, n in dlhs], impl=name)
        else:
            name = dispatch.choose(op, *[gemm(cfg, rows, k, n) for k, n in fwd + dlhs], impl=cfg.moe_kernel)
        if cfg.moe_quant != "bf16" and not nvfp4:
            _check_permute(cfg.replace(moe_kernel=name), num_tokens, rows)
    except (ValueError, NotImplementedError, RuntimeError) as e:  # RuntimeError: jax_triton without jax-triton
        raise ConfigError(f"moe_impl='grouped' cannot run here (moe_kernel={cfg.moe_kernel!r}, "
                          f"moe_quant={cfg.moe_quant!r}): {e}") from e
    return cfg.replace(moe_kernel=name)


def _grouped_gemm_call(cfg: ModelConfig, rows: int, k: int, n: int):
    """Abstract (args, kwargs) of one bf16/fp32 grouped GEMM of the model: [rows, k] x [E, k, n]."""
    dtype, experts = jnp.dtype(cfg.dtype), cfg.n_routed_experts
    operands = (jax.ShapeDtypeStruct((rows, k), dtype), jax.ShapeDtypeStruct((experts, k, n), dtype),
                jax.ShapeDtypeStruct((experts,), jnp.int32))
    return operands, {"preferred_element_type": dtype}


def _mx_gemm_call(cfg: ModelConfig, rows: int, k: int, n: int):
    """Abstract (args, kwargs) of one block-scaled grouped GEMM: E4M3 values and E8M0 scales per 32 along k."""
    from c2jax.kernels.mxfp8 import MX_BLOCK, MXTensor

    experts, blocks, e4m3, e8m0 = cfg.n_routed_experts, -(-k // MX_BLOCK), jnp.float8_e4m3fn, jnp.float8_e8m0fnu
    lhs = MXTensor(jax.ShapeDtypeStruct((rows, k), e4m3), jax.ShapeDtypeStruct((rows, blocks), e8m0))
    rhs = MXTensor(jax.ShapeDtypeStruct((experts, k, n), e4m3), jax.ShapeDtypeStruct((experts, blocks, n), e8m0))
    return (lhs, rhs, jax.ShapeDtypeStruct((experts,), jnp.int32)), {"out_dtype": jnp.dtype(cfg.dtype)}


def _nvfp4_gemm_call(cfg: ModelConfig, rows: int, k: int, n: int):
    """Abstract (args, kwargs) of one NVFP4 grouped GEMM: E2M1 values, E4M3 scales per 16 along k, one FP32 scale
    per row (token) and per column (output channel)."""
    from c2jax.kernels.nvfp4 import NVFP4_BLOCK, NVFP4Tensor

    experts, blocks, f4, e4m3, f32 = (cfg.n_routed_experts, -(-k // NVFP4_BLOCK), jnp.float4_e2m1fn,
                                      jnp.float8_e4m3fn, jnp.float32)
    lhs = NVFP4Tensor(jax.ShapeDtypeStruct((rows, k), f4), jax.ShapeDtypeStruct((rows, blocks), e4m3),
                      jax.ShapeDtypeStruct((rows, 1), f32))
    rhs = NVFP4Tensor(jax.ShapeDtypeStruct((experts, k, n), f4), jax.ShapeDtypeStruct((experts, blocks, n), e4m3),
                      jax.ShapeDtypeStruct((experts, 1, n), f32))
    return (lhs, rhs, jax.ShapeDtypeStruct((experts,), jnp.int32)), {"out_dtype": jnp.dtype(cfg.dtype)}


def _check_permute(cfg: ModelConfig, num_tokens: int, rows: int) -> None:
    """Raise unless the fused permute + quantize `grouped_quant(cfg)` names runs here (where it is used)."""
    from c2jax.kernels.permute import OP as PERMUTE_OP

    if not grouped_qlinear.fuses_permute(cfg.hidden_size):
        return
    x = jax.ShapeDtypeStruct((num_tokens, cfg.hidden_size), jnp.dtype(cfg.dtype))
    dispatch.choose(PERMUTE_OP, ((x, jax.ShapeDtypeStruct((rows,), jnp.int32)), {}), impl=grouped_quant(cfg).permute)


def resolve_loaded_moe_kernel(cfg: ModelConfig, source: str) -> ModelConfig:
    """`cfg`, a run's resolved model config loaded to run on this device (`source` names the run in the message), with
    a moe_impl="grouped" kernel that is not native here replaced by what `resolve_moe_kernel` picks here for
    moe_kernel=None ($C2JAX_KERNEL_IMPL, else the registry's first native kernel that accepts the model's GEMMs),
    printing one line that says which kernel replaced which. A run's config.yaml names the kernel of the device it
    ran on (the Trainer writes it): evaluating a mosaic_sm90 run on a CPU would otherwise run Pallas' Mosaic GPU
    interpreter, seconds a GEMM, and a jax_triton run would fail. A kernel native here (on a GPU, also one the
    registry does not pick itself) and every other moe_impl are kept as they are. The one helper of every loader of
    a run directory (rl/eval/agents.py)."""
    if cfg.moe_impl != "grouped" or cfg.moe_kernel is None:
        return cfg
    platform, kind = dispatch.current_device()
    named = {i.name: i for i in dispatch.implementations(_grouped_op(cfg))}.get(cfg.moe_kernel)
    if named is not None and named.native(platform, kind):
        return cfg
    local = resolve_moe_kernel(cfg.replace(moe_kernel=None))
    here = platform + (f" {kind!r}" if kind and kind != platform else "")
    print(f"{source}: moe_kernel {cfg.moe_kernel!r} does not run natively on this device ({here}); running "
          f"{local.moe_kernel!r} instead", flush=True)
    return local


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _registry_grouped_matmul(impl, lhs, rhs, group_sizes):
    """lhs [M, K] (rows sorted by group) @ rhs [G, K, N] per group, by the kernel registry's grouped GEMM. The
    kernels are forward-only; the backward runs the same registry for dlhs = dout @ rhs^T (a grouped GEMM over
    the same groups) and the registry's grouped weight gradient for drhs (per group lhs^T dout,
    kernels/grouped_wgrad.py: the implementation of the same name where it has one, else the device's choice)."""
    from c2jax.kernels.grouped_gemm import grouped_matmul

    return grouped_matmul(lhs, rhs, group_sizes, impl=impl, preferred_element_type=lhs.dtype)


def _registry_grouped_fwd(impl, lhs, rhs, group_sizes):
    return _registry_grouped_matmul(impl, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _registry_grouped_bwd(impl, res, dout):
    from c2jax.kernels.grouped_gemm import grouped_matmul
    from c2jax.kernels.grouped_wgrad import grouped_wgrad
    from c2jax.kernels.grouped_wgrad import implementation_for as wgrad_implementation_for

    lhs, rhs, group_sizes = res
    dlhs = grouped_matmul(dout, jnp.swapaxes(rhs, 1, 2), group_sizes, impl=impl, preferred_element_type=lhs.dtype)
    # per group lhs^T dout (kernels/grouped_wgrad.py): a kernel or the capacity einsum, never the ragged
    # contraction XLA lowers to a G x dense masked dot
    drhs = grouped_wgrad(lhs, dout.astype(lhs.dtype), group_sizes, impl=wgrad_implementation_for(impl),
                         preferred_element_type=jnp.float32)
    return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None


_registry_grouped_matmul.defvjp(_registry_grouped_fwd, _registry_grouped_bwd)


def capacity_buckets(cfg: ModelConfig, num_tokens: int) -> tuple[int, ...]:
    """Static per-expert capacities tried in order; the last is T, which can never overflow."""
    balanced = num_tokens * cfg.num_experts_per_tok / cfg.n_routed_experts
    caps = []
    for factor in cfg.moe_capacity_factors:
        cap = min(num_tokens, 8 * math.ceil(factor * balanced / 8))
        if not caps or cap > caps[-1]:
            caps.append(cap)
    if caps[-1] < num_tokens:
        caps.append(num_tokens)
    return tuple(caps)


# The sorted path is one custom_vjp with a hand-written backward. Two measured XLA:CPU traps make that
# worth its length (small preset, T=4096: fwd+bwd of one MoE layer went from ~500 to ~280 ms):
#  * Differentiating through `lax.switch` joins the residuals of all branches, so the branch that runs
#    zero-fills the [E, C, .] residuals of every larger capacity bucket (C up to T): ~1/3 of the layer
#    time went to broadcasts of zeros. Here the switch runs inside the forward and inside the backward,
#    never under autodiff, and the only residuals are [T*k, .] arrays whose shape is bucket independent.
#  * Autodiff of gather is scatter-add, and of `where(valid, ., 0)` a select over the whole buffer.
#    Both directions here are gathers: the buffer row (e, c) reads token src[e, c] or an appended zero
#    row (empty slots), and a token's gradient is the sum of its k buffer rows, so no scatter, no select.


def _pad_row(a):
    """a with one zero row appended: the source that empty buffer slots gather from."""
    return jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])


def _take(a, idx):
    return a.at[idx].get(mode="promise_in_bounds")


class _Plan(NamedTuple):
    """Capacity-independent bookkeeping of the T*k assignments (a = t*k + j), sorted by expert."""
    order: jnp.ndarray  # [T*k] assignment indices grouped by expert (stable)
    starts: jnp.ndarray  # [E] first position of each expert in `order`
    counts: jnp.ndarray  # [E] assignments per expert
    flat: jnp.ndarray  # [T*k] expert of each assignment
    rank: jnp.ndarray  # [T*k] position of each assignment among its expert's


def _plan(expert_ids: jnp.ndarray, num_experts: int, discard: bool = False) -> _Plan:
    """With `discard`, id `num_experts` marks an assignment that is not this device's (expert parallelism):
    it is sorted into an extra last group that owns no buffer rows and contributes zero."""
    flat, order, counts, starts = _sort_assignments(expert_ids, num_experts + int(discard))
    rank_sorted = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[flat[order]]
    rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
    return _Plan(order, starts, counts, flat, rank)


def _slots(plan: _Plan, capacity: int, num_experts: int):
    """slot [T*k]: buffer row of each assignment (E*C, one past the end, if discarded); src [E*C]:
    assignment in each row (T*k if empty)."""
    num_assign = plan.order.shape[0]
    slot = jnp.where(plan.flat < num_experts, plan.flat * capacity + plan.rank, num_experts * capacity)
    c = jnp.arange(capacity, dtype=jnp.int32)
    pos = plan.starts[:num_experts, None] + c[None, :]
    held = plan.order[jnp.minimum(pos, num_assign - 1)]
    src = jnp.where(c[None, :] < plan.counts[:num_experts, None], held, num_assign)
    return slot, src.reshape(-1)


def _expert_ffn(recipe, h, gate_up, down):
    """h [E, C, d] through each expert's SwiGLU: (gu [E, C, 2f], out [E, C, d])."""
    f = down.shape[1]
    gu = jnp.einsum("ecd,edg->ecg", h, gate_up) if recipe is None else qlinear.fprop(h, gate_up, recipe)[0]
    act = jax.nn.silu(gu[..., :f]) * gu[..., f:]
    out = jnp.einsum("ecf,efd->ecd", act, down) if recipe is None else qlinear.fprop(act, down, recipe)[0]
    return gu, out


def _expert_ffn_grads(recipe, h, gu, dout, gate_up, down):
    """Backward of `_expert_ffn` for cotangent dout [E, C, d]: (dh [E, C, d], dgate_up, ddown)."""
    f = down.shape[1]
    gate, up = gu[..., :f], gu[..., f:]
    if recipe is not None:
        return _quantized_ffn_grads(recipe, h, gate, up, dout, gate_up, down)
    dact = jnp.einsum("ecd,efd->ecf", dout, down)
    act, dgate, dup = swiglu_act_grads(gate, up, dact)
    ddown = jnp.einsum("ecf,ecd->efd", act, dout)
    dgu = jnp.concatenate([dgate, dup], axis=-1)
    dgate_up = jnp.einsum("ecd,ecg->edg", h, dgu)
    dh = jnp.einsum("ecg,edg->ecd", dgu, gate_up)
    return dh, dgate_up, ddown


def _quantized_ffn_grads(recipe, h, gate, up, dout, gate_up, down):
    """The backward GEMMs under `recipe`: dgrad and wgrad quantized along their own contraction axes (wgrad
    along the capacity axis, so scale blocks never span two experts), and the straight-through masks of the
    two forward GEMMs, recomputed from the same operands."""
    act_fwd = jax.nn.silu(gate) * up  # the operand the forward quantized, bit for bit
    _, mask_act, mask_down = qlinear.fprop(act_fwd, down, recipe)
    dact = qlinear.apply_mask(qlinear.dgrad(dout, down, recipe), mask_act)
    act, dgate, dup = swiglu_act_grads(gate, up, dact)
    ddown = qlinear.apply_mask(qlinear.wgrad(act, dout, recipe), mask_down)
    dgu = jnp.concatenate([dgate, dup], axis=-1)
    _, mask_h, mask_gate_up = qlinear.fprop(h, gate_up, recipe)
    dgate_up = qlinear.apply_mask(qlinear.wgrad(h, dgu, recipe), mask_gate_up)
    dh = qlinear.apply_mask(qlinear.dgrad(dgu, gate_up, recipe), mask_h)
    return dh, dgate_up, ddown


def _experts_fwd_at(capacity, discard, recipe, x, weights, gate_up, down, plan):
    num_tokens, k = weights.shape
    num_experts, d, f = gate_up.shape[0], x.shape[1], down.shape[1]
    slot, src = _slots(plan, capacity, num_experts)
    pad = _pad_row if discard else (lambda a: a)  # discarded assignments read the appended zero row
    h = _take(_pad_row(x), src // k).reshape(num_experts, capacity, d)  # empty rows: src // k == T
    gu, out = _expert_ffn(recipe, h, gate_up, down)
    out_a = _take(pad(out.reshape(num_experts * capacity, d)), slot)  # [T*k, d], assignment order
    gu_a = _take(pad(gu.reshape(num_experts * capacity, 2 * f)), slot)
    y = jnp.einsum("tkd,tk->td", out_a.reshape(num_tokens, k, d), weights)
    return y, gu_a, out_a


def _experts_bwd_at(capacity, discard, recipe, x, weights, gate_up, down, plan, gu_a, out_a, dy):
    num_tokens, k = weights.shape
    num_experts, d, f = gate_up.shape[0], x.shape[1], down.shape[1]
    slot, src = _slots(plan, capacity, num_experts)
    tok = src // k
    dweights = jnp.einsum("tkd,td->tk", out_a.reshape(num_tokens, k, d), dy)
    row_weight = _take(_pad_row(weights.reshape(-1)), src)  # 0 on empty rows
    dout = (_take(_pad_row(dy), tok) * row_weight[:, None]).reshape(num_experts, capacity, d)
    h = _take(_pad_row(x), tok).reshape(num_experts, capacity, d)
    gu = _take(_pad_row(gu_a), src).reshape(num_experts, capacity, 2 * f)
    dh, dgate_up, ddown = _expert_ffn_grads(recipe, h, gu, dout, gate_up, down)
    dh = dh.reshape(num_experts * capacity, d)
    dx = _take(_pad_row(dh) if discard else dh, slot).reshape(num_tokens, k, d).sum(1)  # each token's k rows
    return dx, dweights, dgate_up, ddown


# The last capacity bucket (C = T, which no load can overflow) is the rare path, taken only when an expert
# gets more than the largest factor x its balanced share. As one batched einsum its [E, T, .] buffers were
# the largest of a whole training step (E x the buffers of any other bucket; XLA sizes temporaries for the
# worst branch), so where they exceed `moe_overflow_loop_bytes` it runs one expert at a time instead: E GEMMs
# over that expert's window of the sorted assignments, written back to assignment order by scatter. Same
# math per row, 1/E of the memory. Small buffers keep the einsum: at decode sizes (T = 16 tokens, where the
# 8-row buckets make the overflow bucket common) the loop took 2-3x as long.


def _expert_window(plan: _Plan, expert, num_tokens: int):
    """The assignments of `expert` as a fixed-size window of T rows: (src [T], valid [T]); invalid rows hold
    T*k (one past the last assignment: scatters drop it, gathers from padded arrays read zeros)."""
    num_assign = plan.order.shape[0]
    order = jnp.concatenate([plan.order, jnp.full((num_tokens,), num_assign, plan.order.dtype)])
    window = jax.lax.dynamic_slice(order, (plan.starts[expert],), (num_tokens,))
    valid = jnp.arange(num_tokens) < plan.counts[expert]
    return jnp.where(valid, window, num_assign), valid


def _experts_fwd_looped(discard, recipe, x, weights, gate_up, down, plan):
    del discard  # discarded assignments belong to no local expert: never written, they stay zero
    num_tokens, k = weights.shape
    num_experts, d, f = gate_up.shape[0], x.shape[1], down.shape[1]
    x_pad = _pad_row(x)

    def one_expert(e, carry):
        out_a, gu_a = carry
        src, _ = _expert_window(plan, e, num_tokens)
        h = _take(x_pad, src // k)[None]
        gu, out = _expert_ffn(recipe, h, gate_up[e][None], down[e][None])
        out_a = out_a.at[src].set(out[0], mode="drop")
        gu_a = gu_a.at[src].set(gu[0], mode="drop")
        return out_a, gu_a

    zeros = (jnp.zeros((num_tokens * k, d), x.dtype), jnp.zeros((num_tokens * k, 2 * f), x.dtype))
    out_a, gu_a = jax.lax.fori_loop(0, num_experts, one_expert, zeros)
    y = jnp.einsum("tkd,tk->td", out_a.reshape(num_tokens, k, d), weights)
    return y, gu_a, out_a


def _experts_bwd_looped(discard, recipe, x, weights, gate_up, down, plan, gu_a, out_a, dy):
    del discard
    num_tokens, k = weights.shape
    num_experts, d = gate_up.shape[0], x.shape[1]
    dweights = jnp.einsum("tkd,td->tk", out_a.reshape(num_tokens, k, d), dy)
    x_pad, dy_pad, gu_pad = _pad_row(x), _pad_row(dy), _pad_row(gu_a)
    weight_pad = _pad_row(weights.reshape(-1))

    def one_expert(e, carry):
        dh_a, dgate_up, ddown = carry
        src, _ = _expert_window(plan, e, num_tokens)
        tok = src // k
        dout = _take(dy_pad, tok) * _take(weight_pad, src)[:, None]  # 0 on invalid rows
        dh, dgu_e, ddown_e = _expert_ffn_grads(recipe, _take(x_pad, tok)[None], _take(gu_pad, src)[None],
                                               dout[None], gate_up[e][None], down[e][None])
        return (dh_a.at[src].set(dh[0], mode="drop"), dgate_up.at[e].set(dgu_e[0]), ddown.at[e].set(ddown_e[0]))

    init = (jnp.zeros((num_tokens * k, d), x.dtype), jnp.zeros_like(gate_up), jnp.zeros_like(down))
    dh_a, dgate_up, ddown = jax.lax.fori_loop(0, num_experts, one_expert, init)
    return dh_a.reshape(num_tokens, k, d).sum(1), dweights, dgate_up, ddown


def _fwd_branches(buckets, discard, recipe, loop):
    branches = [partial(_experts_fwd_at, cap, discard, recipe) for cap in buckets]
    if loop:  # the overflow bucket (C = T): one expert at a time
        branches[-1] = partial(_experts_fwd_looped, discard, recipe)
    return branches


def _bwd_branches(buckets, discard, recipe, loop):
    branches = [partial(_experts_bwd_at, cap, discard, recipe) for cap in buckets]
    if loop:
        branches[-1] = partial(_experts_bwd_looped, discard, recipe)
    return branches


def _bucket_index(buckets, counts, num_experts):
    index = jnp.searchsorted(jnp.asarray(buckets), jnp.max(counts[:num_experts]), side="left")
    return jnp.minimum(index, len(buckets) - 1)


# Not differentiated (the sampler's prefill, eval and RL scoring forwards), the sorted path runs the first
# implementation of FORWARD_OP that accepts the call (kernels/dispatch: by device kind, override by
# $C2JAX_KERNEL_IMPL="moe_sorted_forward=bucketed"); under autodiff it always runs the bucketed einsum above.
FORWARD_OP = "moe_sorted_forward"
# rows of the sorted assignments one GEMM of the tiled forward takes: bounds, and the balanced load per expert
# below which the tiled forward steps aside (decode sizes, where one padded einsum over all experts is faster)
_TILE_ROWS = (32, 128)


def _forward_tile_rows(num_tokens: int, k: int, num_experts: int) -> int | None:
    """Tile rows for the tiled forward at this size: a quarter of the balanced load per expert as a power of two,
    within _TILE_ROWS; None where the balanced load is under two of the smallest tiles."""
    balanced = num_tokens * k / num_experts
    if balanced < 2 * _TILE_ROWS[0]:
        return None
    return min(_TILE_ROWS[1], max(_TILE_ROWS[0], 1 << int(math.log2(balanced / 4))))


def _experts_tiled(buckets, discard, recipe, loop, x, weights, gate_up, down, expert_ids):
    """The sorted path's forward without capacity padding: each expert's run of the expert-sorted assignments in
    tiles of m rows (a loop over experts, and over that expert's ceil(count / m) tiles), so the work follows the
    actual load instead of the busiest expert's bucket. A tile that runs past its expert's rows computes the next
    expert's first rows with the wrong weights; experts go in order, so the next expert's own tiles overwrite them
    (and rows past the last local expert, the discarded group, are zeroed). Same per-row math as the einsum.
    Measured on XLA:CPU (2-core AMD EPYC, AVX-512, load ~1; E = 16, d = 512, f = 256, k = 4): T = 512 at a
    balanced load 1.1-2x faster, with the busiest expert at 2.5x its share (the C = T bucket) ~3x faster;
    T = 4096 at 2.4x ~3x faster."""
    del buckets, loop
    if recipe is not None:
        raise NotImplementedError("quantized expert GEMMs run the bucketed einsum (per-expert weight scales)")
    num_tokens, k = weights.shape
    num_experts, d, f = gate_up.shape[0], x.shape[1], down.shape[1]
    rows_per_tile = _forward_tile_rows(num_tokens, k, num_experts)
    if rows_per_tile is None:
        raise NotImplementedError(f"{num_tokens} tokens x {k} over {num_experts} experts: under two tiles per expert")
    plan = _plan(expert_ids, num_experts, discard)
    rows = jnp.concatenate([_take(x, plan.order // k), jnp.zeros((rows_per_tile, d), x.dtype)])

    def one_expert(e, out):
        gate_up_e, down_e, start = gate_up[e], down[e], plan.starts[e]

        def one_tile(j, out):
            at = start + j * rows_per_tile
            gu = jax.lax.dynamic_slice_in_dim(rows, at, rows_per_tile) @ gate_up_e
            tile = (jax.nn.silu(gu[:, :f]) * gu[:, f:]) @ down_e
            return jax.lax.dynamic_update_slice_in_dim(out, tile, at, 0)

        return jax.lax.fori_loop(0, (plan.counts[e] + rows_per_tile - 1) // rows_per_tile, one_tile, out)

    out = jax.lax.fori_loop(0, num_experts, one_expert, jnp.zeros_like(rows))
    if discard:  # the discarded group's rows (after every local expert's) contribute zero
        local = plan.starts[num_experts]
        out = jnp.where((jnp.arange(out.shape[0]) < local)[:, None], out, 0)
    out_a = _take(out, plan.starts[plan.flat] + plan.rank)  # [T*k, d], assignment order
    return jnp.einsum("tkd,tk->td", out_a.reshape(num_tokens, k, d), weights)


def _experts_bucketed(buckets, discard, recipe, loop, x, weights, gate_up, down, expert_ids):
    return _sorted_experts_fwd(buckets, discard, recipe, loop, x, weights, gate_up, down, expert_ids)[0]


dispatch.register(FORWARD_OP, dispatch.Implementation(
    "tiled_loop", _experts_tiled, ("cpu",),
    description="loops over experts and m-row tiles of their sorted rows: no capacity padding (XLA:CPU runs "
                "a loop of GEMMs at full speed; a GPU would serialise small kernels)"))
dispatch.register(FORWARD_OP, dispatch.Implementation(
    "bucketed", _experts_bucketed, ("cpu", "gpu", "tpu"),
    description="the capacity-bucketed batched einsum of the differentiated path"))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _sorted_experts(buckets, discard, recipe, loop, x, weights, gate_up, down, expert_ids):
    return dispatch.call(FORWARD_OP, buckets, discard, recipe, loop, x, weights, gate_up, down, expert_ids)


def _sorted_experts_fwd(buckets, discard, recipe, loop, x, weights, gate_up, down, expert_ids):
    num_experts = gate_up.shape[0]
    plan = _plan(expert_ids, num_experts, discard)
    y, gu_a, out_a = jax.lax.switch(_bucket_index(buckets, plan.counts, num_experts),
                                    _fwd_branches(buckets, discard, recipe, loop),
                                    x, weights, gate_up, down, plan)
    return y, (x, weights, gate_up, down, plan, gu_a, out_a)


def _sorted_experts_bwd(buckets, discard, recipe, loop, res, dy):
    x, weights, gate_up, down, plan, gu_a, out_a = res
    grads = jax.lax.switch(_bucket_index(buckets, plan.counts, gate_up.shape[0]),
                           _bwd_branches(buckets, discard, recipe, loop),
                           x, weights, gate_up, down, plan, gu_a, out_a, dy.astype(x.dtype))
    return (*grads, None)


_sorted_experts.defvjp(_sorted_experts_fwd, _sorted_experts_bwd)


def dispatch_sorted(cfg: ModelConfig, x, routing: Routing, gate_up, down, first_expert=None):
    """Dropless sort + capacity-bucketed batched einsum (see module docstring).

    With `first_expert` (expert parallelism), `gate_up`/`down` hold only experts
    [first_expert, first_expert + E_local) and assignments to other experts contribute zero.
    More than `cfg.moe_chunk_tokens` tokens are dispatched in equal chunks by a `lax.scan` (the last padded
    with tokens that select no expert), each chunk with its own capacity bucket: the [E, C, .] buffers
    then scale with the chunk, not with T, and the scan's residuals are the same [T*k, .] arrays."""
    recipe = None if cfg.moe_quant == "bf16" else qlinear.get_recipe(cfg.moe_quant, cfg.moe_quant_division)
    ids = routing.expert_ids
    num_local = gate_up.shape[0]
    discard = first_expert is not None
    if discard:
        local = ids - first_expert
        ids = jnp.where((local >= 0) & (local < num_local), local, num_local).astype(jnp.int32)
    weights, gate_up, down = routing.weights.astype(x.dtype), gate_up.astype(x.dtype), down.astype(x.dtype)
    num_tokens, d = x.shape
    chunk = cfg.moe_chunk_tokens

    def loop(buckets):  # the overflow bucket one expert at a time: only where its buffer is large (config)
        return len(buckets) > 1 and num_local * buckets[-1] * gate_up.shape[2] * x.dtype.itemsize \
            > cfg.moe_overflow_loop_bytes

    if not chunk or num_tokens <= chunk:
        buckets = capacity_buckets(cfg, num_tokens)
        return _sorted_experts(buckets, discard, recipe, loop(buckets), x, weights, gate_up, down, ids)
    num_chunks = -(-num_tokens // chunk)
    size = -(-num_tokens // num_chunks)
    pad = num_chunks * size - num_tokens
    if pad:  # padding tokens select the "not mine" group: they take no buffer rows and contribute zero
        x = jnp.concatenate([x, jnp.zeros((pad, d), x.dtype)])
        weights = jnp.concatenate([weights, jnp.zeros((pad, weights.shape[1]), weights.dtype)])
        ids = jnp.concatenate([ids, jnp.full((pad, ids.shape[1]), num_local, ids.dtype)])
        discard = True
    buckets = capacity_buckets(cfg, size)

    def one_chunk(carry, chunk_in):
        xc, wc, ic = chunk_in
        return carry, _sorted_experts(buckets, discard, recipe, loop(buckets), xc, wc, gate_up, down, ic)

    chunks = (x.reshape(num_chunks, size, d), weights.reshape(num_chunks, size, -1),
              ids.reshape(num_chunks, size, -1))
    _, y = jax.lax.scan(one_chunk, None, chunks)
    return y.reshape(num_chunks * size, d)[:num_tokens]
