"""Context parallelism (CP) layout: which tokens each CP rank holds, and the mask that travels with them.

The sequence is cut into 2*CP equal chunks and rank i holds chunks i and 2*CP-1-i (the load-balanced
causal layout of Composer 2 sec. 6 / Megatron-LM): under a causal mask chunk c needs keys of chunks
0..c, so every rank's pair needs 2*CP+1 chunks of keys and the work is even.

    seq:   | c0 | c1 | c2 | c3 | c4 | c5 | c6 | c7 |      CP = 4, 8 chunks
    rank0:  c0                                    c7
    rank1:       c1                          c6
    rank2:            c2                c5
    rank3:                 c3      c4

The model permutes its inputs into this order once (`balanced_order`), so that contiguous sharding of
the sequence axis over the CP mesh axis gives each rank its two chunks, runs every layer in permuted
order (attention masks by original position, everything else is per token), and un-permutes its
outputs. Attention itself is in models/attention.py (`MLAttention`, context-parallel branch).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from c2jax.models.logical import active_mesh_axes


class ContextParallelMask(NamedTuple):
    """Stands in for the [B, 1, S, S] mask when attention is context-parallel."""

    segment_ids: jnp.ndarray | None  # [B, S] in permuted order; None = one document per row
    seq_index: jnp.ndarray  # [S] int32: original position of each permuted position (= balanced_order)


def context_parallel_size() -> int:
    """CP degree under the installed logical rules: the size of the mesh axes "seq" maps to (1 if none)."""
    found = active_mesh_axes("seq")
    if found is None:
        return 1
    mesh, axes = found
    return int(np.prod([mesh.shape[a] for a in axes]))


def balanced_order(seq: int, cp: int) -> np.ndarray:
    """order[j] = original index of the token at permuted position j (x_permuted = x[:, order])."""
    if seq % (2 * cp):
        raise ValueError(f"context parallelism over {cp} ranks needs a sequence length divisible by "
                         f"2 x {cp} = {2 * cp}, got {seq}")
    chunk = seq // (2 * cp)
    chunks = np.arange(seq).reshape(2 * cp, chunk)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def inverse_order(order: np.ndarray) -> np.ndarray:
    """x == x_permuted[:, inverse_order(order)]."""
    return np.argsort(order)
