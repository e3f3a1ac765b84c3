"""from_pretrained.

Besides the layout `save_pretrained` writes (see `c2jax.models.hf.keys`), `from_pretrained` accepts HF's in-memory
fused expert layout (`mlp.experts.gate_up_proj` [E, 2I, d], `mlp.experts.down_proj` [E, d, I]), sharded
checkpoints (`model.safetensors.index.json`), the `kimi_k25` multimodal wrapper (`language_model.` prefixes;
vision tensors are skipped) and DeepSeek's FP8 release format (float8_e4m3fn weights with float32
`weight_scale_inv` over 128x128 blocks, dequantized on load).

Decisions worth knowing:
  * MTP: transformers' `DeepseekV3Config` defaults `num_nextn_predict_layers` to 1 while its
    `save_pretrained` never writes MTP tensors. With `mtp="auto"` (default) a checkpoint without
    `model.layers.{L}.*` therefore yields a model without MTP (and a warning); `mtp="require"` makes that an
    error; `mtp="drop"` skips MTP tensors that are present.
  * The per-MTP-layer copies of the embedding and output head (`model.layers.{L+j}.embed_tokens`,
    `.shared_head.head`) are not loaded: c2jax shares the trunk's (DeepSeek-V3 sec. 2.2). They are checked
    against the trunk's tensors (shape mismatch: error; value mismatch: warning). `save_pretrained` writes
    them, so DeepSeek-format consumers (vLLM, SGLang) find them.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from c2jax.models.hf.checkpoint import SafetensorsCheckpoint
from c2jax.models.hf.config import config_from_hf, text_config
from c2jax.models.hf.errors import CheckpointError
from c2jax.models.hf.keys import leaf_keys, load_slice
from c2jax.models.transformer import Transformer


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


def read_config_json(path: Path) -> dict:
    """config.json of a checkpoint directory, or a CheckpointError saying what is wrong with it."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: {'not a directory' if path.exists() else 'no such directory'} (a "
                              "Hugging Face checkpoint is a directory of config.json + safetensors)")
    config = path / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{path}: no config.json (a Hugging Face checkpoint directory holds config.json "
                              "and model.safetensors or model.safetensors.index.json)")
    try:
        hf = json.loads(config.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config}: a JSON {type(hf).__name__}, expected an object")
    return hf


def from_pretrained(
    path: str | os.PathLike,
    dtype: Any = None,
    *,
    mtp: str = "auto",
    sharding: Callable[[tuple[str, ...], nnx.Variable], Any] | None = None,
    **config_overrides: Any,
) -> Transformer:
    """Load a safetensors checkpoint of any supported family (DeepSeek-V3 / V2, Kimi-K2 / K2.5 text, Moonlight,
    Qwen3-MoE, Qwen3, Llama: models/hf/families/) into a `Transformer`.

    dtype: sets ModelConfig.dtype and .param_dtype together (default: the ModelConfig defaults, float32): a
        name ("bfloat16", "bf16"), a NumPy / jnp dtype (jnp.bfloat16) or a torch dtype;
        pass `param_dtype=...` as an override to store parameters differently from the compute dtype.
    mtp: "auto" (load MTP modules if the checkpoint has them, else build without and warn when config.json
        asked for them), "require" (missing MTP tensors are an error), "drop" (never load MTP).
    sharding: optional (state path, abstract variable) -> jax.sharding.Sharding for device placement.
    config_overrides: ModelConfig fields (e.g. moe_impl="dense", scan_layers=False).

    The model is built with `nnx.eval_shape` (no random init), then each leaf is assembled on the host from
    the memory-mapped checkpoint and transferred; host memory peaks at about one leaf (one stacked tensor).
    """
    path = Path(path)
    hf = read_config_json(path)
    if mtp not in ("auto", "require", "drop"):
        raise ValueError(f"mtp must be 'auto', 'require' or 'drop', got {mtp!r}")
    if dtype is not None:
        config_overrides = {"dtype": dtype, "param_dtype": dtype} | config_overrides
    if mtp == "auto" and config_overrides.get("num_nextn_predict_layers"):
        mtp = "require"
    cfg = config_from_hf(hf, **config_overrides)
    text, _ = text_config(hf)
    ckpt = SafetensorsCheckpoint(path, wrapper=hf.get("model_type") == "kimi_k25")

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
    # greedy DeepSeek checkpoints, and families without a selection bias, carry no e_score_correction_bias
    bias_optional = text.get("topk_method") == "greedy" or not cfg.has_router_bias

    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract)
    pure: dict = {}
    for leaf_path, variable in nnx.to_flat_state(state):
        leaf_path = tuple(str(p) for p in leaf_path)
        spec = variable.get_value()
        prefixes, rel, kind = leaf_keys(cfg, leaf_path)
        host = np.empty(spec.shape, spec.dtype)
        optional = bias_optional and rel.endswith("e_score_correction_bias")
        if prefixes is None:
            load_slice(ckpt, "", rel, kind, host, optional)
        else:
            for i, prefix in enumerate(prefixes):
                load_slice(ckpt, prefix, rel, kind, host[i], optional)
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


def _check_copy(ckpt: SafetensorsCheckpoint, copy: str, trunk: str) -> None:
    shape = ckpt.shape(trunk)
    a, b = ckpt.read(copy, shape), ckpt.read(trunk, shape)
    if not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)):
        diff = float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
        warnings.warn(
            f"{copy} differs from {trunk} (max |diff| {diff:.3g}); c2jax shares the trunk's tensor "
            "and ignores the copy",
            stacklevel=3,
        )
