"""Attention backends by name, chosen by platform, with an explicit override (argument or environment), falling
through on NotImplementedError to the always-capable "blockwise" (the kernels/dispatch.py pattern).

    attention(q, k, v, scale=s, segment_ids=seg)                    -> the platform's default backend
    attention(q, k, v, scale=s, backend="dense")                    -> that one
    C2JAX_ATTENTION=blockwise                                       same, from the environment

Every backend takes the same arguments: q [B, Sq, H, Dqk], k [B, Sk, H, Dqk], v [B, Sk, H, Dv]; keyword-only
scale, q_segment_ids / kv_segment_ids ([B, S] int), q_positions / kv_positions ([S] or [B, S] int; None =
arange) and causal. Key j is visible to query i iff (not causal or kv_positions[j] <= q_positions[i]) and (no
segments or the segment ids are equal); a query that sees no key gets zeros. Returns [B, Sq, H, Dv].
Grouped-query attention: k and v may have Hkv heads dividing H (query head h reads K/V head h // (H / Hkv));
a backend that reads grouped K/V itself says so (Backend.grouped_kv), the others get them repeated per head.

    "blockwise"  models/blockwise_attention.py: exact, memory O(S), program size independent of S. Any platform.
    "dense"      models/dense_attention.py's dot_product_attention (hand-written VJP, saves [B, H, Sq, Sk]
                 fp32 probabilities), fed a dense [B, 1, Sq, Sk] mask built here from the same vectors. The
                 small-S oracle of the tests; never chosen by default except through "auto".
    "auto"       dense when Sq * Sk <= AUTO_DENSE_MAX_SCORES, else blockwise. The CPU default.
    "cudnn"      jax.nn.dot_product_attention(implementation="cudnn"), CUDA GPUs only. See _cudnn for what
                 it accepts; anything else (packed documents, explicit positions, fp32, ...) is refused and
                 runs blockwise.

Defaults by jax.default_backend(): cpu -> auto; gpu -> cudnn, then blockwise; anything else -> blockwise.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from c2jax.models.blockwise_attention import blockwise_attention
from c2jax.models.dense_attention import CAUSAL_BLOCK, dot_product_attention

ENV_OVERRIDE = "C2JAX_ATTENTION"
FALLBACK = "blockwise"  # runs everything; tried after any backend that refuses a call

# "auto" on CPU: the dense path while Sq * Sk is at most this. Measured 2026-12-04, 2-core CI VM, load 1.3-2.5,
# jit fwd+bwd fp32, B=1, H=8, Dqk=48, Dv=32, causal; best of 7-9 runs, dense vs blockwise (512:256) in ms:
#   S = 128: 1.3-1.6 vs 1.8   256: 2.9-4.9 vs 3.4-6.0   384: 5.8-8.1 vs 7.3-8.6   512: 11.0-13.2 vs 11.8-17.5
#   S = 1024: 50-57 vs 36-60   2048: 199-213 vs 113-196 (blockwise timings are bimodal on this VM)
# Dense wins by 5-20% up to S = 512 and loses from 1024 on; it also keeps [B, H, Sq, Sk] fp32 probabilities
# (8 MB per layer at B=1, H=8, S=512) and compiles an unrolled loop (2.4 s vs 1.0 s at S = 2048).
AUTO_DENSE_MAX_SCORES = 512 * 512


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable
    platforms: tuple[str, ...] | None = None  # jax.default_backend() values it runs on; None: any
    description: str = ""
    grouped_kv: bool = False  # takes k, v with fewer heads than q (GQA) without their being repeated

    def runs_on(self, platform: str) -> bool:
        return self.platforms is None or platform in self.platforms


_BACKENDS: dict[str, Backend] = {}
_DEFAULTS: dict[str, tuple[str, ...]] = {"cpu": ("auto",), "gpu": ("cudnn", FALLBACK)}


def register(backend: Backend) -> None:
    if backend.name in _BACKENDS:
        raise ValueError(f"attention backend {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend


def backends() -> list[str]:
    return sorted(_BACKENDS)


def get(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choices: {backends()}") from None


def candidates(backend: str | None = None, platform: str | None = None) -> list[Backend]:
    """Backends to try in order: the override (argument, else $C2JAX_ATTENTION) then the fallback, or the
    platform's defaults."""
    platform = platform or jax.default_backend()
    name = backend or os.environ.get(ENV_OVERRIDE, "").strip() or None
    if name is not None:
        chosen = get(name)
        if not chosen.runs_on(platform):
            source = "argument" if backend else f"${ENV_OVERRIDE}"
            raise ValueError(f"attention backend {name!r} (from the {source}) runs on {chosen.platforms}, "
                             f"this is {platform!r}; choices: {backends()}")
        names = (name,) if name == FALLBACK else (name, FALLBACK)
    else:
        names = _DEFAULTS.get(platform, (FALLBACK,))
    return [get(n) for n in names]


def attention(q, k, v, *, scale: float, segment_ids=None, q_segment_ids=None, kv_segment_ids=None,
              positions=None, q_positions=None, kv_positions=None, causal: bool = True,
              backend: str | None = None, platform: str | None = None):
    """softmax(q k^T * scale, masked) v by the chosen backend (see the module docstring).

    segment_ids / positions are shorthands for self-attention (the same vector for queries and keys);
    give either them or the q_/kv_ pair. `platform` (default: jax.default_backend()) picks the backends as for
    that platform, e.g. "gpu" while lowering for CUDA on a CPU-only machine (experiments/bench/gpu_check)."""
    if segment_ids is not None:
        if q_segment_ids is not None or kv_segment_ids is not None:
            raise ValueError("give segment_ids or q_segment_ids/kv_segment_ids, not both")
        q_segment_ids = kv_segment_ids = segment_ids
    if positions is not None:
        if q_positions is not None or kv_positions is not None:
            raise ValueError("give positions or q_positions/kv_positions, not both")
        q_positions = kv_positions = positions
    kwargs = dict(scale=scale, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                  q_positions=q_positions, kv_positions=kv_positions, causal=causal)
    heads, kv_heads = q.shape[2], k.shape[2]
    if v.shape[2] != kv_heads or heads % kv_heads:
        raise ValueError(f"attention: k and v must have the same number of heads dividing q's {heads}, got "
                         f"k {k.shape[2]}, v {v.shape[2]}")
    refusals = []
    for b in candidates(backend, platform):
        if kv_heads != heads and not b.grouped_kv:  # GQA for a backend that wants one K/V head per query head
            k, v = jnp.repeat(k, heads // kv_heads, axis=2), jnp.repeat(v, heads // kv_heads, axis=2)
            kv_heads = heads
        try:
            return b.fn(q, k, v, **kwargs)
        except NotImplementedError as e:
            refusals.append(f"{b.name}: {e}")
    raise NotImplementedError(f"attention: every backend refused: {refusals}")


def dense_mask(batch, num_q, num_k, *, q_segment_ids=None, kv_segment_ids=None, q_positions=None,
               kv_positions=None, causal=True):
    """[B, 1, Sq, Sk] boolean, True = attend: the S x S form of the visibility rule (dense backend only)."""
    q_pos = jnp.arange(num_q) if q_positions is None else jnp.asarray(q_positions)
    kv_pos = jnp.arange(num_k) if kv_positions is None else jnp.asarray(kv_positions)
    q_pos = q_pos if q_pos.ndim == 2 else q_pos[None]
    kv_pos = kv_pos if kv_pos.ndim == 2 else kv_pos[None]
    mask = jnp.ones((1, num_q, num_k), bool)
    if causal:
        mask = mask & (kv_pos[:, None, :] <= q_pos[:, :, None])
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("give both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is not None:
        mask = mask & (jnp.asarray(q_segment_ids)[:, :, None] == jnp.asarray(kv_segment_ids)[:, None, :])
    return jnp.broadcast_to(mask, (batch, num_q, num_k))[:, None]


def _dense(q, k, v, *, scale, q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
           causal=True):
    batch, num_q, num_k = q.shape[0], q.shape[1], k.shape[1]
    mask = dense_mask(batch, num_q, num_k, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                      q_positions=q_positions, kv_positions=kv_positions, causal=causal)
    # its causal_block promise (nothing above the diagonal) holds for index-causal masks only
    index_causal = causal and q_positions is None and kv_positions is None and num_q == num_k
    out = dot_product_attention(q, k, v, mask, scale, causal_block=CAUSAL_BLOCK if index_causal else None)
    if index_causal and q_segment_ids is kv_segment_ids:  # self-attention: every row sees itself
        return out
    # dot_product_attention averages all values for a row that sees nothing; the contract is zeros
    seen = mask[:, 0].any(-1)  # [B, Sq]
    return out * seen[:, :, None, None].astype(out.dtype)


def _auto(q, k, v, **kwargs):
    small = q.shape[1] * k.shape[1] <= AUTO_DENSE_MAX_SCORES
    return (_dense if small else blockwise_attention)(q, k, v, **kwargs)


def _cudnn(q, k, v, *, scale, q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
           causal=True):
    """cuDNN flash attention through the public jax.nn.dot_product_attention (JAX 0.10.2 checked).

    Accepts only what that API expresses without an S x S mask: unpacked attention (no segment ids),
    index positions (positions None), causal or not, Sq == Sk when causal (cuDNN's causal mask is
    top-left aligned for Sq != Sk, not our positions rule), bf16/fp16. The public API has no segment-id
    argument (packed documents exist only in the private jax._src.cudnn API via per-segment offsets and
    lengths, Hopper-only); packed inputs fall back to blockwise. It requires value's head dim to equal the
    key's, so for MLA (Dqk 192, Dv 128) v is zero-padded to Dqk and the output sliced (1.5x the PV work).
    Head-dim limits (<= 128, or <= 256 on Hopper; multiple of 8) and the cuDNN version are checked by JAX at
    trace time and raise NotImplementedError / RuntimeError("cuDNN is not detected"), which refuse here."""
    if q_segment_ids is not None or kv_segment_ids is not None:
        raise NotImplementedError("packed documents (segment ids) need a dense mask in jax.nn's cuDNN API")
    if q_positions is not None or kv_positions is not None:
        raise NotImplementedError("explicit positions are not expressible in jax.nn's cuDNN API")
    if causal and q.shape[1] != k.shape[1]:
        raise NotImplementedError("causal with Sq != Sk: cuDNN aligns the diagonal differently")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotImplementedError(f"cuDNN flash attention needs bf16/fp16 q, k, v, got {q.dtype}")
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - dv)))
    elif dv > q.shape[-1]:
        raise NotImplementedError(f"value head dim {dv} > query head dim {q.shape[-1]}")
    try:
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn")
    except RuntimeError as e:  # "cuDNN is not detected" (ROCm, or CUDA without cuDNN)
        raise NotImplementedError(str(e)) from e
    return out[..., :dv]


register(Backend("blockwise", blockwise_attention, description="exact FlashAttention-2-style blocks, O(S) memory"))
register(Backend("dense", _dense, description="dense_attention.dot_product_attention, O(S^2); the oracle"))
register(Backend("auto", _auto, description="dense for small Sq*Sk, blockwise otherwise"))
register(Backend("cudnn", _cudnn, platforms=("gpu",), description="jax.nn.dot_product_attention cuDNN",
                grouped_kv=True))
