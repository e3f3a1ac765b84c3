"""The GPU path, proven on CPU (issue 41): moe_impl="grouped" runs the model's expert GEMMs through the kernel
registry (kernels/dispatch.py); on CPU a GPU kernel named by `moe_kernel` runs in its Pallas interpreter. For each
grouped_matmul implementation that can run here, the three jitted steps of the project give what
moe_impl="ragged" (jax.lax.ragged_dot, autodiff) gives:

  * the pretraining step (c2jax.train.step.make_train_step): loss, updated parameters, router biases;
  * the RL learner step (c2jax.rl.learner.make_rl_step) with router replay of the model's own experts: loss,
    updated parameters, replay override fraction 0;
  * the sampler (c2jax.models.inference.InferenceEngine): prefill + decode chunks, greedy: the same tokens, the
    same routed experts per token, logprobs within tolerance.

SGD with lr 1 makes the parameter update minus the gradient, so equal updates mean equal gradients (Adam's first
step, ~lr * sign(g), would hide scale errors and magnify noise on gradients near zero).

Which implementations run, and how:
  ragged_dot     native (lax.ragged_dot through the registry's custom VJP): bit for bit the ragged path
  xla            native (capacity-padded batched einsum): fp32, 1-ulp differences
  pallas_triton  Pallas Triton kernel in the Pallas interpreter: fp32
  mosaic_sm90    JAX's Hopper ragged_dot_mgpu in Pallas' Mosaic GPU interpreter (slow): it takes bf16 operands
                 with K % 64 == 0 and N % 128 == 0, so it runs a bf16 variant of `tiny` (hidden 128, expert
                 FFN 128, 1 MoE layer) against the ragged path in the same bf16
  jax_triton     cannot run on CPU: raw Triton through jax-triton, no interpreter, needs a CUDA jaxlib

moe_quant="mxfp8" (cases "mxfp8/<kernel>"): the grouped path's MXFP8 recipe (c2jax.kernels.grouped_qlinear: fused
permute + MXFP8 quantize, block-scaled grouped GEMM forward and dgrad, wgrad on dequantized operands) against
moe_impl="sorted" with the same recipe (qlinear's fake quantization on capacity buffers): the same blocks, scales
and codes, so
  mxfp8/xla            dequantized operands through an FP32 einsum, as the sorted path: bit for bit
  mxfp8/pallas_triton  the block-scaled kernel (interpreted) sums per 32-block dot then scales, in FP32: the sums
                       in another order, 1e-5 of each quantity's scale (a 1-ulp change that moved a value across an
                       E4M3 rounding boundary downstream would show as ~1e-2 and fail: it did not happen here)

moe_quant="nvfp4_per_token_fwd+mxfp8_bwd" (cases "nvfp4/<kernel>", the same three tests): Composer 2's recipe on the
grouped path (NVFP4 per-token forward: tokens quantized once, codes gathered, grouped_matmul_nvfp4; the MXFP8
backward above times the straight-through masks, recomputed from x and w) against moe_impl="sorted" with the same
recipe (qlinear's fake quantization and masks on capacity buffers). Same codes, scales and masks (checked bit for
bit below), so the tolerance is again 1e-5 of each quantity's scale:
  nvfp4/xla            dequantized operands through an FP32 einsum
  nvfp4/pallas_triton  the NVFP4 kernel (interpreted): exact bf16 products of E2M1 x E4M3 per 16-block, FP32
                       sums, the FP32 per-token / per-channel scales on the accumulator (its RL step and sampler
                       cases are marked `slow`: the training step already runs its forward and backward GEMMs)
Measured (jax 0.10.2, XLA:CPU): nvfp4/xla losses equal, parameters 1.5e-8 (train, update scale 0.13) and 3.7e-9 (RL,
scale 0.0071) apart, logprobs equal; nvfp4/pallas_triton 6.0e-8, 3.7e-9, equal. A tiny model's values rarely clip
(an E4M3 block scale must underflow), so the masks are checked where they bite: the grouped_linear test below, with
outlier tokens and channels.
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from c2jax.kernels import dispatch
from c2jax.kernels.grouped_gemm import MX_OP, NVFP4_OP, OP
from c2jax.models.config import preset
from c2jax.models.transformer import init

FP32 = preset("tiny").replace(num_nextn_predict_layers=0, moe_impl="ragged")
# mosaic_sm90's shapes: d and 2f multiples of 128 and 64 for the four GEMMs (forward and dlhs of gate_up, down)
BF16 = FP32.replace(hidden_size=128, moe_intermediate_size=128, num_hidden_layers=2, dtype="bfloat16")

# the MXFP8 reference: the sorted path's recipe; expert FFN 32 so every GEMM's K is whole 32-blocks (the Pallas
# block-scaled kernel's condition)
MXFP8 = FP32.replace(moe_impl="sorted", moe_quant="mxfp8", moe_intermediate_size=32)
NVFP4 = MXFP8.replace(moe_quant="nvfp4_per_token_fwd+mxfp8_bwd")  # Composer 2's recipe, the sorted path's

# case ([recipe/]kernel) -> (reference config, tolerance relative to each quantity's scale; 0: bit for bit)
KERNELS = {
    "ragged_dot": (FP32, 0.0),  # the same lax.ragged_dot calls, dlhs = ragged_dot(dout, rhs^T) = its transpose rule
    "xla": (FP32, 1e-5),
    "pallas_triton": (FP32, 1e-5),
    "mosaic_sm90": (BF16, 2e-2),  # bf16 activations (eps 7.8e-3); fp32 master weights
    "mxfp8/xla": (MXFP8, 1e-5),  # module docstring
    "mxfp8/pallas_triton": (MXFP8, 1e-5),
    "nvfp4/xla": (NVFP4, 1e-5),  # module docstring
    "nvfp4/pallas_triton": (NVFP4, 1e-5),
}
SLOW = {"mosaic_sm90"}  # each interpreted call ~4 s (132 simulated SMs)
SLOW_UNLESS_TRAIN = {"nvfp4/pallas_triton"}  # the train step covers its forward and backward GEMMs
NOT_ON_CPU = {"jax_triton": "raw Triton through jax-triton: no interpreter, needs a CUDA jaxlib"}
OPS = {OP: "", MX_OP: "mxfp8", NVFP4_OP: "nvfp4"}  # registry op -> the case prefix of its implementations


def kernel_params(train=False):
    slow = SLOW if train else SLOW | SLOW_UNLESS_TRAIN
    return [pytest.param(k, marks=pytest.mark.slow) if k in slow else k for k in KERNELS]


def _grouped(cfg, case):
    return cfg.replace(moe_impl="grouped", moe_kernel=case.rpartition("/")[2])


def _base(cfg):
    """The model the weights, batches and replayed experts come from: the same for the case and its reference."""
    return cfg.replace(moe_impl="ragged", moe_kernel=None, moe_quant="bf16")


def _graphdef(cfg, *filters):
    return nnx.split(nnx.eval_shape(lambda: init(cfg, 0)), *filters)[0]


def _flat(tree):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


def _report(kernel, step, **diffs):
    print(f"[grouped {kernel}] {step}: " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))


def _compare(kernel, step, got, want, tol, scale):
    """max |got - want| <= tol * scale (== 0 when tol is 0); returns the difference."""
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want, strict=True))
    assert diff <= tol * scale, (kernel, step, diff, scale)
    return diff


def test_every_grouped_kernel_that_runs_on_cpu_is_checked():
    """A newly registered grouped_matmul (or block-scaled grouped_matmul_mx / grouped_matmul_nvfp4) implementation
    that can run here must be added to KERNELS."""
    for op, recipe in OPS.items():
        cases = {c.rpartition("/")[2] for c in KERNELS if c.rpartition("/")[0] == recipe}
        runnable = {i.name for i in dispatch.implementations(op) if i.interpretable or i.native("cpu", "cpu")}
        assert runnable == cases
        named_only = set() if op == NVFP4_OP else set(NOT_ON_CPU)  # no raw-Triton NVFP4 kernel
        assert {i.name for i in dispatch.implementations(op)} == cases | named_only
        for name in cases:
            impl, interpret = dispatch.candidates(op, impl=name, platform="cpu", device_kind="cpu")[0]
            assert impl.name == name and interpret == (name in ("pallas_triton", "mosaic_sm90"))


# training ------------------------------------------------------------------------------------------
@functools.cache
def _train(cfg):
    """(loss, params before, params after, router biases after) of one SGD(lr=1) pretraining step."""
    from c2jax.train.step import init_train_state, make_train_step

    tx = optax.sgd(1.0)
    _, state = init_train_state(init(_base(cfg), seed=0), tx)
    before = _flat(state.params)
    batch = jax.random.randint(jax.random.key(0), (2, 17), 0, cfg.vocab_size)
    step = make_train_step(_graphdef(cfg, nnx.Param, ...), tx, router_bias_rate=1e-3)
    state, metrics = step(state, batch)
    return float(metrics["loss"]), before, _flat(state.params), _flat(state.model_state)


@pytest.mark.parametrize("kernel", kernel_params(train=True))
def test_train_step_equals_ragged(kernel):
    ref_cfg, tol = KERNELS[kernel]
    want_loss, before, want, want_bias = _train(ref_cfg)
    loss, _, got, bias = _train(_grouped(ref_cfg, kernel))
    update = max(float(np.max(np.abs(a - b))) for a, b in zip(want, before))
    assert update > 1e-3
    dloss = abs(loss - want_loss)
    assert dloss <= tol * abs(want_loss), (kernel, loss, want_loss)
    dparam = _compare(kernel, "train", got, want, tol, update)
    for a, b in zip(bias, want_bias, strict=True):  # the sign rule on the step's expert counts: same routing
        np.testing.assert_array_equal(a, b)
    _report(kernel, "train step", loss=dloss, params=dparam, update_scale=update)


# RL ------------------------------------------------------------------------------------------------
@functools.cache
def _rl_batch(cfg):
    """Four sequences packed into 2 rows of 8, replay ids and behaviour logprobs from the (ragged) model (the
    RL learner tests' sequences, tests/test_rl_learner.py)."""
    from c2jax.rl.batch import pack
    from tests.test_rl_learner import _sequences

    return pack(_sequences(cfg=cfg), seq_len=8)


@functools.cache
def _rl(cfg):
    from c2jax.rl.config import LossConfig, RLConfig
    from c2jax.rl.learner import init_rl_state, make_rl_step

    rl_cfg = RLConfig(learning_rate=1.0, max_grad_norm=None, compute_entropy=True,
                      loss=LossConfig(policy_loss="ppo", aggregation="seq_mean_token_mean"))
    tx = optax.sgd(1.0)
    _, state = init_rl_state(init(_base(cfg), 0), tx, rl_cfg)
    before = _flat(state.params)
    batch = _rl_batch(_base(cfg))
    assert batch.replay_ids is not None
    step = make_rl_step(_graphdef(cfg, nnx.Param, ...), tx, rl_cfg)
    state, metrics = step(state, jax.tree.map(jnp.asarray, batch))
    return {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}, before, _flat(state.params)


@pytest.mark.parametrize("kernel", kernel_params())
def test_rl_step_with_router_replay_equals_ragged(kernel):
    ref_cfg, tol = KERNELS[kernel]
    want_metrics, before, want = _rl(ref_cfg)
    metrics, _, got = _rl(_grouped(ref_cfg, kernel))
    assert metrics["replay/override_fraction"] == want_metrics["replay/override_fraction"] == 0.0
    update = max(float(np.max(np.abs(a - b))) for a, b in zip(want, before))
    assert update > 1e-4
    dloss = abs(metrics["loss"] - want_metrics["loss"])
    assert dloss <= tol * abs(want_metrics["loss"]), (kernel, metrics["loss"], want_metrics["loss"])
    dentropy = abs(metrics["entropy"] - want_metrics["entropy"])
    assert dentropy <= tol * abs(want_metrics["entropy"])
    dparam = _compare(kernel, "rl", got, want, tol, update)
    _report(kernel, "rl step", loss=dloss, entropy=dentropy, params=dparam, update_scale=update)


# sampling ------------------------------------------------------------------------------------------
PROMPTS = ([5, 17, 3, 99, 42, 8, 61], [7, 7, 1, 120, 64])


@functools.cache
def _sample(cfg):
    """Greedy generations of two prompts in two slots: one prefill, then decode chunks of 4 steps."""
    from c2jax.models.inference import EngineConfig, InferenceEngine, Request

    _, state = nnx.split(init(_base(cfg), 0))
    engine = InferenceEngine(cfg, _graphdef(cfg), state, config=EngineConfig(slots=2, max_len=32, chunk_steps=4))
    return engine.generate([Request(list(p), 6, temperature=0.0) for p in PROMPTS])


@pytest.mark.parametrize("kernel", kernel_params())
def test_greedy_sampling_equals_ragged(kernel):
    ref_cfg, tol = KERNELS[kernel]
    want = _sample(ref_cfg)
    got = _sample(_grouped(ref_cfg, kernel))
    dlogp = 0.0
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and len(g.token_ids) == 6
        np.testing.assert_array_equal(g.expert_ids, w.expert_ids)
        np.testing.assert_array_equal(g.prompt_expert_ids, w.prompt_expert_ids)
        scale = max(1.0, float(np.max(np.abs(w.raw_logprobs))))
        dlogp = max(dlogp, _compare(kernel, "sample", [np.asarray(g.raw_logprobs)], [np.asarray(w.raw_logprobs)],
                                    tol, scale))
    _report(kernel, "sampling", raw_logprobs=dlogp)


# the kernel a run names ---------------------------------------------------------------------------
H100 = ("gpu", "NVIDIA H100 80GB HBM3")


def test_resolve_moe_kernel_names_what_the_registry_runs(monkeypatch):
    from c2jax.models.config import ConfigError
    from c2jax.models.moe_dispatch import resolve_moe_kernel

    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    grouped = FP32.replace(moe_impl="grouped")
    assert resolve_moe_kernel(FP32) == FP32  # other paths do not use the registry: unchanged
    assert resolve_moe_kernel(grouped).moe_kernel == "xla"  # CPU: interpreters only when named
    assert resolve_moe_kernel(grouped.replace(moe_kernel="pallas_triton")).moe_kernel == "pallas_triton"
    with dispatch.target(*H100):  # Hopper: mosaic_sm90 first, where it accepts all four GEMMs
        assert resolve_moe_kernel(BF16.replace(moe_impl="grouped")).moe_kernel == "mosaic_sm90"
        assert resolve_moe_kernel(grouped).moe_kernel == "pallas_triton"  # fp32: mosaic_sm90 refuses
        assert resolve_moe_kernel(grouped.replace(dtype="bfloat16")).moe_kernel == "pallas_triton"  # d = 32
    with dispatch.target("gpu", "NVIDIA B200"):
        assert resolve_moe_kernel(BF16.replace(moe_impl="grouped")).moe_kernel == "pallas_triton"
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "grouped_matmul=ragged_dot")
    assert resolve_moe_kernel(grouped).moe_kernel == "ragged_dot"
    assert resolve_moe_kernel(grouped.replace(moe_kernel="xla")).moe_kernel == "xla"  # the config wins
    with pytest.raises(ConfigError, match="refused"):
        resolve_moe_kernel(grouped.replace(moe_kernel="mosaic_sm90"))  # fp32
    with pytest.raises(ConfigError, match="no interpreter"):
        resolve_moe_kernel(grouped.replace(moe_kernel="jax_triton"))


def test_resolve_moe_kernel_names_the_mxfp8_kernel_or_refuses_saying_why(monkeypatch):
    """moe_quant="mxfp8" on the grouped path: moe_kernel names the block-scaled grouped GEMM (grouped_matmul_mx),
    the fused permute + quantize follows it by name; recipes the grouped path lacks are refused by the config."""
    from c2jax.models.config import ConfigError
    from c2jax.models.moe_dispatch import grouped_quant, resolve_moe_kernel

    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    mx = MXFP8.replace(moe_impl="grouped")
    assert resolve_moe_kernel(mx).moe_kernel == "xla"
    named = resolve_moe_kernel(mx.replace(moe_kernel="pallas_triton"))
    assert named.moe_kernel == "pallas_triton" and grouped_quant(named).permute == "pallas_triton"  # interpreted
    with dispatch.target(*H100):  # no Mosaic GPU form of the block-scaled GEMM: the Triton one
        assert resolve_moe_kernel(mx).moe_kernel == "pallas_triton"
        assert resolve_moe_kernel(mx.replace(moe_intermediate_size=16)).moe_kernel == "xla"  # K 16: not 32-blocks
        if importlib.util.find_spec("jax_triton") is None:  # named: tl.dot_scaled; here it cannot even trace
            with pytest.raises(ConfigError, match="jax-triton"):
                resolve_moe_kernel(mx.replace(moe_kernel="jax_triton"))
    assert grouped_quant(mx.replace(moe_kernel="jax_triton")).permute is None  # no permute of that name: registry's
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "grouped_matmul_mx=pallas_triton")
    assert resolve_moe_kernel(mx).moe_kernel == "pallas_triton"
    with pytest.raises(ConfigError, match="unknown implementation 'mosaic_sm90'"):
        resolve_moe_kernel(mx.replace(moe_kernel="mosaic_sm90"))
    with pytest.raises(ConfigError, match="no interpreter"):
        resolve_moe_kernel(mx.replace(moe_kernel="jax_triton"))
    for recipe in ("mxfp8_floor", "nvfp4_per_tensor_fwd+mxfp8_bwd", "fp8_deepseek"):
        with pytest.raises(ConfigError, match="moe_impl='grouped' runs moe_quant in"):
            mx.replace(moe_quant=recipe)


def test_resolve_moe_kernel_names_the_nvfp4_kernel_for_both_of_its_gemm_ops(monkeypatch):
    """Under the NVFP4 forward, moe_kernel names the forward's grouped_matmul_nvfp4 and the backward's
    grouped_matmul_mx implementation: one name that both ops accept for the model's GEMMs."""
    from c2jax.models.config import ConfigError
    from c2jax.models.moe_dispatch import grouped_quant, resolve_moe_kernel

    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    nv = NVFP4.replace(moe_impl="grouped")
    assert resolve_moe_kernel(nv).moe_kernel == "xla"
    named = resolve_moe_kernel(nv.replace(moe_kernel="pallas_triton"))
    assert named.moe_kernel == "pallas_triton" and grouped_quant(named).gemm == "pallas_triton"
    with dispatch.target(*H100):
        assert resolve_moe_kernel(nv).moe_kernel == "pallas_triton"
        assert resolve_moe_kernel(nv.replace(moe_intermediate_size=8)).moe_kernel == "xla"  # K 8: not 16-blocks
        with pytest.raises(ConfigError, match="multiple of 32"):  # d 48: 16-blocks for NVFP4, not the MXFP8 dgrad's
            resolve_moe_kernel(nv.replace(hidden_size=48, moe_kernel="pallas_triton"))
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, f"{NVFP4_OP}=pallas_triton")
    assert resolve_moe_kernel(nv).moe_kernel == "pallas_triton"
    with pytest.raises(ConfigError, match="unknown implementation 'jax_triton'"):
        resolve_moe_kernel(nv.replace(moe_kernel="jax_triton"))


# NVFP4 per-token forward: the sorted path's quantization and masks ---------------------------------------------
def _nvfp4_operands(outliers=3e5):
    """Rows of 20 tokens (every 4th with one outlier, which pushes its other 16-blocks' E4M3 scales into the
    subnormals, where they round far enough down to clip: the masks are not all ones), expert weights with outlier
    output channels likewise, groups of 0, 1, 31, 33 rows and 3 rows past them (tests/test_kernels.py)."""
    from tests.test_kernels import GROUP_SIZES

    rng = np.random.default_rng(11)
    t, k, n = 20, 64, 32
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[::4, 0] = outliers
    w = (rng.standard_normal((len(GROUP_SIZES), k, n)) / 8).astype(np.float32)
    w[:, 0, ::3] = outliers / 8
    src = np.concatenate([rng.integers(0, t, sum(GROUP_SIZES)), [t, t, t]]).astype(np.int32)
    dy = rng.standard_normal((src.shape[0], n)).astype(np.float32)
    return (jnp.asarray(x), jnp.asarray(w), jnp.asarray(GROUP_SIZES, jnp.int32), jnp.asarray(src),
            jnp.asarray(dy))


def test_grouped_matmul_nvfp4_pallas_interpreted_equals_the_xla_reference():
    """The registry's NVFP4 grouped GEMM (op grouped_matmul_nvfp4): the Pallas kernel interpreted (codes and E4M3
    block scales dequantized in the kernel, exact bf16 products, FP32 sums, FP32 row / column scales on the
    accumulator) against the XLA reference (dequantize to FP32, einsum): the FP32 roundings differ (sum order,
    where the FP32 scales multiply), 1e-5 of the output's scale. K 48: three 16-blocks, not whole 32-blocks."""
    from c2jax.kernels.grouped_gemm import grouped_matmul_nvfp4, grouped_matmul_reference
    from c2jax.kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from tests.test_kernels import GROUP_SIZES, grouped_operands

    def operands(k):
        lhs, rhs, gs = grouped_operands(k=k, n=40)
        scale = jnp.exp(jnp.linspace(-4.0, 4.0, lhs.shape[0]))[:, None]  # tokens of very different sizes
        return quantize_nvfp4(lhs * scale, axis=1), quantize_nvfp4(rhs, axis=1), gs

    ql, qr, gs = operands(48)
    ref = np.asarray(grouped_matmul_nvfp4(ql, qr, gs, impl="xla", out_dtype=jnp.float32))
    exact = grouped_matmul_reference(dequantize_nvfp4(ql, axis=1), dequantize_nvfp4(qr, axis=1), gs)
    np.testing.assert_allclose(ref, np.asarray(exact), rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    out = np.asarray(grouped_matmul_nvfp4(ql, qr, gs, impl="pallas_triton", out_dtype=jnp.float32))
    diff = np.abs(out - ref)
    print(f"[grouped_matmul_nvfp4] pallas_triton vs xla: max |diff| {diff.max():.3g} of scale {np.abs(ref).max():.3g}")
    assert (diff <= 1e-5 * np.abs(ref).max(axis=1, keepdims=True) + 1e-30).all()  # per row: rows span e^8
    assert not out[sum(GROUP_SIZES):].any() and not ref[sum(GROUP_SIZES):].any()
    assert dispatch.choose(NVFP4_OP) == "xla"  # on CPU; the interpreter only when named
    assert [i.name for i, _ in dispatch.candidates(NVFP4_OP, platform="gpu", device_kind="NVIDIA B200")] == [
        "pallas_triton", "xla"]
    ql40, qr40, gs = operands(40)  # K not whole 16-blocks: the kernel refuses, the registry falls through
    with pytest.raises(NotImplementedError, match="multiple of 16"):
        grouped_matmul_nvfp4(ql40, qr40, gs, impl="pallas_triton")
    assert grouped_matmul_nvfp4(ql40, qr40, gs).shape == (ql40.values.shape[0], 40)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def test_grouped_nvfp4_quantization_is_the_sorted_paths_bit_for_bit():
    """Tokens quantized once and their codes gathered (grouped_qlinear.quantize_rows_nvfp4) give, row for row, the
    codes, E4M3 block scales and FP32 per-token scales of quantizing the gathered rows (what the sorted path's
    capacity buffers hold, empty slots a zero row), and the same dequantized operand and STE mask as its fake
    quantization; the weights' per-channel quantization likewise."""
    from c2jax.kernels import grouped_qlinear, qlinear
    from c2jax.kernels.nvfp4 import dequantize_nvfp4, fake_quantize_nvfp4, quantize_nvfp4
    from c2jax.kernels.pallas_grouped import e2m1_codes

    x, w, _, src, _ = _nvfp4_operands()
    spec = qlinear.get_recipe(NVFP4.moe_quant).forward
    rows = jnp.concatenate([x, jnp.zeros_like(x[:1])])[src]
    got, want = grouped_qlinear.quantize_rows_nvfp4(spec, x, src), quantize_nvfp4(rows, axis=1)
    np.testing.assert_array_equal(np.asarray(e2m1_codes(got.values)), np.asarray(e2m1_codes(want.values)))
    for a, b in zip(got[1:], want[1:], strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    deq, mask = fake_quantize_nvfp4(rows, -1)  # qlinear.fprop's operand and mask of the buffer rows
    np.testing.assert_array_equal(_bits(dequantize_nvfp4(got, axis=1)), _bits(deq))
    q = grouped_qlinear.GroupedQuant(qlinear.get_recipe(NVFP4.moe_quant))
    mask_x, mask_w = grouped_qlinear.forward_masks(q, x, w)
    np.testing.assert_array_equal(np.asarray(jnp.concatenate([mask_x, jnp.ones_like(mask_x[:1])])[src]), mask)
    assert not np.asarray(mask).all()
    wdeq, wmask = fake_quantize_nvfp4(w, -2)
    np.testing.assert_array_equal(_bits(dequantize_nvfp4(quantize_nvfp4(w, axis=1), axis=1)), _bits(wdeq))
    np.testing.assert_array_equal(np.asarray(mask_w), np.asarray(wmask))


@pytest.mark.parametrize("kernels", ["xla", "pallas_triton"])
def test_grouped_nvfp4_linear_equals_the_sorted_path_and_a_broken_mask_or_scale_is_caught(kernels, monkeypatch):
    """grouped_qlinear.grouped_linear under the NVFP4 recipe against qlinear on capacity buffers (the sorted path):
    y, dx and dw within 1e-5 of their scale, and both zero exactly where the forward clipped (dx on the clipped
    token elements, dw on the clipped weights). Dropping the masks from the backward, or quantizing with one scale
    for the whole tensor instead of per token, is caught."""
    from c2jax.kernels import grouped_qlinear, qlinear
    from c2jax.kernels.nvfp4 import NVFP4Tensor, fake_quantize_nvfp4, quantize_nvfp4
    from tests.test_kernels import _capacity_reference

    x, w, gs, src, dy = _nvfp4_operands()
    recipe = qlinear.get_recipe(NVFP4.moe_quant)
    q = grouped_qlinear.GroupedQuant(recipe, gemm=kernels)
    value_and_vjp = lambda fn: jax.jit(lambda x, w: (lambda y, vjp: (y, *vjp(dy)))(*jax.vjp(fn, x, w)))
    run = lambda: [np.asarray(a) for a in value_and_vjp(lambda x, w: grouped_qlinear.grouped_linear(
        q, x, w, gs, src))(x, w)]
    want = [np.asarray(a) for a in value_and_vjp(lambda x, w: _capacity_reference(recipe, 40)(x, w, gs, src))(x, w)]
    clipped_x, clipped_w = (~np.asarray(fake_quantize_nvfp4(a, 1)[1]) for a in (x, w))
    assert clipped_x.sum() and clipped_w.sum()
    got = run()
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        diff = np.abs(a - b).max()
        print(f"[grouped_qlinear nvfp4 {kernels}] {name}: max |diff| {diff:.3g} of scale {np.abs(b).max():.3g}")
        assert diff <= 1e-5 * np.abs(b).max(), (name, diff)
    assert not want[1][clipped_x].any() and not got[1][clipped_x].any()
    assert not want[2][clipped_w].any() and not got[2][clipped_w].any()

    with monkeypatch.context() as m:  # no straight-through masks: gradient flows through the clipped elements
        m.setattr(grouped_qlinear, "forward_masks", lambda q, x, w: (None, None))
        broken = run()
    assert np.abs(broken[1][clipped_x]).max() > 0.1 and np.abs(broken[2][clipped_w]).max() > 0.1

    def per_tensor(spec, x, src=None):  # one FP32 scale for all tokens, broadcast to the per-token layout
        t = quantize_nvfp4(x, axis=1, scaling="per_tensor")
        t = NVFP4Tensor(t.values, t.block_scales, jnp.broadcast_to(t.tensor_scale, (x.shape[0], 1)))
        pad = lambda a, v: jnp.concatenate([a, jnp.full((1, a.shape[1]), v, a.dtype)])[src]  # noqa: E731
        return t if src is None else NVFP4Tensor(pad(t.values, 0), pad(t.block_scales, 0), pad(t.tensor_scale, 1))

    with monkeypatch.context() as m:
        m.setattr(grouped_qlinear, "quantize_rows_nvfp4", per_tensor)
        broken = run()
    plain = (np.asarray(src) % 4 != 0) & (np.asarray(src) < x.shape[0])  # tokens without an outlier: crushed
    assert np.abs(broken[0][plain] - want[0][plain]).max() > 0.1 * np.abs(want[0][plain]).max()


def test_a_loaded_runs_kernel_from_another_device_is_resolved_for_this_one(monkeypatch, capsys):
    """models.moe_dispatch.resolve_loaded_moe_kernel, the one helper of the run-directory loaders: a kernel not
    native here (mosaic_sm90 on a CPU, pallas_triton on a CPU) is replaced by this device's, with one line saying
    which by which ($C2JAX_KERNEL_IMPL still chooses); a native kernel, an unset one and other paths are kept."""
    from c2jax.models.moe_dispatch import resolve_loaded_moe_kernel

    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    h100_run = BF16.replace(moe_impl="grouped", moe_kernel="mosaic_sm90")
    local = resolve_loaded_moe_kernel(h100_run, "run r")
    assert local == h100_run.replace(moe_kernel="xla")
    assert capsys.readouterr().out == ("run r: moe_kernel 'mosaic_sm90' does not run natively on this device (cpu); "
                                       "running 'xla' instead\n")
    assert resolve_loaded_moe_kernel(h100_run.replace(moe_kernel="pallas_triton"), "r").moe_kernel == "xla"
    for kept in (h100_run.replace(moe_kernel="ragged_dot"), h100_run.replace(moe_kernel=None), FP32):
        assert resolve_loaded_moe_kernel(kept, "r") is kept
    with dispatch.target(*H100):
        assert resolve_loaded_moe_kernel(h100_run, "r") is h100_run
    with dispatch.target("gpu", "NVIDIA B200"):
        assert resolve_loaded_moe_kernel(h100_run, "r").moe_kernel == "pallas_triton"
    capsys.readouterr()
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "grouped_matmul=ragged_dot")
    assert resolve_loaded_moe_kernel(h100_run, "r").moe_kernel == "ragged_dot"
    assert "running 'ragged_dot' instead" in capsys.readouterr().out


def test_pretraining_run_writes_the_kernel_into_its_config(tmp_path, monkeypatch):
    """`c2jax pretrain`'s Trainer: config.yaml names the kernel, and the run trains with that config."""
    from c2jax.config import from_dict, load
    from c2jax.train.config import PretrainConfig
    from c2jax.train.loop import Trainer
    from c2jax.train.synthetic import MarkovSource

    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    model = FP32.replace(moe_impl="grouped", num_hidden_layers=2)
    cfg = from_dict(PretrainConfig, dict(name="grouped", output_dir=str(tmp_path), model=dict(model.__dict__),
                                         progress=False, log_every=1, phases=[dict(name="main", steps=1, seq_len=16,
                                                                                   batch_size=2)],
                                         checkpoint=dict(every=100), eval=dict(every=0)))
    trainer = Trainer(cfg, batches=lambda c, p, split: MarkovSource(c.model.vocab_size, p.seq_len, p.batch_size,
                                                                    seed=0),
                      eval_sources=None, tensorboard=False)
    assert trainer.cfg.model.moe_kernel == "xla"
    saved = load(PretrainConfig, tmp_path / "grouped" / "config.yaml")
    assert saved.model.moe_kernel == "xla" and saved.model.moe_impl == "grouped"
    out = trainer.run()
    trainer.close()
    assert out["step"] == 1 and np.isfinite(out["losses"]).all()
    assert [k[0].moe_kernel for k in trainer._steps] == ["xla"]  # the step it ran was built from that config
