"""save_pretrained: config.json + safetensors in DeepSeek's on-disk layout (see `c2jax.models.hf.keys`), optionally
in DeepSeek's FP8 release format; the MTP layers carry copies of the embedding and head, as DeepSeek-format
consumers (vLLM, SGLang) expect."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from c2jax.models.config import ModelConfig, dtype_name
from c2jax.models.hf.config import config_to_hf
from c2jax.models.hf.errors import CheckpointError
from c2jax.models.hf.fp8 import FP8_BLOCK, quantize_fp8_block
from c2jax.models.hf.keys import leaf_keys, save_slice
from c2jax.models.hf.safetensors_io import write_safetensors
from c2jax.models.transformer import Transformer

_FLOAT_DTYPES = (
    np.dtype(np.float64),
    np.dtype(np.float32),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
)


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", size.upper())
    if not match:
        raise ValueError(f"max_shard_size: cannot parse {size!r} (use bytes or e.g. '5GB', '500MiB')")
    number, unit = float(match.group(1)), match.group(2)
    base = 1024 if "I" in unit else 1000
    return int(number * base ** "BKMGT".index(unit[0]))


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
    dtype: Any = None,
    quantization: str | None = None,
) -> None:
    """Write config.json (of cfg.hf_model_type's family) + safetensors in the on-disk layout of
    `c2jax.models.hf.keys`.

    dtype: cast floating tensors ("bfloat16", jnp.bfloat16, torch.bfloat16...); the router correction bias
        stays float32.
    quantization: None, or "fp8" for DeepSeek's release format (e4m3 weights + 128x128 `weight_scale_inv`);
        `from_pretrained` dequantizes it. Used to exercise the FP8 path in tests.
    """
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
    cfg: ModelConfig = model.cfg
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = None if dtype is None else dtype_name(dtype)
    cast = None if dtype is None else np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    saved_dtype = dtype or cfg.param_dtype
    hf = config_to_hf(cfg, dtype=saved_dtype)  # first: a config its family cannot express writes nothing

    tensors: dict[str, np.ndarray] = {}
    for leaf_path, variable in nnx.to_flat_state(nnx.state(model)):
        leaf_path = tuple(str(p) for p in leaf_path)
        value = np.asarray(jax.device_get(variable.get_value()))
        prefixes, rel, kind = leaf_keys(cfg, leaf_path)
        if rel.endswith("e_score_correction_bias") and not cfg.has_router_bias:
            if np.any(value != 0):  # trained with router_bias_rate > 0: dropping it would change the routing
                raise CheckpointError(
                    f"{cfg.hf_model_type} checkpoints have no expert selection bias, but this model's is nonzero "
                    f"(max |b| {float(np.abs(value).max()):.3g}; trained with router_bias_rate > 0?): exporting would "
                    "change its routing. Train this family with loss.router_bias_rate 0 (and router_aux_loss), or "
                    "export as deepseek_v3")
            continue  # the family's checkpoints carry no selection bias (ours stays zero)
        slices = [("", value)] if prefixes is None else list(zip(prefixes, value, strict=True))
        for prefix, part in slices:
            for key, view in save_slice(prefix, rel, kind, part):
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
        write_safetensors(path / "model.safetensors", shards[0])
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(path / name, shard)
            for key, _, dt, shape in shard:
                weight_map[key] = name
                total += int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))

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
