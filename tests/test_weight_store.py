"""Weight packets in shared storage (rl/system/packet_store.py): a sampler process that shares only a directory
with the learner rebuilds its weights bit for bit; broken chains make the follower wait for a full packet;
readers never see partial packets."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import uuid
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from c2jax.config import load
from c2jax.rl.system import packet_store
from c2jax.rl.system.config import ConfigError, RLSystemConfig
from c2jax.rl.system.packet_store import (
    MANIFEST,
    PacketFollower,
    PacketPublisher,
    WeightStoreError,
    packet_from_bytes,
    packet_to_bytes,
)
from c2jax.rl.system.weight_sync import DeltaEncoder


def digest(weights: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        a = np.ascontiguousarray(weights[name])
        h.update(f"{name}|{a.dtype.name}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


class SyntheticLearner:
    """A weight tree (f32, bf16, int32 leaves) where each step changes a random ~5% of the float entries,
    as an RL step at a small learning rate does to bf16 weights."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.weights = {
            "params/embed": self.rng.standard_normal((64, 32)).astype(np.float32),
            "params/layer0/w": self.rng.standard_normal((32, 48)).astype(ml_dtypes.bfloat16),
            "params/layer0/b": np.zeros(48, np.float32),
            "model_state/count": np.zeros(3, np.int32),
        }

    def step(self) -> dict[str, np.ndarray]:
        for w in self.weights.values():
            if w.dtype.kind == "i":
                w += 1
                continue
            mask = self.rng.random(w.shape) < 0.05
            w[mask] = (w[mask].astype(np.float32) + 1e-2 * self.rng.standard_normal(int(mask.sum()))).astype(w.dtype)
        return {k: v.copy() for k, v in self.weights.items()}


FOLLOWER = textwrap.dedent("""
    import json, pickle, sys
    from pathlib import Path
    from c2jax.rl.system.packet_store import open_follower

    follower = open_follower(sys.argv[1])  # one chain, or a multi-process learner's shard chains
    polls = 0
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        r = follower.poll()
        polls += 1
        out = None
        if r.version >= 0:  # the rebuilt weights go back whole; the test digests them (one digest function)
            out = str(Path(sys.argv[2]) / f"poll-{polls}.pkl")
            Path(out).write_bytes(pickle.dumps(follower.weights))
        print(json.dumps({"version": r.version, "applied": r.applied, "skipped": r.skipped,
                          "waiting": r.waiting_for_full, "weights_file": out}), flush=True)
""")


class FollowerProcess:
    """A separate Python process (no Ray, no shared memory) that knows only the store's directory; it hands
    its rebuilt weights back through files in a directory of its own."""

    def __init__(self, location: str):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        self.out = tempfile.mkdtemp(prefix="follower-")
        self.proc = subprocess.Popen([sys.executable, "-c", FOLLOWER, location, self.out], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def poll(self) -> dict:
        self.proc.stdin.write("poll\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"follower process died: {self.proc.stderr.read()}")
        report = json.loads(line)
        weights = pickle.loads(Path(report["weights_file"]).read_bytes()) if report["weights_file"] else None
        report["digest"] = digest(weights) if weights is not None else None
        report["dtypes"] = {k: v.dtype.name for k, v in (weights or {}).items()}
        return report

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.out, ignore_errors=True)


def packet_path(root, version: int) -> str:
    manifest = json.loads((root / MANIFEST).read_text())
    (entry,) = [e for e in manifest["packets"] if e["version"] == version]
    return str(root / entry["file"])


def test_follower_process_rebuilds_weights_bit_for_bit_and_recovers_at_the_next_full_packet(tmp_path):
    store = tmp_path / "store"
    learner, enc = SyntheticLearner(), DeltaEncoder(full_every=4, compression="zlib")
    pub = PacketPublisher(store, keep_full=2)
    follower = FollowerProcess(str(store))
    try:
        assert follower.poll()["version"] == -1  # nothing published yet
        truth = {}
        for v in range(0, 14):
            weights = learner.step()
            truth[v] = digest(weights)
            packet = enc.encode(weights, v)
            assert packet.kind == ("full" if v % 4 == 0 else "delta")
            pub.publish(packet)
            if v == 5:  # a corrupted delta: one flipped byte in the middle of the file
                path = packet_path(store, 5)
                data = bytearray(open(path, "rb").read())
                data[len(data) // 2] ^= 0xFF
                open(path, "wb").write(bytes(data))
            if v == 10:  # a lost delta
                os.remove(packet_path(store, 10))
            r = follower.poll()
            if v in (5, 6, 7):  # corrupt v5; v6, v7 build on it: the follower keeps v4's weights
                assert r["version"] == 4 and r["digest"] == truth[4] and r["waiting"]
                assert r["applied"] == [] and [s[0] for s in r["skipped"]] == [v]
                assert r["skipped"][0][1].startswith("corrupt: sha256") if v == 5 else "waiting" in r["skipped"][0][1]
            elif v in (10, 11):
                assert r["version"] == 9 and r["digest"] == truth[9] and r["waiting"]
                assert [s[0] for s in r["skipped"]] == [v]
                assert r["skipped"][0][1].startswith("corrupt: missing") if v == 10 else True
            else:  # exact at every version, and again right at the full packets v8 and v12
                assert r["version"] == v and r["applied"] == [v] and r["skipped"] == [] and not r["waiting"]
                assert r["digest"] == truth[v], f"v{v} differs from the learner's weights"
        assert r["dtypes"]["params/layer0/w"] == "bfloat16"
    finally:
        follower.close()
    # a fresh follower starts from the newest full packet (v12) and catches up to v13
    late = PacketFollower(store)
    assert late.poll().applied == [12, 13] and digest(late.weights) == truth[13]


def test_follower_that_falls_behind_jumps_to_the_newest_full_packet(tmp_path):
    learner, enc = SyntheticLearner(1), DeltaEncoder(full_every=3)
    pub, fol = PacketPublisher(tmp_path, keep_full=3), PacketFollower(tmp_path)
    pub.publish(enc.encode(learner.step(), 0))
    assert fol.poll().applied == [0]
    for v in range(1, 8):
        weights = learner.step()
        pub.publish(enc.encode(weights, v))
    r = fol.poll()
    assert r.applied == [6, 7] and [s[0] for s in r.skipped] == [1, 2, 3, 4, 5]
    assert all("superseded" in why for _, why in r.skipped) and not r.waiting_for_full
    assert digest(fol.weights) == digest(weights)


def test_pruning_keeps_the_chains_of_the_last_full_packets(tmp_path):
    learner, enc = SyntheticLearner(2), DeltaEncoder(full_every=3)
    pub = PacketPublisher(tmp_path, keep_full=2)
    for v in range(11):
        pub.publish(enc.encode(learner.step(), v))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert [e["version"] for e in manifest["packets"]] == [6, 7, 8, 9, 10]  # fulls at 6 and 9
    assert manifest["latest"] == 10
    on_disk = sorted(os.listdir(tmp_path / "packets"))
    assert on_disk == sorted(e["file"].split("/")[1] for e in manifest["packets"])
    assert all(e["bytes"] == os.path.getsize(tmp_path / e["file"]) for e in manifest["packets"])


def test_a_crash_mid_write_never_exposes_a_partial_packet(tmp_path, monkeypatch):
    learner, enc = SyntheticLearner(3), DeltaEncoder(full_every=10)
    pub = PacketPublisher(tmp_path)
    pub.publish(enc.encode(learner.step(), 0))
    weights1 = learner.step()
    packet1 = enc.encode(weights1, 1)

    real_replace = os.replace

    def crash_after_half(src, dst):  # the temp file is complete, but we die before the rename ...
        with open(src, "r+b") as f:  # ... and, worse, truncated to half
            f.truncate(os.path.getsize(src) // 2)
        raise KeyboardInterrupt("killed mid-publish")

    monkeypatch.setattr(packet_store.os, "replace", crash_after_half)
    with pytest.raises(KeyboardInterrupt):
        pub.publish(packet1)
    monkeypatch.setattr(packet_store.os, "replace", real_replace)
    # nothing new is listed, no packet file under a final name, and the temporary is gone
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert [e["version"] for e in manifest["packets"]] == [0]
    assert len(os.listdir(tmp_path / "packets")) == 1 and not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    fol = PacketFollower(tmp_path)
    assert fol.poll().applied == [0] and fol.version == 0

    # a crash between the packet's rename and the manifest's: the packet file exists but is not listed
    calls = []

    def crash_on_manifest(src, dst):
        calls.append(dst)
        if str(dst).endswith(MANIFEST):
            raise KeyboardInterrupt("killed before the manifest")
        return real_replace(src, dst)

    monkeypatch.setattr(packet_store.os, "replace", crash_on_manifest)
    with pytest.raises(KeyboardInterrupt):
        pub.publish(packet1)
    monkeypatch.setattr(packet_store.os, "replace", real_replace)
    assert len(os.listdir(tmp_path / "packets")) == 2  # orphaned, unlisted
    assert fol.poll().applied == [] and fol.version == 0
    # a restarted learner cleans the orphan and goes on
    pub2 = PacketPublisher(tmp_path)
    assert len(os.listdir(tmp_path / "packets")) == 1
    pub2.publish(packet1)
    assert fol.poll().applied == [1] and digest(fol.weights) == digest(weights1)


def test_concurrent_reader_never_sees_a_partial_packet(tmp_path):
    learner, enc = SyntheticLearner(4), DeltaEncoder(full_every=5)
    pub, fol = PacketPublisher(tmp_path, keep_full=2), PacketFollower(tmp_path)
    done, errors, seen = threading.Event(), [], []

    def reader():
        try:
            while not done.is_set():
                r = fol.poll()
                seen.extend(r.applied)
                # a reader that falls behind may jump to a newer full packet; anything else is a failure
                errors.extend(s for s in r.skipped if "superseded" not in s[1])
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    t = threading.Thread(target=reader)
    t.start()
    for v in range(40):
        weights = learner.step()
        pub.publish(enc.encode(weights, v))
    done.set()
    t.join()
    r = fol.poll()
    assert not errors and not r.skipped, (errors, r.skipped)
    assert fol.version == 39 and digest(fol.weights) == digest(weights)
    assert seen == sorted(seen) and len(seen) > 1


def test_learner_rewind_bumps_the_epoch_and_followers_resync(tmp_path):
    learner, enc = SyntheticLearner(5), DeltaEncoder(full_every=100)
    pub, fol = PacketPublisher(tmp_path), PacketFollower(tmp_path)
    for v in range(6):
        pub.publish(enc.encode(learner.step(), v))
    assert fol.poll().version == 5
    # the learner restarts from its v3 checkpoint with other weights: a full packet at v3
    restarted, enc2 = SyntheticLearner(6), DeltaEncoder(full_every=100)
    pub2 = PacketPublisher(tmp_path)
    w3 = restarted.step()
    pub2.publish(enc2.encode(w3, 3, force_full=True))
    w4 = restarted.step()
    pub2.publish(enc2.encode(w4, 4))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["epoch"] == 1 and [e["version"] for e in manifest["packets"]] == [0, 1, 2, 3, 4]
    r = fol.poll()
    assert r.applied == [3, 4] and fol.version == 4 and digest(fol.weights) == digest(w4)
    # a delta that does not extend the published chain is refused
    with pytest.raises(WeightStoreError, match="applies to v2"):
        bad = enc2.encode(restarted.step(), 5)
        bad.base_version = 2
        pub2.publish(bad)


def test_a_new_store_at_the_same_location_is_another_chain(tmp_path):
    """Wiped and restarted from scratch: same versions and epoch, other weights. The follower must not
    apply the new chain's delta v4 on its old v3 (bases match by number only)."""
    old, enc = SyntheticLearner(10), DeltaEncoder(full_every=100)
    pub, fol = PacketPublisher(tmp_path), PacketFollower(tmp_path)
    for v in range(4):
        pub.publish(enc.encode(old.step(), v))
    assert fol.poll().version == 3
    for f in os.listdir(tmp_path / "packets"):
        os.remove(tmp_path / "packets" / f)
    os.remove(tmp_path / MANIFEST)
    new, enc2 = SyntheticLearner(11), DeltaEncoder(full_every=100)
    pub2 = PacketPublisher(tmp_path)
    for v in range(6):
        w = new.step()
        pub2.publish(enc2.encode(w, v))
    assert json.loads((tmp_path / MANIFEST).read_text())["epoch"] == 0
    r = fol.poll()
    assert r.applied == [0, 1, 2, 3, 4, 5] and digest(fol.weights) == digest(w)


def test_fsspec_memory_store_round_trip():
    pytest.importorskip("fsspec")
    url = f"memory://c2jax-test-store-{uuid.uuid4().hex}"  # the memory filesystem is process-global
    learner, enc = SyntheticLearner(7), DeltaEncoder(full_every=2)
    pub, fol = PacketPublisher(url, keep_full=1), PacketFollower(url)
    for v in range(5):
        weights = learner.step()
        pub.publish(enc.encode(weights, v))
        assert fol.poll().applied == [v] and digest(fol.weights) == digest(weights)
    assert [e["version"] for e in pub.manifest["packets"]] == [4]
    assert pub.storage.list("packets") == [pub.manifest["packets"][0]["file"].split("/")[1]]
    assert pub.storage.list("") == ["manifest.json", "packets"]  # no temporaries left


def test_packet_file_format_round_trips_and_rejects_truncation():
    enc = DeltaEncoder()
    packet = enc.encode(SyntheticLearner(8).step(), 0)
    packet.stats["created"] = 123.0
    data = packet_to_bytes(packet)
    back = packet_from_bytes(data)
    assert (back.version, back.kind, back.base_version, back.leaves, back.stats["created"]) == (
        packet.version, packet.kind, packet.base_version, packet.leaves, 123.0)
    for cut in (3, 20, len(data) - 1):
        with pytest.raises(packet_store.PacketFormatError):
            packet_from_bytes(data[:cut])


def test_config_publish_dir_and_keep_full(tmp_path):
    cfg = load(RLSystemConfig, None, [f"weight_sync.publish_dir={tmp_path}", "weight_sync.keep_full=3"])
    assert cfg.weight_sync.publish_dir == str(tmp_path) and cfg.weight_sync.keep_full == 3
    assert load(RLSystemConfig, None, []).weight_sync.publish_dir == ""
    with pytest.raises(ConfigError, match="keep_full"):
        load(RLSystemConfig, None, ["weight_sync.keep_full=0"])


def test_learner_actor_publishes_every_packet(tmp_path):
    """The Ray learner class (used directly, no Ray): each step's packet lands in the store, and a follower
    with only the directory holds the learner's exact weights."""
    from types import SimpleNamespace

    from c2jax.rl.system.actors import Learner

    cfg = load(RLSystemConfig, None, ["backend.learner=fake", "backend.policy=fake", "weight_sync.full_every=2",
                                      f"weight_sync.publish_dir={tmp_path / 'store'}", "checkpoint.every=100",
                                      "system.steps=100"])
    learner = Learner(cfg, str(tmp_path / "run"))
    version, _ = learner.start(resume=False)
    fol = PacketFollower(tmp_path / "store")
    assert fol.poll().applied == [version] == [0]
    assert digest(fol.weights) == digest(learner.core.weights())
    rng = np.random.default_rng(0)
    for v in (1, 2, 3):
        batch = SimpleNamespace(loss_mask=np.ones((2, 8), bool), targets=rng.integers(0, 16, (2, 8)),
                                advantages=rng.standard_normal((2, 8)), policy_versions=np.full((2, 8), v - 1))
        learner.train(batch)
        learner.packet(v)  # waits for the encode thread, which also published it
        assert fol.poll().applied == [v] and digest(fol.weights) == digest(learner.core.weights())
    manifest = json.loads((tmp_path / "store" / MANIFEST).read_text())
    assert [(e["version"], e["kind"]) for e in manifest["packets"]] == [(0, "full"), (1, "delta"), (2, "full"),
                                                                       (3, "delta")]


# ------------------------------------------------------------------------ a multi-process learner's store
def _split(weights: dict[str, np.ndarray]) -> list[tuple[dict, dict]]:
    """Two processes' (pieces, layout), as RLLearner.owned_shards makes them: every element of every weight
    in exactly one piece (embed by rows, the bf16 matrix by columns, the small leaves whole)."""
    from c2jax.rl.system.weight_sync import piece_name

    cuts = {"params/embed": [((0, 40), (0, 32)), ((40, 64), (0, 32))],
            "params/layer0/w": [((0, 32), (0, 16)), ((0, 32), (16, 48))],
            "params/layer0/b": [((0, 48),), None], "model_state/count": [None, ((0, 3),)]}
    out = []
    for rank in (0, 1):
        pieces, layout = {}, {}
        for leaf, w in weights.items():
            bounds = cuts[leaf][rank]
            if bounds is not None:
                name = piece_name(leaf, bounds)
                pieces[name] = np.ascontiguousarray(w[tuple(slice(a, b) for a, b in bounds)])
                layout[name] = (leaf, w.shape, bounds)
        out.append((pieces, layout))
    return out


def test_a_two_process_learner_publishes_shard_chains_that_a_follower_process_assembles(tmp_path):
    """Each learner process publishes its own chain (the pieces it owns) and their layout; a follower process
    sharing only the directory assembles the learner's exact weights, at the newest version BOTH chains list
    (process 0 publishing ahead of process 1 is never half-applied), and a corrupt delta in one chain holds
    the assembled weights until that chain's next full packet."""
    from c2jax.rl.system.packet_store import ShardedPacketFollower, ShardPublisher, open_follower
    from c2jax.rl.system.weight_sync import ShardPacket

    store = tmp_path / "store"
    learner = SyntheticLearner(2)
    encoders = [DeltaEncoder(full_every=4) for _ in range(2)]
    pubs = [ShardPublisher(store, rank, 2, keep_full=2) for rank in range(2)]
    assert isinstance(open_follower(store), ShardedPacketFollower)
    follower = FollowerProcess(str(store))

    def publish(rank, v, parts):
        pieces, layout = parts[rank]
        return pubs[rank].publish(ShardPacket(encoders[rank].encode(pieces, v), rank, 2, layout))

    try:
        truth, pending = {}, None
        for v in range(12):
            weights = learner.step()
            truth[v] = digest(weights)
            parts = _split(weights)
            publish(0, v, parts)  # process 0 is one version ahead of process 1 at every poll
            if pending is not None:
                publish(1, v - 1, pending)
                if v - 1 == 5:  # process 1's delta v5 corrupted
                    path = packet_path(store / "process-0001-of-0002", 5)
                    data = bytearray(open(path, "rb").read())
                    data[len(data) // 2] ^= 0xFF
                    open(path, "wb").write(bytes(data))
            pending = parts
            r = follower.poll()
            if v == 0:
                assert r["version"] == -1 and r["applied"] == []  # process 1 has published nothing yet
            elif v - 1 in (5, 6, 7):  # v6, v7 build on the corrupt v5: the weights of v4 stay
                assert r["version"] == 4 and r["digest"] == truth[4] and r["waiting"]
                assert any(why.startswith("process 1: corrupt: sha256") for _, why in r["skipped"]) or v - 1 != 5
            else:  # the newest version both chains list, exact; again right at the full packet v8
                assert r["version"] == v - 1 and r["applied"] == [v - 1] and not r["waiting"], r
                assert r["digest"] == truth[v - 1]
        assert r["dtypes"]["params/layer0/w"] == "bfloat16"
    finally:
        follower.close()
    # a store is one learner's: another process count, or a one-process learner, is refused (and vice versa)
    with pytest.raises(WeightStoreError, match="2-process learner, this one has 4"):
        ShardPublisher(store, 0, 4)
    with pytest.raises(WeightStoreError, match="multi-process learner's shard chains"):
        PacketPublisher(store)
    one = tmp_path / "one"
    PacketPublisher(one).publish(DeltaEncoder().encode(learner.step(), 0))
    with pytest.raises(WeightStoreError, match="one-process learner's chain"):
        ShardPublisher(one, 0, 2)


def test_a_shard_layout_changes_only_with_a_full_packet(tmp_path):
    from c2jax.rl.system.packet_store import ShardedPacketFollower, ShardPublisher
    from c2jax.rl.system.weight_sync import ShardPacket

    learner, enc = SyntheticLearner(3), DeltaEncoder(full_every=100)
    pub = ShardPublisher(tmp_path, 0, 1)
    weights = learner.step()
    whole = {f"{k}@": v for k, v in weights.items()}  # one process owning everything, as whole pieces
    layout = {f"{k}@": (k, v.shape, tuple((0, n) for n in v.shape)) for k, v in weights.items()}
    pub.publish(ShardPacket(enc.encode(whole, 0), 0, 1, layout))
    fol = ShardedPacketFollower(tmp_path)
    assert fol.poll().applied == [0] and digest(fol.weights) == digest(weights)
    moved = {**layout, "model_state/count@": ("model_state/renamed", *layout["model_state/count@"][1:])}
    weights = learner.step()
    packet = enc.encode({f"{k}@": v for k, v in weights.items()}, 1)
    assert packet.kind == "delta"
    with pytest.raises(WeightStoreError, match="layout changed at delta v1"):
        pub.publish(ShardPacket(packet, 0, 1, moved))
    pub.publish(ShardPacket(packet, 0, 1, layout))  # the same layout: published, assembled
    assert fol.poll().applied == [1] and digest(fol.weights) == digest(weights)
