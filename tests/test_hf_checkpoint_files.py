"""Damaged Hugging Face checkpoints: every kind of damage is a CheckpointError naming the file and the
problem (never a bare ValueError, MemoryError, struct.error or FileNotFoundError); non-finite weights load
with a CheckpointWarning naming the tensor. Also: dtype arguments in the forms JAX, NumPy and torch users
pass them."""

import json
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

from c2jax.models.config import ConfigError, ModelConfig, dtype_name, preset
from c2jax.models.hf import CheckpointError, CheckpointWarning, from_pretrained, save_pretrained
from c2jax.models.hf.safetensors_io import SafetensorsFile
from c2jax.models.transformer import init


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real (tiny) checkpoint written by save_pretrained; tests damage copies of it."""
    cfg = preset("tiny").replace(num_nextn_predict_layers=0)
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_pretrained(init(cfg, seed=0), path)
    return path


@pytest.fixture
def damaged(checkpoint, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(checkpoint, path)
    return path


def _header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path, header, data):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_truncated_file_is_named(damaged):
    st = damaged / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor .* run past the end .* truncated"):
        from_pretrained(damaged)


def test_random_bytes_are_not_a_safetensors_file(damaged):
    st = damaged / "model.safetensors"
    st.write_bytes(np.random.default_rng(0).bytes(4096))  # header length ~1e19: must not be allocated
    with pytest.raises(CheckpointError, match=r"model\.safetensors: header length \d+ exceeds"):
        from_pretrained(damaged)


def test_header_that_is_not_json(damaged):
    st = damaged / "model.safetensors"
    st.write_bytes(struct.pack("<Q", 16) + b"\xff" * 16 + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: header is not valid JSON"):
        from_pretrained(damaged)


@pytest.mark.parametrize("size", [0, 5])
def test_empty_or_tiny_file(damaged, size):
    (damaged / "model.safetensors").write_bytes(b"\0" * size)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: {size} bytes, too short"):
        from_pretrained(damaged)


def test_directory_without_config_json(damaged):
    (damaged / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"copy: no config\.json"):
        from_pretrained(damaged)
    with pytest.raises(CheckpointError, match="no such directory"):
        from_pretrained(damaged / "nowhere")
    (damaged / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        from_pretrained(damaged)


def test_shape_dtype_and_offsets_must_agree(damaged):
    st = damaged / "model.safetensors"
    header, data = _header(st)
    key = next(k for k in header if k != "__metadata__")
    bad = json.loads(json.dumps(header))
    bad[key]["shape"] = [d + 1 for d in bad[key]["shape"]]
    _write(st, bad, data)
    with pytest.raises(CheckpointError, match=rf"tensor '{key}': \d+ bytes for F32 of shape .*, expected \d+"):
        from_pretrained(damaged)
    bad = json.loads(json.dumps(header))
    bad[key]["data_offsets"] = [-4, 8]
    _write(st, bad, data)
    with pytest.raises(CheckpointError, match=rf"tensor '{key}': data_offsets must be"):
        from_pretrained(damaged)


def test_overlapping_tensors(tmp_path):
    path = tmp_path / "x.safetensors"
    _write(path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                  "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, b"\0" * 24)
    with pytest.raises(CheckpointError, match=r"x\.safetensors: tensors 'a' and 'b' overlap"):
        SafetensorsFile(path)


def test_index_naming_a_missing_shard(damaged):
    header, _ = _header(damaged / "model.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in header if k != "__metadata__"}
    (damaged / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"index\.json names shard file\(s\) not in .*model-00001"):
        from_pretrained(damaged)
    (damaged / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CheckpointError, match=r"index\.json: not a safetensors index"):
        from_pretrained(damaged)


def test_non_finite_weights_load_with_a_warning(damaged):
    st = damaged / "model.safetensors"
    header, data = _header(st)
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    begin, _ = header[key]["data_offsets"]
    data = bytearray(data)
    data[begin : begin + 8] = np.array([np.nan, np.inf], np.float32).tobytes()
    _write(st, header, bytes(data))
    with pytest.warns(CheckpointWarning, match=rf"tensor '{key}' holds 2 non-finite value"):
        model = from_pretrained(damaged)
    leaves = jax.tree.leaves(nnx.state(model))  # loaded as is, not refused
    assert sum(int(np.isnan(np.asarray(x)).sum()) for x in leaves) == 1
    assert sum(int(np.isinf(np.asarray(x)).sum()) for x in leaves) == 1


# ------------------------------------------------------------------------------------------------
# dtype arguments
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("given, name", [
    ("float32", "float32"), ("BF16", "bfloat16"), ("fp16", "float16"), (np.float32, "float32"),
    (np.dtype("float16"), "float16"), (jnp.bfloat16, "bfloat16"), (jnp.dtype("bfloat16"), "bfloat16"),
    (jnp.float32, "float32"), (ml_dtypes.bfloat16, "bfloat16"), (torch.bfloat16, "bfloat16"),
    (torch.float32, "float32"), ("torch.float16", "float16"),
])
def test_dtype_in_every_form_users_pass(given, name):
    assert dtype_name(given) == name
    cfg = ModelConfig(dtype=given, param_dtype=given)
    assert (cfg.dtype, cfg.param_dtype) == (name, name)
    assert cfg.replace(dtype="float32").param_dtype == name


@pytest.mark.parametrize("bad", ["float64", np.int32, torch.int8, 1.0, None, "bfloat17"])
def test_unsupported_dtype_names_the_field(bad):
    with pytest.raises(ConfigError, match="param_dtype must be"):
        ModelConfig(param_dtype=bad)


def test_from_pretrained_and_save_pretrained_take_dtype_objects(checkpoint, tmp_path):
    model = from_pretrained(checkpoint, dtype=jnp.bfloat16)
    assert (model.cfg.dtype, model.cfg.param_dtype) == ("bfloat16", "bfloat16")
    save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)
    header, _ = _header(tmp_path / "bf16" / "model.safetensors")
    assert {e["dtype"] for k, e in header.items() if k != "__metadata__"} <= {"BF16", "F32"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert from_pretrained(checkpoint, dtype=np.float32).cfg.dtype == "float32"
