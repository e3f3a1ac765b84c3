"""The multi-process RL learner (config `learner.num_processes`): a group of Ray actors in one placement
group, joined by jax.distributed over loopback (gloo collectives on CPU), running one rl_step on one global
mesh. 2 processes x 4 fake CPU devices train the same batches as 1 process x 8 devices (this test process,
conftest's 8 devices) to the same metrics and weights; each process encodes the weight shards it owns and a
rollout worker assembles the learner's exact weights from the shard packets. Plus the pure pieces: shard
sets, assembly (gaps, overlaps) and the config's checks."""

import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from c2jax.config import load
from c2jax.rl.system.config import RLSystemConfig
from c2jax.rl.system.weight_sync import (
    DeltaEncoder,
    ShardedDeltaDecoder,
    ShardPacket,
    ShardSet,
    WeightChain,
    WeightSyncError,
    assemble,
    piece_name,
)

# the tiny MoE model of tests/test_rl_system.py; rows over data x fsdp = all 8 devices, so a batch of 8 rows
# gives each process 4 (min_rows 8); no checkpoint during the run
TINY = ["model.preset=tiny", "model.vocab_size=16", "model.num_hidden_layers=2", "model.num_nextn_predict_layers=0",
        "model.moe_impl=dense", "model.n_group=1", "model.topk_group=1", "rl.learning_rate=3e-3", "rl.adam_eps=1e-4",
        "rl.loss.constant_normalizer=128", "system.seq_len=8", "system.min_rows=8", "system.steps=1000",
        "checkpoint.every=1000", "resume=false", "dashboard=false", "mesh.data=2", "mesh.fsdp=-1",
        "weight_sync.full_every=3", "backend.policy=fake", "system.call_timeout_s=240"]
STEPS = 4
ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------ pure pieces
def _split(weights: dict, cuts: dict) -> tuple[list, list]:
    """Two processes' pieces of `weights`: rows [0, cut) to process 0, the rest to process 1 (cut None:
    the whole weight to process 0, as a replicated leaf)."""
    pieces, layouts = [{}, {}], [{}, {}]
    for name, w in weights.items():
        cut = cuts.get(name)
        parts = [(0, ((0, w.shape[0]),))] if cut is None else [(0, ((0, cut),)), (1, ((cut, w.shape[0]),))]
        for proc, bounds in parts:
            key = piece_name(name, bounds)
            pieces[proc][key] = w[bounds[0][0]:bounds[0][1]].copy()
            layouts[proc][key] = (name, w.shape, bounds)
    return pieces, layouts


def test_shard_packets_assemble_bit_exact_over_a_delta_chain():
    rng = np.random.default_rng(0)
    w = {"a": rng.normal(size=(10,)).astype(np.float32), "b": np.array([np.nan, -0.0, 1.0, 2.0], np.float32)}
    encoders = [DeltaEncoder(full_every=3), DeltaEncoder(full_every=3)]
    dec, kinds = ShardedDeltaDecoder(2), []
    for version in range(5):
        if version:
            w["a"] = w["a"].copy()
            w["a"][rng.integers(10)] += 1.0
        pieces, layouts = _split(w, {"a": 6})
        shards = [ShardPacket(enc.encode(p, version), i, 2, lay)
                  for i, (enc, p, lay) in enumerate(zip(encoders, pieces, layouts))]
        sset = ShardSet(reversed(shards))  # any order
        kinds.append(sset.kind)
        assert dec.apply(sset) and dec.version == version
        for k in w:
            np.testing.assert_array_equal(dec.weights[k].view(np.uint32), w[k].view(np.uint32))
    assert kinds == ["full", "delta", "delta", "full", "delta"]
    assert not dec.apply(sset)  # an old version is a no-op


def test_shard_sets_and_assembly_reject_what_does_not_fit():
    w = {"a": np.arange(8, dtype=np.float32)}
    pieces, layouts = _split(w, {"a": 5})
    enc = [DeltaEncoder(), DeltaEncoder()]
    shards = [ShardPacket(e.encode(p, 0), i, 2, lay) for i, (e, p, lay) in enumerate(zip(enc, pieces, layouts))]
    with pytest.raises(WeightSyncError, match="exactly one from each"):
        ShardSet(shards[:1], 2)
    with pytest.raises(WeightSyncError, match="exactly one from each"):
        ShardSet([shards[0], shards[0]])
    later = ShardPacket(DeltaEncoder().encode(pieces[1], 1), 1, 2, layouts[1])
    with pytest.raises(WeightSyncError, match="disagree on"):
        ShardSet([shards[0], later])
    with pytest.raises(WeightSyncError, match="not ShardPackets"):
        ShardSet([shards[0].packet])
    with pytest.raises(WeightSyncError, match="3 of 8 elements are in no shard packet"):
        assemble(pieces[:1], layouts[:1])
    overlap = {piece_name("a", ((4, 8),)): w["a"][4:]}
    with pytest.raises(WeightSyncError, match="overlaps"):
        assemble([pieces[0], overlap], [layouts[0], {k: ("a", (8,), ((4, 8),)) for k in overlap}])
    with pytest.raises(WeightSyncError, match="has shape"):
        assemble([pieces[0], {k: v[:1] for k, v in pieces[1].items()}], layouts)
    # a delta whose base the receiver lacks leaves it as it was
    dec = ShardedDeltaDecoder(2)
    assert dec.apply(shards)
    stale = [ShardPacket(DeltaEncoder().encode(p, 5), i, 2, lay) for i, (p, lay) in enumerate(zip(pieces, layouts))]
    for s in stale:
        s.packet.kind, s.packet.base_version = "delta", 4
    with pytest.raises(WeightSyncError, match="re-sync"):
        dec.apply(stale)
    assert dec.version == 0 and np.array_equal(dec.weights["a"], w["a"])


def test_config_checks_of_a_learner_group():
    from c2jax.models.config import ConfigError

    ok = load(RLSystemConfig, None, [*TINY, "learner.num_processes=2"])
    assert ok.learner.num_processes == 2 and load(RLSystemConfig, None, []).learner.num_processes == 1
    for extra, msg in [(["learner.num_processes=0"], "must be >= 1"),
                       (["learner.num_processes=2", "mesh.data=1", "mesh.fsdp=1"], "mesh must span"),
                       (["learner.num_processes=2", "backend.learner=fake"], "needs backend.learner=rl")]:
        with pytest.raises(ConfigError, match=msg):
            load(RLSystemConfig, None, [*TINY, *extra])


def test_learner_env_gives_fake_cpu_devices_and_keeps_other_flags():
    from c2jax.rl.system.actors import learner_env

    cfg = load(RLSystemConfig, None, [*TINY, "learner.num_processes=2", "learner.cpu_devices_per_process=4"])
    env = learner_env(cfg, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"})
    assert env == {"JAX_PLATFORMS": "cpu",
                   "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=4"}
    assert learner_env(load(RLSystemConfig, None, TINY)) == {}


# --------------------------------------------------------------------------------- the group on local Ray
def _batches(seed: int):
    from c2jax.rl.config import AdvantageConfig
    from c2jax.rl.system.groups import Group, Rollout, build_batch

    rng = np.random.default_rng(seed)
    out = []
    for step in range(STEPS):
        groups = []
        for g in range(4):
            rollouts = []
            for _ in range(4):
                n = int(rng.integers(4, 9))
                toks = rng.integers(0, 16, n).tolist()
                rollouts.append(Rollout([{"tokens": toks, "loss_mask": [0] + [1] * (n - 1),
                                          "behavior_logprobs": [0.0] + (-rng.uniform(1, 4, n - 1)).tolist(),
                                          "policy_versions": [-1] + [step] * (n - 1)}], float(rng.uniform())))
            groups.append(Group(f"s{step}g{g}", "p", rollouts).with_advantages(AdvantageConfig()))
        out.append(build_batch(groups, seq_len=8, min_rows=8))
    return out


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster whose processes (the learner group's) share this repository's compilation cache."""
    pytest.importorskip("ray")
    from c2jax.rl.system.cluster import init_ray, shutdown_ray

    # the actors inherit conftest's JAX_COMPILATION_CACHE_DIR and threshold from this process's environment
    init_ray(num_cpus=2)
    yield
    shutdown_ray()


@pytest.fixture(scope="module")
def group_run(ray_cluster, tmp_path_factory):
    """4 steps of a 2-process learner group on local Ray (its shard packets synced by a rollout worker after
    every step) and of the 1-process learner on this process's 8 devices, on the same batches."""
    import jax

    from c2jax.rl.system.actors import LearnerGroup, RolloutWorker
    from c2jax.rl.system.backends import RLLearner
    from c2jax.rl.system.reconciler import run_system

    assert len(jax.devices()) == 8
    tmp = tmp_path_factory.mktemp("group")
    cfg1 = load(RLSystemConfig, None, [*TINY, f"output_dir={tmp}", "name=one"])
    cfg2 = load(RLSystemConfig, None, [*TINY, f"output_dir={tmp}", "name=two", "learner.num_processes=2",
                                       "learner.cpu_devices_per_process=4", "learner.placement_strategy=PACK",
                                       f"weight_sync.publish_dir={tmp / 'store'}"])
    batches = _batches(0)
    seconds = {}
    t = time.perf_counter()
    group = LearnerGroup(cfg2, str(cfg2.run_dir), "test")  # the two processes build while this one does
    try:
        seconds["group up"] = time.perf_counter() - t
        t = time.perf_counter()
        one = RLLearner(cfg1, cfg1.run_dir)
        w0_one = one.weights()
        rows = [len(b.input_ids) for b in batches]  # 8 or 16
        ref, one_s = [], []
        for b, r in zip(batches, rows):
            t1 = time.perf_counter()
            ref.append(one.train(one.global_batch(b, tuple(range(r)), r)))
            one_s.append(time.perf_counter() - t1)
        seconds["1 process, 4 steps"] = time.perf_counter() - t
        t = time.perf_counter()
        worker = RolloutWorker(cfg2, [], {}, "w")  # the rollout side's code, in this process
        chain, synced, two, step_s = WeightChain(), [], [], []
        version_ref, payload = group.start(False)
        assert ray_get(version_ref) == 0
        chain.add(0, "full", payload)
        synced.append(worker.sync(chain.payloads()))
        w0_two = worker.synced_weights()[1]
        for version, batch in enumerate(batches, start=1):
            t1 = time.perf_counter()
            metrics = group.result(group.train(batch), timeout=240)
            step_s.append(time.perf_counter() - t1)
            two.append(metrics)
            chain.add(version, "full" if metrics["sync/full"] else "delta", group.packet(version))
            synced.append(worker.sync(chain.payloads()))
        got_version, got = worker.synced_weights()
        learner_w = group.full_weights(timeout=240)
        # shared storage: each process published its own shard chain; a follower with only the directory
        # assembles them (before run_system below trains the group on)
        from c2jax.rl.system.packet_store import open_follower

        follower = open_follower(tmp / "store")
        follower.wait_for(STEPS, timeout_s=60)
        followed = (follower.version, follower.weights, sorted(p.name for p in (tmp / "store").iterdir()))
        packets = [ray_get(r) for r in chain.payloads()[-1]]
        seconds["2 processes, 4 steps"] = time.perf_counter() - t
        # the same group in a whole run (run_system): engine samplers assemble its shard packets
        t = time.perf_counter()
        run = run_system(load(RLSystemConfig, None, [
            *TINY, f"output_dir={tmp}", "name=run", "backend.policy=engine", "learner.num_processes=2",
            f"system.steps={STEPS + 2}", "system.group_size=4", "system.groups_per_step=2",
            "system.num_rollout_workers=1", "env.gen_len=4", "env.prompt_len=2", "engine.slots=8",
            "engine.max_len=16", "engine.chunk_steps=2", "engine.key_bucket=16", "engine.min_prompt_bucket=2",
            "system.max_staleness=1"]), learner=group)
        seconds["run_system, 2 steps"] = time.perf_counter() - t
        # kill -9 of one process: the step's call fails at once, naming it (not after the heartbeat timeout)
        os.kill(group.pids[1], signal.SIGKILL)
        t = time.perf_counter()
        with pytest.raises(RuntimeError, match="learner process 1 of 2 failed in `train`") as killed:
            group.result(group.train(batches[0]), timeout=120)
        seconds["kill detected"] = time.perf_counter() - t
    finally:
        group.shutdown()
    print("\n" + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()),
          f"; steps 2-4: 1 x 8 {np.mean(one_s[1:]):.3f} s each, 2 x 4 {np.mean(step_s[1:]):.3f} s each (rl_step, "
          "encoding and, for the group, Ray calls); bytes sent per packet by process 0 / 1: " +
          ", ".join(f"v{m['sync/stats_version']:.0f} {m['sync/bytes/p0']:.0f} / {m['sync/bytes/p1']:.0f}" for m in two))
    return dict(followed=followed, ref=ref, two=two, synced=synced, got=got, got_version=got_version,
                learner_w=learner_w,
                one_w=one.weights(), w0_one=w0_one, w0_two=w0_two, packets=packets, chain=chain,
                killed=str(killed.value), seconds=seconds, run=run)


def ray_get(ref):
    import ray

    return ray.get(ref, timeout=240)


def test_two_processes_train_like_one_on_the_same_mesh_and_batches(group_run):
    ref, two = group_run["ref"], group_run["two"]
    assert len(ref) == len(two) == STEPS
    keys = sorted(k for k in ref[0] if not k.startswith(("sync/", "learner/")))
    assert {"loss", "policy_loss", "grad_norm", "entropy", "tokens_trained", "ratio/mean"} <= set(keys)
    for step, (a, b) in enumerate(zip(ref, two)):
        assert set(keys) <= set(b), set(keys) - set(b)
        np.testing.assert_allclose([b[k] for k in keys], [a[k] for k in keys], rtol=1e-5, atol=1e-7,
                                   err_msg=f"step {step + 1}: {keys}")
        assert b["policy_version"] == step
    assert len({round(r["loss"], 6) for r in ref}) == STEPS  # the steps did train on different batches
    worst = max(abs(b[k] - a[k]) / max(abs(a[k]), 1e-30) for a, b in zip(ref, two) for k in keys)
    print(f"\nlargest relative metric difference, 2 x 4 vs 1 x 8: {worst:.2e}")
    # the starting weights are the same init, and the final ones agree to float-reduction order
    for k in group_run["w0_one"]:
        np.testing.assert_array_equal(group_run["w0_two"][k], group_run["w0_one"][k], err_msg=k)
    one_w, learner_w = group_run["one_w"], group_run["learner_w"]
    assert one_w.keys() == learner_w.keys()
    moved = same = 0
    for k in one_w:
        np.testing.assert_allclose(learner_w[k], one_w[k], rtol=1e-5, atol=1e-6, err_msg=k)
        same += np.array_equal(learner_w[k], one_w[k])
        moved += not np.array_equal(one_w[k], group_run["w0_one"][k])
    assert moved > len(one_w) // 2  # training changed most weights
    print(f"final weights bit-identical to 1 x 8: {same} of {len(one_w)} arrays")


def test_rollout_worker_assembles_the_learners_weights_from_shard_packets(group_run):
    assert group_run["synced"] == list(range(STEPS + 1))  # every version applied, in order
    assert group_run["got_version"] == STEPS
    got, learner_w = group_run["got"], group_run["learner_w"]
    assert got.keys() == learner_w.keys()
    for k in got:  # bit for bit
        assert got[k].dtype == learner_w[k].dtype and got[k].shape == learner_w[k].shape, k
        np.testing.assert_array_equal(got[k].view(np.uint8), learner_w[k].view(np.uint8), err_msg=k)
    # full_every=3: v0 and v3 full, the rest deltas; the chain starts at the last full packet
    kinds = ["full" if r["sync/full"] else "delta" for r in group_run["two"]]
    assert kinds == ["delta", "delta", "full", "delta"]
    assert [v for v, _, _ in group_run["chain"].items] == [3, 4]
    # each process sent only its own pieces: together they cover every weight once, neither holds it all
    p0, p1 = group_run["packets"]
    assert (p0.process_index, p1.process_index) == (0, 1) and p0.kind == p1.kind == "delta"
    assert 0 < p1.stats["raw_bytes"] < p0.stats["raw_bytes"] + p1.stats["raw_bytes"]
    total = sum(v.nbytes for v in learner_w.values())
    assert p0.stats["raw_bytes"] + p1.stats["raw_bytes"] == total
    last = group_run["two"][-1]
    assert last["sync/bytes/p0"] > 0 and last["sync/bytes/p1"] > 0
    assert last["sync/bytes"] == last["sync/bytes/p0"] + last["sync/bytes/p1"]


def test_shard_owners_spread_replicas_over_processes_and_cover_every_shard():
    from c2jax.rl.system.backends import shard_owner

    # fsdp shards (4 of them) each replicated in both processes (data=2): owners alternate
    holders = {((4 * j, 4 * j + 4),): {0, 1} for j in range(4)}
    assert list(shard_owner(holders, 0).values()) == [0, 1, 0, 1]
    assert list(shard_owner(holders, 1).values()) == [1, 0, 1, 0]
    # a replicated weight (one shard, every process): the owner rotates with the weight's ordinal
    assert [shard_owner({(): {0, 1, 2}}, k)[()] for k in range(4)] == [0, 1, 2, 0]
    # a shard held by one process only is that process's
    assert shard_owner({((0, 2),): {1}, ((2, 4),): {0}}, 5) == {((0, 2),): 1, ((2, 4),): 0}


def test_a_killed_learner_process_fails_the_step_at_once_with_a_clear_error(group_run):
    assert "resume=true" in group_run["killed"], group_run["killed"]
    assert group_run["seconds"]["kill detected"] < 10, group_run["seconds"]  # heartbeat timeout: 30 s


def test_a_run_with_a_learner_group_trains_and_its_samplers_load_the_learners_weights(group_run):
    """run_system with the group (at version 4): InferenceEngine samplers assemble the shard packets; the
    first batch was sampled with the learner's own weights, so the learner's logprobs reproduce the
    sampler's (router replay on)."""
    out = group_run["run"]
    assert out["start_version"] == STEPS and out["version"] == STEPS + 2
    assert out["worker_synced_versions"] == [STEPS + 2]
    first = out["history"][0]
    assert first["staleness/max"] == 0 and first["mismatch/abs_p99"] < 1e-3, first["mismatch/abs_p99"]
    for row in out["history"]:
        assert row["tokens_trained"] == 2 * 4 * 4 and np.isfinite(row["loss"])
        assert row["sync/bytes/p0"] > 0 and row["sync/bytes/p1"] > 0


def test_a_sampler_outside_ray_follows_the_groups_shard_chains_in_shared_storage(group_run):
    """weight_sync.publish_dir with 2 learner processes: each publishes the pieces it owns to its own chain,
    and a follower that shares only the directory assembles the learner's exact weights."""
    version, weights, entries = group_run["followed"]
    assert entries == ["process-0000-of-0002", "process-0001-of-0002", "shards.json"]
    assert version == STEPS and set(weights) == set(group_run["learner_w"])
    for k, w in group_run["learner_w"].items():
        assert weights[k].dtype == w.dtype and weights[k].tobytes() == w.tobytes(), k


def test_a_run_rebuilds_a_group_whose_process_died_and_loses_no_graded_group(ray_cluster, tmp_path):
    """kill -9 of learner process 1 after step 3 of a 4-step run (checkpoints every 2 steps): the run tears the
    group down, builds a new one that restores step 2, rewinds the samplers to step 2's weights, trains every
    graded group not trained by step 2 again (step 3's groups included), and ends at step 4 with the samplers
    on the learner's final weights; no group is lost."""
    import json

    from c2jax.rl.system.reconciler import run_system

    killed = {}

    def kill_after_step_3(rec):
        if rec.version == 3 and not killed:
            killed["pid"] = rec.learner.pids[1]
            os.kill(killed["pid"], signal.SIGKILL)

    cfg = load(RLSystemConfig, None, [
        *TINY, f"output_dir={tmp_path}", "name=restart", "backend.policy=engine", "learner.num_processes=2",
        "learner.cpu_devices_per_process=4", "learner.placement_strategy=PACK", "checkpoint.every=2",
        "system.steps=4", "system.group_size=4", "system.groups_per_step=2", "system.num_rollout_workers=1",
        "env.gen_len=4", "env.prompt_len=2", "engine.slots=8", "engine.max_len=16", "engine.chunk_steps=2",
        "engine.key_bucket=16", "engine.min_prompt_bucket=2", "system.max_staleness=1"])
    out = run_system(cfg, on_step=kill_after_step_3)
    assert killed and out["version"] == 4 and out["counts"]["learner_restarts"] == 1
    (restart,) = out["learner_restarts"]
    assert restart["failed_step"] == 4 and restart["restored_step"] == 2, restart
    assert re.search(r"learner process [01] of 2 failed", restart["error"])  # the victim or its peer, first
    assert out["counts"].get("groups_lost", 0) == 0 and out["worker_synced_versions"] == [4]
    events = [json.loads(line) for line in (cfg.run_dir / "events.jsonl").read_text().splitlines()]
    at = next(i for i, e in enumerate(events) if e["event"] == "learner_restart")
    lost_updates = {g for e in events[:at] if e["event"] == "trained" and e["step"] > 2 for g in e["groups"]}
    retrained = {g for e in events[at:] if e["event"] == "trained" for g in e["groups"]}
    assert lost_updates and lost_updates <= retrained, (lost_updates, retrained)
    trained_after = [e["step"] for e in events[at:] if e["event"] == "trained"]
    assert trained_after == [3, 4]


@pytest.mark.slow
def test_the_ray_cluster_recipe_runs_rl_with_a_two_process_learner(tmp_path):
    """docs/parallelism.md's Ray-cluster recipe as a user types it, on loopback: `ray start --head` (no
    c2jax code in it), then `c2jax rl ... ray.address=HOST:PORT learner.num_processes=2`; the driver joins
    the cluster (presenting the machine's Ray token, which `ray start` requires and Ray's driver would not
    send for an explicit address), places the learner group and trains 2 steps with engine samplers."""
    import json
    import socket
    import subprocess
    import sys

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    import shutil
    import tempfile

    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="c2jax-ray-")  # short: Ray's socket paths live under it
    # a user's shell: no token of another test's cluster, JAX on CPU
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env |= {"JAX_PLATFORMS": "cpu", "RAY_USAGE_STATS_ENABLED": "0"}
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
         "--node-ip-address=127.0.0.1", f"--temp-dir={ray_tmp}", "--num-cpus=4", "--include-dashboard=false",
         f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
         "--disable-usage-stats"], stdout=subprocess.DEVNULL, stderr=open(tmp_path / "head.log", "w"), env=env,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None and time.monotonic() < deadline, (tmp_path / "head.log").read_text()[-2000:]
                time.sleep(0.3)
        cli = subprocess.run(
            [sys.executable, "-m", "c2jax.cli", "rl", *TINY, f"output_dir={tmp_path}", "name=recipe",
             "backend.policy=engine", "engine.slots=8", "engine.max_len=16", "engine.chunk_steps=2",
             "engine.key_bucket=16", "engine.min_prompt_bucket=2",
             f"ray.address=127.0.0.1:{port}", "learner.num_processes=2", "learner.cpu_devices_per_process=4",
             "learner.placement_strategy=PACK", "system.steps=2", "system.group_size=4", "system.groups_per_step=2",
             "system.num_rollout_workers=1", "env.gen_len=4", "env.prompt_len=2"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        (tmp_path / "cli.log").write_text(cli.stdout + cli.stderr)
        assert cli.returncode == 0, cli.stdout[-3000:] + cli.stderr[-3000:]
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    summary = json.loads((tmp_path / "recipe" / "summary.json").read_text())
    assert summary["version"] == 2 and summary["counts"].get("groups_lost", 0) == 0
    metrics = [json.loads(line) for line in (tmp_path / "recipe" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m.get("kind") == "train"] == [1, 2]
    assert all("sync/bytes/p1" in m for m in metrics if m.get("kind") == "train")  # two processes' packets
