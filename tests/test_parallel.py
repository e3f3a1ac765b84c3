"""Parallelism (issue 3): every mesh computes what one device computes.

Meshes of 8 fake CPU devices (tests/conftest.py): pure data, fsdp x expert, expert x context,
fsdp x context. Expert parallelism runs the all-gather shard_map path of models/expert_parallel.py
(meshes without an expert axis its token-local form);
context parallelism the balanced-chunk MLA of models/attention.py. The ragged_all_to_all path is
lowered here but only compiled and run where an accelerator exists (XLA:CPU has no ragged-all-to-all).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx
from jax.sharding import PartitionSpec

from c2jax.config import ConfigError, MeshConfig
from c2jax.mesh import activation_rules, batch_shardings, make_mesh, shard_state, state_shardings
from c2jax.models.attention import AttentionMask, make_attention
from c2jax.models.config import preset
from c2jax.models.context_parallel import ContextParallelMask, balanced_order, inverse_order
from c2jax.models.logical import logical_rules
from c2jax.models.rope import rope_tables
from c2jax.models.transformer import abstract_state, forward, init
from c2jax.sharding_rules import DEFAULT_PARAM_RULES, partition_spec

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden" / "kimi_k25_fsdp8_expert8_specs.yaml"
MESHES = [dict(data=8), dict(fsdp=2, expert=4), dict(expert=4, context=2), dict(fsdp=4, context=2)]


def _tiny():
    # MTP on, so the context-parallel permutation is exercised through the MTP block too
    return dataclasses.replace(preset("tiny"), num_nextn_predict_layers=1)


def _batch(cfg):
    ids = jax.random.randint(jax.random.key(1), (8, 32), 0, cfg.vocab_size)
    # two packed documents per row, split across the CP chunk boundaries
    seg = jnp.concatenate([jnp.ones((8, 12), jnp.int32), jnp.full((8, 20), 2, jnp.int32)], axis=1)
    return ids, seg


def _objective(graphdef):
    def f(state, ids, seg):
        out = forward(graphdef, state, ids, segment_ids=seg)
        value = jnp.mean(out.logits ** 2)
        if out.mtp_logits is not None:
            value = value + jnp.mean(out.mtp_logits ** 2)
        return value, out
    return f


def _reference(cfg):
    graphdef, state = nnx.split(init(cfg, seed=0))
    ids, seg = _batch(cfg)
    (value, out), grads = jax.jit(jax.value_and_grad(_objective(graphdef), has_aux=True))(state, ids, seg)
    return cfg, graphdef, state, (ids, seg), out, grads


@pytest.fixture(scope="module")
def reference():
    return _reference(_tiny())


@pytest.fixture(scope="module")
def gqa_reference():
    return _reference(preset("tiny-qwen3-moe"))


@pytest.mark.parametrize("sizes", MESHES, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_forward_and_gradients_match_single_device(reference, sizes):
    _check_sharded_against_reference(reference, sizes)


@pytest.mark.parametrize("sizes", [dict(expert=4, context=2), dict(fsdp=2, context=4)],
                         ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_qwen3_moe_forward_and_gradients_match_single_device(gqa_reference, sizes):
    """The GQA family under FSDP + EP + CP: context parallelism all-gathers its K/V heads, exactly."""
    _check_sharded_against_reference(gqa_reference, sizes)


@pytest.mark.parametrize("sizes", [dict(fsdp=2, expert=4), dict(data=8)],
                         ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_grouped_path_runs_expert_parallel_and_matches_single_device(reference, sizes):
    """moe_impl="grouped" (what "auto" picks on a GPU) under a mesh: each rank runs its own experts' grouped GEMMs
    through the kernel registry inside the shard_map (the other ranks' assignments sorted past its groups), and the
    token-local form runs them on its own tokens; both equal the single-device sorted reference."""
    import c2jax.kernels.grouped_gemm as grouped_gemm

    cfg = dataclasses.replace(reference[0], moe_impl="grouped", moe_kernel="xla")
    graphdef, _ = nnx.split(init(cfg, seed=0))
    calls = []
    real = grouped_gemm.grouped_matmul

    def counted(*args, **kwargs):
        calls.append(kwargs.get("impl"))
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grouped_gemm, "grouped_matmul", counted)
        _check_sharded_against_reference(reference, sizes, graphdef)
    assert calls and set(calls) == {"xla"}  # the registry's grouped GEMM ran, the kernel the config names


def test_ragged_all_to_all_runs_the_grouped_kernels_and_refuses_sorted_quantized(reference):
    """Under moe_ep_impl="ragged_a2a" the received rows run the registry's grouped GEMM on the grouped path (lowered
    here: XLA:CPU cannot compile ragged-all-to-all); a quantized recipe on the sorted path is refused, not run in
    bf16."""
    import c2jax.kernels.grouped_gemm as grouped_gemm

    cfg, _, _, (ids, _), *_ = reference
    mesh_cfg = MeshConfig(fsdp=2, expert=4)
    mesh = make_mesh(mesh_cfg)

    def lowered(cfg):
        graphdef, state = nnx.split(init(cfg, seed=0))

        def loss(state, ids):
            with logical_rules(mesh, activation_rules(mesh_cfg)):
                return jnp.mean(forward(graphdef, state, ids).logits ** 2)

        return jax.jit(jax.grad(loss)).lower(shard_state(state, mesh), ids).as_text()

    calls = []
    real = grouped_gemm.grouped_matmul
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grouped_gemm, "grouped_matmul", lambda *a, **k: calls.append(k.get("impl")) or real(*a, **k))
        text = lowered(dataclasses.replace(cfg, moe_ep_impl="ragged_a2a", moe_impl="grouped", moe_kernel="xla"))
    assert "ragged_all_to_all" in text or "ragged-all-to-all" in text
    assert calls and set(calls) == {"xla"}
    with pytest.raises(ValueError, match="moe_quant='mxfp8' needs moe_impl='grouped'"):
        lowered(dataclasses.replace(cfg, moe_ep_impl="ragged_a2a", moe_impl="sorted", moe_quant="mxfp8"))


def _check_sharded_against_reference(reference, sizes, graphdef=None):
    cfg, ref_graphdef, state, (ids, seg), ref_out, ref_grads = reference
    graphdef = ref_graphdef if graphdef is None else graphdef
    mesh_cfg = MeshConfig(**sizes)
    mesh = make_mesh(mesh_cfg)
    sharded = shard_state(state, mesh)
    rules = activation_rules(mesh_cfg)

    def step(state, ids, seg):
        with logical_rules(mesh, rules):
            return jax.value_and_grad(_objective(graphdef), has_aux=True)(state, ids, seg)

    # every mesh here shards tokens, so the MoE runs in shard_map: expert-parallel when there is an expert
    # axis, else token-local (each rank dispatches its own tokens to all experts)
    assert "shard_map" in str(jax.make_jaxpr(step)(sharded, ids, seg))
    (_, out), grads = jax.jit(step)(sharded, ids, seg)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref_out.logits), rtol=1e-5, atol=1e-5)
    if ref_out.mtp_logits is not None:
        np.testing.assert_allclose(np.asarray(out.mtp_logits), np.asarray(ref_out.mtp_logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.expert_ids), np.asarray(ref_out.expert_ids))
    # global expert counts: reduced over every axis that shards tokens, equal to the unsharded counts
    np.testing.assert_array_equal(np.asarray(out.expert_counts), np.asarray(ref_out.expert_counts))
    for (path, got), (_, want) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        got, want = np.asarray(got.get_value()), np.asarray(want.get_value())
        scale = max(np.abs(want).max(), 1e-6)
        assert np.abs(got - want).max() <= 1e-5 * scale + 1e-7, f"gradient of {'/'.join(map(str, path))}"


def test_balanced_order_layout_and_round_trip():
    order = balanced_order(16, 4)  # 8 chunks of 2; rank i holds chunks i and 7 - i
    np.testing.assert_array_equal(order.reshape(4, 4), [[0, 1, 14, 15], [2, 3, 12, 13],
                                                        [4, 5, 10, 11], [6, 7, 8, 9]])
    x = np.arange(3 * 16).reshape(3, 16)
    np.testing.assert_array_equal(x[:, order][:, inverse_order(order)], x)
    # causal work per rank (keys visible to its queries) is the same on every rank
    work = [sum(int(q) + 1 for q in row) for row in order.reshape(4, 4)]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="divisible by 2 x 4"):
        balanced_order(12, 4)


@pytest.mark.parametrize("cp, backend, name", [(2, None, "tiny"), (4, None, "tiny"), (8, None, "tiny"),
                                               (4, "blockwise", "tiny"), (4, None, "tiny-qwen3-moe"),
                                               (8, "blockwise", "tiny-llama")])
def test_context_parallel_attention_equals_unsharded(cp, backend, name, monkeypatch):
    """Per-rank attention by original positions equals the unsharded layer: under the platform default
    (dense at these sizes) and with the blockwise backend forced on the ranks; MLA and GQA."""
    cfg = preset(name)
    attn = make_attention(cfg, nnx.Rngs(params=3))
    batch, seq = 8 // cp, 64
    x = jax.random.normal(jax.random.key(0), (batch, seq, cfg.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    seg = (jnp.arange(seq)[None, :] >= 23).astype(jnp.int32) + jnp.arange(batch)[:, None] % 2
    cos, sin = rope_tables(cfg, positions)
    want = attn(x, cos, sin, AttentionMask(seg))

    mesh_cfg = MeshConfig(data=8 // cp, context=cp)
    mesh = make_mesh(mesh_cfg)
    order = balanced_order(seq, cp)
    cos_p, sin_p = rope_tables(cfg, positions[:, order])

    @jax.jit
    def run(x):
        with logical_rules(mesh, activation_rules(mesh_cfg)):
            return attn(x[:, order], cos_p, sin_p, ContextParallelMask(seg[:, order], jnp.asarray(order)))

    if backend is not None:
        monkeypatch.setenv("C2JAX_ATTENTION", backend)  # read while `run` traces

    got = np.asarray(run(x))[:, inverse_order(order)]
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)


def test_context_parallel_rejects_indivisible_sequence(reference):
    cfg, graphdef, state, *_ = reference
    mesh_cfg = MeshConfig(data=4, context=2)
    mesh = make_mesh(mesh_cfg)
    ids = jnp.zeros((4, 30), jnp.int32)  # 30 is not a multiple of 2 x 2
    with pytest.raises(ValueError, match="divisible by 2 x 2"), logical_rules(mesh, activation_rules(mesh_cfg)):
        jax.eval_shape(lambda s, i: forward(graphdef, s, i).logits, state, ids)


def test_kimi_k25_specs_on_64_devices_match_hand_written_golden():
    golden = yaml.safe_load(GOLDEN.read_text())
    cfg = preset("kimi-k2.5")
    _, state = abstract_state(cfg)
    mesh_shape = MeshConfig(fsdp=8, expert=8).sizes
    got = {}
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        spec = partition_spec(value.shape, var.get_metadata()["logical_axes"], mesh_shape, DEFAULT_PARAM_RULES)
        got["/".join(map(str, path))] = spec
    as_spec = lambda entries: PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))
    for name, entries in golden.items():
        assert name in got, f"{name} not in the model"
        assert got[name] == as_spec(entries), f"{name}: {got[name]} != {as_spec(entries)}"


def test_mesh_infers_minus_one_and_explains_mistakes():
    assert MeshConfig(fsdp=-1, expert=4).resolve(8).fsdp == 2
    assert dict(make_mesh(MeshConfig(data=-1, context=2)).shape)["data"] == 4
    with pytest.raises(ConfigError, match="at most one"):
        MeshConfig(fsdp=-1, expert=-1)
    with pytest.raises(ConfigError, match="do not divide"):
        MeshConfig(fsdp=-1, expert=3).resolve(8)
    with pytest.raises(ConfigError, match="needs 4 devices, 8 available"):
        make_mesh(MeshConfig(fsdp=4))


def test_state_and_batch_shardings_follow_rules():
    mesh_cfg = MeshConfig(fsdp=2, expert=4, param_rules={"vocab": None}, activation_rules={})
    mesh = make_mesh(mesh_cfg)
    _, state = abstract_state(preset("tiny"))
    shardings = state_shardings(state, mesh)
    experts = shardings["moe_layers"]["mlp"]["gate_up_proj"].get_value()
    assert experts.spec == PartitionSpec(None, "expert", "fsdp", None)
    batch = {"input_ids": jnp.zeros((8, 32), jnp.int32), "reward": jnp.zeros((8,))}
    specs = {k: v.spec for k, v in batch_shardings(batch, mesh, activation_rules(mesh_cfg)).items()}
    assert specs == {"input_ids": PartitionSpec(("fsdp", "expert"), None),
                     "reward": PartitionSpec(("fsdp", "expert"))}


@pytest.mark.parametrize("sizes", [dict(fsdp=2, expert=4), dict(expert=4, context=2)],
                         ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_expert_parallel_exchange_in_token_chunks_matches_single_device(reference, sizes):
    """moe_chunk_tokens=16 splits each rank's 32 (or 64) tokens into chunks, one all-gather exchange each."""
    cfg, _, state, (ids, seg), ref_out, ref_grads = reference
    graphdef, _ = nnx.split(init(dataclasses.replace(cfg, moe_chunk_tokens=16), seed=0))
    mesh_cfg = MeshConfig(**sizes)
    mesh = make_mesh(mesh_cfg)

    def step(state, ids, seg):
        with logical_rules(mesh, activation_rules(mesh_cfg)):
            return jax.value_and_grad(_objective(graphdef), has_aux=True)(state, ids, seg)

    def scans(graphdef):
        def f(state, ids, seg):
            with logical_rules(mesh, activation_rules(mesh_cfg)):
                return _objective(graphdef)(state, ids, seg)[0]
        return str(jax.make_jaxpr(f)(shard_state(state, mesh), ids, seg)).count("scan[")

    assert scans(graphdef) > scans(reference[1])  # the exchange really runs in chunks
    (_, out), grads = jax.jit(step)(shard_state(state, mesh), ids, seg)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref_out.logits), rtol=1e-5, atol=1e-5)
    for (path, got), (_, want) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        got, want = np.asarray(got.get_value()), np.asarray(want.get_value())
        assert np.abs(got - want).max() <= 1e-5 * max(np.abs(want).max(), 1e-6) + 1e-7, "/".join(map(str, path))


def test_token_chunk_count_divides_the_tokens():
    from c2jax.models.expert_parallel import token_chunk_count

    assert token_chunk_count(32, 16) == 2 and token_chunk_count(64, 16) == 4
    assert token_chunk_count(48, 20) == 3
    assert token_chunk_count(16, 16) == 1 and token_chunk_count(100, 0) == 1
    assert token_chunk_count(37, 16) == 1  # prime: only chunks of 1 token would divide it


def test_ragged_all_to_all_path_lowers(reference):
    """The GPU path builds and lowers to HLO here; XLA:CPU cannot compile ragged-all-to-all, so it is run
    (and compared with the all-gather path) only on an accelerator."""
    cfg, _, _, (ids, seg), *_ = reference
    cfg = dataclasses.replace(cfg, moe_ep_impl="ragged_a2a")
    graphdef, state = nnx.split(init(cfg, seed=0))
    mesh_cfg = MeshConfig(fsdp=2, expert=4)
    mesh = make_mesh(mesh_cfg)

    def loss(state, ids):
        with logical_rules(mesh, activation_rules(mesh_cfg)):
            return jnp.mean(forward(graphdef, state, ids).logits ** 2)

    lowered = jax.jit(jax.grad(loss)).lower(shard_state(state, mesh), ids)
    assert "ragged-all-to-all" in lowered.as_text() or "ragged_all_to_all" in lowered.as_text()


def test_plan_cli_reports_exact_parameter_memory(capsys):
    import json

    from c2jax.cli import main

    assert main(["plan", "kimi-k2.5", "--devices", "64", "--mesh", "fsdp=8,expert=8", "--seq", "32768",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    c = preset("kimi-k2.5")
    d, h, n_moe = c.hidden_size, c.num_attention_heads, c.num_hidden_layers - c.first_k_dense_replace
    attention = (d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * c.qk_head_dim
                 + d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
                 + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) + h * c.v_head_dim * d + 2 * d)
    moe = d * c.n_routed_experts + 3 * d * c.moe_intermediate_size * (c.n_routed_experts + c.n_shared_experts)
    total_params = (2 * c.vocab_size * d + d + c.num_hidden_layers * attention
                    + c.first_k_dense_replace * 3 * d * c.intermediate_size + n_moe * moe)
    # fp32 master weights and two fp32 Adam moments, split 64 ways (norms are small and replicated)
    assert out["params_bytes"] == pytest.approx(4 * total_params / 64, rel=5e-3)
    assert out["optimizer_bytes"] == pytest.approx(2 * out["params_bytes"], rel=1e-6)
    assert out["mesh"]["fsdp"] == 8 and out["mesh"]["expert"] == 8 and out["mesh"]["data"] == 1
    assert out["fits"]["H200"] is False  # 192 GB of weights and moments alone
    assert main(["plan", "kimi-k2.5", "--devices", "60", "--mesh", "fsdp=8,expert=8"]) == 2
    assert "do not divide" in capsys.readouterr().err


def test_plan_cli_plans_a_pretraining_config_phase_by_phase(capsys):
    """`c2jax plan --config` on the paper's pretraining config: one plan per phase, at the phase's own
    sequence length and batch; per-device parameter bytes do not depend on the phase."""
    import json

    from c2jax.cli import main
    from c2jax.config import load
    from c2jax.train.config import PretrainConfig

    path = str(ROOT / "experiments" / "configs" / "composer2_k2.5.yaml")
    assert main(["plan", "--config", path, "--devices", "512", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    cfg = load(PretrainConfig, path)
    assert [r["label"] for r in rows] == [f"phase {p.name}" for p in cfg.phases]
    assert [(r["seq"], r["batch"]) for r in rows] == [(p.seq_len, p.batch_size or cfg.data["batch_size"])
                                                      for p in cfg.phases]
    assert all(r["mesh"] == {"data": 1, "fsdp": 8, "expert": 8, "context": 8, "tensor": 1} for r in rows)
    assert all(r["fits"]["H200"] for r in rows)  # the size the config states
    assert len({r["params_bytes"] for r in rows}) == 1
    # 8x the sequence of the short phase: the long phase holds more activation memory per device
    assert rows[1]["activation_bytes"] > rows[0]["activation_bytes"]
    # --seq/--batch replace every phase's shape: one plan
    assert main(["plan", "--config", path, "--devices", "512", "--seq", "4096", "--batch", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq"] == 4096
    # an inferred (-1) mesh axis needs the device count
    assert main(["plan", "--config", path]) == 2
    assert "pass --devices N" in capsys.readouterr().err


def test_plan_cli_plans_an_rl_config_at_its_engine_context_and_takes_overrides(capsys):
    import json

    from c2jax.cli import main

    path = ROOT / "experiments" / "configs" / "rl_composer2_k2.5.yaml"
    max_len = yaml.safe_load(path.read_text())["engine"]["max_len"]
    assert main(["plan", "--config", str(path), "--devices", "64", "--batch", "8", "--json"]) == 0
    capsys.readouterr()
    assert main(["plan", "--config", str(path), "mesh.context=4", "--devices", "64", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["label"] == "engine.max_len" and row["seq"] == max_len and row["mesh"]["context"] == 4
    # only model/mesh overrides mean anything to a plan; a source given twice is an error
    assert main(["plan", "--config", str(path), "rl.kl_coef=0.1", "--devices", "64"]) == 2
    assert "only model.* and mesh.* overrides" in capsys.readouterr().err
    assert main(["plan", "kimi-k2.5", "--config", str(path)]) == 2
    assert "two sources" in capsys.readouterr().err
