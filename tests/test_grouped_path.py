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
from c2jax.kernels.grouped_gemm import MX_OP, OP
from c2jax.models.config import preset
from c2jax.models.transformer import init

FP32 = preset("tiny").replace(num_nextn_predict_layers=0, moe_impl="ragged")
# mosaic_sm90's shapes: d and 2f multiples of 128 and 64 for the four GEMMs (forward and dlhs of gate_up, down)
BF16 = FP32.replace(hidden_size=128, moe_intermediate_size=128, num_hidden_layers=2, dtype="bfloat16")

# the MXFP8 reference: the sorted path's recipe; expert FFN 32 so every GEMM's K is whole 32-blocks (the Pallas
# block-scaled kernel's condition)
MXFP8 = FP32.replace(moe_impl="sorted", moe_quant="mxfp8", moe_intermediate_size=32)

# case ([recipe/]kernel) -> (reference config, tolerance relative to each quantity's scale; 0: bit for bit)
KERNELS = {
    "ragged_dot": (FP32, 0.0),  # the same lax.ragged_dot calls, dlhs = ragged_dot(dout, rhs^T) = its transpose rule
    "xla": (FP32, 1e-5),
    "pallas_triton": (FP32, 1e-5),
    "mosaic_sm90": (BF16, 2e-2),  # bf16 activations (eps 7.8e-3); fp32 master weights
    "mxfp8/xla": (MXFP8, 1e-5),  # module docstring
    "mxfp8/pallas_triton": (MXFP8, 1e-5),
}
SLOW = {"mosaic_sm90"}  # each interpreted call ~4 s (132 simulated SMs)
NOT_ON_CPU = {"jax_triton": "raw Triton through jax-triton: no interpreter, needs a CUDA jaxlib"}


def kernel_params():
    return [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in KERNELS]


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
    """A newly registered grouped_matmul (or block-scaled grouped_matmul_mx) implementation that can run here must
    be added to KERNELS."""
    for op, recipe in ((OP, ""), (MX_OP, "mxfp8")):
        cases = {c.rpartition("/")[2] for c in KERNELS if c.rpartition("/")[0] == recipe}
        runnable = {i.name for i in dispatch.implementations(op) if i.interpretable or i.native("cpu", "cpu")}
        assert runnable == cases
        assert {i.name for i in dispatch.implementations(op)} == cases | set(NOT_ON_CPU)
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


@pytest.mark.parametrize("kernel", kernel_params())
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
    for recipe in ("mxfp8_floor", "nvfp4_per_token_fwd+mxfp8_bwd", "fp8_deepseek"):
        with pytest.raises(ConfigError, match="moe_impl='grouped' runs moe_quant in"):
            mx.replace(moe_quant=recipe)


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
