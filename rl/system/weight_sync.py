"""Versioned weight packets: XOR deltas of the raw bit patterns, losslessly compressed, with a periodic
full checkpoint that resets the chain (Composer 2 sec. 5; the Fireworks write-up: >98% of bf16 weights are
bit-identical between consecutive RL steps, a full checkpoint every N = 25 steps).

A packet is `version`, `kind` ("full" or "delta"), `base_version` (the version a delta applies to) and
one compressed blob per leaf. For a delta, blob = compress(bits(new) XOR bits(old)): unchanged weights
give zero words, which compress to almost nothing. Decoding XORs the blob back onto the receiver's bits, so
reconstruction is bit-exact by construction (XOR is its own inverse). bf16 leaves are XORed as uint16, f32
as uint32: the bit pattern of whatever dtype the learner holds, never a lossy float difference.
Pure NumPy: the learner encodes on the host after the step, receivers decode before swapping.
"""

from __future__ import annotations

import lzma
import zlib
from dataclasses import dataclass, field

import numpy as np

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_COMPRESS = {"zlib": (lambda b, lvl: zlib.compress(b, lvl), zlib.decompress),
             "lzma": (lambda b, lvl: lzma.compress(b, preset=min(lvl, 9)), lzma.decompress),
             "none": (lambda b, lvl: bytes(b), bytes)}


class WeightSyncError(RuntimeError):
    """A packet does not apply to the receiver's weights (wrong base version, leaf names or shapes)."""


@dataclass
class WeightPacket:
    version: int
    kind: str  # "full" | "delta"
    base_version: int  # the version a delta applies to; == version for a full packet
    compression: str
    leaves: dict[str, tuple[str, tuple[int, ...], bytes]]  # name -> (dtype, shape, compressed blob)
    stats: dict[str, float] = field(default_factory=dict)  # bytes, identical_fraction, encode_s

    @property
    def nbytes(self) -> int:
        return sum(len(blob) for _, _, blob in self.leaves.values())


def dtype_tag(dt: np.dtype) -> str:
    """How a packet names a dtype: NumPy's `str` ('<f4'), or the name of an ml_dtypes type ('bfloat16'),
    whose `str` is an anonymous void ('<V2') that would decode as raw bytes."""
    dt = np.dtype(dt)
    return dt.name if dt.kind == "V" and dt.names is None and not dt.name.startswith("void") else dt.str


def dtype_from_tag(tag: str) -> np.dtype:
    try:
        return np.dtype(tag)
    except TypeError:
        import ml_dtypes  # noqa: F401  (registers bfloat16, float8_*, ... with NumPy)

        try:
            return np.dtype(tag)
        except TypeError:
            raise WeightSyncError(f"unknown dtype {tag!r} in weight packet") from None


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(_UINT[a.dtype.itemsize])


class DeltaEncoder:
    """Learner side: keeps the bits of the last packet's weights; `encode` returns the next packet, full at
    every version divisible by `full_every` (and the first), a delta on the previous packet otherwise."""

    def __init__(self, full_every: int = 25, compression: str = "zlib", level: int = 1):
        if full_every <= 0:
            raise ValueError(f"full_every must be positive, got {full_every}")
        if compression not in _COMPRESS:
            raise ValueError(f"compression must be one of {sorted(_COMPRESS)}, got {compression!r}")
        self.full_every, self.compression, self.level = full_every, compression, level
        self._prev: dict[str, np.ndarray] | None = None
        self._prev_version: int | None = None

    def kind(self, weights: dict[str, np.ndarray], version: int, *, force_full: bool = False) -> str:
        """"full" or "delta": what `encode` will make of `weights` at `version` after the packets so far."""
        full = (force_full or self._prev is None or version % self.full_every == 0
                or set(weights) != set(self._prev))
        return "full" if full else "delta"

    def encode(self, weights: dict[str, np.ndarray], version: int, *, force_full: bool = False) -> WeightPacket:
        import time

        t0 = time.perf_counter()
        compress = _COMPRESS[self.compression][0]
        full = self.kind(weights, version, force_full=force_full) == "full"
        leaves, same, total = {}, 0, 0
        bits_now = {}
        for name, value in weights.items():
            value = np.asarray(value)
            bits = _bits(value)
            bits_now[name] = bits.copy()
            if full:
                payload = bits
            else:
                prev = self._prev[name]
                if prev.shape != bits.shape or prev.dtype != bits.dtype:
                    raise WeightSyncError(f"leaf {name}: shape/dtype changed from {prev.shape} {prev.dtype} to "
                                          f"{bits.shape} {bits.dtype}; send a full packet")
                payload = np.bitwise_xor(bits, prev)
                same += int(np.count_nonzero(payload == 0))
            total += bits.size
            leaves[name] = (dtype_tag(value.dtype), tuple(value.shape), compress(payload.tobytes(), self.level))
        packet = WeightPacket(version, "full" if full else "delta", version if full else self._prev_version,
                              self.compression, leaves)
        raw = sum(b.nbytes for b in bits_now.values())
        packet.stats = {"bytes": float(packet.nbytes), "raw_bytes": float(raw), "encode_s": time.perf_counter() - t0}
        if not full:
            packet.stats["identical_fraction"] = same / max(total, 1)
        self._prev, self._prev_version = bits_now, version
        return packet


class DeltaDecoder:
    """Receiver side: applies packets in order; `weights` are bit-identical to the encoder's input."""

    def __init__(self):
        self.version = -1
        self._bits: dict[str, np.ndarray] = {}
        self._dtypes: dict[str, np.dtype] = {}

    def apply(self, packet: WeightPacket) -> bool:
        """Applies `packet`; returns False (no-op) for a packet at or below the current version."""
        if packet.version <= self.version:
            return False
        if packet.kind == "delta" and packet.base_version != self.version:
            raise WeightSyncError(f"delta packet v{packet.version} applies to v{packet.base_version}, but the "
                                  f"receiver holds v{self.version}; re-sync from the last full packet")
        if packet.compression not in _COMPRESS:
            raise WeightSyncError(f"packet v{packet.version}: unknown compression {packet.compression!r}")
        decompress = _COMPRESS[packet.compression][1]
        new_bits, new_dtypes = {}, {}
        for name, (dtype, shape, blob) in packet.leaves.items():
            dt = dtype_from_tag(dtype)
            raw = np.frombuffer(decompress(blob), dtype=_UINT[dt.itemsize])
            if raw.size != int(np.prod(shape, dtype=np.int64)):
                raise WeightSyncError(f"packet v{packet.version} leaf {name}: {raw.size} words for shape {shape}")
            raw = raw.reshape(shape)
            if packet.kind == "full":
                new_bits[name] = raw.copy()
            else:
                if name not in self._bits:
                    raise WeightSyncError(f"delta packet v{packet.version} has leaf {name} the receiver lacks")
                if self._bits[name].shape != raw.shape or self._dtypes[name] != dt:
                    raise WeightSyncError(f"delta packet v{packet.version} leaf {name}: {shape} {dt} does not "
                                          f"match the receiver's {self._bits[name].shape} {self._dtypes[name]}")
                new_bits[name] = np.bitwise_xor(self._bits[name], raw)
            new_dtypes[name] = dt
        if packet.kind == "delta" and set(new_bits) != set(self._bits):
            raise WeightSyncError(f"delta packet v{packet.version} leaves differ from the receiver's")
        # committed only now: a packet that fails to decode leaves the receiver's weights as they were
        self._bits, self._dtypes, self.version = new_bits, new_dtypes, packet.version
        return True

    def apply_chain(self, packets) -> int:
        """Applies every packet newer than the current version (a chain starts with a full packet)."""
        applied = 0
        for p in sorted(packets, key=lambda p: p.version):
            applied += self.apply(p)
        return applied

    @property
    def weights(self) -> dict[str, np.ndarray]:
        return {name: bits.view(self._dtypes[name]) for name, bits in self._bits.items()}


class WeightChain:
    """The packets since (and including) the last full one: all a fresh receiver needs to catch up."""

    def __init__(self):
        self.items: list = []  # (version, kind, payload) with payload a packet or a Ray ObjectRef to one

    def add(self, version: int, kind: str, payload) -> None:
        if kind == "full":
            self.items = []
        elif not self.items:
            raise WeightSyncError(f"delta v{version} with no full packet before it")
        self.items.append((version, kind, payload))

    @property
    def version(self) -> int:
        return self.items[-1][0] if self.items else -1

    def payloads(self) -> list:
        return [p for _, _, p in self.items]


# ------------------------------------------------------------------------------ multi-process learners
# A learner spread over N processes (config `learner.num_processes`) holds each weight as a global array
# whose shards live on different processes. Each process encodes only the pieces it owns (the shards with
# replica id 0 on its devices: across processes they tile every weight exactly once) with its own
# DeltaEncoder, so its packets form an ordinary delta chain over its pieces; a `ShardPacket` adds where each
# piece lies in its weight. Receivers keep one DeltaDecoder per process and assemble full weights from them.
# The one-process WeightPacket, and everything that reads it, is unchanged.

Bounds = tuple[tuple[int, int], ...]  # [start, stop) along every axis of the weight


def piece_name(leaf: str, bounds: Bounds) -> str:
    """The name of a piece of `leaf` in a process's packet: 'params/w@0:4,0:16' (a scalar: 'params/s@')."""
    return f"{leaf}@{','.join(f'{a}:{b}' for a, b in bounds)}"


@dataclass
class ShardPacket:
    """One learner process's part of a weight version: `packet` (a WeightPacket over this process's pieces,
    a delta on its own previous packet) and `layout`: piece name -> (weight name, the weight's global
    shape, the piece's bounds in it)."""

    packet: WeightPacket
    process_index: int
    num_processes: int
    layout: dict[str, tuple[str, tuple[int, ...], Bounds]]

    @property
    def version(self) -> int:
        return self.packet.version

    @property
    def kind(self) -> str:
        return self.packet.kind

    @property
    def base_version(self) -> int:
        return self.packet.base_version

    @property
    def stats(self) -> dict[str, float]:
        return self.packet.stats

    @property
    def nbytes(self) -> int:
        return self.packet.nbytes


class ShardSet:
    """The N shard packets of one version, checked to fit together: one per process 0..N-1, of one
    version, kind and base version. Has the version / kind / base_version a receiver orders packets by."""

    def __init__(self, shards, num_processes: int | None = None):
        shards = sorted(shards, key=lambda s: getattr(s, "process_index", -1))
        if not shards:
            raise WeightSyncError("an empty set of shard packets")
        bad = [type(s).__name__ for s in shards if not isinstance(s, ShardPacket)]
        if bad:
            raise WeightSyncError(f"a shard set holds {bad[0]} objects, not ShardPackets (a one-process packet "
                                  "in a multi-process learner's chain?)")
        n = shards[0].num_processes if num_processes is None else num_processes
        if {s.num_processes for s in shards} != {n} or [s.process_index for s in shards] != list(range(n)):
            counts = sorted({s.num_processes for s in shards})
            raise WeightSyncError(f"shard packets v{shards[0].version} come from processes "
                                  f"{[s.process_index for s in shards]} of {counts}; "
                                  f"a set needs exactly one from each of processes 0..{n - 1}")
        heads = {(s.version, s.kind, s.base_version) for s in shards}
        if len(heads) != 1:
            raise WeightSyncError(f"the shard packets of one set disagree on (version, kind, base version): "
                                  f"{sorted(heads)}")
        self.shards = tuple(shards)
        self.version, self.kind, self.base_version = heads.pop()

    @property
    def stats(self) -> dict[str, float]:
        return self.shards[0].stats

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


def assemble(pieces: list[dict[str, np.ndarray]], layouts: list[dict]) -> dict[str, np.ndarray]:
    """Full weights from every process's pieces (`pieces[i]`, laid out by `layouts[i]`). Every element of
    every weight must come from exactly one piece: a gap, an overlap or a piece whose shape or dtype does
    not fit is a WeightSyncError naming the weight."""
    out: dict[str, np.ndarray] = {}
    covered: dict[str, np.ndarray] = {}
    for proc, (got, layout) in enumerate(zip(pieces, layouts)):
        if set(got) != set(layout):
            raise WeightSyncError(f"process {proc}: pieces {sorted(set(got) ^ set(layout))[:3]} are in the packet "
                                  "or its layout, not both")
        for piece, (leaf, shape, bounds) in layout.items():
            value = got[piece]
            shape, bounds = tuple(shape), tuple(tuple(b) for b in bounds)
            if len(bounds) != len(shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(bounds, shape)):
                raise WeightSyncError(f"{leaf}: piece {piece} of process {proc} has bounds {bounds} outside its "
                                      f"shape {shape}")
            if value.shape != tuple(b - a for a, b in bounds):
                raise WeightSyncError(f"{leaf}: piece {piece} of process {proc} has shape {value.shape} for "
                                      f"bounds {bounds}")
            if leaf not in out:
                out[leaf] = np.empty(shape, value.dtype)
                covered[leaf] = np.zeros(shape, bool)
            elif out[leaf].shape != shape or out[leaf].dtype != value.dtype:
                raise WeightSyncError(f"{leaf}: pieces disagree on the weight's shape/dtype ({out[leaf].shape} "
                                      f"{out[leaf].dtype} vs {shape} {value.dtype})")
            where = tuple(slice(a, b) for a, b in bounds)
            if covered[leaf][where].any():
                raise WeightSyncError(f"{leaf}: piece {piece} of process {proc} overlaps another piece")
            covered[leaf][where] = True
            out[leaf][where] = value  # same dtype: a byte copy, bit-exact
    gaps = {leaf: int((~c).sum()) for leaf, c in covered.items() if not c.all()}
    if gaps:
        leaf = next(iter(gaps))
        raise WeightSyncError(f"{leaf}: {gaps[leaf]} of {covered[leaf].size} elements are in no shard packet "
                              f"({len(gaps)} weights incomplete)")
    return out


class ShardedDeltaDecoder:
    """Receiver of a multi-process learner: one DeltaDecoder per process, advanced together one ShardSet
    (a version's N shard packets) at a time; `weights` are the assembled full weights, bit-identical to
    the learner's."""

    def __init__(self, num_processes: int):
        if num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {num_processes}")
        self.num_processes = num_processes
        self._decoders = [DeltaDecoder() for _ in range(num_processes)]
        self._layouts: list[dict] = [{} for _ in range(num_processes)]
        self.version = -1
        self._assembled: dict[str, np.ndarray] | None = None

    def apply(self, shards) -> bool:
        """Applies a ShardSet (or the list of its shard packets); False (no-op) for one at or below the
        current version. All or nothing: a set that fails to decode leaves the weights as they were."""
        sset = shards if isinstance(shards, ShardSet) else ShardSet(shards, self.num_processes)
        if len(sset.shards) != self.num_processes:
            raise WeightSyncError(f"a set of {len(sset.shards)} shard packets for a {self.num_processes}-process "
                                  "learner")
        if sset.version <= self.version:
            return False
        if sset.kind == "delta" and sset.base_version != self.version:
            raise WeightSyncError(f"delta shard packets v{sset.version} apply to v{sset.base_version}, but the "
                                  f"receiver holds v{self.version}; re-sync from the last full packet")
        saved = [(d.version, d._bits, d._dtypes) for d in self._decoders]
        try:
            for dec, shard in zip(self._decoders, sset.shards):
                dec.apply(shard.packet)
            layouts = [s.layout for s in sset.shards]
            assembled = assemble([d.weights for d in self._decoders], layouts)
        except Exception:
            for dec, (v, bits, dtypes) in zip(self._decoders, saved):
                dec.version, dec._bits, dec._dtypes = v, bits, dtypes
            raise
        self._layouts, self._assembled, self.version = layouts, assembled, sset.version
        return True

    def apply_chain(self, sets) -> int:
        applied = 0
        for s in sorted(sets, key=lambda s: s.version if isinstance(s, ShardSet) else s[0].version):
            applied += self.apply(s)
        return applied

    @property
    def weights(self) -> dict[str, np.ndarray]:
        return {} if self._assembled is None else dict(self._assembled)
