"""Paper configs load and plan; each ablation script runs (--quick) and its numbers match closed forms."""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from c2jax.config import load
from c2jax.plan import plan
from c2jax.train.config import PretrainConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "experiments" / "configs"
ABLATIONS = ROOT / "experiments" / "ablations"


def _load_script(name: str):
    path = ABLATIONS / name / "run.py"
    spec = importlib.util.spec_from_file_location(f"ablation_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["composer2_k2.5.yaml", "composer2_cpt_small.yaml"])
def test_composer2_configs_load(name):
    cfg = load(PretrainConfig, CONFIGS / name)
    assert [p.name for p in cfg.phases] == ["main", "long", "sft"]
    assert cfg.optimizer.name == "adamw"
    long = cfg.phases[1]
    assert long.seq_len > cfg.phases[0].seq_len and long.rope_scaling is not None


def test_full_scale_config_is_the_report_setup_and_plans():
    cfg = load(PretrainConfig, CONFIGS / "composer2_k2.5.yaml")
    assert cfg.model.n_routed_experts == 384 and cfg.model.num_experts_per_tok == 8  # Kimi K2.5 routing
    assert [p.seq_len for p in cfg.phases] == [32768, 262144, 32768]
    mesh = cfg.mesh.resolve(512)  # the device count the config states
    assert (mesh.sizes["expert"], mesh.sizes["context"], mesh.sizes["fsdp"]) == (8, 8, 8)
    for phase in cfg.phases:
        p = plan(cfg.model, mesh, phase.seq_len, phase.batch_size or cfg.data["batch_size"])
        # ~1.03T fp32 master parameters sharded over all 512 devices (fsdp x expert x context): ~8 GB each
        assert 1.0e12 * 4 / 512 < p.params_bytes < 1.1e12 * 4 / 512
        assert p.optimizer_bytes == pytest.approx(2 * p.params_bytes, rel=0.01)  # fp32 m and v, like the masters
        assert p.fits(141.0), phase.name  # an H200


def test_kl_estimators_bias_matches_closed_form(tmp_path):
    result = _load_script("03_kl_estimators").main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "kl_estimators.png").stat().st_size > 0 and any((tmp_path / "tb").iterdir())
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == result["rows"]
    n = result["config"]["samples"]
    for row in result["rows"]:
        mu = row["mu"]
        assert row["true_kl"] == pytest.approx(mu**2 / 2)
        # k1 = (x - mu)^2/2 - x^2/2 = mu^2/2 - mu x: mean mu^2/2, std |mu|; within 5 standard errors
        assert abs(row["k1"]["bias"]) < 5 * abs(mu) / math.sqrt(n)
        assert row["k1"]["std"] == pytest.approx(abs(mu), rel=0.1)
        # k2 = (mu^2/2 - mu x)^2 / 2: E = (mu^4/4 + mu^2) / 2, so bias = mu^4 / 8
        assert row["k2"]["bias"] == pytest.approx(mu**4 / 8, rel=0.3, abs=3 * mu**2 / math.sqrt(n))


def test_length_penalty_curves_match_closed_forms(tmp_path):
    result = _load_script("05_length_penalty").main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "length_penalty.png").stat().st_size > 0
    for c in result["curves"]:
        x, y, k, q = np.array(c["x"]), np.array(c["cost"]), c["k"], c["q"]
        if q == 0:
            want = x
        elif q == 1:
            want = np.log(1 + k * x) / k
        else:
            want = ((1 + k * x) ** (1 - q) - 1) / (k * (1 - q))
        np.testing.assert_allclose(y, want, rtol=1e-9, atol=1e-9)
        marg = list(c["tool_call_marginal_cost"].values())
        assert marg == sorted(marg, reverse=True)  # concave: later calls never cost more


def test_advantage_std_normalisation_amplifies_groups_without_signal(tmp_path):
    result = _load_script("04_advantage_std").main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "advantage_std.png").stat().st_size > 0 and any((tmp_path / "tb").iterdir())
    on, off = result["summary"]["std_on"], result["summary"]["std_off"]
    g = result["config"]["group_size"]
    # normalised by the sample std (ddof 1), the advantages of a group have RMS sqrt((g-1)/g) exactly, and the
    # mean |.| of a Gaussian sample is below its RMS (about sqrt(2/pi) of it)
    assert 0.5 < on["noise_group_abs_advantage"] <= math.sqrt((g - 1) / g) + 1e-6
    # unnormalised, the same groups keep the noise at its own scale: E|x - mean| < noise_scale
    assert off["noise_group_abs_advantage"] < result["config"]["noise_scale"]
    for run in result["runs"]:
        assert len(run["correctness"]) == result["config"]["steps"]
        assert all(0.0 <= c <= 1.0 for c in run["correctness"])


def test_router_replay_removes_routing_flips_from_the_mismatch(tmp_path):
    result = _load_script("08_router_replay").main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "router_replay.png").stat().st_size > 0 and any((tmp_path / "tb").iterdir())
    for row in result["rows"]:
        off, on = row["replay_off"], row["replay_on_filter0.0"]
        assert 0.0 <= row["routing_disagreement"] < 0.2
        # without the filter the trainer uses exactly the sampler's experts
        assert on["filter_override_fraction"] == 0.0
        assert on["tokens"] == off["tokens"] > 0
        # what is left with replay is rounding only, so it is never worse in the tail than a flipped expert
        assert on["abs_max"] <= off["abs_max"] + 1e-6
        assert on["abs_mean"] < 0.05


def test_nvfp4_per_token_output_is_invariant_to_the_batch_per_tensor_is_not(tmp_path):
    result = _load_script("06_nvfp4_scales").main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "nvfp4_scales.png").stat().st_size > 0 and any((tmp_path / "tb").iterdir())
    assert json.loads((tmp_path / "results.json").read_text())["batch_variance"] == result["batch_variance"]
    per_token, per_tensor = result["batch_variance"]["per_token"], result["batch_variance"]["per_tensor"]
    # per token: the probe sequence's codes and output are bit-identical whatever else is in the batch
    assert per_token["batches_where_probe_output_changed"] == 0.0
    assert per_token["probe_inputs_changed_fraction"] == 0.0
    assert per_token["probe_relative_error_max"] == per_token["probe_relative_error_alone"]
    # per tensor: the batch's global amax sets the probe's encode scale, so other sequences change its codes
    assert per_tensor["batches_where_probe_output_changed"] > 0.9
    assert per_tensor["probe_inputs_changed_fraction"] > 0.1
    for s in (per_token, per_tensor):  # NVFP4 of Gaussian activations: ~0.13 relative error on the product
        assert 0.05 < s["probe_relative_error_mean"] < 0.2
    # one other sequence 10^6 x larger: per tensor, the probe's E4M3 block scales round to 0 (amax_b / amax_g below
    # ~2^-10 / 448) and its blocks are flushed to zero; per token, nothing changes
    sweep = result["amax_ratio_sweep"]
    assert sweep["ratio"][-1] == 1e6 and sweep["per_tensor"]["probe_zero_block_fraction"][-1] == 1.0
    assert sweep["per_tensor"]["probe_relative_error"][-1] == pytest.approx(1.0)
    assert len(set(sweep["per_token"]["probe_relative_error"])) == 1
    assert sweep["per_token"]["probe_zero_block_fraction"] == [0.0] * len(sweep["ratio"])


@pytest.mark.xla_default_codegen
def test_approximate_division_changes_nvfp4_codes_never_mxfp8(tmp_path):
    result = _load_script("07_division").main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "division.png").stat().st_size > 0 and any((tmp_path / "tb").iterdir())
    stats = result["quantizer"]
    assert {s["distribution"] for s in stats.values()} == {"gaussian", "gaussian_bf16"}
    for s in stats.values():
        if s["format"] == "mxfp8_e4m3":  # power-of-two scales: x * (1/s) == x / s exactly
            assert s["elements_differing_fraction"] == 0.0
        # a last-bit difference in x / s only moves values sitting on a rounding tie: the errors agree
        assert s["relative_error_approx"] == pytest.approx(s["relative_error_ieee"], rel=1e-3)
    # bf16-valued inputs sit on exact E2M1 / E4M3 ties often enough that some codes flip (~1e-4 .. 1e-3). Per
    # tensor there is one scale s_dec for all rows, which may or may not put bf16 values on ties: not asserted
    for fmt in ("nvfp4_per_token", "fp8_deepseek"):
        assert 0.0 < stats[f"gaussian_bf16/{fmt}"]["elements_differing_fraction"] < 1e-2


def test_full_scale_rl_config_is_the_report_setup():
    from c2jax.rl.system.config import RLSystemConfig

    cfg = load(RLSystemConfig, CONFIGS / "rl_composer2_k2.5.yaml")
    assert cfg.model.n_routed_experts == 384 and cfg.model.moe_quant == "nvfp4_per_token_fwd+mxfp8_bwd"
    assert cfg.model.moe_quant_division == "ieee"
    assert not cfg.rl.advantage.std_normalize and cfg.rl.loss.aggregation == "constant"  # Dr. GRPO
    assert cfg.rl.kl.estimator == "k1" and cfg.rl.kl.placement == "reward" and cfg.rl.kl.coef > 0
    assert cfg.rl.reward.length_penalty.scale > 0 and 0 < cfg.rl.reward.length_penalty.q < 1  # concave
    assert cfg.router_replay and cfg.system.mode == "async"
    assert cfg.env.episode.summary_trigger_tokens is not None  # self-summarization on long episodes
    assert load(PretrainConfig, CONFIGS / "composer2_k2.5.yaml").model.moe_quant == cfg.model.moe_quant


def test_self_summarization_carries_a_long_chain_past_the_context_truncation_does_not(tmp_path):
    module = _load_script("11_self_summarization")
    result = module.main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "self_summarization.png").stat().st_size > 0 and any((tmp_path / "tb").iterdir())
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == result["rows"]
    rows = {(r["arm"], r["length"]): r for r in result["rows"]}
    ctx = result["config"]["episode"]["max_context_tokens"]
    for arm in ("truncation", "self_summary"):  # a 2-note chain fits one context: the arms are the same episode
        assert rows[(arm, 2)]["success_rate"] == 1.0 and rows[(arm, 2)]["mean_summaries"] == 0
    assert rows[("truncation", 2)]["mean_total_tokens"] == rows[("self_summary", 2)]["mean_total_tokens"]
    # a 16-note chain does not fit: truncation fills the context and ends; self-summary continues from summaries
    cut, summ = rows[("truncation", 16)], rows[("self_summary", 16)]
    assert cut["success_rate"] == 0.0 and cut["finish_reasons"] == {"context_full": 1} and cut["mean_notes_read"] < 16
    assert summ["success_rate"] == 1.0 and summ["finish_reasons"] == {"submitted": 1}
    assert summ["mean_summaries"] >= 1 and summ["mean_segments"] == summ["mean_summaries"] + 1
    assert summ["mean_notes_read"] == 16 and summ["restarts"] == 0 and summ["summaries_cut"] == 0
    assert summ["mean_peak_context"] <= ctx < summ["mean_total_tokens"]
    # the policy acts on its visible context only: with no pointer in view it reads the start note again
    instruction = "Start by reading `notes/a.txt`. Then follow it."
    state = module.visible_state([{"role": "system", "content": "s"}, {"role": "user", "content": instruction}])
    assert state["latest"] is None and state["start"] == "notes/a.txt"
    summary = module.summary_text({"start": "notes/a.txt", "latest": ("next", "notes/b.txt"), "read": ["x"]})
    resumed = module.visible_state([{"role": "user", "content": instruction + "\n\n" + summary}])
    assert resumed["latest"] == ("next", "notes/b.txt")


def test_code_completion_tasks_cut_inside_a_word_and_keep_its_rest_as_the_reference():
    import random
    import re

    script = _load_script("01_cpt_compute_to_rl")
    text = "".join(f"    value_{i} = compute(alpha_{i}, beta={i})\n" for i in range(40))
    pairs = script.completion_pairs(text, random.Random(0), 10, context=60, min_answer=2, max_answer=6)
    assert len(pairs) == 10
    for prompt, reference in pairs:
        assert len(prompt) == 60 and 2 <= len(reference) <= 6
        at = text.index(prompt + reference) + 60
        word = re.match(r"\w+", text[at - 2:]).group()  # the word around the cut, read independently
        assert re.match(r"\w\w$", prompt[-2:]) and text[at:].startswith(reference)
        assert word.endswith(reference) and not re.match(r"\w", text[at + len(reference)])
    assert script.completion_pairs("short words\n", random.Random(0), 5, 60, 2, 6) == []
    only = script.completion_pairs(text, random.Random(1), 10, 60, 2, 6, vocabulary={"compute"})
    assert len(only) == 10 and all("compute".endswith(ref) and prompt.endswith("compute"[:-len(ref)][-2:])
                                   for prompt, ref in only)


def test_rl_lifts_best_of_k_intervals_and_paired_difference_from_step0():
    """Ablation 02's eval rows: a bootstrap interval over prompts per metric, and from the second row the
    paired (prompt by prompt) difference from step 0; a prompt solved at step 0 and after is a zero difference."""
    mod = _load_script("02_rl_lifts_best_of_k")
    per0 = {f"p{i}": {"avg@1": 0.25, "best_of_4": 0.0} for i in range(8)}
    per1 = {f"p{i}": {"avg@1": 0.75, "best_of_4": 1.0 if i < 6 else 0.0} for i in range(8)}
    rows = mod.with_intervals([{"step": 0, "avg@1": 0.25, "best_of_4": 0.0, "per_prompt": per0},
                               {"step": 6, "avg@1": 0.75, "best_of_4": 0.75, "per_prompt": per1}], 4, seed=0)
    assert rows[0]["per_prompt"] == per0 and "vs_step0" not in rows[0]  # kept for two-level seed intervals
    assert rows[0]["avg@1/ci"] == [0.25, 0.25] and rows[1]["avg@1/ci"] == [0.75, 0.75]
    lo, hi = rows[1]["best_of_4/ci"]
    assert 0.25 <= lo < 0.75 < hi <= 1.0
    d = rows[1]["vs_step0"]
    assert d["avg@1"]["diff"] == pytest.approx(0.5) and d["avg@1"]["ci_low"] == pytest.approx(0.5)
    assert d["best_of_4"]["diff"] == pytest.approx(0.75) and d["best_of_4"]["ci_low"] > 0.25


def test_rl_lifts_best_of_k_reuses_a_named_demo_runs_sft_start(tmp_path):
    """Ablation 02's `sft_from:` (with {seed} replaced by the config's seed) goes to the demo's --sft-from: a run
    directory without results.json is refused by name before any stage runs."""
    mod = _load_script("02_rl_lifts_best_of_k")
    raw = {"seed": 3, "steps": 28, "eval_every": 7, "k": 4, "eval_prompts": 8,
           "sft_from": str(tmp_path / "demo" / "seed-{seed}")}
    with pytest.raises(FileNotFoundError, match=r"seed-3: no results.json"):
        mod.run_ladder(raw, False, tmp_path / "work")
    assert not (tmp_path / "work" / "base").exists()


def test_weak_start_study_runs_every_variant_from_the_same_sft_start(tmp_path):
    """Ablation 12's plan: one SFT-start study (--until eval with the `sft` flags), then per variant an RL run
    from each seed's own SFT start (--sft-from) with the same SFT flags (else --sft-from refuses) and its own."""
    mod = _load_script("12_rl_from_weak_start")
    raw = {"seeds": [0, 3], "sft": {"teacher_error": 0.5}, "rl": {"rl_steps": 40},
           "variants": {"always": {"rl_penalty_gate": "always"}, "none": {"rl_length_penalty": 0.0}}}
    steps = mod.plan(raw, tmp_path, quick=False)
    assert [Path(s).name for s, _ in steps] == ["sft", "rl-always", "rl-none"]
    sft = steps[0][1]
    assert sft[:4] == ["--seeds", "0,3", "--out", str(tmp_path / "sft")]
    assert sft[4:] == ["demo", "--until", "eval", "--teacher-error", "0.5"]
    rl = steps[2][1]
    cmd = rl[rl.index("--") + 1:]
    assert cmd[cmd.index("--sft-from") + 1] == str(tmp_path / "sft" / "seed-{seed}")
    assert cmd[-6:] == ["--teacher-error", "0.5", "--rl-steps", "40", "--rl-length-penalty", "0.0"]
    assert rl[rl.index("--figures") + 1] == "demo"
    with pytest.raises(ValueError, match="not a demo setting"):
        mod.demo_flags({"sft_from": "x"})
    with pytest.raises(ValueError, match="not a demo setting"):
        mod.demo_flags({"teacher_eror": 0.5})


@pytest.mark.parametrize("level, steps", [(1, 1000), (2, 4000), (3, 16000)])
def test_ablation01_on_qwen3_coder_plans_on_one_node(level, steps):
    """The report's CPT -> RL compute study on its own model (Qwen3-Coder-30B-A3B): three log-spaced CPT levels
    (x4 apart) with the same SFT; each fits one 8-GPU node: 8 x H200 as written (expert=8), 8 x H100-80GB with the
    Adam moments offloaded (optimizer.offload=true)."""
    from c2jax.mesh import MeshConfig
    from c2jax.rl.system.config import RLSystemConfig

    folder = CONFIGS / "ablation01_qwen3_coder_30b_a3b"
    cfg = load(PretrainConfig, folder / f"cpt_c{level}.yaml")
    assert cfg.model.hf_model_type == "qwen3_moe" and cfg.model.max_position_embeddings == 262144
    assert [p.steps for p in cfg.phases] == [steps, 500] and cfg.phases[1].loss_mask == "completion"
    assert cfg.loss.router_bias_rate == 0.0 and cfg.loss.router_aux_loss > 0  # the family's balancing
    mesh = MeshConfig(**{k: v for k, v in cfg.mesh.__dict__.items()})
    assert mesh.num_devices == 8
    for phase in cfg.phases:
        on_device = plan(cfg.model, mesh, phase.seq_len, cfg.data["batch_size"])
        assert on_device.fits(141) and not on_device.fits(80)
        assert plan(cfg.model, mesh, phase.seq_len, cfg.data["batch_size"], offload_optimizer=True).fits(80)
    rl = load(RLSystemConfig, folder / "rl.yaml")
    assert rl.model == cfg.model and rl.router_replay
    assert plan(rl.model, mesh, rl.engine.max_len, 8).fits(141)
