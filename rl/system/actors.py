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
from c2jax.rl.system.envs import EnvironmentHost, byte_tokenizer, run_ladder_episode, run_target_group
from c2jax.rl.system.groups import Group
from c2jax.rl.system.packet_store import PacketPublisher
from c2jax.rl.system.weight_sync import DeltaDecoder, DeltaEncoder


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
        self.publisher = PacketPublisher(ws.publish_dir, ws.keep_full) if ws.publish_dir else None
        self.busy_s = 0.0
        self._encoding = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")  # in version order
        self._packets: dict[int, Future] = {}
        self._last_stats: dict[str, float] = {}
        self._last_future: Future | None = None

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


class RolloutWorker:
    """Holds a sampler and drives up to `system.groups_per_worker` groups at once against environment
    workers; their requests, and the G episodes of an agentic group, run concurrently on the sampler
    (threads sharing the engine's slots: continuous batching)."""

    def __init__(self, cfg: RLSystemConfig, env_workers: list, prompts: dict, worker_id: str):
        import ray

        self.ray, self.cfg, self.env_workers, self.prompts, self.worker_id = ray, cfg, env_workers, prompts, worker_id
        self.renderer = None
        detok = None
        if cfg.env.kind in ("ladder", "text"):
            from c2jax.rl.harness import ChatRenderer

            self.renderer = ChatRenderer(byte_tokenizer())
            detok = self.renderer.decode
        self.policy = make_policy(cfg, detok)
        self.decoder = DeltaDecoder()
        self._lock = threading.Lock()
        # at most groups_per_worker groups at once per sampler (a call the reconciler abandoned may linger)
        self._run_slots = threading.BoundedSemaphore(cfg.system.groups_per_worker)
        self.swaps = 0
        self.sync_latency_s: list[float] = []
        self.incarnation = uuid.uuid4().hex[:8]  # changes when Ray restarts the actor

    # weights ------------------------------------------------------------------------------------------
    def sync(self, chain: list) -> int:
        """Applies every packet of `chain` (ObjectRefs to the packets since the last full one) newer than
        what this worker holds. Safe to call while a group is decoding."""
        packets = self.ray.get(list(chain), timeout=self.cfg.system.call_timeout_s) if chain else []
        with self._lock:
            for p in sorted(packets, key=lambda p: p.version):
                if p.version > self.decoder.version and (p.kind == "full" or p.base_version == self.decoder.version):
                    self.decoder.apply(p)
                    self.sync_latency_s.append(time.time() - p.stats.get("created", time.time()))
        return self.decoder.version

    def _maybe_swap(self) -> None:
        with self._lock:
            if self.decoder.version <= self.policy.version:
                return
            weights, version = self.decoder.weights, self.decoder.version
        self.policy.load(weights, version)
        self.swaps += 1

    def _swap_at_chunk(self) -> None:
        if self.cfg.system.in_flight_updates:
            self._maybe_swap()

    def version(self) -> int:
        return self.policy.version

    def info(self) -> dict:
        lat = self.sync_latency_s[-16:]
        return {"version": self.policy.version, "incarnation": self.incarnation, "swaps": self.swaps,
                "sync_latency_s": float(np.mean(lat)) if lat else float("nan")}

    # episodes -----------------------------------------------------------------------------------------
    def _env_call(self, env):
        timeout = self.cfg.system.call_timeout_s

        def call(method, *args):
            return self.ray.get(getattr(env, method).remote(*args), timeout=timeout)

        return call

    def run_group(self, spec: dict, chain: list) -> Group:
        """spec: {group_id, prompt_id, seed, attempt[, group_size]}. Re-syncs weights before serving."""
        with self._run_slots:
            return self._run_group(spec, chain)

    def _run_group(self, spec: dict, chain: list) -> Group:
        t0 = time.perf_counter()
        self.sync(chain)
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
            policy = _TokenPolicy(self.policy, self._swap_at_chunk)
            with ThreadPoolExecutor(max_workers=size, thread_name_prefix="episode") as pool:
                rollouts = list(pool.map(
                    lambda i: run_ladder_episode(policy, self.renderer, call, spec["prompt_id"],
                                                 self.prompts[spec["prompt_id"]], ec, spec["seed"] * 1009 + i,
                                                 sc.max_episode_retries, self.cfg.router_replay), range(size)))
        return Group(spec["group_id"], spec["prompt_id"], rollouts, attempt=spec.get("attempt", 0),
                     worker=f"{self.worker_id}/{self.incarnation}",
                     timings={"total_s": time.perf_counter() - t0, "version_at_start": version_at_start,
                              "version_at_end": self.policy.version, **self.info()})


class _TokenPolicy:
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

    def evaluate(self, prompt_ids: list[str], k: int, chain: list, seed: int) -> dict:
        rewards, scores = [], []
        for i, pid in enumerate(prompt_ids):
            spec = {"group_id": f"eval-{seed}-{i}", "prompt_id": pid, "seed": 10_000_000 + seed * 1000 + i,
                    "group_size": k}
            rollouts = self.run_group(spec, chain).rollouts
            rewards.append([r.reward for r in rollouts])
            scores.append([model_score(r) for r in rollouts])
        return {**eval_scores(rewards, scores, k, self.cfg.eval.success_threshold), "version": self.policy.version,
                "prompts": len(prompt_ids)}


def model_score(rollout) -> float:
    """Mean sampler log-probability of a rollout's sampled tokens: the `model_score` selector of c2jax.rl.eval
    (runner.model_score), 0.0 when it sampled nothing."""
    lps = [lp for s in rollout.sequences for lp, m in zip(s["behavior_logprobs"], s["loss_mask"]) if m]
    return float(sum(lps) / len(lps)) if lps else 0.0


def eval_scores(rewards, scores, k: int, success_threshold: float) -> dict:
    """Online-eval scores of a [prompts, K] reward matrix with the canonical estimators (c2jax.rl.eval.metrics,
    docs/eval.md): a sample succeeds when its reward >= success_threshold; avg@1 = mean over prompts of
    c/n, pass@K, and best-of-K with the model_score selector (the sample the policy is most confident in).
    `reward/mean` is the plain mean reward (the target task's reward is fractional)."""
    from c2jax.rl.eval.metrics import best_of_k, mean, pass_at_k

    rw = np.asarray(rewards, np.float64)
    if rw.ndim != 2 or rw.shape[1] != k or np.shape(scores) != rw.shape:
        raise ValueError(f"expected [prompts, {k}] rewards and scores, got {rw.shape} and {np.shape(scores)}")
    ok = rw >= success_threshold
    return {"avg@1": mean([float(row.mean()) for row in ok]),
            f"pass@{k}": mean([pass_at_k(k, int(row.sum()), k) for row in ok]),
            f"best_of_{k}": mean([best_of_k(list(o), list(sc), k) for o, sc in zip(ok, scores)]),
            "reward/mean": float(rw.mean())}


# ----------------------------------------------------------------------------------------- spawning
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
