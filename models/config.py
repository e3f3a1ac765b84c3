"""Model configuration: one frozen dataclass, field names follow Hugging Face's DeepseekV3Config.

Keeping Hugging Face's names means a `config.json` maps onto `ModelConfig` field by field
(see `c2jax.models.hf`), and a reader who knows the HF model knows this one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# "auto": the path `models.moe_dispatch.moe_path` picks for the device (grouped where the kernel registry has a
# device kernel for the grouped GEMM, i.e. on GPUs; sorted elsewhere); the others name one path
MOE_IMPLS = ("auto", "sorted", "ragged", "dense", "grouped")
MOE_EP_IMPLS = ("allgather", "ragged_a2a")
# c2jax.kernels.qlinear.RECIPES (kept literal here so the config imports nothing; tests check the two agree)
MOE_QUANT_RECIPES = ("bf16", "mxfp8", "nvfp4_per_token_fwd+mxfp8_bwd", "nvfp4_per_tensor_fwd+mxfp8_bwd",
                     "mxfp8_floor", "fp8_deepseek")
MOE_QUANT_DIVISIONS = ("ieee", "approx")
# the recipes moe_impl="grouped" runs (c2jax.kernels.grouped_qlinear: the fused permute + MXFP8 quantize and the
# block-scaled grouped GEMM; Composer 2's NVFP4 per-token forward, its straight-through masks recomputed in the
# MXFP8 backward); the others (FLOOR MXFP8, per-tensor NVFP4, DeepSeek FP8) run on moe_impl="sorted"
MOE_QUANT_GROUPED = ("bf16", "mxfp8", "nvfp4_per_token_fwd+mxfp8_bwd")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "save_attn_out", "save_attn_kernel")
SCORING_FUNCS = ("sigmoid", "softmax")
# "mla": DeepSeek-V2/V3 multi-head latent attention; "gqa": grouped-query attention (Llama, Qwen3; MHA when
# num_key_value_heads == num_attention_heads, MQA when it is 1)
ATTENTION_TYPES = ("mla", "gqa")
# expert selection: "noaux_tc" (DeepSeek-V3: groups ranked by the sum of their top-2 biased scores),
# "group_limited_greedy" (DeepSeek-V2: groups ranked by their best score), "greedy" (top-k over all experts)
TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")
ROPE_SCALING_TYPES = ("yarn", "llama3", "linear")
# the Hugging Face model_type a ModelConfig exports as (models/hf/families/); also what `from_pretrained` read
HF_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "qwen3_moe", "qwen3", "llama")  # Kimi K2 / K2.5: deepseek_v3
DTYPES = ("float32", "bfloat16", "float16")
# Short names researchers type; the canonical name is what configs store and YAML shows.
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "float": "float32", "bf16": "bfloat16",
                  "fp16": "float16", "f16": "float16", "half": "float16"}


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or inconsistent. The message names the field."""


def dtype_name(value, *, field: str = "dtype", allowed: tuple[str, ...] = DTYPES) -> str:
    """The canonical name ("float32", "bfloat16", "float16") of a dtype given as JAX, Flax and Hugging Face
    users give it: a name or alias ("bfloat16", "bf16"), a NumPy / ml_dtypes / jnp dtype or scalar type
    (np.float32, jnp.bfloat16, jnp.dtype("float16")), or a torch dtype (torch.bfloat16, named only, so
    torch need not be installed). Anything else is a ConfigError naming `field`."""
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.").removeprefix("jnp.").removeprefix("np.")
        name = _DTYPE_ALIASES.get(name, name)
    elif type(value).__module__ == "torch":  # torch.dtype: str() is "torch.bfloat16"
        name = str(value).removeprefix("torch.")
    else:
        import numpy as np  # local: this module imports nothing heavy at import time

        try:
            name = np.dtype(value).name
        except TypeError:
            name = None
        if name is None or isinstance(value, bool | int | float):  # np.dtype(1.0) etc. are not dtypes
            raise ConfigError(f"{field} must be a dtype or its name, one of {allowed}, got {value!r}") from None
    if name not in allowed:
        raise ConfigError(f"{field} must be one of {allowed} (or a matching NumPy/JAX/torch dtype), "
                          f"got {value!r}")
    return name


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as in HF's `rope_scaling` / `rope_parameters`: YaRN (type "yarn", Peng et al. 2023;
    DeepSeek-V3, Kimi, Qwen3 long context), Llama 3's ("llama3": low/high_freq_factor over the original
    context) or position interpolation ("linear", Chen et al. 2023: every frequency divided by `factor`)."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True  # floor/ceil the YaRN correction range, as HF does by default
    attention_factor: float | None = None  # cos/sin scale; None: derived from mscale (HF rule)
    type: str = "yarn"
    # llama3 only: wavelengths above original / low_freq_factor are interpolated by `factor`, below
    # original / high_freq_factor kept, smoothly blended between
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self):
        if self.type not in ROPE_SCALING_TYPES:
            raise ConfigError(f"rope_scaling.type must be one of {ROPE_SCALING_TYPES}, got {self.type!r}")
        if self.type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"rope_scaling: llama3 needs 0 < low_freq_factor < high_freq_factor, got "
                              f"{self.low_freq_factor}, {self.high_freq_factor}")
        if self.factor < 1.0:
            raise ConfigError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError("rope_scaling.original_max_position_embeddings must be positive")
        # beta_fast == beta_slow is legal (Kimi K2 ships 1.0/1.0): the ramp degenerates to a step, as in HF
        if self.beta_fast < self.beta_slow:
            raise ConfigError(
                f"rope_scaling.beta_fast ({self.beta_fast}) must be >= beta_slow ({self.beta_slow})"
            )


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: DeepSeek-V3 / Kimi-K2-shaped (MLA attention, sigmoid-routed MoE with shared
    experts, MTP) by default; the same fields describe DeepSeek-V2 (softmax routing), Qwen3-MoE and the dense
    GQA families (Qwen3, Llama: `attention_type="gqa"`, every layer dense). docs/models.md lists the families."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128  # dense SwiGLU width (first_k_dense_replace layers)
    moe_intermediate_size: int = 32  # width of one routed / shared expert
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    attention_type: str = "mla"
    # GQA (attention_type="gqa"): K/V heads (None: num_attention_heads), the head width (None: hidden / heads;
    # Qwen3 sets 128 whatever the width), per-head RMSNorm of q and k before RoPE (Qwen3)
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    qk_norm: bool = False
    # biased projections (HF names): attention_bias on q/k/v/o_proj (GQA only), mlp_bias on the dense SwiGLU
    # MLP's gate/up/down_proj (Llama's LlamaMLP; routed and shared experts stay bias-free)
    attention_bias: bool = False
    mlp_bias: bool = False
    # MLA
    q_lora_rank: int | None = None  # None: direct q projection
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    # MoE
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 1  # layers [0, k) dense SwiGLU, the rest MoE (every layer dense: k = layers)
    # position / norms / head
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    num_nextn_predict_layers: int = 0  # DeepSeek-V3 multi-token-prediction modules
    hf_model_type: str = "deepseek_v3"  # the Hugging Face family `save_pretrained` writes (HF_MODEL_TYPES)
    # execution (not part of the HF format)
    dtype: str = "float32"  # compute dtype of activations and matmuls
    param_dtype: str = "float32"  # storage dtype of parameters (fp32 master weights)
    moe_impl: str = "auto"  # "auto": grouped on devices with a grouped-GEMM kernel (GPUs), else sorted
    # (models.moe_dispatch.moe_path; a run's resolved config names the path it ran); "sorted": sort +
    # capacity-bucketed einsum (fast, dropless); "ragged": jax.lax.ragged_dot; "dense": every expert on every token
    # (oracle); "grouped": the kernel registry's grouped GEMM (kernels/grouped_gemm.py: Pallas Triton / Mosaic GPU on
    # GPUs, XLA on CPU)
    # the "grouped" path's implementation (kernels.grouped_gemm; None: the registry's first for the device kind,
    # $C2JAX_KERNEL_IMPL overrides; a GPU kernel named on CPU runs in Pallas' interpreter)
    moe_kernel: str | None = None
    # capacity buckets of moe_impl="sorted" (x the balanced load; T is always appended, so nothing drops).
    # 1.5 is there because a randomly initialised router already loads its busiest expert ~1.35x.
    moe_capacity_factors: tuple[float, ...] = (1.25, 1.5, 2.0)
    # moe_impl="sorted" dispatches at most this many tokens at a time (a lax.scan over chunks; 0: all at
    # once). Its [E, C, .] buffers scale with the tokens dispatched together: at 32k tokens of `small`
    # they were most of a training step's temporaries (docs/attention.md). 4096 keeps the common
    # T <= 4096 shapes on the single-dispatch path.
    moe_chunk_tokens: int = 4096
    # moe_impl="sorted": the overflow bucket (C = T, taken when an expert gets more than the largest factor x its
    # share) runs one expert at a time when its [E, T, 2f] buffer would exceed this many bytes, and as one batched
    # einsum otherwise. Looping bounds a training step's memory; at decode sizes (T = 16 at `small`) the loop
    # cost ~2x the einsum. 0: always loop.
    moe_overflow_loop_bytes: int = 32 << 20
    # the fused LM head + cross-entropy computes logits for at most this many tokens at a time and
    # recomputes them in its backward (0: never chunk; None: auto, [chunk, V] fp32 logits <= 256 MiB,
    # so T x V above that is chunked and below it runs in one pass that keeps its logits)
    loss_chunk_tokens: int | None = None
    # token exchange under expert parallelism (models/expert_parallel.py): "allgather" runs everywhere;
    # "ragged_a2a" (jax.lax.ragged_all_to_all) needs a GPU/TPU, XLA:CPU does not implement it
    moe_ep_impl: str = "allgather"
    # low-precision recipe of the routed-expert GEMMs (fprop, dgrad, wgrad) of moe_impl="sorted" (kernels/qlinear.py,
    # fake-quantized) and, for MOE_QUANT_GROUPED, of moe_impl="grouped" (kernels/grouped_qlinear.py: the FP8
    # kernels; docs/kernels.md); "bf16" quantizes nothing and runs the plain einsums
    moe_quant: str = "bf16"
    # division in the quantizers: "ieee" or "approx" (reciprocal-multiply; Composer 2's NVFP4 ablation)
    moe_quant_division: str = "ieee"
    scan_layers: bool = True
    remat_policy: str = "none"
    # router replay plausibility filter (Composer 2 sec. 5): a replayed expert whose live gating score is
    # below this ratio x the weakest score of the trainer's own top-k is replaced; 0 keeps every replayed id
    router_replay_filter_ratio: float = 0.0

    def __post_init__(self):
        def positive(name):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
            "n_group", "topk_group", "max_position_embeddings",
        ):
            positive(name)
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                f"({self.n_routed_experts})"
            )
        if self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts})"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        experts_per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and experts_per_group < 2 and self.topk_method == "noaux_tc":
            raise ConfigError("n_group > 1 needs at least 2 experts per group (group score = top-2 sum)")
        if self.topk_group * experts_per_group < self.num_experts_per_tok:
            raise ConfigError(
                f"topk_group ({self.topk_group}) groups of {experts_per_group} experts cannot hold "
                f"num_experts_per_tok ({self.num_experts_per_tok}) experts"
            )
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace ({self.first_k_dense_replace}) must be in "
                f"[0, num_hidden_layers={self.num_hidden_layers}]"
            )
        if self.n_shared_experts < 0:
            raise ConfigError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.num_nextn_predict_layers < 0:
            raise ConfigError(f"num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}")
        if self.attention_type not in ATTENTION_TYPES:
            raise ConfigError(f"attention_type must be one of {ATTENTION_TYPES}, got {self.attention_type!r}")
        if self.topk_method not in TOPK_METHODS:
            raise ConfigError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.hf_model_type not in HF_MODEL_TYPES:
            raise ConfigError(f"hf_model_type must be one of {HF_MODEL_TYPES}, got {self.hf_model_type!r}")
        for name in ("num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"{name} must be a positive integer or null, got {value!r}")
        for name in ("attention_bias", "mlp_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.attention_bias and self.attention_type == "mla":
            raise ConfigError("attention_bias: biased projections are supported for GQA attention only, not MLA")
        if self.attention_type == "gqa":
            if self.num_attention_heads % self.kv_heads:
                raise ConfigError(f"num_key_value_heads ({self.kv_heads}) must divide num_attention_heads "
                                  f"({self.num_attention_heads})")
            if self.head_dim is None and self.hidden_size % self.num_attention_heads:
                raise ConfigError(f"head_dim is null, so hidden_size ({self.hidden_size}) must be a multiple of "
                                  f"num_attention_heads ({self.num_attention_heads}); or set head_dim")
            if self.gqa_head_dim % 2:
                raise ConfigError(f"head_dim must be even (RoPE rotates pairs), got {self.gqa_head_dim}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.moe_impl not in MOE_IMPLS:
            raise ConfigError(f"moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        if self.moe_ep_impl not in MOE_EP_IMPLS:
            raise ConfigError(f"moe_ep_impl must be one of {MOE_EP_IMPLS}, got {self.moe_ep_impl!r}")
        if self.moe_quant not in MOE_QUANT_RECIPES:
            raise ConfigError(f"moe_quant must be one of {MOE_QUANT_RECIPES}, got {self.moe_quant!r}")
        if self.moe_quant_division not in MOE_QUANT_DIVISIONS:
            raise ConfigError(
                f"moe_quant_division must be one of {MOE_QUANT_DIVISIONS}, got {self.moe_quant_division!r}"
            )
        if self.moe_quant != "bf16" and self.moe_impl not in ("auto", "sorted", "grouped"):
            raise ConfigError(f"moe_quant={self.moe_quant!r} needs moe_impl='sorted' (or 'grouped' for "
                              f"{MOE_QUANT_GROUPED[1:]}), got {self.moe_impl!r}")
        if self.moe_impl == "grouped" and self.moe_quant not in MOE_QUANT_GROUPED:
            raise ConfigError(f"moe_impl='grouped' runs moe_quant in {MOE_QUANT_GROUPED} (the recipes its fused "
                              f"quantizers and block-scaled kernels implement); moe_quant={self.moe_quant!r} runs on "
                              f"moe_impl='sorted'")
        if self.remat_policy not in REMAT_POLICIES:
            raise ConfigError(f"remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
        for name in ("dtype", "param_dtype"):  # stored by name whatever form the caller gave
            object.__setattr__(self, name, dtype_name(getattr(self, name), field=name))
        if not self.moe_capacity_factors or any(f <= 0 for f in self.moe_capacity_factors):
            raise ConfigError(f"moe_capacity_factors must be positive, got {self.moe_capacity_factors}")
        loop_bytes = self.moe_overflow_loop_bytes
        if isinstance(loop_bytes, bool) or not isinstance(loop_bytes, int) or loop_bytes < 0:
            raise ConfigError(f"moe_overflow_loop_bytes must be a non-negative integer, got {loop_bytes!r}")
        for name in ("moe_chunk_tokens", "loss_chunk_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"{name} must be a non-negative integer (0: no chunking), got {value!r}")
        if list(self.moe_capacity_factors) != sorted(self.moe_capacity_factors):
            raise ConfigError(f"moe_capacity_factors must be increasing, got {self.moe_capacity_factors}")
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")
        if not 0.0 <= self.router_replay_filter_ratio <= 1.0:
            raise ConfigError(f"router_replay_filter_ratio must be in [0, 1], got {self.router_replay_filter_ratio}")

    # derived quantities -------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        """GQA key/value heads (num_attention_heads when num_key_value_heads is null)."""
        return self.num_attention_heads if self.num_key_value_heads is None else self.num_key_value_heads

    @property
    def gqa_head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads if self.head_dim is None else self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: nope + rope dims for MLA, head_dim for GQA."""
        if self.attention_type == "gqa":
            return self.gqa_head_dim
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def value_head_dim(self) -> int:
        return self.gqa_head_dim if self.attention_type == "gqa" else self.v_head_dim

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates per head: MLA's decoupled qk_rope_head_dim, a GQA head's all."""
        return self.gqa_head_dim if self.attention_type == "gqa" else self.qk_rope_head_dim

    @property
    def has_router_bias(self) -> bool:
        """Whether the family's checkpoints carry the selection bias (DeepSeek-V3's e_score_correction_bias);
        the others' stays zero and is neither read nor written."""
        return self.hf_model_type == "deepseek_v3"

    @property
    def num_dense_layers(self) -> int:
        return self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(d_qk), times YaRN's mscale(factor, mscale_all_dim)^2 for MLA (DeepSeek-V2 sec. 2.1, HF);
        GQA families scale only cos/sin (transformers' Llama / Qwen3)."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if self.attention_type == "mla" and rs is not None and rs.type == "yarn" and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale = scale * m * m
        return scale

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature: 0.1 * mscale * ln(scale) + 1 for scale > 1 (Peng et al. 2023)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# Presets ------------------------------------------------------------------------------------------

def _kimi_k25() -> ModelConfig:
    # Kimi K2.5 text backbone (`text_config` of the released `kimi_k25` config.json).
    # rope_theta and rms_norm_eps: public fixtures disagree (theta 50000 vs 10000, eps 1e-5 vs 1e-6).
    # We use theta=50000 (Kimi K2's documented value, and the pinned-revision K2.6 check) and
    # eps=1e-5 (same pinned check); YaRN factor 64 from 4096 to 262144 positions, beta 32/1,
    # mscale = mscale_all_dim = 1. Experts ship INT4 in the release; we model them in bf16.
    return ModelConfig(
        vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384,
        n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
        routed_scaling_factor=2.827, norm_topk_prob=True, scoring_func="sigmoid",
        first_k_dense_replace=1, rope_theta=50000.0,
        rope_scaling=RopeScaling(factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=262144, rms_norm_eps=1e-5, num_nextn_predict_layers=0,
        dtype="bfloat16", param_dtype="float32", remat_policy="full",
    )


def _deepseek_v3() -> ModelConfig:
    # deepseek-ai/DeepSeek-V3 config.json.
    return ModelConfig(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid",
        first_k_dense_replace=3, rope_theta=10000.0,
        rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=163840, rms_norm_eps=1e-6, num_nextn_predict_layers=1,
        dtype="bfloat16", param_dtype="float32", remat_policy="full",
    )


def _tiny() -> ModelConfig:
    # For unit tests: every feature on (q LoRA, groups, YaRN, MTP), compiles in seconds.
    return ModelConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, first_k_dense_replace=1, rope_theta=10000.0,
        rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=64, mscale=1.0,
                                 mscale_all_dim=1.0),
        max_position_embeddings=256, num_nextn_predict_layers=1,
    )


def _small() -> ModelConfig:
    # CPU demos: about 30M parameters.
    return ModelConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=8, q_lora_rank=None, kv_lora_rank=128,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
        n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, first_k_dense_replace=1, rope_theta=10000.0,
        max_position_embeddings=4096, num_nextn_predict_layers=1,
    )


def _medium() -> ModelConfig:
    # One GPU: a few hundred million parameters.
    return ModelConfig(
        vocab_size=32768, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=512,
        num_hidden_layers=12, num_attention_heads=16, q_lora_rank=384, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32,
        n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, rope_theta=50000.0,
        max_position_embeddings=32768, num_nextn_predict_layers=1, dtype="bfloat16",
    )


def _qwen3_moe(**changes) -> ModelConfig:
    """Qwen3-MoE's fixed choices: GQA with q/k norms, rotate-half RoPE, softmax top-k over routed experts only,
    every layer MoE (decoder_sparse_step 1, no mlp_only_layers)."""
    base = dict(attention_type="gqa", qk_norm=True, rope_interleave=False, n_shared_experts=0, scoring_func="softmax",
                topk_method="greedy", routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True,
                first_k_dense_replace=0, num_nextn_predict_layers=0, hf_model_type="qwen3_moe")
    return ModelConfig(**(base | changes))


def _dense_gqa(family: str, **changes) -> ModelConfig:
    """A dense GQA decoder (Qwen3: q/k norms; Llama: none): every layer dense SwiGLU."""
    layers = changes["num_hidden_layers"]
    base = dict(attention_type="gqa", qk_norm=family == "qwen3", rope_interleave=False, first_k_dense_replace=layers,
                n_shared_experts=0, num_nextn_predict_layers=0, hf_model_type=family)
    return ModelConfig(**(base | changes))


def _qwen3_30b_a3b() -> ModelConfig:
    # Qwen/Qwen3-30B-A3B config.json: 48 layers of 128 experts (top 8, normalised), GQA 32/4 heads of 128
    return _qwen3_moe(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                      num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      n_routed_experts=128, num_experts_per_tok=8, rope_theta=1e6, max_position_embeddings=40960,
                      rms_norm_eps=1e-6, dtype="bfloat16", param_dtype="float32", remat_policy="full")


def _qwen3_coder_30b_a3b() -> ModelConfig:
    # Qwen/Qwen3-Coder-30B-A3B-Instruct: the same network as Qwen3-30B-A3B with 256k positions (theta 1e7); the
    # model of the Composer 2 report's CPT -> RL compute ablation
    return _qwen3_30b_a3b().replace(rope_theta=1e7, max_position_embeddings=262144)


def _qwen3_0_6b() -> ModelConfig:
    # Qwen/Qwen3-0.6B: dense, 28 layers, GQA 16/8 heads of 128, tied embeddings
    return _dense_gqa("qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                      max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="bfloat16")


def _deepseek_v2_lite() -> ModelConfig:
    # deepseek-ai/DeepSeek-V2-Lite config.json: MLA without q LoRA, 64 experts (top 6, softmax, not renormalised)
    # + 2 shared, YaRN x40 with mscale 0.707
    return ModelConfig(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, scoring_func="softmax",
        topk_method="greedy", first_k_dense_replace=1, rope_theta=10000.0,
        rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                 mscale=0.707, mscale_all_dim=0.707),
        max_position_embeddings=163840, rms_norm_eps=1e-6, num_nextn_predict_layers=0, hf_model_type="deepseek_v2",
        dtype="bfloat16", param_dtype="float32", remat_policy="full",
    )


def _moonlight_16b_a3b() -> ModelConfig:
    # moonshotai/Moonlight-16B-A3B config.json (model_type deepseek_v3, DeepseekV3ForCausalLM): V2-Lite's shape with
    # V3's sigmoid router and selection bias, Kimi's vocabulary, theta 50000, no MTP
    return ModelConfig(
        vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        n_group=1, topk_group=1, routed_scaling_factor=2.446, norm_topk_prob=True, scoring_func="sigmoid",
        first_k_dense_replace=1, rope_theta=50000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
        num_nextn_predict_layers=0, dtype="bfloat16", param_dtype="float32", remat_policy="full",
    )


# small presets of each family for CPU tests and benchmarks (the `tiny` / `small` of DeepSeek-V3 above)
def _tiny_qwen3_moe() -> ModelConfig:
    return _qwen3_moe(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, rope_theta=1e6,
                      max_position_embeddings=256)


def _small_qwen3_moe() -> ModelConfig:
    # beside `small` (DeepSeek-V3-shaped, ~30M) in the benchmarks: the same width, depth and expert count
    return _qwen3_moe(vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      n_routed_experts=16, num_experts_per_tok=4, first_k_dense_replace=1, rope_theta=1e6,
                      max_position_embeddings=4096)


def _tiny_qwen3() -> ModelConfig:
    return _dense_gqa("qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=12, rope_theta=1e6,
                      max_position_embeddings=256, tie_word_embeddings=True)


def _tiny_llama() -> ModelConfig:
    return _dense_gqa("llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                      rope_scaling=RopeScaling(type="llama3", factor=8.0, original_max_position_embeddings=64),
                      max_position_embeddings=256)


def _tiny_deepseek_v2() -> ModelConfig:
    return _tiny().replace(scoring_func="softmax", topk_method="group_limited_greedy", norm_topk_prob=False,
                           routed_scaling_factor=1.0, n_shared_experts=2, num_nextn_predict_layers=0,
                           hf_model_type="deepseek_v2")


PRESETS = {
    "kimi-k2.5": _kimi_k25,
    "deepseek-v3": _deepseek_v3,
    "tiny": _tiny,
    "small": _small,
    "medium": _medium,
    "qwen3-30b-a3b": _qwen3_30b_a3b,
    "qwen3-coder-30b-a3b": _qwen3_coder_30b_a3b,
    "qwen3-0.6b": _qwen3_0_6b,
    "deepseek-v2-lite": _deepseek_v2_lite,
    "moonlight-16b-a3b": _moonlight_16b_a3b,
    "tiny-qwen3-moe": _tiny_qwen3_moe,
    "small-qwen3-moe": _small_qwen3_moe,
    "tiny-qwen3": _tiny_qwen3,
    "tiny-llama": _tiny_llama,
    "tiny-deepseek-v2": _tiny_deepseek_v2,
}
# the small presets of each family, for tests parametrised over families
FAMILY_TINY_PRESETS = {"deepseek_v3": "tiny", "qwen3_moe": "tiny-qwen3-moe", "qwen3": "tiny-qwen3",
                       "llama": "tiny-llama", "deepseek_v2": "tiny-deepseek-v2"}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None


__all__ = ["ConfigError", "FAMILY_TINY_PRESETS", "ModelConfig", "RopeScaling", "PRESETS", "preset", "yarn_mscale"]
