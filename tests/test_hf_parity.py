"""c2jax.models.hf against transformers' DeepseekV3ForCausalLM (fp32, eval mode, eager attention): the independent
reference. Tiny random models; routing made nontrivial (std-0.1 weights, random norm scales, nonzero
e_score_correction_bias).

Spec, in short:
  * HF save_pretrained -> c2jax from_pretrained: logits within 1e-4 relative L2 (and a max-abs check) for
    configs with / without q LoRA, grouped routing (topk_group < n_group), YaRN (factor, mscale,
    mscale_all_dim, beta), rope_interleave on and off, norm_topk_prob off, first_k_dense_replace 2, tied
    embeddings with 2 shared experts; router top-k of the first MoE layer equal to HF's as sets per token.
  * c2jax save_pretrained -> HF from_pretrained with no missing / unexpected / mismatched keys (except MTP
    layers), same logits; c2jax reload bit-exact. Sharded checkpoints both ways; HF's fused expert layout.
  * MTP layers in the checkpoint (DeepSeek layout at model.layers.{L+j}) match transformers' MtpModel.
  * kimi_k25 wrapper config (text_config, language_model. prefixes, vision tensors) loads.
  * FP8 e4m3 + 128x128 weight_scale_inv: exact dequant math, logits within FP8 tolerance.
  * Errors name the tensor / config field.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from flax import nnx  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from c2jax.models.config import ConfigError, ModelConfig, preset  # noqa: E402
from c2jax.models.hf import (  # noqa: E402
    CheckpointError,
    config_from_hf,
    config_to_hf,
    dequantize_fp8_block,
    from_pretrained,
    quantize_fp8_block,
    save_pretrained,
)

REL_TOL = 1e-4
BATCH, SEQ = 2, 10

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    num_nextn_predict_layers=0,
    rope_interleave=True,
    tie_word_embeddings=False,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 8.0,
    "beta_slow": 2.0,
    "mscale": 0.8,
    "mscale_all_dim": 0.6,
}
# written to config.json in the pre-v5 form (rope_scaling + rope_theta), Kimi-K2-style beta_fast == beta_slow,
# mscale unset (transformers then uses mscale(factor) for the cos/sin scale)
OLD_YARN = {
    "type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
}
CONFIGS = {
    "plain": {},
    "qlora_groups": dict(q_lora_rank=16, n_group=4, topk_group=2),
    "yarn_interleave": dict(q_lora_rank=12, qk_rope_head_dim=8, rope_parameters=YARN),
    "yarn_rotate_half_v4_names": dict(
        qk_rope_head_dim=8,
        rope_interleave=False,
        n_group=2,
        topk_group=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, **OLD_YARN},
    ),
    "no_norm_topk_dense2": dict(norm_topk_prob=False, first_k_dense_replace=2, routed_scaling_factor=1.5),
    "tied_shared2": dict(tie_word_embeddings=True, n_shared_experts=2, q_lora_rank=16),
}
ERRORS: dict[str, tuple[float, float]] = {}  # config -> (relative L2, max abs), printed with pytest -s


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Std-0.1 weights (HF init with initializer_range=0.1), random RMSNorm scales, nonzero router bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        for sub in module.modules():
            if hasattr(sub, "e_score_correction_bias"):
                sub.e_score_correction_bias.copy_(
                    0.05 * torch.randn(sub.e_score_correction_bias.shape, generator=gen)
                )


def _hf_model(overrides: dict, seed: int = 0) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    config = DeepseekV3Config(**(BASE | overrides), attn_implementation="eager")
    model = DeepseekV3ForCausalLM(config).eval()
    _randomize(model, seed)
    return model


_jit_call = nnx.jit(lambda model, ids: model(ids))


def _forward(model, ids: np.ndarray):
    """model(ids) as one compiled program (much faster than op-by-op dispatch for these tiny models)."""
    return _jit_call(model, jnp.asarray(ids, jnp.int32))


def _rel(a, b) -> tuple[float, float]:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b)), float(np.max(np.abs(a - b)))


def _assert_close(ours, ref, name: str, tol: float = REL_TOL) -> tuple[float, float]:
    rel, max_abs = _rel(ours, ref)
    scale = float(np.max(np.abs(ref)))
    assert rel <= tol, f"{name}: relative L2 error {rel:.3e} > {tol}"
    assert max_abs <= 10 * tol * max(scale, 1.0), (
        f"{name}: max abs error {max_abs:.3e} (|ref| max {scale:.3g})"
    )
    return rel, max_abs


def _hf_forward(model, ids: np.ndarray):
    """Logits and the first MoE layer's router outputs (via a forward hook on DeepseekV3TopkRouter)."""
    captured = {}
    layer = model.model.layers[model.config.first_k_dense_replace]
    handle = layer.mlp.gate.register_forward_hook(lambda mod, inp, out: captured.update(out=out))
    try:
        with torch.no_grad():
            logits = model(torch.from_numpy(ids)).logits.numpy()
    finally:
        handle.remove()
    router_logits, _, topk = captured["out"]
    return logits, router_logits.numpy(), topk.numpy()


def _rewrite(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    """Copy a single-file checkpoint, editing its tensors (dict) and/or config (dict) on the way."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if edit_tensors:
        tensors = edit_tensors(tensors) or tensors
    if edit_config:
        config = edit_config(config) or config
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors", metadata={"format": "pt"}
    )
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _to_v4_rope_names(config: dict) -> dict:
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    params.pop("rope_type", None)
    config["rope_scaling"] = dict(OLD_YARN) if params else None
    return config


@dataclass
class Case:
    name: str
    hf: DeepseekV3ForCausalLM
    path: Path
    ids: np.ndarray
    logits: np.ndarray
    router_logits: np.ndarray
    topk: np.ndarray
    ours: object
    out: object


def _build_case(name: str, root: Path) -> Case:
    hf = _hf_model(CONFIGS[name], seed=len(name))
    path = root / name
    hf.save_pretrained(path)
    if name == "yarn_rotate_half_v4_names":
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(_to_v4_rope_names(config)))
    ids = np.random.default_rng(len(name)).integers(0, BASE["vocab_size"], (BATCH, SEQ)).astype(np.int64)
    logits, router_logits, topk = _hf_forward(hf, ids)
    ours = from_pretrained(path)
    return Case(name, hf, path, ids, logits, router_logits, topk, ours, _forward(ours, ids))


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """name -> Case, built on first use and shared by the module's tests."""
    built: dict[str, Case] = {}
    root = tmp_path_factory.mktemp("cases")

    def get(name: str) -> Case:
        if name not in built:
            built[name] = _build_case(name, root)
        return built[name]

    return get


@pytest.fixture(params=list(CONFIGS))
def case(request, cases) -> Case:
    return cases(request.param)


# ------------------------------------------------------------------------------------------------
# parity with transformers
# ------------------------------------------------------------------------------------------------


def test_logits_match_transformers(case: Case):
    assert np.asarray(case.out.logits).shape == (BATCH, SEQ, BASE["vocab_size"])
    ERRORS[case.name] = _assert_close(case.out.logits, case.logits, case.name)
    print(f"[{case.name}] logits rel L2 {ERRORS[case.name][0]:.2e}, max abs {ERRORS[case.name][1]:.2e}")


def test_router_topk_matches_transformers(case: Case):
    k = BASE["num_experts_per_tok"]
    ours = np.asarray(case.out.expert_ids[0]).reshape(-1, k)
    ref = case.topk.reshape(-1, k)
    assert [sorted(r) for r in ours.tolist()] == [sorted(r) for r in ref.tolist()]
    _assert_close(
        np.asarray(case.out.router_logits[0]).reshape(ref.shape[0], -1),
        case.router_logits,
        f"{case.name} router logits",
    )
    # routing is nontrivial: the selection is not the same expert pair for every token
    assert len({tuple(sorted(r)) for r in ref.tolist()}) > 3


def test_config_parsed_as_transformers_reads_it(case: Case):
    cfg = case.ours.cfg
    hc = case.hf.config
    assert cfg.q_lora_rank == hc.q_lora_rank and cfg.n_group == hc.n_group and cfg.topk_group == hc.topk_group
    assert cfg.rope_interleave == hc.rope_interleave and cfg.tie_word_embeddings == hc.tie_word_embeddings
    assert cfg.rope_theta == hc.rope_parameters["rope_theta"]
    assert (cfg.rope_scaling is None) == (hc.rope_parameters["rope_type"] == "default")
    assert cfg.num_nextn_predict_layers == 0 and case.ours.mtp is None


def _assert_same_state(a, b) -> None:
    flat_a, flat_b = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), err_msg=str(path))


def test_round_trip_through_transformers(case: Case, tmp_path):
    save_pretrained(case.ours, tmp_path)
    back, info = AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    logits, _, _ = _hf_forward(back.eval(), case.ids)
    np.testing.assert_array_equal(logits, case.logits)  # same fp32 weights, same program
    again = from_pretrained(tmp_path)
    assert again.cfg == case.ours.cfg
    _assert_same_state(again, case.ours)


def test_sharded_checkpoints(cases, tmp_path):
    case = cases("qlora_groups")
    case.hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    _assert_same_state(from_pretrained(tmp_path / "hf"), case.ours)

    save_pretrained(case.ours, tmp_path / "c2jax", max_shard_size="20KB")
    index = json.loads((tmp_path / "c2jax" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 3 and len(list((tmp_path / "c2jax").glob("model-*.safetensors"))) == len(shards)
    back, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "c2jax", output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    np.testing.assert_array_equal(_hf_forward(back.eval(), case.ids)[0], case.logits)
    again = from_pretrained(tmp_path / "c2jax")
    _assert_same_state(again, case.ours)
    np.testing.assert_array_equal(np.asarray(_forward(again, case.ids).logits), np.asarray(case.out.logits))


def test_fused_expert_layout(cases, tmp_path):
    """transformers' in-memory layout (mlp.experts.gate_up_proj [E, 2I, d], down_proj [E, d, I]) on disk."""
    case = cases("plain")
    state = {k: v.contiguous() for k, v in case.hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    path = _rewrite(case.path, tmp_path / "fused", edit_tensors=lambda _: state)
    _assert_same_state(from_pretrained(path), case.ours)


# ------------------------------------------------------------------------------------------------
# MTP
# ------------------------------------------------------------------------------------------------


def _add_mtp_tensors(path: Path, hf: DeepseekV3ForCausalLM, mtp_model) -> None:
    """Write transformers' MtpModel weights into the checkpoint in DeepSeek's on-disk layout (HF won't):
    model.layers.{L+j}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, embed_tokens, <layer>}."""
    L = hf.config.num_hidden_layers
    inter = hf.config.moe_intermediate_size
    tensors = load_file(path / "model.safetensors")
    for key, value in mtp_model.state_dict().items():
        m = re.match(r"layers\.(\d+)\.(.*)", key)
        if not m:
            continue  # shared embedding / head: the main model's
        prefix, rest = f"model.layers.{L + int(m.group(1))}.", m.group(2)
        if rest == "post_norm.weight":
            tensors[prefix + "shared_head.norm.weight"] = value
            continue
        rest = rest.removeprefix("mtp_block.")
        if rest == "mlp.experts.gate_up_proj":
            for e in range(value.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = value[e, :inter]
                tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"] = value[e, inter:]
        elif rest == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] = value[e]
        else:
            tensors[prefix + rest] = value
    for j in range(len(mtp_model.layers)):
        tensors[f"model.layers.{L + j}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        tensors[f"model.layers.{L + j}.shared_head.head.weight"] = tensors["lm_head.weight"]
    save_file(
        {k: v.clone().contiguous() for k, v in tensors.items()},
        path / "model.safetensors",
        metadata={"format": "pt"},
    )


def _hf_mtp_logits(hf, mtp_model, ids: np.ndarray) -> list[np.ndarray]:
    """transformers' MTP semantics (MTPCandidateGenerator / MtpModel.forward) over a whole sequence: depth j
    sees tokens shifted by j + 1 and the previous depth's output, at positions shifted by j + 1."""
    ids_t = torch.from_numpy(ids)
    outs = []
    with torch.no_grad():
        hidden = hf(ids_t, output_hidden_states=True).hidden_states[-1]  # the final-norm output
        for j in range(len(mtp_model.layers)):
            n = ids.shape[1] - j - 1
            positions = torch.arange(j + 1, j + 1 + n)[None].expand(ids.shape[0], -1)
            hidden = mtp_model.forward_layer(j, hidden[:, :n], positions, None, input_ids=ids_t[:, j + 1 :])
            outs.append(mtp_model._project_to_logits(hidden).numpy())
    return outs


def test_mtp_matches_transformers_mtp_model(tmp_path, monkeypatch):
    from transformers.modeling_layers import MtpModel

    depth = 2
    hf = _hf_model(
        dict(CONFIGS["plain"], num_hidden_layers=2, num_nextn_predict_layers=depth, q_lora_rank=16), seed=11
    )
    mtp_model = MtpModel(hf, depth).eval()
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():  # MtpModel's own init leaves some tensors empty: draw everything
        for name, p in mtp_model.named_parameters():
            if name.startswith("layers."):
                scale = (1.0, 0.2) if name.endswith("norm.weight") else (0.0, 0.1)
                p.copy_(scale[0] + scale[1] * torch.randn(p.shape, generator=gen))
        for sub in mtp_model.modules():
            if hasattr(sub, "e_score_correction_bias"):
                sub.e_score_correction_bias.copy_(
                    0.05 * torch.randn(sub.e_score_correction_bias.shape, generator=gen)
                )
    hf.save_pretrained(tmp_path / "ckpt")
    _add_mtp_tensors(tmp_path / "ckpt", hf, mtp_model)
    ids = np.random.default_rng(3).integers(0, BASE["vocab_size"], (BATCH, SEQ))
    ref_logits, _, _ = _hf_forward(hf, ids)
    ref_mtp = _hf_mtp_logits(hf, mtp_model, ids)

    ours = from_pretrained(tmp_path / "ckpt")
    assert ours.cfg.num_nextn_predict_layers == depth
    out = _forward(ours, ids)
    _assert_close(out.logits, ref_logits, "mtp trunk")
    for j in range(depth):
        n = SEQ - j - 1  # our depth-j logits at t use token t + j + 1; the last j + 1 positions have none
        rel, mx = _assert_close(np.asarray(out.mtp_logits[j])[:, :n], ref_mtp[j], f"mtp depth {j}")
        ERRORS[f"mtp_depth{j}"] = (rel, mx)
        print(f"[mtp depth {j}] rel L2 {rel:.2e}, max abs {mx:.2e}")

    # c2jax save -> transformers (trunk; MTP keys are its only unexpected ones) and MtpModel.from_pretrained
    save_pretrained(ours, tmp_path / "c2jax")
    layer_l = rf"model\.layers\.{hf.config.num_hidden_layers}"
    back, info = DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "c2jax", output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(
        re.match(rf"model\.layers\.({hf.config.num_hidden_layers}|{hf.config.num_hidden_layers + 1})\.", k)
        for k in info["unexpected_keys"]
    ), info["unexpected_keys"]
    # transformers finds MTP weights through _keys_to_ignore_on_load_unexpected, hard-coded to layer 61
    monkeypatch.setattr(
        DeepseekV3ForCausalLM,
        "_keys_to_ignore_on_load_unexpected",
        [layer_l + r".*", rf"model\.layers\.{hf.config.num_hidden_layers + 1}.*"],
    )
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "c2jax", attn_implementation="eager").eval()
    back_mtp = MtpModel.from_pretrained(back).eval()
    for j, logits in enumerate(_hf_mtp_logits(back, back_mtp, ids)):
        np.testing.assert_allclose(logits, ref_mtp[j], rtol=0, atol=1e-6)
    again = from_pretrained(tmp_path / "c2jax")
    np.testing.assert_array_equal(np.asarray(_forward(again, ids).mtp_logits), np.asarray(out.mtp_logits))


def test_mtp_absent_from_checkpoint(cases, tmp_path):
    case = cases("plain")
    # transformers' DeepseekV3Config defaults num_nextn_predict_layers to 1 but never saves MTP tensors
    path = _rewrite(case.path, tmp_path / "m", edit_config=lambda c: c.update(num_nextn_predict_layers=1))
    with pytest.warns(UserWarning, match="no MTP tensors"):
        model = from_pretrained(path)
    assert model.mtp is None and model.cfg.num_nextn_predict_layers == 0
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.3\."):
        from_pretrained(path, mtp="require")


# ------------------------------------------------------------------------------------------------
# kimi_k25 wrapper
# ------------------------------------------------------------------------------------------------


def test_kimi_k25_wrapper(cases, tmp_path):
    case = cases("qlora_groups")

    def wrap_config(text):
        text = dict(text, model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
        return {
            "model_type": "kimi_k25",
            "architectures": ["KimiK25ForConditionalGeneration"],
            "text_config": text,
            "tie_word_embeddings": True,  # top level: ignored, text_config decides
            "vision_config": {"model_type": "kimi_k25_vision", "patch_size": 14, "hidden_size": 16},
            "media_placeholder_token_id": 95,
            "projection_hidden_size": 16,
            "image_token_id": 94,
        }

    def wrap_tensors(tensors):
        out = {}
        for k, v in tensors.items():
            out[
                k.replace("model.", "language_model.model.", 1)
                if k.startswith("model.")
                else "language_model." + k
            ] = v
        out["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.zeros(48, 16)
        out["mm_projector.proj.0.weight"] = torch.zeros(16, 16)
        return out

    path = _rewrite(case.path, tmp_path / "k25", edit_tensors=wrap_tensors, edit_config=wrap_config)
    model = from_pretrained(path)
    assert model.cfg == case.ours.cfg
    _assert_same_state(model, case.ours)
    _assert_close(_forward(model, case.ids).logits, case.logits, "kimi_k25 wrapper")


# ------------------------------------------------------------------------------------------------
# FP8
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (128, 128), (200, 300), (129, 257), (64, 700)])
def test_fp8_block_dequant_math(shape):
    rng = np.random.default_rng(sum(shape))
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0, shape[1])).astype(np.float32)
    q, scale_inv = quantize_fp8_block(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and scale_inv.dtype == np.float32
    assert scale_inv.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    rows, cols = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    expected = q.astype(np.float32) * scale_inv[rows // 128, cols // 128]  # W = q * s[i // 128, j // 128]
    np.testing.assert_array_equal(dequantize_fp8_block(q, scale_inv), expected)
    # e4m3 has 3 mantissa bits: per-element relative error <= 2^-4 for normal values
    assert np.linalg.norm(expected - w) / np.linalg.norm(w) < 0.05


def test_fp8_checkpoint(tmp_path):
    hf = _hf_model(dict(CONFIGS["qlora_groups"], intermediate_size=136), seed=13)  # 136: partial 128-blocks
    hf.save_pretrained(tmp_path / "hf")
    ids = np.random.default_rng(4).integers(0, BASE["vocab_size"], (BATCH, SEQ))
    ref, _, _ = _hf_forward(hf, ids)
    ours = from_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "fp8", quantization="fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]

    from c2jax.models.hf.safetensors_io import SafetensorsFile

    file = SafetensorsFile(tmp_path / "fp8" / "model.safetensors")
    key = "model.layers.0.mlp.gate_proj.weight"  # [136, 32]: two block rows, the second partial
    assert file.entries[key]["dtype"] == "F8_E4M3" and file.shape(key) == (136, 32)
    assert file.shape(key + "_scale_inv") == (2, 1)
    assert file.entries["model.layers.1.mlp.gate.weight"]["dtype"] == "F32"  # router stays unquantized
    assert file.entries["model.embed_tokens.weight"]["dtype"] == "F32"

    loaded = from_pretrained(tmp_path / "fp8")
    q, s = file.get(key), file.get(key + "_scale_inv")
    rows, cols = np.meshgrid(np.arange(136), np.arange(32), indexing="ij")
    expected = (q.astype(np.float32) * s[rows // 128, cols // 128]).T  # ours stores [in, out]
    np.testing.assert_array_equal(np.asarray(loaded.dense_layers.mlp.gate_proj[...])[0], expected)
    e3 = "model.layers.2.mlp.experts.3.up_proj.weight"
    q, s = file.get(e3), file.get(e3 + "_scale_inv")
    f = BASE["moe_intermediate_size"]
    np.testing.assert_array_equal(
        np.asarray(loaded.moe_layers.mlp.gate_up_proj[...])[1, 3, :, f:], (q.astype(np.float32) * s[0, 0]).T
    )

    # reference: transformers on the NumPy-dequantized weights (an fp32 per-expert checkpoint built here,
    # without c2jax.models.hf)
    dequantized = {}
    for k in file.entries:
        if k.endswith("_scale_inv"):
            continue
        value = file.get(k)
        if k + "_scale_inv" in file.entries:
            sc = file.get(k + "_scale_inv")
            r, c = np.meshgrid(np.arange(value.shape[0]), np.arange(value.shape[1]), indexing="ij")
            value = value.astype(np.float32) * sc[r // 128, c // 128]
        dequantized[k] = torch.from_numpy(np.array(value, np.float32))
    (tmp_path / "deq").mkdir()
    save_file(dequantized, tmp_path / "deq" / "model.safetensors", metadata={"format": "pt"})
    config.pop("quantization_config")
    (tmp_path / "deq" / "config.json").write_text(json.dumps(config))
    hf_deq = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "deq", attn_implementation="eager").eval()
    ref_deq, _, _ = _hf_forward(hf_deq, ids)

    out = np.asarray(_forward(loaded, ids).logits)
    ERRORS["fp8_vs_dequantized_hf"] = _assert_close(out, ref_deq, "fp8 vs HF on dequantized weights")
    rel, mx = _rel(out, ref)
    ERRORS["fp8_vs_fp32"] = (rel, mx)
    print(
        f"[fp8] vs HF on dequantized weights: rel L2 {ERRORS['fp8_vs_dequantized_hf'][0]:.2e}; "
        f"vs the fp32 original: rel L2 {rel:.2e}, max abs {mx:.2e}"
    )
    # the FP8 rounding itself (~2-3% per weight, plus the routing flips it causes) against the fp32 model
    assert rel < 0.5, rel


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------


def test_missing_tensor_is_named(cases, tmp_path):
    case = cases("plain")
    key = "model.layers.2.mlp.experts.3.up_proj.weight"

    def edit(t):
        del t[key]

    path = _rewrite(case.path, tmp_path / "m", edit_tensors=edit)
    with pytest.raises(CheckpointError, match=re.escape(f"missing tensor '{key}' (expected shape (16, 32))")):
        from_pretrained(path)


def test_wrong_shape_is_named(cases, tmp_path):
    case = cases("plain")
    key = "model.layers.0.self_attn.kv_b_proj.weight"

    def edit(t):
        t[key] = torch.zeros(30, 16)

    path = _rewrite(case.path, tmp_path / "m", edit_tensors=edit)
    with pytest.raises(
        CheckpointError, match=re.escape(f"tensor '{key}' has shape (30, 16), expected (32, 16)")
    ):
        from_pretrained(path)


def test_unexpected_tensor_is_named(cases, tmp_path):
    case = cases("plain")

    def edit(t):
        t["model.layers.1.self_attn.q_proj.bias"] = torch.zeros(24)

    path = _rewrite(case.path, tmp_path / "m", edit_tensors=edit)
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor.*model\.layers\.1\.self_attn\.q_proj\.bias \(24,\)"
    ):
        from_pretrained(path)


def _hf_dict(**changes) -> dict:
    d = dict(BASE, model_type="deepseek_v3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    d.update(changes)
    return d


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(moe_layer_freq=2), "moe_layer_freq"),
        (dict(topk_method="group_limited_greedy"), "topk_method"),
        (dict(topk_method="sparse"), "topk_method"),
        (dict(scoring_func="sparsemixer"), "scoring_func"),
        (
            dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
            "rope_parameters.rope_type",  # Llama-3 scaling exists for GQA families, not for DeepSeek's MLA
        ),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type"),
        (
            dict(quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized"}),
            "quantization_config.quant_method",
        ),
        (
            dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]}),
            "quantization_config.weight_block_size",
        ),
        (
            dict(quantization_config={"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}),
            "quantization_config.fmt",
        ),
        (dict(model_type="mixtral"), "model_type: 'mixtral' is not supported; supported model_types: deepseek_v3,"),
    ],
)
def test_unsupported_config_values_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        config_from_hf(_hf_dict(**changes))


def test_kimi_k25_text_quantization_is_named():
    k25 = {
        "model_type": "kimi_k25",
        "vision_config": {"patch_size": 14},
        "text_config": _hf_dict(
            model_type="kimi_k2", quantization_config={"quant_method": "compressed-tensors"}
        ),
    }
    with pytest.raises(ConfigError, match=re.escape("text_config.quantization_config.quant_method")):
        config_from_hf(k25)


# ------------------------------------------------------------------------------------------------
# config mapping
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2.5", "tiny", "small"])
def test_config_round_trip(name):
    cfg = preset(name)
    hf = config_to_hf(cfg)
    back = config_from_hf(json.loads(json.dumps(hf)))
    model_fields = {
        f: getattr(cfg, f)
        for f in ModelConfig.__dataclass_fields__
        if f
        not in ("dtype", "param_dtype", "moe_impl", "moe_capacity_factors", "scan_layers", "remat_policy")
    }
    assert {f: getattr(back, f) for f in model_fields} == model_fields
    # transformers reads the same numbers
    hc = DeepseekV3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    assert hc.q_lora_rank == cfg.q_lora_rank and hc.n_group == cfg.n_group
    assert hc.num_nextn_predict_layers == cfg.num_nextn_predict_layers
    if cfg.rope_scaling is not None:
        assert hc.rope_parameters["rope_type"] == "yarn"
        assert hc.rope_parameters["factor"] == cfg.rope_scaling.factor
        assert hc.rope_parameters["mscale_all_dim"] == cfg.rope_scaling.mscale_all_dim


def test_real_world_configs_parse():
    """Field sets of the released DeepSeek-V3 and Kimi-K2 config.json files (values as published)."""
    v3 = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
        "aux_loss_alpha": 0.001,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "first_k_dense_replace": 3,
        "hidden_act": "silu",
        "hidden_size": 7168,
        "initializer_range": 0.02,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048,
        "moe_layer_freq": 1,
        "n_group": 8,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": 129280,
    }
    expected = preset("deepseek-v3")
    got = config_from_hf(v3)
    for f in (
        "hidden_size",
        "n_group",
        "topk_group",
        "first_k_dense_replace",
        "rope_scaling",
        "rope_theta",
        "num_nextn_predict_layers",
        "routed_scaling_factor",
        "max_position_embeddings",
        "vocab_size",
    ):
        assert getattr(got, f) == getattr(expected, f), f
    k2 = dict(
        copy.deepcopy(v3),
        model_type="kimi_k2",
        n_group=1,
        topk_group=1,
        n_routed_experts=384,
        num_attention_heads=64,
        num_key_value_heads=64,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,
        rope_theta=50000.0,
        num_nextn_predict_layers=0,
        vocab_size=163840,
        max_position_embeddings=131072,
        rope_scaling={
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
    )
    got = config_from_hf(k2)
    assert got.rope_scaling.beta_fast == got.rope_scaling.beta_slow == 1.0 and got.n_routed_experts == 384
