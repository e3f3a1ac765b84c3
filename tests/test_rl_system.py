"""The asynchronous RL system (rl/system): delta weight sync, staleness rules, the group store, and runs
on local Ray with the NumPy fake learner/sampler (async, sync, fault injection, resume) and with the real
tiny model (rl_step + InferenceEngine)."""

import numpy as np
import pytest

from rl.system.config import load_system_config
from rl.system.groups import Group, Rollout, build_batch
from rl.system.staleness import StalenessManager, is_stale
from rl.system.store import GroupStore
from rl.system.weight_sync import DeltaDecoder, DeltaEncoder, WeightChain, WeightSyncError

FAKE = ["backend.learner=fake", "backend.policy=fake", "resume=false", "rl.learning_rate=0.5",
        "rl.loss.constant_normalizer=64", "env.gen_len=8", "system.seq_len=16", "system.groups_per_step=2",
        "system.group_size=4", "engine.chunk_steps=2", "dashboard=false", "system.call_timeout_s=60"]


def _cfg(tmp_path, name, *extra):
    return load_system_config(None, [*FAKE, f"output_dir={tmp_path}", f"name={name}", *extra])


# ------------------------------------------------------------------------------------------ weight sync
def test_delta_chain_reconstructs_bit_exact_and_full_packets_reset_it():
    import ml_dtypes

    rng = np.random.default_rng(0)
    w = {"a": rng.normal(size=(64, 32)).astype(np.float32),
         "b": rng.normal(size=(128,)).astype(ml_dtypes.bfloat16),
         "c": np.array([np.nan, -0.0, np.inf], np.float32)}  # bit patterns, not values, must survive
    enc, dec, chain = DeltaEncoder(full_every=3, compression="zlib"), DeltaDecoder(), WeightChain()
    kinds = []
    for version in range(8):
        if version:
            for k in ("a", "b"):
                idx = rng.choice(w[k].size, size=w[k].size // 50, replace=False)
                flat = w[k].reshape(-1).copy()
                flat[idx] = (flat[idx].astype(np.float32) * 1.001 + 1e-3).astype(w[k].dtype)
                w[k] = flat.reshape(w[k].shape)
        p = enc.encode(w, version)
        kinds.append(p.kind)
        chain.add(version, p.kind, p)
        assert dec.apply(p)
        for k in w:
            np.testing.assert_array_equal(dec.weights[k].view(np.uint8), w[k].view(np.uint8))
        if p.kind == "delta":
            assert p.stats["identical_fraction"] > 0.9
            assert p.nbytes < 0.5 * p.stats["raw_bytes"]
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full", "delta"]
    assert [v for v, _, _ in chain.items] == [6, 7]  # the full packet at v6 reset the chain
    fresh = DeltaDecoder()  # a restarted receiver catches up from the chain alone
    fresh.apply_chain(chain.payloads())
    for k in w:
        np.testing.assert_array_equal(fresh.weights[k].view(np.uint8), w[k].view(np.uint8))
    stale = DeltaDecoder()
    with pytest.raises(WeightSyncError, match="re-sync"):
        stale.apply(chain.payloads()[1])  # a delta without its base
    assert not dec.apply(chain.payloads()[0])  # an old packet is a no-op


# ------------------------------------------------------------------------------- staleness, groups, store
def _group(gid, versions, rewards=(0.0, 1.0)):
    rollouts = [Rollout([{"tokens": [1, 2, 3], "loss_mask": [0, 1, 1], "behavior_logprobs": [0.0, -1.0, -1.0],
                          "policy_versions": [-1, v, v]}], r, model_tokens=2) for v, r in zip(versions, rewards)]
    return Group(gid, "p", rollouts)


def test_staleness_rules_and_admission():
    assert not is_stale(3, 5, 2) and is_stale(2, 5, 2) and not is_stale(5, 5, 0)
    m = StalenessManager(max_staleness=1, groups_per_step=2)
    assert m.capacity(0) == 4  # (S + v + 1) * B
    for _ in range(4):
        m.on_dispatch()
    assert m.capacity(0) == 0 and m.capacity(1) == 2
    m.on_return(accepted=False)  # a lost group frees its slot
    assert m.capacity(0) == 1
    m.on_return(accepted=True)
    m.on_stale(requeue=False)
    assert m.dropped == 1 and m.capacity(0) == 2
    m.on_resume(5)
    assert m.accepted == 10 and m.running == 0


def test_group_assembly_tags_versions_and_advantages():
    from rl.config import AdvantageConfig

    groups = [_group("g1", (3, 4)).with_advantages(AdvantageConfig()), _group("g2", (4, 4), (1.0, 1.0))]
    groups[1].with_advantages(AdvantageConfig())
    assert groups[0].min_version == 3 and groups[0].max_version == 4 and groups[1].zero_variance
    batch = build_batch(groups, seq_len=8, min_rows=1)
    mask = batch.loss_mask
    assert sorted(set(batch.policy_versions[mask].tolist())) == [3, 4]
    assert sorted(set(np.round(batch.advantages[mask], 3).tolist())) == [-0.5, 0.0, 0.5]
    assert batch.group_rewards.shape == (2, 2)
    assert batch.input_ids.shape[0] in (1, 2)


@pytest.mark.parametrize("policy", ["drop", "requeue"])
def test_reconciler_drops_or_requeues_groups_past_the_bound(tmp_path, policy):
    from rl.config import AdvantageConfig
    from rl.system.curriculum import Curriculum
    from rl.system.reconciler import Reconciler

    cfg = _cfg(tmp_path, "rules", "system.max_staleness=1", f"system.stale_policy={policy}")
    rec = Reconciler(cfg)
    rec.store, rec.version = GroupStore(cfg.run_dir), 5
    rec.curriculum = Curriculum(["p"], cfg.curriculum)
    for i, v in enumerate((2, 4, 3, 5, 4)):  # in arrival order; v2 and v3 are past 5 - 1
        g = _group(f"g{i}", (v, v)).with_advantages(AdvantageConfig())
        rec.ready.append(g)
        rec.staleness.on_dispatch()
        rec.staleness.on_return(True)
    batch = rec._take_batch()
    assert [g.group_id for g in batch] == ["g1", "g3"]  # groups_per_step = 2 fresh groups, FIFO
    assert [g.group_id for g in rec.ready] == ["g4"]
    key = "groups_dropped_stale" if policy == "drop" else "groups_requeued_stale"
    assert rec.counts[key] == 2 and rec.staleness.accepted == 3
    assert list(rec.curriculum.requeued) == (["p", "p"] if policy == "requeue" else [])
    rec.store.close()
    events = (cfg.run_dir / "events.jsonl").read_text().splitlines()
    assert len(events) == 2 and all('"stale"' in e for e in events)


def test_group_store_resumes_untrained_and_uncheckpointed_groups(tmp_path):
    store = GroupStore(tmp_path)
    for gid in ("a", "b", "c", "d"):
        store.put(_group(gid, (1, 1)))
    store.mark_trained(["a"], step=2)
    store.mark_trained(["b"], step=4)  # trained after the last checkpoint (step 3): must come back
    store.mark("c", "stale")
    store.close()
    with open(tmp_path / "groups.jsonl", "a") as f:
        f.write('{"group_id": "torn')  # a crash mid-write
    pending = GroupStore(tmp_path).pending(learner_step=3)
    assert sorted(g.group_id for g in pending) == ["b", "d"]
    assert pending[0].rollouts[0].sequences[0]["policy_versions"] == [-1, 1, 1]


# --------------------------------------------------------------------------------------- runs on Ray
@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def _accounted(out):
    """Every new group ends returned (trained, stale, errored or skipped), lost after its retries, in flight,
    or awaiting a retry; re-dispatches are retries of the same group."""
    c = out["counts"]
    made = c.get("groups_dispatched", 0)
    settled = c.get("groups_returned", 0) + c.get("groups_lost", 0) + out["inflight_at_end"] + out["retry_at_end"]
    return made, settled


def test_async_run_bounds_staleness_syncs_weights_and_evaluates(ray_local, tmp_path):
    from c2jax.train.metrics import read_metrics
    from rl.system.reconciler import run_system

    cfg = _cfg(tmp_path, "async", "system.steps=6", "system.max_staleness=1", "eval.every=3", "eval.k=2",
               "env.eval_prompts=2", "env.delay_s=0.02", "weight_sync.full_every=4")
    out = run_system(cfg)
    assert out["steps"] == 6 and out["version"] == 6
    for row in out["history"]:  # every trained token's version >= learner version - max_staleness
        assert row["staleness/max"] <= 1 and row["staleness/batch_max"] <= 1
    c = out["counts"]
    assert c.get("groups_dropped_stale", 0) == out["staleness"]["dropped"]
    made, settled = _accounted(out)
    assert made == settled  # every dispatched group has an outcome
    assert out["worker_synced_versions"] == [6, 6]
    assert max(i["swaps"] for i in out["worker_info"]) >= 2
    fulls = [r["sync/full"] for r in out["history"]]
    assert fulls[3] == 1.0 and sum(fulls) == 1  # v4 is a full packet, the rest deltas
    assert all(r["sync/identical_fraction"] > 0.5 and r["sync/bytes"] < 0.5 * r["sync/raw_bytes"]
               for r, f in zip(out["history"], fulls) if not f)
    assert {r["step"] for r in out["eval"]} >= {3, 6} and all("best_of_2" in r for r in out["eval"])
    rows = read_metrics(cfg.run_dir)
    assert len(rows) == 6 and "sync/bytes" in rows[0] and (cfg.run_dir / "config.yaml").exists()
    assert len(read_metrics(cfg.run_dir, kind="eval")) >= 2


def test_sync_mode_trains_on_policy(ray_local, tmp_path):
    from rl.system.reconciler import run_system

    out = run_system(_cfg(tmp_path, "sync", "system.mode=sync", "system.steps=3"))
    assert out["version"] == 3
    assert all(r["staleness/max"] == 0 and r["staleness/batch_max"] == 0 for r in out["history"])


def test_killed_rollout_and_env_workers_lose_no_episode(ray_local, tmp_path):
    from rl.system.reconciler import run_system

    killed = {}

    def on_step(rec):
        if rec.version == 2:  # groups are mid-episode: grading sleeps 0.15 s per rollout
            killed["before"] = ray_local.get(rec.workers[0].info.remote())["incarnation"]
            ray_local.kill(rec.workers[0], no_restart=False)
            ray_local.kill(rec.env_workers[0], no_restart=False)

    cfg = _cfg(tmp_path, "faults", "system.steps=4", "env.delay_s=0.15", "system.max_staleness=2",
               "system.call_timeout_s=30")
    out = run_system(cfg, on_step=on_step)
    c = out["counts"]
    assert out["version"] == 4
    assert c.get("groups_retried", 0) + c.get("episodes_retried", 0) + c.get("groups_lost", 0) >= 1, c
    made, settled = _accounted(out)
    assert made == settled, (c, out["inflight_at_end"], out["retry_at_end"])
    info = out["worker_info"][0]
    assert info["incarnation"] != killed["before"]  # restarted by Ray ...
    assert out["worker_synced_versions"][0] == 4  # ... and re-synced to the current weights


def test_resume_from_persisted_groups_and_learner_checkpoint(ray_local, tmp_path):
    from rl.system.reconciler import run_system
    from rl.system.store import GroupStore

    base = ["checkpoint.every=1", "system.max_staleness=3", "env.delay_s=0.01", "system.num_rollout_workers=1"]
    first = run_system(_cfg(tmp_path, "resume", "system.steps=2", *base))
    assert first["version"] == 2
    pending = GroupStore(tmp_path / "resume").pending(2)
    second = run_system(_cfg(tmp_path, "resume", "system.steps=3", "resume=true", *base))
    assert second["start_version"] == 2 and second["version"] == 3
    assert second["counts"].get("groups_resumed", 0) == len(pending)
    left = {g.group_id for g in GroupStore(tmp_path / "resume").pending(3)}
    trained_first = sorted({g.group_id for g in pending} - left)  # resumed groups are trained (or dropped stale)
    assert len(trained_first) + second["counts"].get("groups_dropped_stale", 0) >= min(len(pending), 2)
    assert second["history"][0]["step"] == 3  # the pipeline resumed at the checkpointed version


TINY = ["model.preset=tiny", "model.vocab_size=16", "model.num_hidden_layers=2", "model.num_nextn_predict_layers=0",
        "model.moe_impl=dense", "model.n_group=1", "model.topk_group=1", "rl.learning_rate=3e-3",
        "rl.loss.constant_normalizer=128", "env.gen_len=4", "env.prompt_len=2", "system.seq_len=8",
        "system.group_size=8", "system.groups_per_step=4", "engine.slots=8", "engine.max_len=16",
        "engine.chunk_steps=2", "engine.key_bucket=16", "engine.min_prompt_bucket=2", "system.max_staleness=1",
        "system.num_rollout_workers=1", "resume=false", "dashboard=false", "checkpoint.every=2"]


def test_real_learner_and_engine_run_async(ray_local, tmp_path):
    """The tiny MoE model end to end: InferenceEngine samplers with in-flight swaps, rl_step on the learner
    actor, Orbax checkpoints. (Reward rising is shown by `c2jax rl` on rl_small.yaml, see docs.)"""
    from rl.system.reconciler import run_system

    cfg = load_system_config(None, [*TINY, f"output_dir={tmp_path}", "name=tiny", "system.steps=2"])
    out = run_system(cfg)
    assert out["version"] == 2 and out["worker_synced_versions"] == [2]
    for row in out["history"]:
        assert row["staleness/max"] <= 1 and row["tokens_trained"] == 4 * 8 * 4
        assert np.isfinite(row["loss"]) and row["sync/bytes"] > 0
    assert (cfg.run_dir / "checkpoints" / "2").is_dir()
    last = out["history"][-1]
    assert last["sync/full"] == 0.0 and last["sync/bytes"] < last["sync/raw_bytes"]
