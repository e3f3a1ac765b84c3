"""Expert parallelism for the MoE layer, inside `jax.shard_map`.

Experts are split over the mesh axes that the logical axis "experts" maps to (the EP group, P ranks,
E/P experts each); tokens are split over the axes of "batch" and "seq". Routing runs on each rank's
own tokens, then one of two exchanges moves tokens to the ranks that own their experts:

  allgather   (`moe_ep_impl="allgather"`, runs everywhere, the CPU path) all-gather the EP group's
              tokens, run this rank's experts on every assignment that selects one of them (the sorted
              dropless dispatch of models/moe_dispatch.py, other experts' assignments contribute zero), and
              `psum_scatter` the partial outputs back: each rank receives the sum over the group for its
              own tokens. Bytes moved per rank: (P-1)/P * P*T*d each way, against (P-1)/P * k*T*d for
              an all-to-all; for k >= P the two are comparable (K2.5: k = 8 = EP).
  ragged_a2a  (`moe_ep_impl="ragged_a2a"`, GPU/TPU) sort assignments by expert, exchange exactly the
              rows each rank needs with `jax.lax.ragged_all_to_all`, grouped GEMM with
              `jax.lax.ragged_dot`, and send results back the same way. XLA:CPU does not implement
              ragged-all-to-all, so this path is compiled only on accelerators (see tests).

If the EP axis does not shard the tokens (tokens replicated over it), each rank computes its experts'
share of its (replicated) tokens and a `psum` over the EP axis completes the sum.

Expert load counts are `psum`-ed over every mesh axis that shards tokens, so the router-bias update
sees global counts whatever the mesh.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from c2jax.models.config import MOE_QUANT_GROUPED, ModelConfig
from c2jax.models.logical import active_mesh_axes, batch_axes
from c2jax.models.moe_dispatch import dispatch_local, grouped_gemm_fn, moe_path
from c2jax.models.moe_routing import Routing, route


def _axis(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


def _group_size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def expert_parallel_axes():
    """(mesh, EP axes) when expert parallelism is active under the installed logical rules, else None."""
    return active_mesh_axes("experts")


def token_parallel_mesh():
    """The mesh when tokens are sharded (batch or sequence) but experts are not, else None.

    Then each rank dispatches its own tokens to all experts (`moe_expert_parallel` with no EP axis): left
    to GSPMD, the global sort of the sorted dispatch over batch-sharded tokens turned into all-to-alls and
    all-reduces of the dispatch buffers (2.4 GB per step for `small` on fsdp=2, against 0.48 GB on
    fsdp=2 x expert=2; experiments/bench/parallel_scaling.py)."""
    if active_mesh_axes("experts") is not None:
        return None
    found = active_mesh_axes("batch") or active_mesh_axes("seq")
    return None if found is None else found[0]


def moe_expert_parallel(cfg: ModelConfig, x, w_router, bias, gate_up, down, replay_ids=None,
                        route_fn=route):
    """x [B, S, d] -> (routed-expert output [B, S, d], Routing over the B*S tokens), expert-parallel.

    `route_fn(cfg, x_tokens, w_router, bias, replay)` is the router (c2jax.models.moe_routing.route by
    default), run on each rank's tokens."""
    found = expert_parallel_axes()
    mesh, ep_axes = found if found is not None else (token_parallel_mesh(), ())
    if mesh is None:
        raise ValueError("moe_expert_parallel needs logical rules that shard the experts or the tokens")
    seq_found = active_mesh_axes("seq")
    seq_axes = () if seq_found is None else seq_found[1]
    tok_batch = tuple(a for a in batch_axes() if a not in seq_axes)
    token_axes = tok_batch + seq_axes
    ep = _group_size(mesh, ep_axes)
    if cfg.n_routed_experts % ep:
        raise ValueError(f"{cfg.n_routed_experts} experts do not split over an expert-parallel group of {ep}")
    batch, seq, d = x.shape
    if batch % max(_group_size(mesh, tok_batch), 1) or seq % max(_group_size(mesh, seq_axes), 1):
        raise ValueError(f"activations [{batch}, {seq}] do not split over mesh axes {tok_batch} x {seq_axes}")
    tok_spec = P(tok_batch or None, seq_axes or None, None)
    has_replay = replay_ids is not None
    gathered = bool(ep_axes) and all(a in token_axes for a in ep_axes)
    if not gathered and any(a in token_axes for a in ep_axes):
        raise ValueError(f"expert axes {ep_axes} must shard tokens entirely or not at all ({token_axes})")

    def local(x, w_router, bias, gate_up, down, replay):
        b, s, _ = x.shape
        flat = x.reshape(b * s, d)
        routing = route_fn(cfg, flat, w_router, bias, None if replay is None else replay.reshape(b * s, -1))
        first = jax.lax.axis_index(_axis(ep_axes)) * gate_up.shape[0] if ep_axes else None

        def experts(flat, routing):
            if not ep_axes:  # every expert on every rank: its own tokens only, nothing to exchange
                return dispatch_local(cfg, flat, routing, gate_up, down)
            if cfg.moe_ep_impl == "ragged_a2a" and gathered:
                return _ragged_a2a_experts(cfg, flat, routing, gate_up, down, first, ep_axes, ep)
            if gathered:
                return _allgather_experts(cfg, flat, routing, gate_up, down, first, ep_axes)
            return jax.lax.psum(dispatch_local(cfg, flat, routing, gate_up, down, first), _axis(ep_axes))

        y = experts(flat, routing) if not ep_axes else _in_token_chunks(cfg, experts, flat, routing)
        counts = routing.counts if not token_axes else jax.lax.psum(routing.counts, _axis(token_axes))
        k, e = routing.expert_ids.shape[1], routing.logits.shape[1]
        return (y.reshape(b, s, d), routing.expert_ids.reshape(b, s, k), routing.weights.reshape(b, s, k),
                counts, routing.logits.reshape(b, s, e))

    expert_spec = P(_axis(ep_axes) if ep_axes else None, None, None)
    in_specs = (tok_spec, P(), P(), expert_spec, expert_spec, tok_spec if has_replay else None)
    out_specs = (tok_spec, tok_spec, tok_spec, P(), tok_spec)
    fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    replay = None if replay_ids is None else replay_ids.reshape(batch, seq, -1)
    y, ids, weights, counts, logits = fn(x, w_router, bias, gate_up, down, replay)
    t = batch * seq
    return y, Routing(ids.reshape(t, -1), weights.reshape(t, -1), counts, logits.reshape(t, -1))


def token_chunk_count(num_tokens: int, chunk: int) -> int:
    """How many equal chunks to exchange `num_tokens` in: the fewest whose size divides num_tokens and is at
    most `chunk` (1: no chunking, when chunk is 0, num_tokens <= chunk, or only chunks under chunk / 2 fit)."""
    if not chunk or num_tokens <= chunk:
        return 1
    for count in range(-(-num_tokens // chunk), num_tokens + 1):
        if num_tokens % count == 0:
            return count if num_tokens // count >= chunk // 2 else 1
    return 1


def _in_token_chunks(cfg: ModelConfig, experts, flat, routing: Routing):
    """experts(flat, routing) over chunks of `cfg.moe_chunk_tokens` of this rank's tokens, one exchange each
    (a rematerialised lax.scan): the gathered tokens, the dispatch buffers, the receive buffers (whose
    worst-case bucket is ep x the rows sent) and the residuals then scale with the chunk instead of the
    rank's whole batch, for one more forward of each chunk in the backward. Every rank
    has the same token count, so all take the same number of steps and the collectives line up."""
    num_tokens, d = flat.shape
    count = token_chunk_count(num_tokens, cfg.moe_chunk_tokens)
    if count == 1:
        return experts(flat, routing)
    size = num_tokens // count
    split = lambda a: None if a is None else a.reshape(count, size, *a.shape[1:])

    # rematerialised: autodiff would otherwise stack each chunk's residuals, which in the exchange paths span
    # every gathered assignment (ep x this rank's), back to the unchunked total; recomputing a chunk's exchange
    # in the backward keeps only its inputs
    @jax.checkpoint
    def one_chunk(carry, chunk):
        x, ids, weights = chunk
        return carry, experts(x, Routing(ids, weights, routing.counts, None))

    _, y = jax.lax.scan(one_chunk, None, (split(flat), split(routing.expert_ids), split(routing.weights)))
    return y.reshape(num_tokens, d)


def _allgather_experts(cfg, flat, routing: Routing, gate_up, down, first, ep_axes):
    axis = _axis(ep_axes)
    gather = partial(jax.lax.all_gather, axis_name=axis, tiled=True)
    everyone = Routing(gather(routing.expert_ids), gather(routing.weights), routing.counts, None)
    partial_out = dispatch_local(cfg, gather(flat), everyone, gate_up, down, first)
    return jax.lax.psum_scatter(partial_out, axis, scatter_dimension=0, tiled=True)


def _recv_buckets(cfg: ModelConfig, rows: int, ep: int) -> tuple[int, ...]:
    """Static receive-buffer sizes (rows), tried in order; the last, ep * rows, can never overflow."""
    caps = []
    for factor in cfg.moe_capacity_factors:
        cap = min(ep * rows, 8 * math.ceil(factor * rows / 8))
        if not caps or cap > caps[-1]:
            caps.append(cap)
    if caps[-1] < ep * rows:
        caps.append(ep * rows)
    return tuple(caps)


def _ragged_a2a_experts(cfg, flat, routing: Routing, gate_up, down, first, ep_axes, ep):
    # the received rows are already sorted by expert: grouped GEMMs, the registry's on the grouped path
    if moe_path(cfg) == "grouped":
        gemm = grouped_gemm_fn(cfg)
    elif cfg.moe_quant == "bf16":
        gemm = lambda lhs, rhs, sizes, src: jax.lax.ragged_dot(lhs, rhs, sizes)  # noqa: E731
    else:
        raise ValueError(f"moe_ep_impl='ragged_a2a' runs the experts as grouped GEMMs: moe_quant={cfg.moe_quant!r} "
                         f"needs moe_impl='grouped' (it runs {MOE_QUANT_GROUPED}), got {cfg.moe_impl!r}")
    axis = _axis(ep_axes)
    num_local = gate_up.shape[0]
    t, k = routing.expert_ids.shape
    rows = t * k
    ids = routing.expert_ids.reshape(-1)
    order = jnp.argsort(ids, stable=True)  # by expert, hence by destination rank
    sorted_rows = flat[order // k]
    dest = ids // num_local
    send_sizes = jnp.zeros((ep,), jnp.int32).at[dest].add(1)
    input_offsets = jnp.cumsum(send_sizes) - send_sizes
    sizes = jax.lax.all_gather(send_sizes, axis)  # [src, dst]
    offsets = jax.lax.all_gather(input_offsets, axis)
    me = jax.lax.axis_index(axis)
    recv_sizes = sizes[:, me]
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
    # where my rows land in each receiver's buffer: after the rows of every lower-ranked sender
    output_offsets = (jnp.cumsum(sizes, axis=0) - sizes)[me]
    buckets = _recv_buckets(cfg, rows, ep)
    needed = jnp.max(jnp.sum(sizes, axis=0))  # the fullest receiver decides, so every rank takes one branch

    def exchange(capacity):
        def run(sorted_rows, gate_up, down):
            buf = jnp.zeros((capacity, flat.shape[1]), flat.dtype)
            received = jax.lax.ragged_all_to_all(sorted_rows, buf, input_offsets, send_sizes,
                                                 output_offsets, recv_sizes, axis_name=axis)
            local_ids = jax.lax.ragged_all_to_all(
                (ids[order] - first).astype(jnp.int32), jnp.full((capacity,), num_local, jnp.int32),
                input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis)
            local_ids = jnp.where(jnp.arange(capacity) < recv_sizes.sum(), local_ids, num_local)
            by_expert = jnp.argsort(local_ids, stable=True)
            group_sizes = jnp.zeros((num_local + 1,), jnp.int32).at[local_ids].add(1)[:num_local]
            h = received[by_expert]
            gu = gemm(h, gate_up.astype(h.dtype), group_sizes, None)
            gate, up = jnp.split(gu, 2, axis=-1)
            out = gemm(jax.nn.silu(gate) * up, down.astype(h.dtype), group_sizes, None)
            out = jnp.zeros_like(out).at[by_expert].set(out)
            back = jnp.zeros((rows, flat.shape[1]), flat.dtype)
            return jax.lax.ragged_all_to_all(out, back, recv_offsets, recv_sizes, offsets[:, me],
                                             sizes[me], axis_name=axis)
        return run

    index = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets), needed, side="left"), len(buckets) - 1)
    out_sorted = jax.lax.switch(index, [exchange(c) for c in buckets], sorted_rows, gate_up, down)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", out, routing.weights.astype(out.dtype))
