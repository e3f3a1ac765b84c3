"""Token-summed loss terms. Every function returns (sum over tokens, weight sum), so gradient
accumulation over micro-batches divides once by the global token count and equals the full batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_ce_sum(token_losses: jnp.ndarray, loss_mask: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """sum_t mask_t * CE_t and sum_t mask_t (mask = 0 on padding and on SFT prompt tokens)."""
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum(token_losses * mask), jnp.sum(mask)


def z_loss_sum(lse: jnp.ndarray, loss_mask: jnp.ndarray) -> jnp.ndarray:
    """sum_t mask_t * lse_t^2 for the logits' log-sum-exp lse [B, S] (Transformer.token_losses(...,
    with_lse=True), so the logits need not exist): PaLM's auxiliary z-loss (Chowdhery et al. 2022, sec. 5),
    which keeps the softmax normaliser near 1 for numerical stability."""
    return jnp.sum(jnp.square(lse.astype(jnp.float32)) * loss_mask.astype(jnp.float32))


def mtp_distill_weights(segment_ids: jnp.ndarray, loss_mask: jnp.ndarray, offset: int) -> jnp.ndarray:
    """w[b, t] = 1 where the teacher position t + offset exists, lies in the same document as t and is
    a trained token (loss_mask), else 0. Returns [B, S] float32."""
    seq = segment_ids.shape[1]
    valid = jnp.arange(seq) < seq - offset
    seg_next = jnp.roll(segment_ids, -offset, axis=1)
    mask_next = jnp.roll(loss_mask.astype(jnp.float32), -offset, axis=1)
    same_doc = (seg_next == segment_ids) & (segment_ids != 0) if offset else segment_ids != 0
    return jnp.where(valid & same_doc, mask_next, 0.0)


def mtp_self_distillation(main_logits: jnp.ndarray, mtp_logits: jnp.ndarray, segment_ids: jnp.ndarray,
                          loss_mask: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Composer 2's MTP self-distillation (report sec. 3): MTP depth j at position t learns the main head's
    exact next-token distribution at position t + k, k = j + 1 (the position whose prediction target is the
    same token):

        L_j = sum_t w_t KL(sg(p_main[t + k]) || p_mtp_j[t]),  KL(p||q) = sum_v p_v (log p_v - log q_v).

    main_logits [B, S, V], mtp_logits [D, B, S, V]. Returns (KL sum over depths and tokens, weight sum,
    top-1 agreement count), the last being the speculative-decoding acceptance proxy."""
    teacher_logp_all = jax.nn.log_softmax(jax.lax.stop_gradient(main_logits).astype(jnp.float32), axis=-1)
    kl_sum = weight_sum = agree = jnp.zeros((), jnp.float32)
    for j in range(mtp_logits.shape[0]):
        k = j + 1
        w = mtp_distill_weights(segment_ids, loss_mask, k)
        teacher_logp = jnp.roll(teacher_logp_all, -k, axis=1)
        student_logp = jax.nn.log_softmax(mtp_logits[j].astype(jnp.float32), axis=-1)
        kl = jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - student_logp), axis=-1)
        kl_sum += jnp.sum(kl * w)
        weight_sum += jnp.sum(w)
        same = jnp.argmax(student_logp, -1) == jnp.argmax(teacher_logp, -1)
        agree += jnp.sum(same * w)
    return kl_sum, weight_sum, agree


def mtp_self_distillation_chunked(head_w: jnp.ndarray, main_hidden: jnp.ndarray, mtp_hidden: jnp.ndarray,
                                  segment_ids: jnp.ndarray, loss_mask: jnp.ndarray, chunk_tokens: int):
    """`mtp_self_distillation` from the head's inputs instead of its logits: main_hidden [B, S, d] (after the
    trunk's final norm), mtp_hidden [D, B, S, d] (ModelOutput.mtp_hidden), head_w [d, V]. The tokens go
    through in chunks of `chunk_tokens` (0: all at once), each chunk's teacher and student logits formed and
    discarded inside a rematerialised scan step, so memory is O(chunk x V) rather than (D + 1) x [B, S, V]
    fp32 logits and their log-softmaxes (several GiB at 32k tokens). Same sums as the logits version."""
    depth, batch, seq, d = mtp_hidden.shape
    w = head_w.astype(mtp_hidden.dtype)
    teacher_h, student_h, weights = [], [], []
    for j in range(depth):
        k = j + 1
        teacher_h.append(jnp.roll(main_hidden, -k, axis=1))  # the main head's input at t + k
        student_h.append(mtp_hidden[j])
        weights.append(mtp_distill_weights(segment_ids, loss_mask, k))
    tokens = depth * batch * seq
    teacher_h = jnp.stack(teacher_h).reshape(tokens, d)
    student_h = jnp.stack(student_h).reshape(tokens, d)
    weights = jnp.stack(weights).reshape(tokens)
    size = chunk_tokens if chunk_tokens and chunk_tokens < tokens else tokens
    num_chunks = -(-tokens // size)
    pad = num_chunks * size - tokens
    if pad:  # zero-weight rows
        teacher_h, student_h = (jnp.concatenate([a, jnp.zeros((pad, d), a.dtype)]) for a in (teacher_h, student_h))
        weights = jnp.concatenate([weights, jnp.zeros((pad,), weights.dtype)])

    def one_chunk(carry, chunk):
        th, sh, wc = chunk
        teacher_logits = jax.lax.stop_gradient(jnp.matmul(th, w, preferred_element_type=jnp.float32))
        teacher_logp = jax.nn.log_softmax(teacher_logits, axis=-1)  # detached: no gradient into the head
        student_logp = jax.nn.log_softmax(jnp.matmul(sh, w, preferred_element_type=jnp.float32), axis=-1)
        kl = jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - student_logp), axis=-1)
        same = jnp.argmax(student_logp, -1) == jnp.argmax(teacher_logp, -1)
        kl_sum, agree = carry
        return (kl_sum + jnp.sum(kl * wc), agree + jnp.sum(same * wc)), None

    zero = jnp.zeros((), jnp.float32)
    if num_chunks == 1:  # nothing to save by recomputing
        (kl_sum, agree), _ = one_chunk((zero, zero), (teacher_h, student_h, weights))
        return kl_sum, jnp.sum(weights), agree
    chunks = (teacher_h.reshape(num_chunks, size, d), student_h.reshape(num_chunks, size, d),
              weights.reshape(num_chunks, size))
    (kl_sum, agree), _ = jax.lax.scan(jax.checkpoint(one_chunk), (zero, zero), chunks)
    return kl_sum, jnp.sum(weights), agree


def expert_load_stats(counts: jnp.ndarray) -> dict[str, jnp.ndarray]:
    """Per-MoE-layer load from counts [L, E]: entropy of the load distribution (log E = balanced) and
    max/mean load (1 = balanced)."""
    counts = counts.astype(jnp.float32)
    load = counts / jnp.maximum(counts.sum(-1, keepdims=True), 1.0)
    entropy = -jnp.sum(jnp.where(load > 0, load * jnp.log(jnp.where(load > 0, load, 1.0)), 0.0), axis=-1)
    return {"expert_entropy": entropy, "expert_max_over_mean": load.max(-1) * counts.shape[-1]}
