"""Hugging Face interop: `config.json` <-> `ModelConfig` for every supported family (DeepSeek-V3 / V2, Kimi,
Moonlight, Qwen3-MoE, Qwen3, Llama), safetensors checkpoints <-> `Transformer`.

  config.py          config.json <-> ModelConfig (`config_from_hf`, `config_to_hf`), by family
  families/          one module per family: its config mapping, defaults, refusals
  keys.py            parameter <-> checkpoint key mapping; the on-disk layout
  load.py            `from_pretrained`: the formats it accepts, MTP handling
  save.py            `save_pretrained`
  checkpoint.py      reading a (possibly sharded, possibly wrapped) safetensors checkpoint
  safetensors_io.py  the safetensors reader/writer (numpy + ml_dtypes; memory-mapped reads)
  fp8.py             DeepSeek's FP8 block quantization
  errors.py          `CheckpointError`, `CheckpointWarning`
"""

from c2jax.models.hf.config import SUPPORTED_MODEL_TYPES, config_from_hf, config_to_hf
from c2jax.models.hf.errors import CheckpointError, CheckpointWarning
from c2jax.models.hf.fp8 import FP8_BLOCK, FP8_MAX, dequantize_fp8_block, quantize_fp8_block
from c2jax.models.hf.load import from_pretrained
from c2jax.models.hf.save import save_pretrained

__all__ = [
    "FP8_BLOCK",
    "FP8_MAX",
    "SUPPORTED_MODEL_TYPES",
    "CheckpointError",
    "CheckpointWarning",
    "config_from_hf",
    "config_to_hf",
    "dequantize_fp8_block",
    "from_pretrained",
    "quantize_fp8_block",
    "save_pretrained",
]
