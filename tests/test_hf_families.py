"""The model families beyond DeepSeek-V3 against transformers itself (fp32, eval, eager attention): Qwen3-MoE (the
Composer 2 report's ablation model), Qwen3 (dense), Llama and DeepSeek-V2. Each tiny random checkpoint is built by
transformers, saved, loaded by c2jax and compared; c2jax's save_pretrained is read back by transformers as the same
class with no missing or unexpected keys.

Spec, in short:
  * logits within 1e-4 relative L2 of transformers' for every case: GQA with 1, 2 or all K/V heads, head_dim not
    tied to hidden / heads, Qwen3's q/k norms, rope theta 1e6, Llama-3, linear and YaRN scaling, tied embeddings;
    Qwen3-MoE softmax routing with and without norm_topk_prob and a dense first layer (mlp_only_layers); DeepSeek-V2's
    softmax greedy and group-limited greedy routing with routed scaling and no renormalisation; biased projections
    (`attention_bias` on q/k/v/o_proj: Llama, Qwen3, Qwen3-MoE; Llama's `mlp_bias`), with random nonzero biases;
  * c2jax's parameter count (`c2jax info`) equals transformers' for every case, biases included;
  * biased models: the sampler's greedy decode over its KV cache equals the uncached forward's;
  * the first MoE layer's top-k experts equal transformers' as sets per token, and routing is not trivial;
  * c2jax save_pretrained -> transformers: the same architecture class, no missing / unexpected keys, the same
    logits; c2jax reload bit-exact and the same ModelConfig;
  * a config.json of an unsupported model_type is refused with the supported list; layouts c2jax cannot express
    (dense layers after MoE layers, sliding windows, biases a family's class does not have) are refused naming the
    field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from flax import nnx  # noqa: E402

from c2jax.models.config import ConfigError  # noqa: E402
from c2jax.models.hf import SUPPORTED_MODEL_TYPES, config_from_hf, from_pretrained, save_pretrained  # noqa: E402

REL_TOL = 1e-4
BATCH, SEQ = 2, 12
VOCAB = 80

_QWEN3_MOE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128, rms_norm_eps=1e-6,
                  initializer_range=0.1, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})
_QWEN3 = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=1, head_dim=12, max_position_embeddings=128, initializer_range=0.1,
              tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
_LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
_V2 = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
           num_attention_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=8, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1,
           routed_scaling_factor=1.0, topk_method="greedy", norm_topk_prob=False, max_position_embeddings=128,
           initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

# case -> (transformers config class, causal-LM class, config kwargs)
CASES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _QWEN3_MOE),
    "qwen3_moe_dense0_unnormed_yarn": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _QWEN3_MOE | dict(
        norm_topk_prob=False, mlp_only_layers=[0], num_key_value_heads=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 32})),
    "qwen3_dense": ("Qwen3Config", "Qwen3ForCausalLM", _QWEN3),
    "llama_gqa_llama3_rope": ("LlamaConfig", "LlamaForCausalLM", _LLAMA),
    "llama_mha": ("LlamaConfig", "LlamaForCausalLM", _LLAMA | dict(
        num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama_linear_rope": ("LlamaConfig", "LlamaForCausalLM", _LLAMA | dict(
        num_key_value_heads=1, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "llama_biased": ("LlamaConfig", "LlamaForCausalLM", _LLAMA | dict(attention_bias=True, mlp_bias=True)),
    "qwen3_dense_biased": ("Qwen3Config", "Qwen3ForCausalLM", _QWEN3 | dict(attention_bias=True)),
    "qwen3_moe_biased": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _QWEN3_MOE | dict(attention_bias=True)),
    "deepseek_v2_lite_shaped": ("DeepseekV2Config", "DeepseekV2ForCausalLM", _V2),
    "deepseek_v2_group_limited_yarn": ("DeepseekV2Config", "DeepseekV2ForCausalLM", _V2 | dict(
        q_lora_rank=12, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 0.707, "mscale_all_dim": 0.707})),
}


@dataclass
class Case:
    name: str
    hf: object
    path: Path
    ids: np.ndarray
    logits: np.ndarray
    topk: np.ndarray | None
    ours: object
    out: object


_jit_call = nnx.jit(lambda model, ids: model(ids))


def _hf_model(name: str):
    config_cls, model_cls, kwargs = CASES[name]
    torch.manual_seed(len(name))
    config = getattr(transformers, config_cls)(**kwargs, attn_implementation="eager")
    model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(len(name))
    with torch.no_grad():  # random norm scales: a q/k norm or a final norm mapped wrongly cannot hide
        for key, p in model.named_parameters():
            if key.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif key.endswith(".bias"):  # transformers zero-initialises biases: a dropped one would not show
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


_BIASED = [name for name, (_, _, kwargs) in CASES.items() if kwargs.get("attention_bias") or kwargs.get("mlp_bias")]


def _first_moe_gate(model):
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and not isinstance(gate, torch.nn.Linear):  # a router, not a dense MLP's gate_proj
            return gate
    return None


def _hf_forward(model, ids):
    gate, captured = _first_moe_gate(model), {}
    handle = gate.register_forward_hook(lambda mod, inp, out: captured.update(out=out)) if gate else None
    try:
        with torch.no_grad():
            logits = model(torch.from_numpy(ids)).logits.numpy()
    finally:
        if handle:
            handle.remove()
    return logits, (captured["out"][2].numpy() if gate else None)


def _assert_close(ours, ref, name):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    rel = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    assert rel <= REL_TOL, f"{name}: relative L2 error {rel:.3e} > {REL_TOL}"
    assert float(np.max(np.abs(ours - ref))) <= 10 * REL_TOL * max(float(np.max(np.abs(ref))), 1.0), name
    return rel


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    built: dict[str, Case] = {}
    root = tmp_path_factory.mktemp("families")

    def get(name: str) -> Case:
        if name not in built:
            hf = _hf_model(name)
            path = root / name
            hf.save_pretrained(path)
            ids = np.random.default_rng(len(name)).integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64)
            logits, topk = _hf_forward(hf, ids)
            ours = from_pretrained(path)
            built[name] = Case(name, hf, path, ids, logits, topk, ours, _jit_call(ours, jnp.asarray(ids, jnp.int32)))
        return built[name]

    return get


@pytest.fixture(params=list(CASES))
def case(request, cases) -> Case:
    return cases(request.param)


def test_logits_match_transformers(case: Case):
    rel = _assert_close(case.out.logits, case.logits, case.name)
    print(f"[{case.name}] logits rel L2 {rel:.2e}")


def test_router_topk_matches_transformers(case: Case):
    if case.topk is None:
        assert case.ours.cfg.num_moe_layers == 0 and case.out.expert_ids is None
        return
    k = case.ours.cfg.num_experts_per_tok
    ours = np.asarray(case.out.expert_ids[0]).reshape(-1, k)
    ref = case.topk.reshape(-1, k)
    assert [sorted(r) for r in ours.tolist()] == [sorted(r) for r in ref.tolist()]
    assert len({tuple(sorted(r)) for r in ref.tolist()}) > 3  # routing is not the same pair for every token


def test_config_reads_the_family(case: Case):
    cfg, hc = case.ours.cfg, case.hf.config
    assert cfg.hf_model_type == hc.model_type
    assert cfg.num_hidden_layers == hc.num_hidden_layers and cfg.tie_word_embeddings == hc.tie_word_embeddings
    if hc.model_type == "deepseek_v2":
        assert cfg.attention_type == "mla" and cfg.scoring_func == "softmax" and cfg.topk_method == hc.topk_method
        assert not cfg.norm_topk_prob and cfg.routed_scaling_factor == hc.routed_scaling_factor
    else:
        assert cfg.attention_type == "gqa" and cfg.kv_heads == hc.num_key_value_heads
        assert cfg.gqa_head_dim == (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads)
        assert cfg.qk_norm == hc.model_type.startswith("qwen3")
        assert cfg.attention_bias == hc.attention_bias and cfg.mlp_bias == getattr(hc, "mlp_bias", False)
    if hc.model_type == "qwen3_moe":
        assert cfg.first_k_dense_replace == len(hc.mlp_only_layers or [])
        assert cfg.n_shared_experts == 0 and cfg.norm_topk_prob == hc.norm_topk_prob


def test_counts_equal_transformers(case: Case):
    """c2jax's abstract parameter count (`c2jax info`; biases included) equals transformers' count of the same
    model (tied weights once)."""
    from c2jax.models.flops import param_counts

    assert param_counts(case.ours.cfg).total == sum(p.numel() for p in case.hf.parameters())


@pytest.mark.parametrize("name", _BIASED)
def test_biased_models_decode_greedily_from_the_cache_as_the_uncached_forward(cases, name):
    """The sampler (prefill + chunked decode over its K/V cache, which holds the biased k and v) on a biased model
    with transformers' random biases: greedy tokens equal the argmax of the uncached full forward at every step, and
    the raw logprobs equal its log-softmax."""
    from c2jax.models.inference import EngineConfig, InferenceEngine, Request

    case = cases(name)
    graphdef, state = nnx.split(case.ours)
    prompts = [case.ids[0, :5].tolist(), case.ids[1, :3].tolist()]
    reqs = [Request(p, 10, temperature=0.0) for p in prompts]
    engine = InferenceEngine(case.ours.cfg, graphdef, state, config=EngineConfig(slots=2, max_len=32, chunk_steps=4))
    for req, res in zip(reqs, engine.generate(reqs), strict=True):
        seq = list(req.prompt_ids) + res.token_ids
        logits = np.asarray(_jit_call(case.ours, jnp.asarray([seq + [0] * (32 - len(seq))], jnp.int32)).logits[0])
        logits = logits[len(req.prompt_ids) - 1: len(seq) - 1]
        assert res.token_ids == logits.argmax(-1).tolist()
        logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
        want = np.take_along_axis(logp, np.asarray(res.token_ids)[:, None], -1)[:, 0]
        np.testing.assert_allclose(res.raw_logprobs, want, atol=1e-5)


def test_save_pretrained_reads_back_as_the_same_transformers_class(case: Case, tmp_path):
    save_pretrained(case.ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == [type(case.hf).__name__] and written["model_type"] == case.hf.config.model_type
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True,
                                                                   attn_implementation="eager")
    assert type(back) is type(case.hf)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    np.testing.assert_array_equal(_hf_forward(back.eval(), case.ids)[0], case.logits)
    again = from_pretrained(tmp_path)
    assert again.cfg == case.ours.cfg
    for (path, x), (_, y) in zip(nnx.to_flat_state(nnx.state(again)), nnx.to_flat_state(nnx.state(case.ours)),
                                 strict=True):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), err_msg=str(path))


def test_unsupported_family_is_refused_with_the_supported_list():
    with pytest.raises(ConfigError) as err:
        config_from_hf({"model_type": "mixtral", "hidden_size": 32})
    message = str(err.value)
    assert "'mixtral' is not supported" in message
    for model_type in ("deepseek_v3", "deepseek_v2", "qwen3_moe", "qwen3", "llama", "kimi_k25"):
        assert model_type in message and model_type in SUPPORTED_MODEL_TYPES


@pytest.mark.parametrize("changes, field", [
    (dict(mlp_only_layers=[1]), "mlp_only_layers"),  # a dense layer after a MoE layer
    (dict(decoder_sparse_step=2), "decoder_sparse_step"),  # MoE on every other layer
    (dict(use_sliding_window=True), "use_sliding_window"),
])
def test_inexpressible_qwen3_moe_layouts_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        config_from_hf({"model_type": "qwen3_moe", **_QWEN3_MOE, **changes})


def test_biases_a_family_does_not_have_are_refused_or_ignored_as_transformers_does():
    """MLA takes no attention_bias (DeepSeek's loader and ModelConfig refuse it); Qwen3's MLPs have no bias, so
    `mlp_bias` there is ignored with a warning on load (as transformers ignores it) and refused on export; a non-bool
    flag is a ConfigError."""
    from c2jax.models.config import ModelConfig, preset
    from c2jax.models.hf import config_to_hf

    with pytest.raises(ConfigError, match="attention_bias"):
        config_from_hf({"model_type": "deepseek_v2", **_V2, "attention_bias": True})
    with pytest.raises(ConfigError, match="attention_bias"):
        ModelConfig(attention_type="mla", attention_bias=True)
    with pytest.raises(ConfigError, match="mlp_bias"):
        ModelConfig(mlp_bias=1)
    with pytest.warns(UserWarning, match="mlp_bias"):
        cfg = config_from_hf({"model_type": "qwen3", **_QWEN3, "mlp_bias": True})
    assert not cfg.mlp_bias
    for name in ("tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v2"):
        with pytest.raises(ConfigError, match="mlp_bias"):
            config_to_hf(preset(name).replace(mlp_bias=True))
    assert config_to_hf(preset("tiny-llama").replace(attention_bias=True, mlp_bias=True))["mlp_bias"] is True


# every full-size preset and the small presets of each family
COUNTED_PRESETS = ["qwen3-30b-a3b", "qwen3-coder-30b-a3b", "qwen3-0.6b", "deepseek-v2-lite", "moonlight-16b-a3b",
                   "deepseek-v3", "kimi-k2.5", "tiny-qwen3-moe", "small-qwen3-moe", "tiny-qwen3", "tiny-llama",
                   "tiny-deepseek-v2", "tiny", "small"]


@pytest.mark.parametrize("name", COUNTED_PRESETS)
def test_preset_counts_equal_transformers_meta_device_count(name):
    """c2jax's abstract count (what `c2jax info` reports) equals the parameter count of transformers' own model of
    the exported config.json, built on the meta device: total exactly, activated (routed experts at top-k / E)
    within rounding. transformers builds no MTP modules, so those are left out of the comparison."""
    from c2jax.models.config import preset
    from c2jax.models.flops import param_counts
    from c2jax.models.hf import config_to_hf

    cfg = preset(name)
    hf = config_to_hf(cfg)
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = routed = 0
    for key, p in model.named_parameters():  # tied weights are listed once
        total += p.numel()
        if ".mlp.experts." in key:
            routed += p.numel()
    ours = param_counts(cfg.replace(num_nextn_predict_layers=0))
    assert ours.total == total and param_counts(cfg).total == total + param_counts(cfg).mtp
    active = total - routed + routed * cfg.num_experts_per_tok / cfg.n_routed_experts
    assert abs(ours.active - active) <= cfg.num_hidden_layers
    assert type(model).__name__ == hf["architectures"][0]


def test_a_trained_selection_bias_is_not_dropped_silently(cases, tmp_path):
    """Qwen3-MoE checkpoints carry no selection bias: a model whose bias moved (router_bias_rate > 0) is refused
    on export rather than written with different routing."""
    from c2jax.models.hf import CheckpointError

    model = from_pretrained(cases("qwen3_moe").path)
    bias = model.moe_layers.mlp.e_score_correction_bias
    bias[...] = bias[...].at[0, 1].set(0.01)
    with pytest.raises(CheckpointError, match="no expert selection bias"):
        save_pretrained(model, tmp_path)
    assert not (tmp_path / "config.json").exists()
