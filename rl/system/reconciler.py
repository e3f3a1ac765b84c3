"""The reconciler: owns the sample lifecycle and schedules it against staleness.

prompt -> dispatched group (a rollout worker runs G episodes; its environment worker runs tools and
grades) -> graded group (advantages, persisted to disk, tagged with policy versions) -> packed batch
(groups past the staleness bound dropped or re-queued) -> trained (the learner's rl_step) -> weight
packet (a delta in the Ray object store) pushed to every sampler, swapped in at a decode-chunk boundary.

async: samplers keep generating while the learner trains; admission keeps them <= max_staleness versions
ahead. sync: the same components, but a batch is generated only after the previous step's weights are
out, and the learner waits for it (the ablation baseline).

Everything waited on has a timeout; a group whose worker died or timed out is re-dispatched up to
max_group_retries times, then recorded as errored; every outcome is counted.
"""

from __future__ import annotations

import collections
import math
import time
import uuid
from collections.abc import Callable

import numpy as np

from c2jax.config import save
from c2jax.rl.system.actors import (
    Evaluator,
    RolloutWorker,
    kill_actors,
    spawn,
    spawn_env_worker,
    spawn_learner,
)
from c2jax.rl.system.cluster import init_ray
from c2jax.rl.system.config import RLSystemConfig
from c2jax.rl.system.curriculum import Curriculum
from c2jax.rl.system.envs import (
    chat_tokenizer,
    load_text_tasks,
    target_prompts,
    text_prompts,
    tokenizer_name,
)
from c2jax.rl.system.groups import Group, build_batch
from c2jax.rl.system.staleness import StalenessManager, is_stale, oldest_allowed
from c2jax.rl.system.store import GroupStore
from c2jax.rl.system.weight_sync import WeightChain


def check_tokenizer_vocab(cfg: RLSystemConfig):
    """The chat tokenizer `env.tokenizer` selects (loading it fails here, on the driver, naming the path);
    a ValueError naming it when a sampling model's `model.vocab_size` cannot hold its ids."""
    tokenizer = chat_tokenizer(cfg.env.tokenizer)
    vocab = tokenizer.get_vocab_size()
    if cfg.backend.policy == "engine" and cfg.model.vocab_size < vocab:
        raise ValueError(f"{tokenizer_name(cfg.env.tokenizer)} has {vocab} ids (chat special tokens included) but "
                         f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size >= {vocab}")
    return tokenizer


class Reconciler:
    def __init__(self, cfg: RLSystemConfig, *, on_step: Callable | None = None, console=None, learner=None):
        self.cfg, self.on_step, self.console = cfg, on_step, console
        # a learner handle the caller built and owns (SingleLearner / LearnerGroup), or None: start spawns one
        self._given_learner = learner
        self.run_dir = cfg.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.counts = collections.Counter()
        self.failed_in_row, self.last_failure = 0, ""
        self.lineage = 0  # bumped when a restarted learner group rewinds the weights to its checkpoint
        self.restarts: list[dict] = []
        self.history: list[dict] = []
        self.eval_history: list[dict] = []
        self.ready: collections.deque[Group] = collections.deque()
        self.inflight: dict = {}  # ref -> (spec, worker index, dispatch time)
        self.retry: collections.deque[dict] = collections.deque()
        self.training = None
        self.eval_ref = None
        self.eval_due: collections.deque[tuple[int, list]] = collections.deque()
        self.chain = WeightChain()
        self.staleness = StalenessManager(cfg.system.max_staleness, cfg.system.groups_per_step)
        self.trained_rewards: collections.deque[float] = collections.deque(maxlen=64)
        self.actors: list = []

    # set-up -------------------------------------------------------------------------------------------
    def _prompts(self):
        cfg = self.cfg
        if cfg.env.kind == "target":
            vocab = cfg.backend.fake_vocab if cfg.backend.policy == "fake" else cfg.model.vocab_size
            return target_prompts(cfg.env, vocab, cfg.seed), target_prompts(cfg.env, vocab, cfg.seed, True), {}
        tokenizer = check_tokenizer_vocab(cfg)
        if cfg.env.kind == "text":
            from c2jax.rl.harness import ChatRenderer

            renderer = ChatRenderer(tokenizer)
            train = load_text_tasks(cfg.env.text_tasks)
            held = load_text_tasks(cfg.env.text_eval_tasks)[: cfg.env.eval_prompts]
            clash = {t["id"] for t in train} & {t["id"] for t in held}
            if clash:
                raise ValueError(f"text task ids occur in both train and eval files: {sorted(clash)[:5]}")
            refs = {t["id"]: t["reference"] for t in train + held}
            template = cfg.env.text_template
            return text_prompts(train, renderer, template), text_prompts(held, renderer, template), refs
        # ladder and suite: task directories of every source (the ladder is one generated source)
        from c2jax.rl.system.suite import load_taskset, ship_tasks

        taskset = load_taskset(cfg.env, self.run_dir, cfg.seed)
        self.taskset = taskset
        for note in taskset.notes:
            print(f"tasks: {note}", flush=True)
        held = dict(list(taskset.held_out.items())[: cfg.env.eval_prompts])
        if cfg.eval.every > 0 and not held:
            raise ValueError("eval.every > 0 but the task sources hold no held-out task (give a source "
                             "held_out_fraction > 0, held_out_ids, or split: held_out)")
        self.task_meta = {tid: (st.source, st.category) for tid, st in {**taskset.train, **held}.items()}
        tasks = {tid: st.task for tid, st in {**taskset.train, **held}.items()}
        if cfg.env.kind == "suite" and cfg.env.task_transfer == "ship":
            tasks = ship_tasks(tasks)
        return ({tid: st.instruction for tid, st in taskset.train.items()},
                {tid: st.instruction for tid, st in held.items()}, tasks)

    def start(self) -> None:
        import ray

        cfg, sc = self.cfg, self.cfg.system
        init_ray(num_cpus=cfg.ray.num_cpus, address=cfg.ray.address)  # no-op when Ray is already up
        need = (cfg.ray.learner_cpus * cfg.learner.num_processes + sc.num_env_workers * cfg.ray.env_cpus
                + cfg.ray.rollout_cpus * (sc.num_rollout_workers + (cfg.eval.every > 0)))
        have = ray.cluster_resources().get("CPU", 0.0)
        if need > have + 1e-9:
            raise ValueError(f"the actors need {need:g} logical CPUs (ray.learner_cpus x learner.num_processes, "
                             f"env_cpus, rollout_cpus x "
                             f"workers + evaluator) but the Ray cluster has {have:g}; lower them or raise "
                             "ray.num_cpus")
        if cfg.init_from:  # fail here, naming the path, rather than inside the learner actor
            from c2jax.rl.system.backends import check_init_from

            check_init_from(cfg)
        save(cfg, self.run_dir)
        self.train_prompts, self.eval_prompts, task_dirs = self._prompts()
        tag = uuid.uuid4().hex[:6]
        # large constructor arguments (a suite's tasks, its prompts) go into the object store once, and the driver
        # keeps their refs for the whole run: an actor Ray restarts is constructed from them again (Ray frees the
        # copies it makes of large arguments itself once the first construction is done: ray-project/ray#53727)
        self._actor_args = {"tasks": ray.put(task_dirs), "train": ray.put(self.train_prompts),
                            "eval": ray.put(self.eval_prompts)}
        self.env_workers = [spawn_env_worker(cfg, self._actor_args["tasks"], f"env-{tag}-{i}")
                            for i in range(sc.num_env_workers)]
        # one Learner actor, or a group of learner.num_processes actors in one jax.distributed job
        self.learner = self._given_learner or spawn_learner(cfg, str(self.run_dir), tag)
        self.workers = [spawn(RolloutWorker, cfg, self.env_workers, self._actor_args["train"], f"rollout{i}",
                              name=f"rollout-{tag}-{i}", cpus=cfg.ray.rollout_cpus, gpus=cfg.ray.rollout_gpus,
                              concurrency=sc.groups_per_worker + 3) for i in range(sc.num_rollout_workers)]
        self.evaluator = None
        if cfg.eval.every > 0:
            self.evaluator = spawn(Evaluator, cfg, self.env_workers, self._actor_args["eval"], "evaluator",
                                   name=f"evaluator-{tag}", cpus=cfg.ray.rollout_cpus, concurrency=2)
        own = [] if self._given_learner is not None else self.learner.actors
        self.actors = [*self.env_workers, *own, *self.workers] + ([self.evaluator] if self.evaluator else [])
        version_ref, packet_ref = self.learner.start(cfg.resume)
        self.version = self.start_version = ray.get(version_ref, timeout=max(sc.call_timeout_s, 600))
        self.chain.add(self.version, "full", packet_ref)
        if self.evaluator is not None:  # the starting policy is the baseline every later eval is read against
            self.eval_ref = self.evaluator.evaluate.remote(list(self.eval_prompts), cfg.eval.k,
                                                           self.chain.payloads(), self.version)
        self.store = GroupStore(self.run_dir)
        self.task_meta = getattr(self, "task_meta", {})
        self.curriculum = Curriculum(list(self.train_prompts), cfg.curriculum, cfg.seed + self.version,
                                     sources={p: m[0] for p, m in self.task_meta.items()},
                                     source_weights=getattr(self, "taskset", None) and self.taskset.weights,
                                     success_threshold=cfg.eval.success_threshold)
        self.window_stats: list[dict] = []  # per returned group since the last logged step (by source / category)
        if cfg.env.kind == "suite" and cfg.env.task_transfer == "path":
            # every environment worker must see the task paths (the same machine, or shared storage)
            for info in ray.get([w.check_tasks.remote() for w in self.env_workers], timeout=sc.call_timeout_s):
                if info["missing"]:
                    raise ValueError(f"environment worker on {info['host']} cannot see task paths "
                                     f"{info['missing']} (env.task_transfer=path needs them on storage every node "
                                     "mounts at the same path; or set env.task_transfer=ship)")
        if cfg.resume:
            pending = self.store.pending(self.version)
            self.ready.extend(pending)
            self.counts["groups_resumed"] = len(pending)
        self.staleness.on_resume(self.version)
        self.staleness.accepted += len(self.ready)
        self.free_slots = {w: sc.groups_per_worker for w in range(len(self.workers))}  # groups each can take
        self.worker_backoff: dict[int, float] = {}  # worker -> no dispatch before this time (it was restarting)
        from c2jax.train.metrics import MetricsWriter

        self.metrics = MetricsWriter(self.run_dir)
        self.t_start = time.perf_counter()
        self.learner_busy_s = 0.0

    # scheduling ---------------------------------------------------------------------------------------
    def _can_dispatch(self) -> bool:
        sc = self.cfg.system
        if sc.mode == "sync":
            return self.training is None and len(self.ready) + len(self.inflight) < sc.groups_per_step
        return self.staleness.capacity(self.version) > 0

    def _dispatch(self) -> None:
        now = time.perf_counter()
        ready = {w: n for w, n in self.free_slots.items() if self.worker_backoff.get(w, 0.0) <= now}
        while any(ready.values()) and (self.retry or self._can_dispatch()):
            if self.retry:
                spec = self.retry.popleft()
            else:
                n = self.counts["groups_dispatched"]
                spec = {"group_id": f"v{self.version}-{uuid.uuid4().hex[:10]}",
                        "prompt_id": self.curriculum.next_prompt(self.version),
                        "seed": self.cfg.seed * 1_000_003 + self.start_version * 10_007 + n, "attempt": 0}
                self.counts["groups_dispatched"] += 1
            w = max(ready, key=lambda i: (ready[i], -i))  # the least loaded worker
            self.free_slots[w] -= 1
            ready[w] -= 1
            ref = self.workers[w].run_group.remote({**spec, "lineage": self.lineage}, self.chain.payloads())
            self.inflight[ref] = (spec, w, time.perf_counter())
            self.staleness.on_dispatch()

    def _take_batch(self) -> list[Group] | None:
        sc = self.cfg.system
        fresh = []
        while self.ready and len(fresh) < sc.groups_per_step:
            g = self.ready.popleft()
            if is_stale(g.min_version, self.version, sc.max_staleness):
                requeue = sc.stale_policy == "requeue"
                self.staleness.on_stale(requeue)
                self.counts["groups_requeued_stale" if requeue else "groups_dropped_stale"] += 1
                self.store.mark(g.group_id, "stale", min_version=g.min_version, learner_version=self.version)
                if requeue:
                    self.curriculum.requeue(g.prompt_id)
                continue
            fresh.append(g)
        if len(fresh) < sc.groups_per_step:
            self.ready.extendleft(reversed(fresh))
            return None
        return fresh

    def _maybe_train(self) -> None:
        if self.training is not None:
            return
        groups = self._take_batch()
        if groups is None:
            return
        sc = self.cfg.system
        row_multiple = math.lcm(self.cfg.rl.micro_batches, self.learner.row_multiple)  # rows split over processes
        batch = build_batch(groups, sc.seq_len, sc.min_rows, row_multiple, self.cfg.router_replay)
        mask = np.asarray(batch.loss_mask, bool)
        versions = np.asarray(batch.policy_versions)[mask]
        min_v = int(versions.min()) if versions.size else self.version
        if min_v < oldest_allowed(self.version, sc.max_staleness):  # cannot happen: _take_batch filters
            raise AssertionError(f"staleness bound violated: token v{min_v} at learner v{self.version}")
        metrics_ref = self.learner.train(batch)
        info = {"groups": [g.group_id for g in groups], "t0": time.perf_counter(),
                "reward": float(np.mean([g.rewards.mean() for g in groups])),
                # the tests' verdict and the length penalty paid, apart: at a low solve rate the penalty can be
                # most of the reward's spread (issue 38), which reward/mean alone hides
                "verdict": float(np.mean([r.verdict for g in groups for r in g.rollouts])),
                "length_penalty": float(np.mean([r.length_penalty for g in groups for r in g.rollouts])),
                "groups_mixed": float(np.mean([len({r.verdict for r in g.rollouts}) > 1 for g in groups])),
                "tokens": int(mask.sum()), "samples": sum(len(g.rollouts) for g in groups),
                "min_token_version": min_v, "staleness_max": self.version - min_v,
                "staleness_mean": float(self.version - versions.mean()) if versions.size else 0.0}
        self.training = (metrics_ref, info)

    # completions --------------------------------------------------------------------------------------
    def _on_group(self, ref) -> None:
        import ray

        spec, w, _ = self.inflight.pop(ref)
        self.free_slots[w] += 1
        try:
            group: Group = ray.get(ref, timeout=self.cfg.system.call_timeout_s)
        except ray.exceptions.ActorUnavailableError:
            # the worker is being restarted by Ray: the group never ran; send it again (same attempt) once a worker
            # is back, and leave this one alone for a moment rather than spin on it. Not a failure of the setting
            self.staleness.on_return(accepted=False)
            self.counts["groups_resent_worker_restarting"] += 1
            self.worker_backoff[w] = time.perf_counter() + 1.0
            self.retry.appendleft(spec)
            return
        except Exception as e:  # noqa: BLE001 -- RayActorError (worker died), task error, timeout
            self._on_group_failed(spec, f"{type(e).__name__}: {str(e)[:300]}")
            return
        self.staleness.on_return(accepted=True)
        self.counts["groups_returned"] += 1
        self.counts["episodes_returned"] += len(group.rollouts)
        self.counts["episodes_retried"] += sum(r.attempts - 1 for r in group.rollouts)
        self.last_worker_info = group.timings
        if group.errored:
            self.counts["groups_errored"] += 1
            self.counts["episodes_errored"] += sum(r.errored for r in group.rollouts)
            self.staleness.on_skipped()
            self.store.put(group)
            self.store.mark(group.group_id, "errored")
            if all(r.errored for r in group.rollouts):
                self._note_failure(group.rollouts[0].error)
            else:
                self.failed_in_row = 0
            return
        self.failed_in_row = 0
        group.gate_length_penalty(self.cfg.rl.reward.length_penalty)
        self._observe(group)
        if self.cfg.curriculum.skip_zero_variance and group.zero_variance:
            self.counts["groups_skipped_zero_variance"] += 1
            self.staleness.on_skipped()
            self.store.put(group.with_advantages(self.cfg.rl.advantage))
            self.store.mark(group.group_id, "skipped")
            return
        group.with_advantages(self.cfg.rl.advantage)
        self.store.put(group)  # fsynced before it can be trained: a crash never loses a finished group
        self.ready.append(group)

    def _observe(self, group: Group) -> None:
        """Curriculum and filter bookkeeping of one graded group, and its row of the per-source / category stats."""
        rs = group.rollouts
        solve = float(np.mean([r.verdict >= self.cfg.eval.success_threshold for r in rs]))
        turns, tokens = float(np.mean([r.turns for r in rs])), float(np.mean([r.model_tokens for r in rs]))
        thinking = float(np.mean([r.thinking_tokens for r in rs]))
        self.curriculum.observe(group.prompt_id, turns, tokens, thinking, solve_rate=solve)
        for ev in self.curriculum.take_events():
            # the filter says what it does: printed, and noted in groups.jsonl next to the groups
            print(f"filter: task {ev['prompt_id']} (source {ev['source'] or '-'}) {ev['event']}: solve rate "
                  f"{ev['solve_rate']:.2f} over its last {ev['groups']} groups", flush=True)
            self.store.note(f"filter_{ev['event']}", **{k: v for k, v in ev.items() if k != "event"})
            self.counts[f"tasks_{ev['event']}"] += 1
        source, category = self.task_meta.get(group.prompt_id, ("", ""))
        self.window_stats.append({"source": source, "category": category, "solve_rate": solve, "turns": turns,
                                  "tokens": tokens, "thinking_tokens": thinking})

    def _suite_rows(self) -> dict[str, float]:
        """Per source and category: tasks live / filtered (now) and, over the groups returned since the last
        logged step, groups, solve rate, mean turns, model tokens, thinking tokens."""
        if not self.task_meta:
            return {}
        row: dict[str, float] = {}
        live = self.curriculum.live_counts()
        cat_of = {p: self.task_meta[p][1] for p in self.curriculum.prompt_ids if p in self.task_meta}
        for source, (n_live, n_filtered) in live.items():
            row[f"source/{source}/tasks_live"], row[f"source/{source}/tasks_filtered"] = n_live, n_filtered
        for cat in sorted(set(cat_of.values())):
            ids = [p for p, c in cat_of.items() if c == cat]
            n_f = sum(p in self.curriculum.filtered for p in ids)
            row[f"category/{cat}/tasks_live"], row[f"category/{cat}/tasks_filtered"] = len(ids) - n_f, n_f
        for key in ("source", "category"):
            by: dict[str, list[dict]] = collections.defaultdict(list)
            for st in self.window_stats:
                by[st[key]].append(st)
            for name, sts in by.items():
                row[f"{key}/{name}/groups"] = len(sts)
                for stat in ("solve_rate", "turns", "tokens", "thinking_tokens"):
                    row[f"{key}/{name}/{stat}"] = float(np.mean([st[stat] for st in sts]))
        self.window_stats = []
        return row

    def _on_group_failed(self, spec: dict, why: str) -> None:
        if self._given_learner is None and self.cfg.learner.num_processes > 1:
            # a dead learner process also fails the groups whose chain holds its packets, possibly before any
            # step's call fails (no batch is ready while every group fails): restart the group now
            try:
                self.learner.check_alive(self.cfg.system.call_timeout_s)
            except Exception as e:  # noqa: BLE001 -- the first process found dead, named
                self._restart_learner(e)
        self.staleness.on_return(accepted=False)
        if spec["attempt"] < self.cfg.system.max_group_retries:
            self.counts["groups_retried"] += 1
            self.retry.append({**spec, "attempt": spec["attempt"] + 1})
        else:  # recorded as lost: its episodes count as errored
            self.counts["groups_lost"] += 1
            self.counts["episodes_errored"] += spec.get("group_size", self.cfg.system.group_size)
            self.store.mark(spec["group_id"], "lost", error=why, prompt_id=spec["prompt_id"])
            self._note_failure(why)

    def _note_failure(self, error: str) -> None:
        self.failed_in_row, self.last_failure = self.failed_in_row + 1, error or ""
        limit = self.cfg.system.max_failed_groups_in_row
        if limit and self.failed_in_row >= limit:
            # every group is already in the store, marked errored or lost: stopping loses nothing
            raise RuntimeError(
                f"{self.failed_in_row} groups in a row failed in every episode (system.max_failed_groups_in_row="
                f"{limit}), so the run stops; the last error:\n{self.last_failure.strip()[-2000:]}")

    def _on_trained(self) -> None:
        metrics_ref, info = self.training
        self.training = None
        try:
            metrics = self.learner.result(metrics_ref, timeout=self.cfg.system.call_timeout_s)
        except Exception as e:  # noqa: BLE001 -- a learner-group process died (RuntimeError), a timeout, ...
            self._restart_learner(e)
            return
        self.version += 1
        # the packet is still being encoded on the learner; samplers wait on this ref, the learner goes on
        packet_ref = self.learner.packet(self.version)
        self.chain.add(self.version, "full" if metrics.get("sync/full") else "delta", packet_ref)
        for wkr in self.workers:  # fire and forget: the learner never waits for a sampler
            wkr.sync.remote(self.chain.payloads(), self.lineage)
        self.store.mark_trained(info["groups"], self.version)
        self.learner_busy_s += metrics.get("learner/step_s", 0.0)
        self.trained_rewards.append(info["reward"])
        self._log(metrics, info)
        if self.evaluator is not None and (
                self.version % self.cfg.eval.every == 0 or self.version >= self.cfg.system.steps):
            # queued with this version's weight chain: an eval still running delays it, never skips it
            self.eval_due.append((self.version, self.chain.payloads()))
            self._launch_eval()
        if self.on_step is not None:
            self.on_step(self)

    def _launch_eval(self) -> None:
        if self.eval_ref is None and self.eval_due:
            version, payloads = self.eval_due.popleft()
            self.eval_ref = self.evaluator.evaluate.remote(list(self.eval_prompts), self.cfg.eval.k, payloads,
                                                           version, self.lineage)

    def _restart_learner(self, error: Exception) -> None:
        """A learner group whose process died cannot go on (a jax.distributed process cannot rejoin alone):
        tear it down, build a new group that restores the newest checkpoint (step s), rewind every sampler to
        s's weights (a new lineage: a sampler given its chain starts over from it, and chains of the old lineage
        are ignored), and queue every graded group not trained at a step <= s again (the updates after s were
        lost with the group). Up to
        `learner.max_group_restarts` times; a one-process learner (Ray restarts its actor) or a learner the
        caller owns is not rebuilt here: the error propagates."""
        import ray

        lc, sc = self.cfg.learner, self.cfg.system
        if self._given_learner is not None or lc.num_processes == 1 or \
                self.counts["learner_restarts"] >= lc.max_group_restarts:
            raise error
        self.counts["learner_restarts"] += 1
        self.training = None  # a step in flight on the dead group: its groups are re-queued below
        lost_version = self.version
        why = f"{type(error).__name__}: {str(error)[:500]}"
        print(f"learner group failed at step {lost_version + 1} ({why}); restarting it from its newest checkpoint "
              f"(restart {self.counts['learner_restarts']} of {lc.max_group_restarts})", flush=True)
        old = self.learner
        self.actors = [a for a in self.actors if all(a is not b for b in old.actors)]
        old.shutdown()
        self.learner = spawn_learner(self.cfg, str(self.run_dir), uuid.uuid4().hex[:6])
        self.actors += self.learner.actors
        version_ref, packet_ref = self.learner.start(True)
        self.version = ray.get(version_ref, timeout=max(sc.call_timeout_s, 600))
        self.lineage += 1
        self.chain = WeightChain()
        self.chain.add(self.version, "full", packet_ref)
        for wkr in self.workers:  # fire and forget, as every sync; the next dispatch carries the lineage too
            wkr.sync.remote(self.chain.payloads(), self.lineage)
        self.ready = collections.deque(self.store.pending(self.version))
        self.staleness.on_resume(self.version)
        self.staleness.accepted += len(self.ready)
        self.staleness.running = len(self.inflight)
        self.eval_due.clear()  # queued with chains of the lost lineage; the next eval point queues anew
        self.failed_in_row = 0  # groups failed on the dead group's packets, not on the setting
        self.store.note("learner_restart", failed_step=lost_version + 1, restored_step=self.version,
                        requeued=len(self.ready), error=why)
        self.restarts.append({"failed_step": lost_version + 1, "restored_step": self.version,
                              "requeued_groups": len(self.ready), "error": why})

    def _on_eval(self) -> None:
        import ray

        ref = self.eval_ref
        try:
            res = ray.get(ref, timeout=self.cfg.system.call_timeout_s)
        except Exception as e:  # noqa: BLE001
            self.counts["evals_failed"] += 1
            print(f"warning: online eval failed: {type(e).__name__}: {e}")
            return
        finally:  # the next one starts only now: two evals at once would share the evaluator's weights
            self.eval_ref = None
            self._launch_eval()
        version = int(res.pop("version"))
        if self.task_meta and "per_prompt" in res:
            from c2jax.rl.system.actors import eval_breakdown

            res.update(eval_breakdown(res["per_prompt"], {p: m[1] for p, m in self.task_meta.items()},
                                      {p: m[0] for p, m in self.task_meta.items()}, seed=self.cfg.seed))
        self.eval_history.append({"step": version, **res})
        self.metrics.write(version, {k: v for k, v in res.items() if k != "per_prompt"}, kind="eval")

    def _log(self, metrics: dict, info: dict) -> None:
        wall = time.perf_counter() - self.t_start
        steps = self.version - self.start_version
        self.counts["tokens_trained"] += info["tokens"]
        self.counts["samples_trained"] += info["samples"]
        row = {**metrics, "reward/mean": info["reward"], "reward/verdict_mean": info["verdict"],
               "reward/length_penalty_mean": info["length_penalty"], "reward/groups_mixed": info["groups_mixed"],
               "staleness/batch_max": info["staleness_max"],
               "staleness/batch_mean": info["staleness_mean"], "queue/ready": len(self.ready),
               "queue/inflight": len(self.inflight), "queue/retry": len(self.retry),
               "throughput/tokens_per_s": self.counts["tokens_trained"] / wall,
               "throughput/samples_per_s": self.counts["samples_trained"] / wall,
               "throughput/steps_per_s": steps / wall, "learner/busy_fraction": self.learner_busy_s / wall,
               "time/wall_s": wall, **{f"count/{k}": float(v) for k, v in self.counts.items()},
               **self._suite_rows()}
        lat = getattr(self, "last_worker_info", {}).get("sync_latency_s")
        if lat is not None:
            row["sync/latency_s"] = lat
        self.history.append({"step": self.version, **row})
        if self.version % self.cfg.log_every == 0 or self.version >= self.cfg.system.steps:
            self.metrics.write(self.version, row)

    # main loop ----------------------------------------------------------------------------------------
    def run(self, dashboard=None) -> dict:
        import ray

        target = self.cfg.system.steps
        while self.version < target:
            self._dispatch()
            self._maybe_train()
            waiting = list(self.inflight) + ([self.training[0]] if self.training else []) + \
                ([self.eval_ref] if self.eval_ref is not None else [])
            if not waiting and any(t > time.perf_counter() for t in self.worker_backoff.values()):
                time.sleep(0.2)  # every free worker is restarting: wait for one, then dispatch again
                continue
            if not waiting:
                raise RuntimeError("the reconciler has nothing in flight and cannot train: no free rollout "
                                   "worker slot, or groups_per_step exceeds what admission allows")
            done, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            for ref in done:
                if self.training is not None and ref == self.training[0]:
                    self._on_trained()
                elif ref == self.eval_ref:
                    self._on_eval()
                elif ref in self.inflight:
                    self._on_group(ref)
            self._expire()
            if dashboard is not None:
                dashboard.update(self)
        while self.eval_ref is not None:  # the evals still due, in order
            self._on_eval()
        if self.evaluator is not None and (not self.eval_history or self.eval_history[-1]["step"] < self.version):
            self.eval_due.append((self.version, self.chain.payloads()))  # the final weights are always evaluated
            self._launch_eval()
            self._on_eval()
        return self.summary()

    def _expire(self) -> None:
        now, limit = time.perf_counter(), self.cfg.system.group_timeout_s
        for ref, (spec, w, t0) in list(self.inflight.items()):
            if now - t0 > limit:
                del self.inflight[ref]
                self.free_slots[w] += 1
                self.counts["groups_timed_out"] += 1
                self._on_group_failed(spec, f"no result after {limit:.0f}s")

    def summary(self) -> dict:
        wall = time.perf_counter() - self.t_start
        return {"steps": self.version - self.start_version, "version": self.version, "wall_s": wall,
                "start_version": self.start_version, "inflight_at_end": len(self.inflight),
                "retry_at_end": len(self.retry), "ready_at_end": len(self.ready),
                "counts": dict(self.counts), "staleness": {"dropped": self.staleness.dropped,
                                                           "requeued": self.staleness.requeued},
                "history": self.history, "eval": self.eval_history, "learner_restarts": self.restarts,
                **({"tasks": self.taskset.summary(), "filtered_at_end": sorted(self.curriculum.filtered)}
                   if getattr(self, "taskset", None) is not None else {})}

    def _call_each_worker(self, method: str, *args) -> list:
        """One call per rollout worker, waiting out a worker Ray is still restarting.

        A worker killed late in a run may still be coming back when the run ends; its
        call then fails with ActorUnavailableError and succeeds once the restart is done.
        """
        import ray
        from ray.exceptions import ActorUnavailableError

        deadline = time.monotonic() + self.cfg.system.call_timeout_s
        results = []
        for w in self.workers:
            while True:
                try:
                    left = max(deadline - time.monotonic(), 0.1)
                    results.append(ray.get(getattr(w, method).remote(*args), timeout=left))
                    break
                except ActorUnavailableError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.2)
        return results

    def final_sync(self) -> list:
        return self._call_each_worker("sync", self.chain.payloads(), self.lineage)

    def worker_info(self) -> list[dict]:
        return self._call_each_worker("info")

    def shutdown(self) -> None:
        if getattr(self, "store", None) is not None:
            self.store.close()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        kill_actors(self.actors)
        self.actors = []
        if getattr(self, "learner", None) is not None and self._given_learner is None:
            self.learner.shutdown()  # a learner group's placement group


def run_system(cfg: RLSystemConfig, *, on_step=None, dashboard=None, learner=None) -> dict:
    """One RL run. `learner`: an already running learner handle (actors.SingleLearner / LearnerGroup) whose
    model and learner config match `cfg`'s, which the run uses from its current version and leaves running;
    None: the run spawns its own from `cfg`."""
    rec = Reconciler(cfg, on_step=on_step, learner=learner)
    try:
        rec.start()
        out = rec.run(dashboard)
        out["worker_synced_versions"] = rec.final_sync()
        out["worker_info"] = rec.worker_info()
        return out
    finally:
        rec.shutdown()

