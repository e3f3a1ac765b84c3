"""`c2jax info`: counts and memory from abstract shapes, checked against closed-form formulas."""

import json
import math

import pytest

from c2jax.cli import main
from c2jax.info import per_device_memory, report
from c2jax.models.config import preset
from c2jax.models.flops import param_counts, training_flops_per_token
from c2jax.sharding_rules import partition_spec


def closed_form_params(c):
    """DeepSeek-V3 parameter count written out by hand from the config (independent of the model code)."""
    d, h = c.hidden_size, c.num_attention_heads
    q = d * h * c.qk_head_dim if c.q_lora_rank is None else (
        d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * c.qk_head_dim)
    attn = q + d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank \
        + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) + h * c.v_head_dim * d
    norms = 2 * d
    dense = 3 * d * c.intermediate_size
    expert = 3 * d * c.moe_intermediate_size
    moe_total = d * c.n_routed_experts + expert * (c.n_routed_experts + c.n_shared_experts)
    moe_active = d * c.n_routed_experts + expert * (c.num_experts_per_tok + c.n_shared_experts)
    n_dense, n_moe = c.first_k_dense_replace, c.num_hidden_layers - c.first_k_dense_replace
    embed = c.vocab_size * d
    head = 0 if c.tie_word_embeddings else c.vocab_size * d
    mtp = c.num_nextn_predict_layers * (3 * d + 2 * d * d + attn + norms + moe_total)
    mtp_active = c.num_nextn_predict_layers * (3 * d + 2 * d * d + attn + norms + moe_active)
    trunk = n_dense * (attn + norms + dense) + embed + head + d
    total = trunk + n_moe * (attn + norms + moe_total) + mtp
    active = trunk + n_moe * (attn + norms + moe_active) + mtp_active
    return total, active


@pytest.mark.parametrize("name", ["kimi-k2.5", "deepseek-v3", "small", "tiny"])
def test_parameter_counts_match_the_closed_form(name):
    cfg = preset(name)
    counts = param_counts(cfg)
    total, active = closed_form_params(cfg)
    assert counts.total == total
    assert abs(counts.active - active) <= cfg.num_hidden_layers  # rounding of the routed fraction


def test_kimi_k25_is_one_trillion_total_and_32b_active():
    counts = param_counts(preset("kimi-k2.5"))
    assert 1.02e12 < counts.total < 1.05e12
    assert 32e9 < counts.active < 33.5e9


def test_deepseek_v3_main_model_is_671b():
    counts = param_counts(preset("deepseek-v3"))
    assert abs((counts.total - counts.mtp) / 1e9 - 671) < 1.0


def test_training_flops_are_six_n_plus_causal_attention():
    cfg = preset("small").replace(num_nextn_predict_layers=0)
    counts = param_counts(cfg)
    seq = 512
    attention = 3 * 2 * (seq + 1) / 2 * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) \
        * cfg.num_hidden_layers
    expected = 6 * (counts.active - counts.embedding) + attention
    assert training_flops_per_token(cfg, seq, include_mtp=False) == pytest.approx(expected)


def test_fully_sharded_memory_is_sixteen_bytes_per_param_over_devices():
    """fp32 params + two fp32 Adam moments = 12 bytes/param, split over every device when all shard."""
    cfg = preset("kimi-k2.5")
    mesh = {"data": 1, "fsdp": 64, "expert": 8, "context": 1, "tensor": 1}
    mem = per_device_memory(cfg, mesh)
    total = param_counts(cfg).total
    ideal = 12 * total / 512
    assert ideal <= mem.params_bytes + mem.optimizer_bytes < 1.01 * ideal


def test_partition_spec_skips_axes_that_do_not_divide_or_repeat():
    mesh = {"fsdp": 4, "expert": 8, "tensor": 1}
    assert tuple(partition_spec((16, 512, 64), ("experts", "embed", "expert_mlp"), mesh)) == ("expert", "fsdp", None)
    # 6 experts do not split 8 ways, so the expert axis goes to the model dimension instead
    assert tuple(partition_spec((6, 512), ("experts", "embed"), mesh)) == (None, ("fsdp", "expert"))
    with pytest.raises(KeyError, match="bogus"):
        partition_spec((4,), ("bogus",), mesh)


def test_cli_info_prints_counts_without_allocating(capsys):
    assert main(["info", "kimi-k2.5", "mesh.fsdp=64", "mesh.expert=8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["devices"] == 512
    assert math.isclose(r["total_params"], param_counts(preset("kimi-k2.5")).total)
    assert r["per_device_total_bytes"] < 30 * 2**30


def test_cli_info_rejects_bad_values_with_the_field_name(capsys):
    assert main(["info", "tiny", "model.num_experts_per_tok=99"]) == 2
    assert "num_experts_per_tok" in capsys.readouterr().err
    assert report(preset("tiny"), {"fsdp": 1}, 16)["total_params"] > 0
