"""Parameter helpers, RMSNorm and the SwiGLU MLP.

Every parameter carries `logical_axes` metadata (one name per dimension) so the sharding layer can map
it to a mesh without touching model code. Layers built for `lax.scan` get a leading 'layers' axis.
Logical axis names used throughout:
  layers, vocab, embed, q_lora, kv_lora, heads, head_dim, mlp, experts, expert_mlp, norm
Activations: batch, seq, embed, heads, kv_lora, vocab, experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from c2jax.models.config import ModelConfig


class RouterBias(nnx.Variable):
    """Selection-only expert bias (DeepSeek-V3 aux-loss-free balancing): model state, never trained.

    A distinct Variable type keeps it out of `nnx.Param` filters, so optimizers built with `wrt=nnx.Param`
    never see it: no gradient step and no weight decay can touch it.
    """


def param(rngs: nnx.Rngs, shape, axes, *, cfg: ModelConfig, stack: int | None = None,
          init: str = "normal", std: float | None = None) -> nnx.Param:
    if len(shape) != len(axes):
        raise ValueError(f"parameter shape {shape} and logical axes {axes} differ in rank")
    if stack is not None:
        shape, axes = (stack, *shape), ("layers", *axes)
    dtype = jnp.dtype(cfg.param_dtype)
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        std = cfg.initializer_range if std is None else std
        value = std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    """y = w * x / sqrt(mean(x^2) + eps), statistics in float32 (Zhang & Sennrich 2019)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, cfg: ModelConfig, rngs: nnx.Rngs, stack: int | None = None,
                 axis_name: str = "norm"):
        self.eps = cfg.rms_norm_eps
        self.weight = param(rngs, (dim,), (axis_name,), cfg=cfg, stack=stack, init="ones")

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


def dense(x: jnp.ndarray, w: jnp.ndarray, preferred_element_type=None) -> jnp.ndarray:
    """x [..., in] @ w [in, out] in the activation dtype, as one 2-D matmul over the flattened tokens.

    Measured on XLA:CPU: autodiff of the same contraction written as a rank-3 einsum ("bsd,dv->bsv")
    relayouts the cotangent through a transposing copy (LM head fwd+bwd with log_softmax cross-entropy
    at the small preset: 876 ms as "bsd,dv->bsv", 438 ms as a 2-D matmul)."""
    y = jnp.matmul(x.reshape(-1, x.shape[-1]), w.astype(x.dtype), preferred_element_type=preferred_element_type)
    return y.reshape(*x.shape[:-1], w.shape[-1])


class MLP(nnx.Module):
    """SwiGLU: down(silu(x W_gate) * (x W_up)) (Shazeer 2020); with `bias` (the dense layers under
    ModelConfig.mlp_bias, Llama's LlamaMLP) each projection adds its bias (zero-initialised): gate_proj_bias,
    up_proj_bias [width], down_proj_bias [d]. Shared experts are built without."""

    def __init__(self, cfg: ModelConfig, width: int, rngs: nnx.Rngs, stack: int | None = None, bias: bool = False):
        d = cfg.hidden_size
        self.gate_proj = param(rngs, (d, width), ("embed", "mlp"), cfg=cfg, stack=stack)
        self.up_proj = param(rngs, (d, width), ("embed", "mlp"), cfg=cfg, stack=stack)
        self.down_proj = param(rngs, (width, d), ("mlp", "embed"), cfg=cfg, stack=stack)
        self.bias = bias
        if bias:
            self.gate_proj_bias = param(rngs, (width,), ("mlp",), cfg=cfg, stack=stack, init="zeros")
            self.up_proj_bias = param(rngs, (width,), ("mlp",), cfg=cfg, stack=stack, init="zeros")
            self.down_proj_bias = param(rngs, (d,), ("embed",), cfg=cfg, stack=stack, init="zeros")

    def __call__(self, x):
        w = [p[...].astype(x.dtype) for p in (self.gate_proj, self.up_proj, self.down_proj)]
        flat = x.reshape(-1, x.shape[-1])
        if not self.bias:
            return swiglu(flat, *w).reshape(x.shape)
        b = [p[...].astype(x.dtype) for p in (self.gate_proj_bias, self.up_proj_bias, self.down_proj_bias)]
        return swiglu_bias(flat, *w, *b).reshape(x.shape)


def _transposed(w):
    """w.T materialised as its own array (the barrier keeps XLA from folding it into
    the consuming dot). Left to itself, XLA:CPU satisfied autodiff'd matmul backwards by relayouting
    the other, often larger, operand, e.g. the [T, f] transposing copy fusions of the SwiGLU backward
    (dense MLP fwd+bwd at the small preset: 295 -> 181 ms with the hand-written backward below)."""
    return jax.lax.optimization_barrier(w.T)


def matmul_grads(x, w, dy):
    """(dx, dw) of y = x @ w for 2-D x [T, i], w [i, o], in the forms XLA:CPU runs fastest."""
    return dy @ _transposed(w), _transposed(x) @ dy


@jax.custom_vjp
def swiglu(x, w_gate, w_up, w_down):
    """down(silu(x W_gate) * (x W_up)) for 2-D x, with a hand-written backward (see `_transposed`)."""
    return _swiglu_fwd(x, w_gate, w_up, w_down)[0]


def _swiglu_fwd(x, w_gate, w_up, w_down):
    gate, up = x @ w_gate, x @ w_up
    return (jax.nn.silu(gate) * up) @ w_down, (x, w_gate, w_up, w_down, gate, up)


def swiglu_act_grads(gate, up, dact):
    """act = silu(gate) * up and the cotangents (dgate, dup) of act for cotangent dact.
    silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))."""
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    return silu * up, dact * up * sig * (1 + gate * (1 - sig)), dact * silu


def _swiglu_grads(res, dy):
    """((dx, dw_gate, dw_up, dw_down), dgate, dup): the backward of `swiglu` and of `swiglu_bias` (whose bias
    cotangents are dgate, dup and dy summed over the tokens)."""
    x, w_gate, w_up, w_down, gate, up = res
    act = jax.nn.silu(gate) * up
    dact, dw_down = matmul_grads(act, w_down, dy)
    _, dgate, dup = swiglu_act_grads(gate, up, dact)
    x_t = _transposed(x)
    dx = dgate @ _transposed(w_gate) + dup @ _transposed(w_up)
    return (dx, x_t @ dgate, x_t @ dup, dw_down), dgate, dup


def _swiglu_bwd(res, dy):
    return _swiglu_grads(res, dy)[0]


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@jax.custom_vjp
def swiglu_bias(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    """down(silu(x W_gate + b_gate) * (x W_up + b_up)) + b_down for 2-D x: `swiglu` with biases, the same
    hand-written backward plus the biases' cotangents (sums over the tokens)."""
    return _swiglu_bias_fwd(x, w_gate, w_up, w_down, b_gate, b_up, b_down)[0]


def _swiglu_bias_fwd(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    gate, up = x @ w_gate + b_gate, x @ w_up + b_up
    return (jax.nn.silu(gate) * up) @ w_down + b_down, (x, w_gate, w_up, w_down, gate, up)


def _swiglu_bias_bwd(res, dy):
    grads, dgate, dup = _swiglu_grads(res, dy)
    return (*grads, dgate.sum(0), dup.sum(0), dy.sum(0))


swiglu_bias.defvjp(_swiglu_bias_fwd, _swiglu_bias_bwd)


@jax.custom_vjp
def softmax_cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
    """Per-position -log softmax(logits)[label]: logits [..., V] (float32), labels [...] int -> [...].

    Same value as -take_along_axis(log_softmax(logits), labels), but with the backward written out as
    g * (softmax - onehot): one fused pass over the logits. Autodiff of that expression instead
    materialises log-probabilities, scatter-adds the cotangent into a zero [..., V] buffer and runs the
    log_softmax transpose over it (measured on XLA:CPU at [4096, 8192]: several extra 128 MB passes).
    """
    return _softmax_cross_entropy_fwd(logits, labels)[0]


def _softmax_cross_entropy_fwd(logits, labels):
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return lse - picked, (logits, lse, labels)


def _softmax_cross_entropy_bwd(res, g):
    logits, lse, labels = res
    onehot = jnp.arange(logits.shape[-1], dtype=labels.dtype) == labels[..., None]
    dlogits = g[..., None] * (jnp.exp(logits - lse[..., None]) - onehot)
    return dlogits.astype(logits.dtype), None


softmax_cross_entropy.defvjp(_softmax_cross_entropy_fwd, _softmax_cross_entropy_bwd)


LOSS_CHUNK_ELEMENTS = 2**26  # auto chunking: [chunk, V] fp32 logits of at most 256 MiB


def loss_chunk_tokens(setting: int | None, vocab_size: int) -> int:
    """Tokens per chunk of the fused head + loss for ModelConfig.loss_chunk_tokens (0: never chunk;
    None: auto, the most tokens whose [chunk, V] fp32 logits fit LOSS_CHUNK_ELEMENTS, at least 1024)."""
    if setting is None:
        return max(1024, LOSS_CHUNK_ELEMENTS // vocab_size)
    return setting


def lm_head_cross_entropy(h: jnp.ndarray, w: jnp.ndarray, labels: jnp.ndarray,
                          chunk_tokens: int = 0) -> jnp.ndarray:
    """softmax_cross_entropy(h @ w, labels) for 2-D h [T, d], w [d, V], labels [T]: per-token loss [T]."""
    return lm_head_loss(h, w, labels, chunk_tokens)[0]


def lm_head_loss(h: jnp.ndarray, w: jnp.ndarray, labels: jnp.ndarray,
                 chunk_tokens: int = 0) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(CE [T], logsumexp [T]) of the logits h @ w: the head fused into the loss, with both outputs
    differentiable (the log-sum-exp feeds the z-loss), logits never returned.

    Fusing the head into the loss's custom_vjp lets the backward form dlogits once and feed both weight
    and input gradients from it; autodiff of the head einsum instead recomputed the dlogits fusion a second
    time as a transposed [V, T] copy (measured: head + CE fwd+bwd 660 -> 330 ms at T=4096, V=8192).
    With T > chunk_tokens > 0 the tokens go through in chunks (a lax.scan) and the backward recomputes each
    chunk's logits from h and the saved log-sum-exp: memory O(chunk x V) instead of two [T, V] fp32 arrays
    (2 GiB at T=32k, V=8k), for one more head GEMM.
    """
    num_tokens = h.shape[0]
    if not chunk_tokens or num_tokens <= chunk_tokens:
        return _lm_head_loss(h, w, labels)
    num_chunks = -(-num_tokens // chunk_tokens)
    size = -(-num_tokens // num_chunks)
    pad = num_chunks * size - num_tokens
    if pad:  # padded rows are sliced off below, so their cotangents are zero
        h = jnp.concatenate([h, jnp.zeros((pad, h.shape[1]), h.dtype)])
        labels = jnp.concatenate([labels, jnp.zeros((pad,), labels.dtype)])
    loss, lse = _chunked_lm_head_loss(h.reshape(num_chunks, size, -1), w, labels.reshape(num_chunks, size))
    return loss.reshape(-1)[:num_tokens], lse.reshape(-1)[:num_tokens]


def _head_loss_and_lse(h, w, labels):
    logits = jnp.matmul(h, w, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return lse - picked, lse, logits


def _dlogits(logits, lse, labels, g_loss, g_lse):
    """d/dlogits of g_loss * (lse - logits[label]) + g_lse * lse = p (g_loss + g_lse) - onehot g_loss."""
    onehot = jnp.arange(logits.shape[-1], dtype=labels.dtype) == labels[..., None]
    probs = jnp.exp(logits - lse[..., None])
    return probs * (g_loss + g_lse)[..., None] - jnp.where(onehot, g_loss[..., None], 0.0)


@jax.custom_vjp
def _lm_head_loss(h, w, labels):
    return _lm_head_loss_fwd(h, w, labels)[0]


def _lm_head_loss_fwd(h, w, labels):
    loss, lse, logits = _head_loss_and_lse(h, w, labels)
    return (loss, lse), (h, w, labels, logits, lse)


def _lm_head_loss_bwd(res, g):
    h, w, labels, logits, lse = res
    dlogits = _dlogits(logits, lse, labels, *g)
    dh, dw = matmul_grads(h, w.astype(h.dtype), dlogits.astype(h.dtype))
    return dh, dw.astype(w.dtype), None


_lm_head_loss.defvjp(_lm_head_loss_fwd, _lm_head_loss_bwd)


@jax.custom_vjp
def _chunked_lm_head_loss(h, w, labels):
    return _chunked_lm_head_loss_fwd(h, w, labels)[0]


def _chunked_lm_head_loss_fwd(h, w, labels):
    def one_chunk(_, chunk):
        loss, lse, _ = _head_loss_and_lse(chunk[0], w, chunk[1])
        return None, (loss, lse)

    _, (loss, lse) = jax.lax.scan(one_chunk, None, (h, labels))
    return (loss, lse), (h, w, labels, lse)


def _chunked_lm_head_loss_bwd(res, g):
    h, w, labels, lse = res
    w_c = w.astype(h.dtype)

    def one_chunk(dw, chunk):
        h_c, labels_c, lse_c, g_loss, g_lse = chunk
        logits = jnp.matmul(h_c, w_c, preferred_element_type=jnp.float32)
        dlogits = _dlogits(logits, lse_c, labels_c, g_loss, g_lse).astype(h.dtype)
        dh, dw_c = matmul_grads(h_c, w_c, dlogits)
        return dw + dw_c.astype(jnp.float32), dh

    dw, dh = jax.lax.scan(one_chunk, jnp.zeros(w.shape, jnp.float32), (h, labels, lse, *g))
    return dh, dw.astype(w.dtype), None


_chunked_lm_head_loss.defvjp(_chunked_lm_head_loss_fwd, _chunked_lm_head_loss_bwd)
