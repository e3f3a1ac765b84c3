"""Ray actors: the learner, rollout workers, environment workers and the evaluator.

Actor classes are plain Python classes (unit-testable without Ray); `spawn_*` wraps them with
`ray.remote` options (restarts, CPUs, concurrency). Rollout workers are threaded actors, so a weight push
(`sync`) runs while `run_group` decodes; the decode loop swaps the new weights in at the next chunk
boundary, and the learner never waits for a sampler.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from c2jax.rl.system.backends import make_learner, make_policy
from c2jax.rl.system.config import RLSystemConfig
from c2jax.rl.system.envs import EnvironmentHost, chat_tokenizer, run_ladder_episode, run_target_group
from c2jax.rl.system.groups import Group
from c2jax.rl.system.packet_store import PacketPublisher, ShardPublisher
from c2jax.rl.system.weight_sync import DeltaDecoder, DeltaEncoder, ShardedDeltaDecoder, ShardPacket, ShardSet


class Learner:
    """Owns params and optimizer; each `train` is one rl_step. The step's weight packet is encoded on a
    background thread, off the learner's critical path: `packet(version)` returns it (the reconciler puts
    that call's ObjectRef in the weight chain at once, so samplers wait on it, never the learner)."""

    def __init__(self, cfg: RLSystemConfig, run_dir: str):
        self.cfg = cfg
        self.core = make_learner(cfg, Path(run_dir))
        ws = cfg.weight_sync
        self.encoder = DeltaEncoder(ws.full_every, ws.compression, ws.level)
        # every packet also goes to shared storage (written on the encode thread, off the step's path)
        self.publisher = self._make_publisher() if ws.publish_dir else None
        self.busy_s = 0.0
        self._encoding = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")  # in version order
        self._packets: dict[int, Future] = {}
        self._last_stats: dict[str, float] = {}
        self._last_future: Future | None = None

    def _make_publisher(self):
        ws = self.cfg.weight_sync
        return PacketPublisher(ws.publish_dir, ws.keep_full)

    def start(self, resume: bool):
        """(version, full packet): restores the latest checkpoint when resuming."""
        version = self.core.restore() if resume else self.core.version
        return version, self._encode(self._snapshot(), version, force_full=True)

    def _snapshot(self) -> dict[str, np.ndarray]:
        # host copies: the next (donating) rl_step may reuse the device buffers while the packet is encoded
        return {k: np.array(v, copy=True) for k, v in self.core.weights().items()}

    def _encode(self, weights, version, force_full=False):
        packet = self.encoder.encode(weights, version, force_full=force_full)
        packet.stats["created"] = time.time()
        if self.publisher is not None:
            self.publisher.publish(packet)  # a failed write raises: packet(version) reports it
        self._last_stats = {**{f"sync/{k}": v for k, v in packet.stats.items() if k != "created"},
                            "sync/stats_version": float(version)}
        return packet

    def train(self, batch):
        """Metrics of one rl_step. `sync/full` says what this version's packet is; the other `sync/*`
        stats (bytes, identical fraction, encode time) are those of the previous version's packet
        (`sync/stats_version`), whose encoding overlapped this step."""
        t0 = time.perf_counter()
        metrics = self.core.train(batch)
        metrics["learner/step_s"] = time.perf_counter() - t0
        version = self.core.version
        if version % self.cfg.checkpoint.every == 0 or version >= self.cfg.system.steps:
            t1 = time.perf_counter()
            self.core.save()
            metrics["learner/checkpoint_s"] = time.perf_counter() - t1
        weights = self._snapshot()
        metrics["sync/full"] = float(self.encoder.kind(weights, version) == "full")
        if self._last_future is not None:
            self._last_future.result()  # the previous packet (it had this whole step to finish)
        metrics.update(self._last_stats)
        self._last_future = self._packets[version] = self._encoding.submit(self._encode, weights, version)
        self.busy_s += time.perf_counter() - t0
        return metrics

    def packet(self, version: int):
        """The weight packet of `version` (waits for its encoding)."""
        if version not in self._packets:
            raise KeyError(f"no packet for version {version} (learner at {self.core.version}; restarted?)")
        # asked once per version (the reconciler keeps the ObjectRef; Ray serves every sampler from it)
        return self._packets.pop(version).result(timeout=self.cfg.system.call_timeout_s)

    def save(self) -> int:
        self.core.save()
        return self.core.version

    def version(self) -> int:
        return self.core.version


def fetch_packets(ray, chain: list, timeout: float) -> list:
    """The packets of a weight chain. An item is an ObjectRef to a WeightPacket (one learner process) or a
    list of ObjectRefs to the N ShardPackets of one version (a learner group): those come back as a
    ShardSet. One ray.get for all of them."""
    refs = [r for item in chain for r in (item if isinstance(item, (list, tuple)) else [item])]
    got = iter(ray.get(refs, timeout=timeout) if refs else [])
    return [ShardSet([next(got) for _ in item]) if isinstance(item, (list, tuple)) else next(got) for item in chain]


class GroupLearner(Learner):
    """One process of a learner group (`learner.num_processes` > 1; `LearnerGroup` drives them): built
    without JAX, it joins the group's `jax.distributed` job in `setup`, then runs the same jitted rl_step
    on the global mesh as every other process (each fed its rows of the batch), checkpoints as one Orbax
    multi-process job, and encodes only the weight shards it owns (ShardPackets)."""

    def __init__(self, cfg: RLSystemConfig, run_dir: str, rank: int):
        self.cfg, self.run_dir, self.rank = cfg, run_dir, rank
        self.core = None

    def pid(self) -> int:
        import os

        return os.getpid()

    def coordinator_address(self) -> str:
        """host:port for the group's coordination service (process 0 serves it): this node's address and a
        port free on it now."""
        import socket

        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((host, 0))
            return f"{host}:{sock.getsockname()[1]}"

    def setup(self, address: str) -> tuple[tuple[int, ...], int]:
        """Join the group (jax.distributed.initialize: every process calls it, they wait for each other),
        build the learner on the global mesh; returns this process's row blocks (RLLearner.row_blocks)."""
        import jax

        from c2jax import distributed
        from c2jax.config import DistributedConfig

        lc = self.cfg.learner
        distributed.initialize(DistributedConfig(
            enabled=True, coordinator_address=address, num_processes=lc.num_processes, process_id=self.rank,
            heartbeat_timeout_s=lc.heartbeat_timeout_s, initialization_timeout_s=lc.initialization_timeout_s))
        if lc.cpu_devices_per_process and jax.local_device_count() != lc.cpu_devices_per_process:
            raise RuntimeError(f"learner process {self.rank} has {jax.local_device_count()} devices, not "
                               f"learner.cpu_devices_per_process={lc.cpu_devices_per_process}: JAX's backend was "
                               "up before the group's XLA_FLAGS applied")
        super().__init__(self.cfg, self.run_dir)
        self._layout: dict | None = None
        return self.core.row_blocks()

    def _snapshot(self) -> dict[str, np.ndarray]:
        pieces, layout = self.core.owned_shards()
        self._layout = layout
        return pieces

    def _make_publisher(self):
        # each process publishes the chain of the pieces it owns to a sub-store of its own (packet_store.py)
        ws = self.cfg.weight_sync
        return ShardPublisher(ws.publish_dir, self.rank, self.cfg.learner.num_processes, ws.keep_full)

    def _encode(self, weights, version, force_full=False):
        packet = self.encoder.encode(weights, version, force_full=force_full)
        packet.stats["created"] = time.time()
        shard = ShardPacket(packet, self.rank, self.cfg.learner.num_processes, self._layout)
        if self.publisher is not None:
            self.publisher.publish(shard)  # a failed write raises: packet(version) reports it
        self._last_stats = {**{f"sync/{k}": v for k, v in packet.stats.items() if k != "created"},
                            "sync/stats_version": float(version)}
        return shard

    def train_rows(self, local_batch, rows: tuple[int, ...], global_rows: int) -> dict[str, float]:
        """One rl_step of the group on the global batch of which `local_batch` holds this process's rows."""
        return self.train(self.core.global_batch(local_batch, rows, global_rows))

    def full_weights(self) -> dict[str, np.ndarray]:
        """The whole weights (a collective: every process of the group must call it)."""
        return self.core.weights()


class SingleLearner:
    """Driver-side handle of the one-process learner (one Learner actor): the calls the reconciler makes."""

    def __init__(self, cfg: RLSystemConfig, run_dir: str, tag: str):
        self.cfg = cfg
        self.actor = spawn(Learner, cfg, run_dir, name=f"learner-{tag}", cpus=cfg.ray.learner_cpus,
                           gpus=cfg.ray.learner_gpus, concurrency=2)  # packet() is served while train runs
        self.actors = [self.actor]
        self.row_multiple = 1

    def start(self, resume: bool):
        """(ObjectRef to the version, chain payload of its full packet)."""
        return self.actor.start.options(num_returns=2).remote(resume)

    def train(self, batch):
        return self.actor.train.remote(batch)

    def result(self, ref, timeout: float) -> dict:
        import ray

        return ray.get(ref, timeout=timeout)

    def packet(self, version: int):
        return self.actor.packet.remote(version)

    def shutdown(self) -> None:
        pass


def learner_env(cfg: RLSystemConfig, base: dict | None = None) -> dict[str, str]:
    """Environment variables of every learner-group process: with `learner.cpu_devices_per_process`, JAX on
    CPU with that many fake devices (this process's other XLA_FLAGS kept)."""
    import os
    import re

    n = cfg.learner.cpu_devices_per_process
    if not n:
        return {}
    flags = (os.environ if base is None else base).get("XLA_FLAGS", "")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", flags).split()
    return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])}


class LearnerGroup:
    """Driver-side handle of a learner over `learner.num_processes` processes: GroupLearner actors in a
    placement group (one bundle each), joined into one jax.distributed job. `train` sends every process
    only its rows of the batch; `packet` is the version's N shard packets (a list of ObjectRefs, which
    rollout workers fetch and assemble). No Ray restarts: a process of a jax.distributed job cannot rejoin
    alone, so a dead process fails the group's calls."""

    def __init__(self, cfg: RLSystemConfig, run_dir: str, tag: str):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.cfg, lc = cfg, cfg.learner
        n = lc.num_processes
        bundle = {"CPU": cfg.ray.learner_cpus, **({"GPU": cfg.ray.learner_gpus} if cfg.ray.learner_gpus else {})}
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy=lc.placement_strategy,
                                  name=f"learner-{tag}")
        self.actors: list = []
        self._pending: dict = {}
        try:
            ready, _ = ray.wait([self.pg.ready()], timeout=cfg.system.call_timeout_s)
            if not ready:
                raise RuntimeError(f"the learner's placement group ({n} bundles of {bundle}, "
                                   f"{lc.placement_strategy}) was not placed within {cfg.system.call_timeout_s:.0f} s: "
                                   "the cluster lacks the resources (ray.learner_cpus / learner_gpus per process)")
            env = learner_env(cfg)
            self.actors = [ray.remote(GroupLearner).options(
                name=f"learner-{tag}-{i}", max_restarts=0, max_task_retries=0, num_cpus=cfg.ray.learner_cpus,
                num_gpus=cfg.ray.learner_gpus, max_concurrency=2,
                runtime_env={"env_vars": env} if env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote(cfg, run_dir, i) for i in range(n)]
            address = ray.get(self.actors[0].coordinator_address.remote(), timeout=cfg.system.call_timeout_s)
            layouts = ray.get([a.setup.remote(address) for a in self.actors],
                              timeout=lc.initialization_timeout_s + cfg.system.call_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.rows = [tuple(blocks) for blocks, _ in layouts]
        self.blocks = layouts[0][1]
        self.row_multiple = self.blocks
        self.pids = ray.get([a.pid.remote() for a in self.actors], timeout=cfg.system.call_timeout_s)

    def start(self, resume: bool):
        refs = [a.start.options(num_returns=2).remote(resume) for a in self.actors]
        return refs[0][0], [packet for _, packet in refs]

    def split(self, batch) -> list:
        """Every process's rows of `batch`: (local batch, row indices, global rows) each."""
        rows = int(np.shape(batch.input_ids)[0])
        if rows % self.blocks:
            raise ValueError(f"a batch of {rows} rows does not split into the learner mesh's {self.blocks} row "
                             f"blocks; make system.min_rows a multiple of {self.blocks}")
        per = rows // self.blocks
        out = []
        for blocks in self.rows:
            idx = np.concatenate([np.arange(b * per, (b + 1) * per) for b in blocks])
            local = batch._replace(**{k: np.asarray(v)[idx] for k, v in batch._asdict().items()
                                      if v is not None and k != "group_rewards"})
            out.append((local, tuple(int(i) for i in idx), rows))
        return out

    def train(self, batch):
        """Starts one step on every process; returns process 0's ObjectRef (`result` collects them all)."""
        refs = [a.train_rows.remote(*part) for a, part in zip(self.actors, self.split(batch))]
        self._pending[refs[0]] = refs
        return refs[0]

    def result(self, ref, timeout: float) -> dict:
        """The step's metrics (process 0's: the step's outputs are replicated) with the weight packet's
        sync stats summed over the processes and each process's bytes (`sync/bytes/p<i>`)."""
        outs = self._gather(self._pending.pop(ref), timeout, "train")
        merged = dict(outs[0])
        if len({(o.get("loss"), o.get("policy_version")) for o in outs}) != 1:
            raise RuntimeError(f"the learner processes disagree on the step: {[o.get('loss') for o in outs]}")
        if "sync/bytes" in merged:
            raw = [o.get("sync/raw_bytes", 0.0) for o in outs]
            merged["sync/bytes"] = float(sum(o["sync/bytes"] for o in outs))
            merged["sync/raw_bytes"] = float(sum(raw))
            merged["sync/encode_s"] = float(max(o.get("sync/encode_s", 0.0) for o in outs))
            if all("sync/identical_fraction" in o for o in outs) and sum(raw):
                merged["sync/identical_fraction"] = float(
                    sum(o["sync/identical_fraction"] * r for o, r in zip(outs, raw)) / sum(raw))
            for i, o in enumerate(outs):
                merged[f"sync/bytes/p{i}"] = float(o["sync/bytes"])
        merged["learner/step_s"] = float(max(o.get("learner/step_s", 0.0) for o in outs))
        return merged

    def _gather(self, refs: list, timeout: float, what: str) -> list:
        """Every process's result of one call, failing as soon as one process's call fails (a dead process's
        call fails at once; the survivors would wait in a collective until the heartbeat timeout)."""
        import ray

        index = {r: i for i, r in enumerate(refs)}
        out, pending, deadline = [None] * len(refs), list(refs), time.monotonic() + timeout
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not done:
                raise TimeoutError(f"learner processes {sorted(index[r] for r in pending)} did not finish `{what}` "
                                   f"within {timeout:.0f} s")
            i = index[done[0]]
            try:
                out[i] = ray.get(done[0])
            except Exception as e:  # noqa: BLE001 -- RayActorError (died), task error
                raise RuntimeError(
                    f"learner process {i} of {len(refs)} failed in `{what}` ({type(e).__name__}: {str(e)[:300]}); "
                    "a jax.distributed group cannot go on without it. A run rebuilds the group from its last "
                    "checkpoint (learner.max_group_restarts); past that, rerun with resume=true") from e
        return out

    def packet(self, version: int) -> list:
        return [a.packet.remote(version) for a in self.actors]

    def check_alive(self, timeout: float) -> None:
        """Raises as `train` would when a process is dead (a cheap call each process answers beside a step)."""
        self._gather([a.pid.remote() for a in self.actors], timeout, "pid")

    def full_weights(self, timeout: float = 600.0) -> dict[str, np.ndarray]:
        """The whole weights, gathered across the processes."""
        return self._gather([a.full_weights.remote() for a in self.actors], timeout, "full_weights")[0]

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        kill_actors(self.actors)
        self.actors = []
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 -- already removed
            pass


def spawn_learner(cfg: RLSystemConfig, run_dir: str, tag: str):
    """The learner's driver-side handle: one actor, or a group when learner.num_processes > 1."""
    return SingleLearner(cfg, run_dir, tag) if cfg.learner.num_processes == 1 else LearnerGroup(cfg, run_dir, tag)


class RolloutWorker:
    """Holds a sampler and drives up to `system.groups_per_worker` groups at once against environment
    workers; their requests, and the G episodes of an agentic group, run concurrently on the sampler
    (threads sharing the engine's slots: continuous batching)."""

    def __init__(self, cfg: RLSystemConfig, env_workers: list, prompts: dict, worker_id: str):
        import ray

        self.ray, self.cfg, self.env_workers, self.prompts, self.worker_id = ray, cfg, env_workers, prompts, worker_id
        self.renderer = None
        detok = None
        if cfg.env.kind in ("ladder", "text", "suite"):
            from c2jax.rl.harness import ChatRenderer

            self.renderer = ChatRenderer(chat_tokenizer(cfg.env.tokenizer))
            detok = self.renderer.decode
        self.policy = make_policy(cfg, detok)
        self.decoder = self._new_decoder()
        self._lock = threading.Lock()
        # at most groups_per_worker groups at once per sampler (a call the reconciler abandoned may linger)
        self._run_slots = threading.BoundedSemaphore(cfg.system.groups_per_worker)
        self.swaps = 0
        self.sync_latency_s: list[float] = []
        self.incarnation = uuid.uuid4().hex[:8]  # changes when Ray restarts the actor
        # bumped by `rewind` (a restarted learner group): chains of an older lineage are other weights now
        self.lineage = 0
        self._force_swap = False

    # weights ------------------------------------------------------------------------------------------
    def _new_decoder(self):
        n = self.cfg.learner.num_processes
        return DeltaDecoder() if n == 1 else ShardedDeltaDecoder(n)  # full weights from N shard packets

    def sync(self, chain: list, lineage: int = 0) -> int:
        """Applies every packet of `chain` (ObjectRefs to the packets since the last full one) newer than
        what this worker holds. Safe to call while a group is decoding. A chain of an older `lineage` than
        the worker's (sent before a learner restart) is ignored."""
        if lineage < self.lineage:
            return self.decoder.version
        if lineage > self.lineage:  # the learner restarted from a checkpoint: start over from its chain
            return self.rewind(chain, lineage)
        packets = fetch_packets(self.ray, chain, self.cfg.system.call_timeout_s)
        with self._lock:
            if lineage < self.lineage:  # rewound while the packets were fetched
                return self.decoder.version
            for p in sorted(packets, key=lambda p: p.version):
                if p.version > self.decoder.version and (p.kind == "full" or p.base_version == self.decoder.version):
                    self.decoder.apply(p)
                    self.sync_latency_s.append(time.time() - p.stats.get("created", time.time()))
        return self.decoder.version

    def rewind(self, chain: list, lineage: int) -> int:
        """After a learner restart: drop the weights held (newer versions of a lost lineage), take `chain`
        (the restored checkpoint's full packet) as lineage `lineage`; the sampler loads it at its next swap
        point, even though its version is lower than what it serves now."""
        packets = fetch_packets(self.ray, chain, self.cfg.system.call_timeout_s)
        decoder = self._new_decoder()
        for p in sorted(packets, key=lambda p: p.version):
            decoder.apply(p)
        with self._lock:
            if lineage <= self.lineage:  # another thread rewound to this lineage first
                return self.decoder.version
            self.decoder, self.lineage, self._force_swap = decoder, lineage, True
        return decoder.version

    def _maybe_swap(self) -> None:
        with self._lock:
            if self.decoder.version <= self.policy.version and not self._force_swap:
                return
            weights, version = self.decoder.weights, self.decoder.version
            self._force_swap = False
        self.policy.load(weights, version)
        self.swaps += 1

    def _swap_at_chunk(self) -> None:
        if self.cfg.system.in_flight_updates:
            self._maybe_swap()

    def version(self) -> int:
        return self.policy.version

    def synced_weights(self) -> tuple[int, dict[str, np.ndarray]]:
        """(version, weights) as this worker's decoder holds them (what its sampler loads next)."""
        with self._lock:
            return self.decoder.version, self.decoder.weights

    def info(self) -> dict:
        lat = self.sync_latency_s[-16:]
        return {"version": self.policy.version, "incarnation": self.incarnation, "swaps": self.swaps,
                "sync_latency_s": float(np.mean(lat)) if lat else float("nan")}

    # episodes -----------------------------------------------------------------------------------------
    def _env_call(self, env):
        from ray.exceptions import ActorUnavailableError

        timeout = self.cfg.system.call_timeout_s

        def call(method, *args):
            # an environment worker Ray is restarting (it died) is waited for, up to the call timeout: a retry
            # at once would fail the same way. Sandboxes it held are gone with it; their episodes run again
            deadline = time.monotonic() + timeout
            while True:
                try:
                    return self.ray.get(getattr(env, method).remote(*args),
                                        timeout=max(deadline - time.monotonic(), 0.1))
                except ActorUnavailableError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.5)

        return call

    def run_group(self, spec: dict, chain: list) -> Group:
        """spec: {group_id, prompt_id, seed, attempt[, group_size]}. Re-syncs weights before serving."""
        with self._run_slots:
            return self._run_group(spec, chain)

    def _run_group(self, spec: dict, chain: list) -> Group:
        t0 = time.perf_counter()
        self.sync(chain, spec.get("lineage", 0))
        self._maybe_swap()
        if self.policy.version < 0:
            raise RuntimeError(f"rollout worker {self.worker_id} has no weights; the chain was empty")
        version_at_start = self.policy.version
        env = self.env_workers[hash(spec["group_id"]) % len(self.env_workers)]
        call = self._env_call(env)
        sc, ec = self.cfg.system, self.cfg.env
        size = spec.get("group_size", sc.group_size)
        if ec.kind in ("target", "text"):
            text = ec.kind == "text"
            rollouts = run_target_group(lambda reqs: self.policy.generate(reqs, self._swap_at_chunk), call,
                                        self.prompts[spec["prompt_id"]], ec, size, spec["seed"],
                                        sc.max_episode_retries, self.cfg.router_replay,
                                        task_id=spec["prompt_id"] if text else None,
                                        stop_ids=(self.renderer.im_end_id,) if text else ())
        else:
            # the G episodes run concurrently, one thread each, on the one engine: their turns decode together
            # in its slots (continuous batching), and one episode's tool calls overlap the others' decoding
            policy = BackendTokenPolicy(self.policy, self._swap_at_chunk)
            with ThreadPoolExecutor(max_workers=size, thread_name_prefix="episode") as pool:
                rollouts = list(pool.map(
                    lambda i: run_ladder_episode(policy, self.renderer, call, spec["prompt_id"],
                                                 self.prompts[spec["prompt_id"]], ec, spec["seed"] * 1009 + i,
                                                 sc.max_episode_retries, self.cfg.router_replay,
                                                 reward_cfg=self.cfg.rl.reward), range(size)))
        return Group(spec["group_id"], spec["prompt_id"], rollouts, attempt=spec.get("attempt", 0),
                     worker=f"{self.worker_id}/{self.incarnation}",
                     timings={"total_s": time.perf_counter() - t0, "version_at_start": version_at_start,
                              "version_at_end": self.policy.version, **self.info()})


class BackendTokenPolicy:
    """TokenPolicy (c2jax.rl.harness.agents) over a backend, swapping weights at chunk boundaries."""

    def __init__(self, policy, swap):
        self.policy, self.swap = policy, swap

    def generate_tokens(self, prompt_ids, *, max_new_tokens, stop_token_ids, temperature=1.0, seed=0, top_p=1.0,
                        top_k=0):
        from c2jax.models.inference.engine import Request

        req = Request(list(prompt_ids), max_new_tokens, tuple(stop_token_ids), (), temperature, top_p, top_k, seed)
        return self.policy.generate([req], self.swap)[0]


class Evaluator(RolloutWorker):
    """Samples the held-out prompts K times with the weights of one version; scores with c2jax.rl.eval.metrics."""

    def evaluate(self, prompt_ids: list[str], k: int, chain: list, seed: int, lineage: int = 0) -> dict:
        rewards, scores = [], []
        for i, pid in enumerate(prompt_ids):
            spec = {"group_id": f"eval-{seed}-{i}", "prompt_id": pid, "seed": 10_000_000 + seed * 1000 + i,
                    "group_size": k, "lineage": lineage}
            rollouts = self.run_group(spec, chain).rollouts
            rewards.append([r.verdict for r in rollouts])
            scores.append([model_score(r) for r in rollouts])
        return {**eval_scores(rewards, scores, k, self.cfg.eval.success_threshold, prompt_ids=prompt_ids),
                "version": self.policy.version, "prompts": len(prompt_ids)}


def model_score(rollout) -> float:
    """Mean sampler log-probability of a rollout's sampled tokens: the `model_score` selector of c2jax.rl.eval
    (runner.model_score), 0.0 when it sampled nothing."""
    lps = [lp for s in rollout.sequences for lp, m in zip(s["behavior_logprobs"], s["loss_mask"]) if m]
    return float(sum(lps) / len(lps)) if lps else 0.0


def eval_scores(rewards, scores, k: int, success_threshold: float, prompt_ids=None) -> dict:
    """Online-eval scores of a [prompts, K] reward matrix with the canonical estimators (c2jax.rl.eval.metrics,
    docs/eval.md): a sample succeeds when its reward >= success_threshold; avg@1 = mean over prompts of
    c/n, pass@K, and best-of-K with the model_score selector (the sample the policy is most confident in); also
    pass@j and best-of-j for every power of two j < K.
    `reward/mean` is the plain mean reward (the target task's reward is fractional). With `prompt_ids`, also
    `per_prompt`: {prompt id: {metric: value}}, for intervals and paired comparisons across evals (the
    reconciler keeps it in the eval history and out of the scalar metrics)."""
    from c2jax.rl.eval.metrics import best_of_k, mean, pass_at_k

    rw = np.asarray(rewards, np.float64)
    if rw.ndim != 2 or rw.shape[1] != k or np.shape(scores) != rw.shape:
        raise ValueError(f"expected [prompts, {k}] rewards and scores, got {rw.shape} and {np.shape(scores)}")
    ok = rw >= success_threshold
    per = {"avg@1": [float(row.mean()) for row in ok]}
    # K and every smaller power of two, from the same K samples (unbiased subset estimators): best-of-4 can sit
    # at its ceiling where best-of-2 still moves
    for j in sorted({2 ** i for i in range(1, k.bit_length()) if 2 ** i < k} | {k}):
        per[f"pass@{j}"] = [pass_at_k(k, int(row.sum()), j) for row in ok]
        per[f"best_of_{j}"] = [best_of_k(list(o), list(sc), j) for o, sc in zip(ok, scores)]
    out = {key: mean(v) for key, v in per.items()} | {"reward/mean": float(rw.mean())}
    if prompt_ids is not None:
        if len(prompt_ids) != rw.shape[0]:
            raise ValueError(f"{len(prompt_ids)} prompt ids for {rw.shape[0]} rows of rewards")
        out["per_prompt"] = {pid: {key: v[i] for key, v in per.items()} for i, pid in enumerate(prompt_ids)}
    return out


def eval_breakdown(per_prompt: dict, categories: dict[str, str], sources: dict[str, str] | None = None, *,
                   n_boot: int = 2000, alpha: float = 0.05, seed: int = 0) -> dict[str, float]:
    """`c2jax eval`'s figures for an online eval (rl/eval/summary.py): every metric of `per_prompt` with a
    percentile-bootstrap interval over prompts (`{metric}/ci_low`, `/ci_high`), and the same per category
    (`category/{name}/{metric}`, with `/ci_low`, `/ci_high`, `/prompts`) and per source."""
    from c2jax.rl.eval.metrics import bootstrap_ci

    def block(prefix: str, pids: list[str]) -> dict[str, float]:
        out: dict[str, float] = {f"{prefix}prompts": float(len(pids))} if prefix else {}
        for metric in per_prompt[pids[0]]:
            values = [per_prompt[p][metric] for p in pids]
            lo, hi = bootstrap_ci(values, n_boot=n_boot, alpha=alpha, seed=seed)
            if prefix:
                out[f"{prefix}{metric}"] = float(np.mean(values))
            out[f"{prefix}{metric}/ci_low"], out[f"{prefix}{metric}/ci_high"] = float(lo), float(hi)
        return out

    pids = list(per_prompt)
    if not pids:
        return {}
    out = block("", pids)
    for key, labels in (("category", categories), ("source", sources or {})):
        names = sorted({labels.get(p, "") for p in pids} - {""})
        if key == "source" and len(names) < 2:
            continue  # one source: its figures are the overall ones
        for name in names:
            out |= block(f"{key}/{name}/", [p for p in pids if labels.get(p) == name])
    return out


# ----------------------------------------------------------------------------------------- spawning
def kill_actors(actors) -> None:
    """ray.kill every actor, without restarts; an actor already gone is skipped."""
    import ray

    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001 -- already gone
            pass


def spawn(cls, cfg: RLSystemConfig, *args, name: str, cpus: float, gpus: float = 0.0, concurrency: int = 1):
    import ray

    return ray.remote(cls).options(
        name=name, max_restarts=cfg.system.max_restarts, max_task_retries=0, num_cpus=cpus, num_gpus=gpus,
        max_concurrency=concurrency).remote(cfg, *args)


def spawn_env_worker(cfg, tasks, name):
    import ray

    return ray.remote(EnvironmentHost).options(
        name=name, max_restarts=cfg.system.max_restarts, max_task_retries=0, num_cpus=cfg.ray.env_cpus,
        max_concurrency=16).remote(cfg.env, tasks)
