"""Hugging Face interop: DeepSeek-V3 / Kimi-K2 `config.json` <-> `ModelConfig`, safetensors checkpoints
<-> `Transformer`.

On-disk layout (what `save_pretrained` writes; what DeepSeek-V3, Kimi-K2 and transformers 5.x write):

  model.embed_tokens.weight [V, d]     model.norm.weight [d]     lm_head.weight [V, d] (absent if tied)
  model.layers.{l}.input_layernorm.weight / post_attention_layernorm.weight
  model.layers.{l}.self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa,
      kv_a_layernorm, kv_b_proj, o_proj          torch Linear weights are [out, in]
  model.layers.{l}.mlp.{gate,up,down}_proj.weight                       l < first_k_dense_replace
  model.layers.{l}.mlp.gate.weight [E, d], mlp.gate.e_score_correction_bias [E] (float32)
  model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight           per-expert (DeepSeek layout)
  model.layers.{l}.mlp.shared_experts.{gate,up,down}_proj.weight
  model.layers.{L+j}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, embed_tokens} + a full
      MoE decoder layer                                                  MTP module j (L = num_hidden_layers)

`from_pretrained` also accepts HF's in-memory fused expert layout (`mlp.experts.gate_up_proj` [E, 2I, d],
`mlp.experts.down_proj` [E, d, I]), sharded checkpoints (`model.safetensors.index.json`), the `kimi_k25`
multimodal wrapper (`language_model.` prefixes; vision tensors are skipped) and DeepSeek's FP8 release format
(float8_e4m3fn weights with float32 `weight_scale_inv` over 128x128 blocks, dequantized on load).

Decisions worth knowing:
  * MTP: transformers' `DeepseekV3Config` defaults `num_nextn_predict_layers` to 1 while its
    `save_pretrained` never writes MTP tensors. With `mtp="auto"` (default) a checkpoint without
    `model.layers.{L}.*` therefore yields a model without MTP (and a warning); `mtp="require"` makes that an
    error; `mtp="drop"` skips MTP tensors that are present.
  * The per-MTP-layer copies of the embedding and output head (`model.layers.{L+j}.embed_tokens`,
    `.shared_head.head`) are not loaded: c2jax shares the trunk's (DeepSeek-V3 sec. 2.2). They are checked
    against the trunk's tensors (shape mismatch: error; value mismatch: warning). `save_pretrained` writes
    them, so DeepSeek-format consumers (vLLM, SGLang) find them.
  * config.json fields are read with transformers' DeepseekV3Config defaults for absent keys. Values c2jax
    cannot reproduce raise ConfigError naming the field (hidden_act != silu, attention_bias, dropout,
    moe_layer_freq != 1, topk_method other than noaux_tc / group-free greedy, rope types other than
    default / yarn, quantization other than fp8 e4m3 128x128). `num_key_value_heads` is ignored (MLA has
    none; transformers only uses it in its eager GQA path). `scoring_func="softmax"` is honoured as
    DeepSeek's reference code does, although transformers' DeepseekV3 always applies a sigmoid. A
    `topk_method="greedy"` checkpoint may omit `e_score_correction_bias` (zeros are used).
  * The safetensors reader/writer is our own (a few lines: 8-byte header size, JSON header, raw bytes) so that
    bfloat16 and float8 need neither torch nor the safetensors numpy backend; tensors are memory-mapped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from models.config import ConfigError, ModelConfig, RopeScaling
from models.transformer import Transformer

FP8_BLOCK = (128, 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, has an unexpected shape or dtype, or is not expected at all."""


# ================================================================================================
# config.json <-> ModelConfig
# ================================================================================================

# transformers' DeepseekV3Config defaults: the meaning of a field that a config.json leaves out.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "num_nextn_predict_layers": 1,
    "scoring_func": "sigmoid",
}

# HF field -> ModelConfig field, copied as is.
_DIRECT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "scoring_func",
    "first_k_dense_replace",
    "rope_interleave",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "initializer_range",
    "num_nextn_predict_layers",
)

# Fields read for validation only, or that carry no meaning for the forward pass.
_CHECKED_OR_IGNORED = {
    # validated below
    "hidden_act",
    "attention_bias",
    "attention_dropout",
    "moe_layer_freq",
    "topk_method",
    "quantization_config",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "num_mtp_layers",
    "model_type",
    "text_config",
    # derived by transformers from other fields (head_dim := qk_rope_head_dim, qk_head_dim := nope + rope)
    "head_dim",
    "qk_head_dim",
    # MLA has no separate KV heads; transformers only uses this in its eager GQA path
    "num_key_value_heads",
    # training-only or parallelism knobs of the reference implementations
    "aux_loss_alpha",
    "seq_aux",
    "ep_size",
    "pretraining_tp",
    "router_aux_loss_coef",
    "output_router_logits",
    # bookkeeping
    "architectures",
    "auto_map",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "_name_or_path",
    "name_or_path",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
    "_attn_implementation",
    "attn_implementation",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
}

_TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
_ROPE_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
    "partial_rotary_factor",
}


def _text_config(hf: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The language-model config and the prefix naming its fields in error messages."""
    model_type = hf.get("model_type")
    if model_type == "kimi_k25":
        text = hf.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError("text_config: a kimi_k25 config needs a text_config mapping")
        return text, "text_config."
    if model_type is not None and model_type not in _TEXT_MODEL_TYPES:
        raise ConfigError(
            f"model_type: {model_type!r} is not supported (expected one of {_TEXT_MODEL_TYPES} or 'kimi_k25')"
        )
    return hf, ""


def _quantization(hf: Mapping[str, Any]) -> dict[str, Any] | None:
    """The validated quantization_config (top level or, for kimi_k25, text_config), or None."""
    text, prefix = _text_config(hf)
    found = [
        (p, q)
        for p, q in (("", hf.get("quantization_config")), (prefix, text.get("quantization_config")))
        if q is not None
    ]
    if not found:
        return None
    where, q = found[-1]
    name = f"{where}quantization_config"
    if not isinstance(q, Mapping):
        raise ConfigError(f"{name}: expected a mapping, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(
            f"{name}.quant_method: only DeepSeek's 'fp8' (e4m3, 128x128 blocks) is supported, got {method!r}"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{name}.fmt: only 'e4m3' is supported, got {fmt!r}")
    block = q.get("weight_block_size")
    if block is None or list(block) != list(FP8_BLOCK):
        raise ConfigError(f"{name}.weight_block_size: only [128, 128] is supported, got {block!r}")
    return dict(q)


def _rope_from_hf(
    text: Mapping[str, Any], prefix: str, max_positions: int
) -> tuple[float, RopeScaling | None]:
    """(rope_theta, RopeScaling or None) with transformers 5.x semantics; accepts the v5 `rope_parameters`
    dict and the older `rope_scaling` + `rope_theta` pair (rope_scaling wins, as in transformers)."""
    if text.get("rope_scaling"):
        params, name = dict(text["rope_scaling"]), f"{prefix}rope_scaling"
    else:
        params, name = dict(text.get("rope_parameters") or {}), f"{prefix}rope_parameters"
    unknown = set(params) - _ROPE_KEYS
    if unknown:
        warnings.warn(f"{name}: ignoring unknown keys {sorted(unknown)}", stacklevel=3)
    theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"{name}.partial_rotary_factor: only 1.0 is supported, got {params['partial_rotary_factor']}"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ConfigError(f"{name}.rope_type: only 'default' and 'yarn' are supported, got {rope_type!r}")
    # transformers: a top-level original_max_position_embeddings wins; else the dict's; else max positions
    original = text.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    original = int(original if original is not None else max_positions)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    attention_factor = params.get("attention_factor")
    scaling = RopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),  # transformers: `get(...) or 32`
        beta_slow=float(params.get("beta_slow") or 1.0),
        # absent/None mscale means "not set" in transformers (attention factor = mscale(factor)); our rule
        # treats 0.0 the same way, so None maps to 0.0
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )
    return theta, scaling


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """`ModelConfig` from a `deepseek_v3`, `kimi_k2` or `kimi_k25` (wrapper) config.json dict.

    Values c2jax cannot reproduce raise `ConfigError` naming the field. `overrides` replace ModelConfig
    fields afterwards (execution settings such as dtype, moe_impl, scan_layers, or model fields).
    """
    text, prefix = _text_config(hf)
    if prefix:
        inner_type = text.get("model_type")
        if inner_type is not None and inner_type not in _TEXT_MODEL_TYPES:
            raise ConfigError(f"text_config.model_type: {inner_type!r} is not supported")

    def get(name):  # an absent field means transformers' default; null stays null (q_lora_rank)
        return text[name] if name in text else _HF_DEFAULTS.get(name)

    if get("hidden_act") not in (None, "silu"):
        raise ConfigError(f"{prefix}hidden_act: only 'silu' is supported, got {text['hidden_act']!r}")
    if text.get("attention_bias"):
        raise ConfigError(f"{prefix}attention_bias: biased attention projections are not supported")
    if text.get("attention_dropout"):
        raise ConfigError(
            f"{prefix}attention_dropout: only 0.0 is supported, got {text['attention_dropout']}"
        )
    if text.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"{prefix}moe_layer_freq: only 1 is supported, got {text['moe_layer_freq']}")
    n_group = int(get("n_group") or 1)
    topk_group = int(get("topk_group") or 1)
    topk_method = text.get("topk_method") or "noaux_tc"
    if topk_method == "greedy":
        if topk_group != n_group:
            raise ConfigError(
                f"{prefix}topk_method: 'greedy' ignores groups, which c2jax reproduces only with "
                f"topk_group == n_group (got n_group={n_group}, topk_group={topk_group})"
            )
    elif topk_method != "noaux_tc":
        raise ConfigError(
            f"{prefix}topk_method: only 'noaux_tc' and 'greedy' are supported, got {topk_method!r}"
        )
    _quantization(hf)

    fields = {name: get(name) for name in _DIRECT_FIELDS}
    fields["n_group"], fields["topk_group"] = n_group, topk_group
    if text.get("num_nextn_predict_layers") is None and text.get("num_mtp_layers") is not None:
        fields["num_nextn_predict_layers"] = text["num_mtp_layers"]
    fields["num_nextn_predict_layers"] = int(fields["num_nextn_predict_layers"] or 0)
    if fields["scoring_func"] not in ("sigmoid", "softmax"):
        raise ConfigError(
            f"{prefix}scoring_func: only 'sigmoid' and 'softmax' are supported, "
            f"got {fields['scoring_func']!r}"
        )
    fields["rope_theta"], fields["rope_scaling"] = _rope_from_hf(
        text, prefix, fields["max_position_embeddings"]
    )
    for name in ("routed_scaling_factor", "rms_norm_eps", "initializer_range"):
        fields[name] = float(fields[name])
    for name in ("norm_topk_prob", "rope_interleave", "tie_word_embeddings"):
        fields[name] = bool(fields[name])

    unknown = set(text) - set(_DIRECT_FIELDS) - _CHECKED_OR_IGNORED
    if unknown:
        warnings.warn(
            f"config.json: ignoring unknown fields {sorted(prefix + k for k in unknown)}", stacklevel=2
        )

    known = {f.name for f in dataclasses.fields(ModelConfig)}
    bad = set(overrides) - known
    if bad:
        raise ConfigError(f"unknown ModelConfig override(s) {sorted(bad)}")
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(cfg: ModelConfig, dtype: str | None = None) -> dict[str, Any]:
    """A `deepseek_v3` config.json dict that transformers (DeepseekV3ForCausalLM) and DeepSeek-format
    consumers read back to the same model. Execution-only fields (moe_impl, remat, ...) are not written."""
    rs = cfg.rope_scaling
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    rope_scaling = None
    if rs is not None:
        rope_scaling = {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast,
            "beta_slow": rs.beta_slow,
            "mscale": rs.mscale,
            "mscale_all_dim": rs.mscale_all_dim,
        }
        if not rs.truncate:
            rope_scaling["truncate"] = False
        if rs.attention_factor is not None:
            rope_scaling["attention_factor"] = rs.attention_factor
        rope_parameters = {k: v for k, v in rope_scaling.items() if k != "type"} | {
            "rope_theta": cfg.rope_theta
        }
    out = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **{name: getattr(cfg, name) for name in _DIRECT_FIELDS},
        "num_key_value_heads": cfg.num_attention_heads,
        "head_dim": cfg.qk_rope_head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "dtype": dtype or cfg.param_dtype,
        "torch_dtype": dtype or cfg.param_dtype,
    }
    return out


# ================================================================================================
# safetensors I/O (numpy + ml_dtypes; memory-mapped reads)
# ================================================================================================

_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}
_FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
_FLOAT_DTYPES = (
    np.dtype(np.float64),
    np.dtype(np.float32),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
)


class _SafetensorsFile:
    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries: dict[str, dict] = header
        self._start = 8 + size
        self._map = np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) > self._start else None

    def dtype(self, key: str) -> np.dtype:
        code = self.entries[key]["dtype"]
        if code not in _ST_DTYPES:
            raise CheckpointError(f"tensor {key!r} in {self.path.name}: unsupported dtype {code}")
        return _ST_DTYPES[code]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key]["shape"])

    def get(self, key: str) -> np.ndarray:
        entry = self.entries[key]
        begin, end = entry["data_offsets"]
        dtype, shape = self.dtype(key), tuple(entry["shape"])
        if end == begin:
            return np.zeros(shape, dtype)
        raw = self._map[self._start + begin : self._start + end]
        return raw.view(dtype).reshape(shape)


def _write_safetensors(
    path: Path,
    tensors: list[tuple[str, Callable[[], np.ndarray], np.dtype, tuple]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write (key, producer, dtype, shape) entries; producers run one at a time while writing."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for key, _, dtype, shape in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[key] = {
            "dtype": _ST_CODES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, produce, dtype, shape in tensors:
            array = np.ascontiguousarray(produce())
            if array.dtype != dtype or tuple(array.shape) != tuple(shape):
                raise AssertionError(f"{key}: produced {array.dtype}{array.shape}, planned {dtype}{shape}")
            f.write(array.tobytes())


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", size.upper())
    if not match:
        raise ValueError(f"max_shard_size: cannot parse {size!r} (use bytes or e.g. '5GB', '500MiB')")
    number, unit = float(match.group(1)), match.group(2)
    base = 1024 if "I" in unit else 1000
    return int(number * base ** "BKMGT".index(unit[0]))


# ================================================================================================
# FP8 (DeepSeek-V3 release format): float8_e4m3fn weights, float32 `weight_scale_inv` per 128x128 block
# ================================================================================================


def dequantize_fp8_block(
    q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = FP8_BLOCK
) -> np.ndarray:
    """W[i, j] = float(q[i, j]) * scale_inv[i // bm, j // bn]; scale_inv has ceil(m/bm) x ceil(n/bn) entries
    (the last block row/column may be partial)."""
    m, n = q.shape
    bm, bn = block
    expected = (math.ceil(m / bm), math.ceil(n / bn))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not cover a {q.shape} weight "
            f"in {bm}x{bn} blocks (expected {expected})"
        )
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), bm, axis=0), bn, axis=1)[:m, :n]
    return q.astype(np.float32) * scale


def quantize_fp8_block(w: np.ndarray, block: tuple[int, int] = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(q float8_e4m3fn, scale_inv float32) with per-block scale amax / 448 (round to nearest even)."""
    w = np.asarray(w, np.float32)
    m, n = w.shape
    bm, bn = block
    gm, gn = math.ceil(m / bm), math.ceil(n / bn)
    padded = np.zeros((gm * bm, gn * bn), np.float32)
    padded[:m, :n] = w
    amax = np.abs(padded.reshape(gm, bm, gn, bn)).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale_inv, bm, axis=0), bn, axis=1)[:m, :n]
    q = np.clip(w / full, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale_inv


# ================================================================================================
# checkpoint reading
# ================================================================================================

_SKIP_PREFIXES = (
    "vision_tower.",
    "mm_projector.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.mm_projector.",
    "model.multi_modal_projector.",
)


def _normalize_key(key: str, wrapper: bool) -> str | None:
    """Map a checkpoint key onto the DeepSeek text-model namespace; None: not part of the text model."""
    if re.search(r"\.rotary_emb\.inv_freq$", key):
        return None  # a buffer some old checkpoints saved
    if wrapper:
        if key.startswith(_SKIP_PREFIXES):
            return None
        for old, new in (
            ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."),
        ):
            if key.startswith(old):
                return new + key[len(old) :]
    return key


class _Checkpoint:
    """All tensors of a (possibly sharded) safetensors checkpoint, by normalized key; tracks what was read."""

    def __init__(self, path: Path, wrapper: bool):
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        elif (path / "model.safetensors").exists():
            names = ["model.safetensors"]
        else:
            raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")
        self.files: dict[str, tuple[_SafetensorsFile, str]] = {}
        for name in names:
            file = _SafetensorsFile(path / name)
            for raw in file.entries:
                key = _normalize_key(raw, wrapper)
                if key is None:
                    continue
                if key in self.files:
                    raise CheckpointError(f"tensor {key!r} appears twice ({raw!r} in {name})")
                self.files[key] = (file, raw)
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def keys(self) -> set[str]:
        return set(self.files)

    def shape(self, key: str) -> tuple[int, ...]:
        file, raw = self.files[key]
        return file.shape(raw)

    def read(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor (dequantized if it is FP8 with a scale), after checking it exists with this shape."""
        if key not in self.files:
            raise CheckpointError(f"missing tensor {key!r} (expected shape {tuple(shape)})")
        file, raw = self.files[key]
        if file.shape(raw) != tuple(shape):
            raise CheckpointError(f"tensor {key!r} has shape {file.shape(raw)}, expected {tuple(shape)}")
        array = file.get(raw)
        self.used.add(key)
        scale_key = key + "_scale_inv"
        if scale_key in self.files:
            if array.dtype != np.dtype(ml_dtypes.float8_e4m3fn) or array.ndim != 2:
                raise CheckpointError(
                    f"tensor {key!r} has a {scale_key!r} but is {array.dtype}{array.shape}, "
                    "expected a 2-D float8_e4m3fn weight"
                )
            scale_file, scale_raw = self.files[scale_key]
            expected = tuple(math.ceil(d / b) for d, b in zip(shape, FP8_BLOCK, strict=True))
            if scale_file.shape(scale_raw) != expected:
                raise CheckpointError(
                    f"tensor {scale_key!r} has shape {scale_file.shape(scale_raw)}, expected "
                    f"{expected} (128x128 blocks of {tuple(shape)})"
                )
            self.used.add(scale_key)
            return dequantize_fp8_block(array, scale_file.get(scale_raw))
        if array.dtype in _FP8_DTYPES:
            raise CheckpointError(f"tensor {key!r} is {array.dtype} but has no {scale_key!r}")
        return array


# ================================================================================================
# parameter <-> checkpoint key mapping
# ================================================================================================


def _layer_entry(rel: tuple[str, ...], moe: bool) -> tuple[str, Any]:
    """(key relative to `model.layers.{l}.`, kind) for a parameter path inside a DecoderLayer."""
    name = ".".join(rel)
    if moe and name == "mlp.gate_up_proj":
        return "mlp.experts", "experts_gate_up"
    if moe and name == "mlp.down_proj":
        return "mlp.experts", "experts_down"
    if name == "mlp.e_score_correction_bias":
        return "mlp.gate.e_score_correction_bias", "copy"
    if rel[-1] == "weight":  # RMSNorm scales
        return name, "copy"
    return name + ".weight", ("linear", 2 if rel[-1] == "o_proj" else 1)


def _entry(cfg: ModelConfig, path: tuple[str, ...]) -> tuple[list[str] | None, str, Any]:
    """(per-slice key prefixes, or None for an unstacked leaf; relative key; kind) of a state leaf."""
    head, rel = path[0], path[1:]
    if head == "embed_tokens":
        return None, "model.embed_tokens.weight", "copy"
    if head == "norm":
        return None, "model.norm.weight", "copy"
    if head == "lm_head":
        return None, "lm_head.weight", ("linear", 1)
    if head == "dense_layers":
        prefixes = [f"model.layers.{i}." for i in range(cfg.num_dense_layers)]
        return (prefixes, *_layer_entry(rel, moe=False))
    if head == "moe_layers":
        prefixes = [f"model.layers.{cfg.first_k_dense_replace + i}." for i in range(cfg.num_moe_layers)]
        return (prefixes, *_layer_entry(rel, moe=True))
    if head == "mtp":
        prefixes = [f"model.layers.{cfg.num_hidden_layers + j}." for j in range(cfg.num_nextn_predict_layers)]
        if rel[0] == "block":
            return (prefixes, *_layer_entry(rel[1:], moe=True))
        if rel == ("eh_proj",):
            return prefixes, "eh_proj.weight", ("linear", 1)
        if rel == ("norm", "weight"):
            return prefixes, "shared_head.norm.weight", "copy"
        if rel in (("enorm", "weight"), ("hnorm", "weight")):
            return prefixes, ".".join(rel), "copy"
    raise ValueError(f"no checkpoint mapping for model state {'.'.join(path)}")


def _linear_split(shape: tuple[int, ...], n_in: int) -> tuple[int, int]:
    return int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))


def _load_slice(
    ckpt: _Checkpoint, prefix: str, rel: str, kind: Any, out: np.ndarray, optional_zero: bool
) -> None:
    """Fill `out` (one layer's slice of a leaf, our layout) from the checkpoint."""
    key = prefix + rel
    if kind == "copy":
        if optional_zero and key not in ckpt:
            out[...] = 0
            return
        out[...] = ckpt.read(key, out.shape)
    elif kind[0] == "linear":
        n_in, n_out = _linear_split(out.shape, kind[1])
        out[...] = ckpt.read(key, (n_out, n_in)).T.reshape(out.shape)
    elif kind in ("experts_gate_up", "experts_down"):
        num_experts, rows, cols = out.shape  # gate_up: [E, d, 2f]; down: [E, f, d]
        fused = f"{key}.{'gate_up_proj' if kind == 'experts_gate_up' else 'down_proj'}"
        if fused in ckpt:  # transformers' in-memory layout: [E, 2f, d] / [E, d, f]
            out[...] = ckpt.read(fused, (num_experts, cols, rows)).transpose(0, 2, 1)
            return
        for e in range(num_experts):
            if kind == "experts_gate_up":
                f = cols // 2
                out[e, :, :f] = ckpt.read(f"{key}.{e}.gate_proj.weight", (f, rows)).T
                out[e, :, f:] = ckpt.read(f"{key}.{e}.up_proj.weight", (f, rows)).T
            else:
                out[e] = ckpt.read(f"{key}.{e}.down_proj.weight", (cols, rows)).T
    else:
        raise AssertionError(kind)


def _save_slice(prefix: str, rel: str, kind: Any, value: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(key, view) pairs of one layer's slice of a leaf, in the DeepSeek on-disk layout."""
    key = prefix + rel
    if kind == "copy":
        yield key, value
    elif kind[0] == "linear":
        n_in, n_out = _linear_split(value.shape, kind[1])
        yield key, value.reshape(n_in, n_out).T
    elif kind == "experts_gate_up":
        f = value.shape[2] // 2
        for e in range(value.shape[0]):
            yield f"{key}.{e}.gate_proj.weight", value[e, :, :f].T
            yield f"{key}.{e}.up_proj.weight", value[e, :, f:].T
    elif kind == "experts_down":
        for e in range(value.shape[0]):
            yield f"{key}.{e}.down_proj.weight", value[e].T
    else:
        raise AssertionError(kind)


# ================================================================================================
# from_pretrained
# ================================================================================================


def _set_nested(tree: dict, path: tuple, value) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def _mtp_depth_present(keys: set[str], num_layers: int) -> int:
    indices = {int(m.group(1)) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    depth = 0
    while num_layers + depth in indices:
        depth += 1
    return depth


def from_pretrained(
    path: str | os.PathLike,
    dtype: str | None = None,
    *,
    mtp: str = "auto",
    sharding: Callable[[tuple[str, ...], nnx.Variable], Any] | None = None,
    **config_overrides: Any,
) -> Transformer:
    """Load a DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 (text) safetensors checkpoint into a `Transformer`.

    dtype: sets ModelConfig.dtype and .param_dtype together (default: the ModelConfig defaults, float32);
        pass `param_dtype=...` as an override to store parameters differently from the compute dtype.
    mtp: "auto" (load MTP modules if the checkpoint has them, else build without and warn when config.json
        asked for them), "require" (missing MTP tensors are an error), "drop" (never load MTP).
    sharding: optional (state path, abstract variable) -> jax.sharding.Sharding for device placement.
    config_overrides: ModelConfig fields (e.g. moe_impl="dense", scan_layers=False).

    The model is built with `nnx.eval_shape` (no random init), then each leaf is assembled on the host from
    the memory-mapped checkpoint and transferred; host memory peaks at about one leaf (one stacked tensor).
    """
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    if mtp not in ("auto", "require", "drop"):
        raise ValueError(f"mtp must be 'auto', 'require' or 'drop', got {mtp!r}")
    if dtype is not None:
        config_overrides = {"dtype": dtype, "param_dtype": dtype} | config_overrides
    if mtp == "auto" and config_overrides.get("num_nextn_predict_layers"):
        mtp = "require"
    cfg = config_from_hf(hf, **config_overrides)
    text, _ = _text_config(hf)
    ckpt = _Checkpoint(path, wrapper=hf.get("model_type") == "kimi_k25")

    num_layers = cfg.num_hidden_layers
    present = _mtp_depth_present(ckpt.keys(), num_layers)
    configured = cfg.num_nextn_predict_layers
    if mtp == "drop":
        cfg = cfg.replace(num_nextn_predict_layers=0)
    elif mtp == "auto" and cfg.num_nextn_predict_layers and not present:
        warnings.warn(
            f"config.json sets num_nextn_predict_layers={cfg.num_nextn_predict_layers} but the checkpoint "
            f"has no MTP tensors (model.layers.{num_layers}.*); building the model without MTP modules",
            stacklevel=2,
        )
        cfg = cfg.replace(num_nextn_predict_layers=0)
    elif present and present != cfg.num_nextn_predict_layers and cfg.num_nextn_predict_layers:
        raise CheckpointError(
            f"config.json sets num_nextn_predict_layers={cfg.num_nextn_predict_layers} but the "
            f"checkpoint holds {present} MTP layer(s) from model.layers.{num_layers}"
        )
    depth = cfg.num_nextn_predict_layers
    bias_optional = text.get("topk_method") == "greedy"  # greedy checkpoints carry no correction bias

    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract)
    pure: dict = {}
    for leaf_path, variable in nnx.to_flat_state(state):
        leaf_path = tuple(str(p) for p in leaf_path)
        spec = variable.get_value()
        prefixes, rel, kind = _entry(cfg, leaf_path)
        host = np.empty(spec.shape, spec.dtype)
        optional = bias_optional and rel.endswith("e_score_correction_bias")
        if prefixes is None:
            _load_slice(ckpt, "", rel, kind, host, optional)
        else:
            for i, prefix in enumerate(prefixes):
                _load_slice(ckpt, prefix, rel, kind, host[i], optional)
        target = sharding(leaf_path, variable) if sharding is not None else None
        _set_nested(
            pure, leaf_path, jax.device_put(host, target) if target is not None else jnp.asarray(host)
        )
        del host

    # the MTP modules' copies of the shared embedding / head: checked, not loaded
    for j in range(depth):
        prefix = f"model.layers.{num_layers + j}."
        for copy, trunk in (
            ("embed_tokens.weight", "model.embed_tokens.weight"),
            (
                "shared_head.head.weight",
                "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight",
            ),
        ):
            if prefix + copy in ckpt:
                _check_copy(ckpt, prefix + copy, trunk)
    if cfg.tie_word_embeddings and "lm_head.weight" in ckpt:
        _check_copy(ckpt, "lm_head.weight", "model.embed_tokens.weight")

    # MTP tensors beyond the loaded depth: skipped on request (mtp="drop") or when config.json asks for no
    # MTP (as transformers does); anything else is unexpected
    ignored = set()
    if mtp == "drop" or not configured:
        ignored = {
            k
            for k in ckpt.keys()
            if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m.group(1)) >= num_layers
        }
    if ignored and mtp != "drop":
        warnings.warn(
            f"ignoring {len(ignored)} MTP tensors (model.layers.{num_layers}.*): config.json sets "
            "num_nextn_predict_layers=0",
            stacklevel=2,
        )
    unexpected = sorted(ckpt.keys() - ckpt.used - ignored)
    if unexpected:
        shown = ", ".join(f"{k} {ckpt.shape(k)}" for k in unexpected[:10])
        more = f" (and {len(unexpected) - 10} more)" if len(unexpected) > 10 else ""
        raise CheckpointError(f"unexpected tensor(s) in checkpoint not used by the model: {shown}{more}")

    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _check_copy(ckpt: _Checkpoint, copy: str, trunk: str) -> None:
    shape = ckpt.shape(trunk)
    a, b = ckpt.read(copy, shape), ckpt.read(trunk, shape)
    if not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)):
        diff = float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
        warnings.warn(
            f"{copy} differs from {trunk} (max |diff| {diff:.3g}); c2jax shares the trunk's tensor "
            "and ignores the copy",
            stacklevel=3,
        )


# ================================================================================================
# save_pretrained
# ================================================================================================


def _fp8_quantized(key: str) -> bool:
    """Which weights DeepSeek's FP8 release stores in float8: every Linear inside decoder layers except the
    router (`mlp.gate`), the MTP projections (`eh_proj`) and heads; never embeddings, norms, biases."""
    if not key.startswith("model.layers.") or not key.endswith(".weight"):
        return False
    if key.endswith("norm.weight") or ".mlp.gate.weight" in key:
        return False
    return not any(s in key for s in (".eh_proj.", ".shared_head.", ".embed_tokens."))


def save_pretrained(
    model: Transformer,
    path: str | os.PathLike,
    max_shard_size: int | str = "5GB",
    dtype: str | None = None,
    quantization: str | None = None,
) -> None:
    """Write config.json + safetensors in DeepSeek's on-disk layout (see the module docstring).

    dtype: cast floating tensors (e.g. "bfloat16"); the router correction bias stays float32.
    quantization: None, or "fp8" for DeepSeek's release format (e4m3 weights + 128x128 `weight_scale_inv`);
        `from_pretrained` dequantizes it. Used to exercise the FP8 path in tests.
    """
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    cfg: ModelConfig = model.cfg
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cast = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else (np.dtype(dtype) if dtype else None)

    tensors: dict[str, np.ndarray] = {}
    for leaf_path, variable in nnx.to_flat_state(nnx.state(model)):
        leaf_path = tuple(str(p) for p in leaf_path)
        value = np.asarray(jax.device_get(variable.get_value()))
        prefixes, rel, kind = _entry(cfg, leaf_path)
        slices = [("", value)] if prefixes is None else list(zip(prefixes, value, strict=True))
        for prefix, part in slices:
            for key, view in _save_slice(prefix, rel, kind, part):
                tensors[key] = view
    for j in range(cfg.num_nextn_predict_layers):  # DeepSeek format: each MTP layer carries embed/head copies
        prefix = f"model.layers.{cfg.num_hidden_layers + j}."
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        tensors[prefix + "shared_head.head.weight"] = tensors.get(
            "lm_head.weight", tensors["model.embed_tokens.weight"]
        )

    plan: list[tuple[str, Callable[[], np.ndarray], np.dtype, tuple]] = []
    for key in sorted(tensors, key=_key_order):
        view = tensors[key]
        target = cast if cast is not None and view.dtype in _FLOAT_DTYPES else view.dtype
        if key.endswith("e_score_correction_bias"):
            target = np.dtype(np.float32)
        if quantization == "fp8" and _fp8_quantized(key):
            memo: dict[str, tuple[np.ndarray, np.ndarray]] = {}

            def quantized(view=view, memo=memo):
                if "q" not in memo:
                    memo["q"] = quantize_fp8_block(np.asarray(view, np.float32))
                return memo["q"]

            scale_shape = tuple(math.ceil(d / b) for d, b in zip(view.shape, FP8_BLOCK, strict=True))
            plan.append((key, lambda f=quantized: f()[0], np.dtype(ml_dtypes.float8_e4m3fn), view.shape))
            plan.append((key + "_scale_inv", lambda f=quantized: f()[1], np.dtype(np.float32), scale_shape))
        else:
            plan.append(
                (key, lambda v=view, t=target: np.asarray(v).astype(t, copy=False), target, view.shape)
            )

    limit = _parse_size(max_shard_size)
    shards: list[list] = [[]]
    size = 0
    for entry in plan:
        nbytes = int(np.prod(entry[3], dtype=np.int64)) * entry[2].itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    for stale in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        stale.unlink()
    if len(shards) == 1:
        _write_safetensors(path / "model.safetensors", shards[0])
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_safetensors(path / name, shard)
            for key, _, dt, shape in shard:
                weight_map[key] = name
                total += int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))

    saved_dtype = dtype or cfg.param_dtype
    hf = config_to_hf(cfg, dtype=saved_dtype)
    if quantization == "fp8":
        hf["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(FP8_BLOCK),
        }
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def _key_order(key: str):
    """Checkpoint order: embeddings, layers by index (MTP last), final norm, head."""
    m = re.match(r"model\.layers\.(\d+)\.(.*)", key)
    if m:
        return (1, int(m.group(1)), m.group(2))
    return (0 if key.startswith("model.embed") else 2, 0, key)


__all__ = [
    "CheckpointError",
    "config_from_hf",
    "config_to_hf",
    "dequantize_fp8_block",
    "from_pretrained",
    "quantize_fp8_block",
    "save_pretrained",
]
