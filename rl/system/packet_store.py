"""Weight packets in shared storage: the learner publishes every packet (full and delta) to a directory or an
fsspec URL, and a sampler with no route to the learner follows the chain from there (Composer 2 sec. 5: each
inference cluster rebuilds the weights from the delta chain in shared storage).

Layout under the store's root:

    manifest.json                          the chain: one entry per packet, oldest first (the commit point)
    packets/v0000000012-delta-<sha12>.c2wp  one file per packet (format below)
    .tmp-<uuid>                            an in-progress write; never listed, removed on the next publish

Writes are atomic: a packet is written to a temporary name, made durable and renamed (local: fsync +
os.replace; fsspec: one put to a temporary key, then mv), and only then is it listed in a new manifest,
itself written the same way. A reader takes only packets the manifest lists, so it never sees a partial
packet; a crash at any point leaves at most an unlisted temporary or packet file, which the next publish
removes.

A manifest entry has `version`, `kind` ("full" | "delta"), `base_version`, `bytes`, `sha256` (of the
whole file), `file` and `created`. The manifest also has `chain_id` (random, made with a new store),
`epoch`, bumped when a restarted learner publishes a full packet at or below the newest listed version
(versions after a rewind are different weights), and `latest`; a follower that sees either change resyncs
from a full packet. Pruning keeps every packet from the `keep_full`-th newest full packet on.

Packet file: b"C2WP1\\n", an 8-byte little-endian header length, a JSON header (version, kind,
base_version, compression, stats, and per leaf name/dtype/shape/offset/length), then the leaf blobs.

`PacketFollower` (the sampler side) starts from the newest full packet, applies the deltas after it in
order, checks each file's size and sha256 against the manifest, and on a missing, corrupt or out-of-chain
packet keeps the last good weights and waits for the next full packet, recording what it skipped.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import struct
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from c2jax.rl.system.weight_sync import DeltaDecoder, WeightPacket, WeightSyncError, assemble

MAGIC = b"C2WP1\n"
MANIFEST = "manifest.json"
PACKETS = "packets"
TMP_PREFIX = ".tmp-"
FORMAT = 1


class WeightStoreError(RuntimeError):
    """The shared weight store is unusable: unreadable manifest, a publish that breaks the chain, a bad URL."""


class PacketFormatError(WeightStoreError):
    """A packet file is truncated or malformed."""


# ---------------------------------------------------------------------------------------------------------
# packet <-> bytes


def packet_to_bytes(packet: WeightPacket) -> bytes:
    leaves, offset = [], 0
    for name, (dtype, shape, blob) in packet.leaves.items():
        leaves.append({"name": name, "dtype": dtype, "shape": list(shape), "offset": offset, "length": len(blob)})
        offset += len(blob)
    header = json.dumps({"format": FORMAT, "version": packet.version, "kind": packet.kind,
                         "base_version": packet.base_version, "compression": packet.compression,
                         "stats": {k: float(v) for k, v in packet.stats.items()}, "leaves": leaves},
                        sort_keys=True).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(header)), header,
                     *(blob for _, _, blob in packet.leaves.values())])


def packet_from_bytes(data: bytes) -> WeightPacket:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise PacketFormatError("not a weight packet (bad magic or truncated header)")
    (hlen,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    if start + hlen > len(data):
        raise PacketFormatError(f"truncated packet: header of {hlen} bytes, file of {len(data)}")
    try:
        header = json.loads(data[start:start + hlen])
    except ValueError as e:
        raise PacketFormatError(f"unreadable packet header: {e}") from None
    body = memoryview(data)[start + hlen:]
    leaves = {}
    for leaf in header["leaves"]:
        end = leaf["offset"] + leaf["length"]
        if end > len(body):
            raise PacketFormatError(f"truncated packet: leaf {leaf['name']} ends at {end}, body has {len(body)}")
        leaves[leaf["name"]] = (leaf["dtype"], tuple(leaf["shape"]), bytes(body[leaf["offset"]:end]))
    if sum(leaf["length"] for leaf in header["leaves"]) != len(body):
        raise PacketFormatError("packet body length does not match its leaves")
    return WeightPacket(header["version"], header["kind"], header["base_version"], header["compression"],
                        leaves, dict(header.get("stats", {})))


# ---------------------------------------------------------------------------------------------------------
# storage backends: a local directory (os) or any fsspec filesystem, same small interface


class LocalDirStorage:
    """A local (or network-mounted) directory; atomic writes by fsync + os.replace within the directory."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.url = str(self.root)

    def write_atomic(self, rel: str, data: bytes) -> None:
        final = self.root / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        try:  # make the rename itself durable
            fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass

    def read(self, rel: str) -> bytes | None:
        try:
            return (self.root / rel).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, rel: str) -> None:
        (self.root / rel).unlink(missing_ok=True)

    def list(self, rel: str) -> list[str]:
        d = self.root / rel
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


class FsspecStorage:
    """Any fsspec filesystem (`memory://`, `file://`, `s3://`, `gs://`, ...). A write is one put to a
    temporary key and a mv to the final one: readers see the old object or the whole new one."""

    def __init__(self, url: str):
        try:
            import fsspec
        except ImportError:
            raise WeightStoreError(f"weight store URL {url!r} needs the fsspec package (pip install fsspec); "
                                   "a plain directory path needs nothing") from None
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/")
        self.url = url

    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def write_atomic(self, rel: str, data: bytes) -> None:
        final = self._p(rel)
        self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
        tmp = self._p(f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, final)
        except BaseException:
            try:
                self.fs.rm_file(tmp)
            except Exception:
                pass
            raise

    def read(self, rel: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._p(rel))
        except FileNotFoundError:
            return None

    def delete(self, rel: str) -> None:
        try:
            self.fs.rm_file(self._p(rel))
        except FileNotFoundError:
            pass

    def list(self, rel: str) -> list[str]:
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self._p(rel), detail=False))
        except FileNotFoundError:
            return []


def open_storage(location: str | os.PathLike):
    """A plain path (or `file:///abs/path`) -> LocalDirStorage; any other URL scheme -> FsspecStorage."""
    loc = os.fspath(location)
    if not loc:
        raise WeightStoreError("empty weight store location")
    if loc.startswith("file://"):
        return LocalDirStorage(loc[len("file://"):])
    if "://" in loc:
        return FsspecStorage(loc)
    return LocalDirStorage(loc)


def _read_manifest(storage) -> dict | None:
    data = storage.read(MANIFEST)
    if data is None:
        return None
    try:
        manifest = json.loads(data)
        if (manifest.get("format") != FORMAT or not isinstance(manifest.get("packets"), list)
                or "chain_id" not in manifest or "epoch" not in manifest):
            raise ValueError(f"format {manifest.get('format')!r}")
    except ValueError as e:
        raise WeightStoreError(f"unreadable weight manifest at {storage.url}/{MANIFEST}: {e}") from None
    return manifest


# ---------------------------------------------------------------------------------------------------------
# learner side


class PacketPublisher:
    """Writes each packet, then the manifest listing it, then prunes packets older than the `keep_full`-th
    newest full packet. One publisher per store (the learner); a restarted learner picks up the manifest."""

    def __init__(self, location: str | os.PathLike, keep_full: int = 2):
        if keep_full < 1:
            raise ValueError(f"keep_full must be >= 1, got {keep_full}")
        self.storage = open_storage(location)
        if self.storage.read(SHARDS) is not None:
            raise WeightStoreError(f"{self.storage.url} holds a multi-process learner's shard chains; a one-process "
                                   "learner needs an empty weight_sync.publish_dir or one of its own")
        self.keep_full = keep_full
        self.manifest = _read_manifest(self.storage) or {"format": FORMAT, "chain_id": uuid.uuid4().hex,
                                                          "epoch": 0, "latest": -1, "packets": []}
        self._clean_unlisted()

    def _clean_unlisted(self) -> None:
        """Removes temporaries and packet files the manifest does not list (left by a crash mid-publish)."""
        listed = {e["file"] for e in self.manifest["packets"]}
        for name in self.storage.list(""):
            if name.startswith(TMP_PREFIX):
                self.storage.delete(name)
        for name in self.storage.list(PACKETS):
            if f"{PACKETS}/{name}" not in listed:
                self.storage.delete(f"{PACKETS}/{name}")

    def publish(self, packet: WeightPacket) -> dict:
        """Writes `packet` and lists it; returns its manifest entry. A delta must extend the listed chain."""
        m = self.manifest
        entries = list(m["packets"])
        epoch = m["epoch"]
        if packet.kind not in ("full", "delta"):
            raise WeightStoreError(f"packet v{packet.version} has kind {packet.kind!r}")
        if packet.kind == "delta":
            if not entries or entries[-1]["version"] != packet.base_version:
                have = entries[-1]["version"] if entries else None
                raise WeightStoreError(f"delta v{packet.version} applies to v{packet.base_version}, but the store's "
                                       f"chain ends at {have}; publish a full packet first")
        elif entries and packet.version <= entries[-1]["version"]:
            # a restarted learner rewinds to its checkpoint: later versions are other weights now
            entries = [e for e in entries if e["version"] < packet.version]
            epoch += 1
        data = packet_to_bytes(packet)
        sha = hashlib.sha256(data).hexdigest()
        rel = f"{PACKETS}/v{packet.version:010d}-{packet.kind}-{sha[:12]}.c2wp"
        self.storage.write_atomic(rel, data)
        entry = {"version": packet.version, "kind": packet.kind, "base_version": packet.base_version,
                 "bytes": len(data), "sha256": sha, "file": rel, "created": time.time()}
        entries.append(entry)
        fulls = [i for i, e in enumerate(entries) if e["kind"] == "full"]
        cut = fulls[-self.keep_full] if len(fulls) >= self.keep_full else 0
        kept, dropped = entries[cut:], entries[:cut]
        new = {"format": FORMAT, "chain_id": m["chain_id"], "epoch": epoch, "latest": packet.version,
               "packets": kept}
        self.storage.write_atomic(MANIFEST, json.dumps(new, indent=1).encode())  # the commit point
        gone = {e["file"] for e in m["packets"]} - {e["file"] for e in kept}
        self.manifest = new
        for rel_old in sorted(gone | {e["file"] for e in dropped}):
            self.storage.delete(rel_old)
        return entry


# ---------------------------------------------------------------------------------------------------------
# sampler side


@dataclass
class FollowReport:
    applied: list[int] = field(default_factory=list)  # versions applied by this poll, in order
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (version, why) passed over by this poll
    version: int = -1  # the version held after the poll
    waiting_for_full: bool = False  # the chain broke: nothing applies until the next full packet


class PacketFollower:
    """Follows a store's chain with nothing but its location. `poll()` reads the manifest once and applies
    what it can; `weights` / `version` are the last good (bit-exact) weights. A gap or a corrupt packet
    is never applied: the follower keeps its weights, waits for the next full packet, and reports the skips
    (also kept in `skipped`, all polls together)."""

    def __init__(self, location: str | os.PathLike):
        self.storage = open_storage(location)
        self.decoder = DeltaDecoder()
        self.epoch: tuple[str, int] | None = None  # (chain_id, epoch) of the chain followed
        self.waiting_for_full = False
        self.skipped: list[tuple[int, str]] = []
        self._seen = -1  # newest listed version examined (applied or skipped) in this epoch

    @property
    def version(self) -> int:
        return self.decoder.version

    @property
    def weights(self):
        return self.decoder.weights

    def _load(self, entry: dict) -> WeightPacket:
        data = self.storage.read(entry["file"])
        if data is None:
            raise PacketFormatError(f"missing file {entry['file']}")
        if len(data) != entry["bytes"]:
            raise PacketFormatError(f"size {len(data)} != manifest's {entry['bytes']}")
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise PacketFormatError("sha256 mismatch")
        packet = packet_from_bytes(data)
        if (packet.version, packet.kind, packet.base_version) != (entry["version"], entry["kind"],
                                                                   entry["base_version"]):
            raise PacketFormatError("header disagrees with the manifest entry")
        return packet

    def latest(self) -> int:
        """The newest version the store lists (-1: none yet)."""
        manifest = _read_manifest(self.storage)
        return -1 if manifest is None or not manifest["packets"] else max(e["version"] for e in manifest["packets"])

    def poll(self, upto: int | None = None) -> FollowReport:
        """Reads the manifest and applies what it can, up to version `upto` (None: everything listed)."""
        report = FollowReport()
        manifest = _read_manifest(self.storage)
        if manifest is None:
            report.version, report.waiting_for_full = self.decoder.version, self.waiting_for_full
            return report
        epoch = (manifest["chain_id"], manifest["epoch"])
        if epoch != self.epoch:
            if self.epoch is not None and self.decoder.version >= 0:
                # the learner rewound, or the store was started afresh: what we hold is not on this chain
                self.waiting_for_full = True
            self.epoch, self._seen = epoch, -1
        pending = [e for e in sorted(manifest["packets"], key=lambda e: e["version"])
                   if e["version"] > self._seen and (upto is None or e["version"] <= upto)]
        fulls = [i for i, e in enumerate(pending) if e["kind"] == "full"]
        if fulls:  # start from the newest full packet: the deltas before it are superseded
            for e in pending[:fulls[-1]]:
                if self.decoder.version >= 0 and (self.waiting_for_full or e["version"] > self.decoder.version):
                    report.skipped.append((e["version"], "superseded by a newer full packet"))
            pending = pending[fulls[-1]:]
        for e in pending:
            self._seen = max(self._seen, e["version"])
            if e["kind"] == "delta":
                if self.waiting_for_full or self.decoder.version < 0:
                    report.skipped.append((e["version"], "waiting for a full packet"))
                    continue
                if e["base_version"] != self.decoder.version:
                    report.skipped.append((e["version"], f"gap: applies to v{e['base_version']}, "
                                                          f"holding v{self.decoder.version}"))
                    self.waiting_for_full = True
                    continue
            try:
                packet = self._load(e)
                if e["kind"] == "full":
                    decoder = DeltaDecoder()
                    decoder.apply(packet)
                    self.decoder = decoder
                else:
                    self.decoder.apply(packet)  # builds the new bits before committing: a failure changes nothing
            except (PacketFormatError, WeightSyncError, ValueError, KeyError, OSError, zlib.error,
                    lzma.LZMAError) as err:
                report.skipped.append((e["version"], f"corrupt: {err}"))
                self.waiting_for_full = True
                continue
            self.waiting_for_full = False
            report.applied.append(e["version"])
        self.skipped += report.skipped
        report.version, report.waiting_for_full = self.decoder.version, self.waiting_for_full
        return report

    def wait_for(self, version: int, timeout_s: float = 60.0, interval_s: float = 0.05) -> FollowReport:
        """Polls until the follower holds `version` or newer; raises TimeoutError with the skips if not."""
        return _wait_for(self, version, timeout_s, interval_s)


def _wait_for(follower, version: int, timeout_s: float, interval_s: float) -> FollowReport:
    deadline = time.monotonic() + timeout_s
    total = FollowReport()
    while True:
        r = follower.poll()
        total.applied += r.applied
        total.skipped += r.skipped
        total.version, total.waiting_for_full = r.version, r.waiting_for_full
        if r.version >= version:
            return total
        if time.monotonic() > deadline:
            raise TimeoutError(f"weight follower at {follower.storage.url}: holds v{r.version}, wanted v{version} "
                               f"after {timeout_s}s; skipped {total.skipped}")
        time.sleep(interval_s)


# ---------------------------------------------------------------------------------------------------------
# multi-process learners (learner.num_processes > 1)
#
#     shards.json                       {"format", "num_processes": N}
#     process-0000-of-0002/             process 0's own store: manifest.json, packets/, and
#         layout.json                   where each of its pieces lies in its weight (rl/system/weight_sync.py)
#     process-0001-of-0002/ ...
#
# Each learner process publishes the packets over the pieces it owns (a ShardPacket's WeightPacket: an
# ordinary chain) to its own sub-store, as the report's trainer ranks upload their own diffs; a follower
# follows the N chains up to the newest version all N list and assembles the full weights.

SHARDS = "shards.json"
LAYOUT = "layout.json"


def process_store(location: str | os.PathLike, rank: int, num_processes: int) -> str:
    """The sub-store learner process `rank` of `num_processes` publishes to."""
    return f"{os.fspath(location).rstrip('/')}/process-{rank:04d}-of-{num_processes:04d}"


def _layout_bytes(layout: dict) -> bytes:
    return json.dumps({piece: [leaf, list(shape), [list(b) for b in bounds]]
                       for piece, (leaf, shape, bounds) in sorted(layout.items())}).encode()


class ShardPublisher:
    """Learner process `rank`'s publisher: its ShardPackets' chain in its own sub-store, and their layout
    (`layout.json`, written before the first packet and again, before a full packet, if it changes: a
    restart on another mesh). A store made by a learner of another process count is refused."""

    def __init__(self, location: str | os.PathLike, rank: int, num_processes: int, keep_full: int = 2):
        if not 0 <= rank < num_processes:
            raise ValueError(f"rank {rank} is not in 0..{num_processes - 1}")
        root = open_storage(location)
        if root.read(MANIFEST) is not None:
            raise WeightStoreError(f"{root.url} holds a one-process learner's chain; a {num_processes}-process "
                                   "learner needs an empty weight_sync.publish_dir or one of its own")
        data = root.read(SHARDS)
        if data is None:
            # every process writes the same bytes: whichever rename lands last, the content is right
            root.write_atomic(SHARDS, json.dumps({"format": FORMAT, "num_processes": num_processes}).encode())
        elif json.loads(data).get("num_processes") != num_processes:
            raise WeightStoreError(f"{root.url}/{SHARDS}: published by a {json.loads(data).get('num_processes')}-"
                                   f"process learner, this one has {num_processes}; use another publish_dir")
        self.publisher = PacketPublisher(process_store(location, rank, num_processes), keep_full)
        self.storage = self.publisher.storage
        old = self.storage.read(LAYOUT)
        self._layout_sha = hashlib.sha256(old).hexdigest() if old is not None else None

    def publish(self, shard) -> dict:
        """Writes a ShardPacket (rl/system/weight_sync.py) to this process's chain; returns its entry."""
        data = _layout_bytes(shard.layout)
        sha = hashlib.sha256(data).hexdigest()
        if sha != self._layout_sha:
            if shard.kind != "full":
                raise WeightStoreError(f"process {shard.process_index}: the pieces' layout changed at delta "
                                       f"v{shard.version}; a new layout starts with a full packet")
            self.storage.write_atomic(LAYOUT, data)
            self._layout_sha = sha
        return self.publisher.publish(shard.packet)


class ShardedPacketFollower:
    """Follows a multi-process learner's store (`shards.json` at its root) with nothing but its location:
    one PacketFollower per process chain, each polled up to the newest version every chain lists, and the
    full weights assembled (bit-exact) when all N hold the same version after a change. A corrupt or
    missing packet in any chain holds the assembled weights where they were until that chain's next full
    packet; the skips are reported with the process that had them."""

    def __init__(self, location: str | os.PathLike):
        self.location = os.fspath(location)
        self.storage = open_storage(location)
        self.followers: list[PacketFollower] = []
        self.version = -1
        self._weights: dict | None = None
        self._changed = False
        self.waiting_for_full = False
        self.skipped: list[tuple[int, str]] = []

    @property
    def num_processes(self) -> int | None:
        return len(self.followers) or None

    @property
    def weights(self):
        return {} if self._weights is None else dict(self._weights)

    def _attach(self) -> bool:
        data = self.storage.read(SHARDS)
        if data is None:
            return False
        try:
            n = int(json.loads(data)["num_processes"])
        except (ValueError, KeyError, TypeError) as e:
            raise WeightStoreError(f"unreadable {self.storage.url}/{SHARDS}: {e}") from None
        self.followers = [PacketFollower(process_store(self.location, i, n)) for i in range(n)]
        return True

    def _layout(self, rank: int) -> dict:
        data = self.followers[rank].storage.read(LAYOUT)
        if data is None:
            raise PacketFormatError(f"process {rank}: no {LAYOUT}")
        return {piece: (leaf, tuple(shape), tuple(tuple(b) for b in bounds))
                for piece, (leaf, shape, bounds) in json.loads(data).items()}

    def poll(self) -> FollowReport:
        report = FollowReport()
        if self.followers or self._attach():
            target = min(f.latest() for f in self.followers)
            for rank, f in enumerate(self.followers):
                r = f.poll(upto=target)
                self._changed |= bool(r.applied)
                report.skipped += [(v, f"process {rank}: {why}") for v, why in r.skipped]
            versions = {f.version for f in self.followers}
            if self._changed and len(versions) == 1 and min(versions) >= 0:
                v = versions.pop()
                try:
                    weights = assemble([f.weights for f in self.followers],
                                       [self._layout(i) for i in range(len(self.followers))])
                except (WeightSyncError, PacketFormatError, ValueError, KeyError, OSError) as err:
                    report.skipped.append((v, f"cannot assemble: {err}"))
                else:
                    self._weights, self.version, self._changed = weights, v, False
                    report.applied.append(v)
            self.waiting_for_full = any(f.waiting_for_full for f in self.followers)
        self.skipped += report.skipped
        report.version, report.waiting_for_full = self.version, self.waiting_for_full
        return report

    def wait_for(self, version: int, timeout_s: float = 60.0, interval_s: float = 0.05) -> FollowReport:
        """Polls until the assembled weights are at `version` or newer; raises TimeoutError if not."""
        return _wait_for(self, version, timeout_s, interval_s)


def open_follower(location: str | os.PathLike):
    """The follower for a store: ShardedPacketFollower where a multi-process learner publishes (shards.json
    at the root), else PacketFollower."""
    return ShardedPacketFollower(location) if open_storage(location).read(SHARDS) is not None \
        else PacketFollower(location)
