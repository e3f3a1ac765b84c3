"""What runs inside the actors: policy backends (the InferenceEngine, or a NumPy fake) and learner cores
(rl_step with Orbax checkpoints, or a NumPy fake). The fakes are a categorical policy over the vocabulary
trained by exact REINFORCE, so system tests exercise staleness, sync and faults in seconds."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np

from c2jax.rl.system.config import RLSystemConfig


# ------------------------------------------------------------------------------------ weight naming
def _name(path) -> str:
    # lazily: c2jax.train.checkpoint imports orbax, which only the Orbax-checkpointing learner core needs
    from c2jax.train.checkpoint import path_key_name

    return "/".join(path_key_name(k) for k in path)


def flatten_weights(params, model_state) -> dict[str, np.ndarray]:
    import jax

    out = {}
    for prefix, tree in (("params", params), ("model_state", model_state)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            out[f"{prefix}/{_name(path)}"] = np.asarray(leaf)
    return out


def unflatten_weights(weights: dict[str, np.ndarray], params_like, model_state_like):
    import jax
    import jax.numpy as jnp

    def rebuild(prefix, like):
        paths, treedef = jax.tree_util.tree_flatten_with_path(like)
        missing = [f"{prefix}/{_name(p)}" for p, _ in paths if f"{prefix}/{_name(p)}" not in weights]
        if missing:
            raise KeyError(f"weights lack {missing[:3]} (and {max(0, len(missing) - 3)} more)")
        return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(weights[f"{prefix}/{_name(p)}"]) for p, _ in paths])

    return rebuild("params", params_like), rebuild("model_state", model_state_like)


# ---------------------------------------------------------------------------------------- policies
class EnginePolicy:
    """The InferenceEngine; `generate` calls `maybe_swap()` before every decode chunk (in-flight updates).
    Thread-safe: concurrent `generate` calls (the episodes of a group) share the engine's slots; whichever
    caller holds the lock runs the next chunk for all of them (continuous batching)."""

    def __init__(self, cfg: RLSystemConfig, detokenize=None):
        from flax import nnx

        from c2jax.models.inference.engine import InferenceEngine
        from c2jax.models.transformer import init

        model = init(cfg.model, cfg.seed)  # structure; the weights come from the first sync
        self._graphdef3, self._params_like, self._rest_like = nnx.split(model, nnx.Param, ...)
        self.engine = InferenceEngine.from_model(model, config=cfg.engine, version=-1, detokenize=detokenize)
        self.recompute_cache = cfg.system.recompute_cache
        self._lock = threading.RLock()  # the engine is not thread-safe: one caller drives it at a time

    @property
    def version(self) -> int:
        return self.engine.version

    def load(self, weights: dict[str, np.ndarray], version: int) -> None:
        from flax import nnx

        params, rest = unflatten_weights(weights, self._params_like, self._rest_like)
        state = nnx.split(nnx.merge(self._graphdef3, params, rest))[1]
        with self._lock:
            self.engine.swap_weights(state, version, recompute_cache=self.recompute_cache)

    def generate(self, requests, maybe_swap):
        with self._lock:
            ids = [self.engine.submit(r) for r in requests]
        out = {}
        while True:
            with self._lock:
                for i in ids:
                    if i not in out:
                        res = self.engine.pop_result(i)
                        if res is not None:
                            out[i] = res
                if len(out) == len(ids):
                    return [out[i] for i in ids]
                maybe_swap()
                self.engine.step()


class FakePolicy:
    """Samples every token from softmax(weights['logits'] / T), chunk_steps tokens per "decode chunk"."""

    def __init__(self, cfg: RLSystemConfig, detokenize=None):
        self.chunk = cfg.engine.chunk_steps
        self.version, self.logits = -1, None

    def load(self, weights, version):
        self.logits, self.version = np.asarray(weights["logits"], np.float64), version

    def generate(self, requests, maybe_swap):
        from c2jax.models.inference.engine import GenerationResult

        results = [GenerationResult([], [], [], None, "length") for _ in requests]
        rngs = [np.random.default_rng(r.seed) for r in requests]
        while any(len(res.token_ids) < r.max_new_tokens for res, r in zip(results, requests)):
            maybe_swap()
            t = max(requests[0].temperature, 1e-6)
            logp = self.logits / t - np.logaddexp.reduce(self.logits / t)
            for res, r, rng in zip(results, requests, rngs):
                for _ in range(min(self.chunk, r.max_new_tokens - len(res.token_ids))):
                    tok = int(rng.choice(len(logp), p=np.exp(logp)))
                    res.token_ids.append(tok)
                    res.logprobs.append(float(logp[tok]))
                    res.policy_versions.append(self.version)
        return results


def on_this_device(cfg: RLSystemConfig) -> RLSystemConfig:
    """`cfg` with the kernels this process runs resolved for its own device (moe_impl="grouped": the grouped GEMM
    kernels/dispatch picks here, models.moe_dispatch.resolve_moe_kernel): each actor resolves its own, so a CPU
    driver never picks a GPU learner's kernel."""
    import dataclasses

    from c2jax.models.moe_dispatch import resolve_moe_kernel

    model = resolve_moe_kernel(cfg.model)
    return cfg if model is cfg.model else dataclasses.replace(cfg, model=model)


def record_execution(cfg: RLSystemConfig, run_dir: Path, role: str) -> None:
    """What this actor runs (device, MoE implementation and kernel) in run_dir/execution.jsonl, one line per
    actor start, next to the driver's config.yaml (which cannot know a remote device's kernel)."""
    import json
    import socket

    from c2jax.kernels.dispatch import current_device

    platform, kind = current_device()
    if not Path(run_dir).is_dir():  # a node that does not share the run directory: nothing to record there
        return
    row = {"role": role, "host": socket.gethostname(), "pid": os.getpid(), "platform": platform, "device_kind": kind,
           "moe_impl": cfg.model.moe_impl, "moe_kernel": cfg.model.moe_kernel, "time": time.time()}
    try:
        with open(Path(run_dir) / "execution.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as e:  # a record, not a reason to fail the actor
        print(f"warning: cannot record the {role}'s execution in {run_dir}: {e}", flush=True)


def make_policy(cfg: RLSystemConfig, detokenize=None):
    if cfg.backend.policy == "fake":
        return FakePolicy(cfg, detokenize)
    cfg = on_this_device(cfg)
    if cfg.run_dir.is_dir():  # the driver's run dir, where this node shares it
        record_execution(cfg, cfg.run_dir, "sampler")
    return EnginePolicy(cfg, detokenize)


# ---------------------------------------------------------------------------------- initial weights
# ModelConfig fields the RL run decides itself even when the weights come from a checkpoint
_EXECUTION_FIELDS = ("moe_impl", "moe_kernel", "scan_layers", "remat_policy", "dtype", "param_dtype")


def check_init_from(cfg: RLSystemConfig) -> str:
    """"hf" or "run" for `cfg.init_from`; a ConfigError naming the path when it is neither (checked on the
    driver before any actor starts, and again where the weights are loaded)."""
    from c2jax.models.config import ConfigError

    path = Path(cfg.init_from).expanduser()
    if cfg.backend.learner != "rl":
        raise ConfigError(f"init_from: needs backend.learner=rl (the {cfg.backend.learner} learner has no model)")
    if not path.exists():
        raise ConfigError(f"init_from: {path} does not exist")
    if (path / "config.json").is_file():
        return "hf"
    if (path / "config.yaml").is_file() and (path / "checkpoints").is_dir():
        return "run"
    raise ConfigError(f"init_from: {path} is neither a Hugging Face DeepseekV3 checkpoint (no config.json) nor a "
                      "c2jax pretraining run directory (config.yaml + checkpoints/)")


def _load_pretraining_run(path: Path):
    """The newest checkpoint of a pretraining run, with the model config of its last phase (its RoPE
    scaling, as `Trainer.export_hf` writes it)."""
    import jax
    from flax import nnx

    from c2jax.config import load
    from c2jax.models.config import ConfigError
    from c2jax.models.transformer import init
    from c2jax.train.checkpoint import Checkpointer
    from c2jax.train.config import PretrainConfig
    from c2jax.train.loop import phase_model_config
    from c2jax.train.optim import make_optimizer
    from c2jax.train.step import init_train_state

    run = load(PretrainConfig, path / "config.yaml")
    ckpt = Checkpointer(path / "checkpoints", run.checkpoint)
    try:
        if not ckpt.steps():
            raise ConfigError(f"init_from: {path / 'checkpoints'} holds no checkpoint")
        tx, _ = make_optimizer(run.optimizer, run.total_steps)
        abstract = jax.eval_shape(lambda: init_train_state(init(run.model, seed=run.seed), tx, seed=run.seed)[1])
        state, _ = ckpt.restore(ckpt.steps()[-1], abstract)
    finally:
        ckpt.close()
    model_cfg = phase_model_config(run, run.phases[-1])
    graphdef = nnx.split(nnx.eval_shape(lambda: init(model_cfg)), nnx.Param, ...)[0]
    return nnx.merge(graphdef, state.params, state.model_state)


def initial_model(cfg: RLSystemConfig):
    """The learner's starting model: `cfg.init_from`'s weights, or a random init of `cfg.model`."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from c2jax.models.config import ConfigError, ModelConfig
    from c2jax.models.transformer import init

    if not cfg.init_from:
        return init(cfg.model, cfg.seed)
    kind = check_init_from(cfg)
    path = Path(cfg.init_from).expanduser()
    if kind == "hf":
        from c2jax.models import hf

        model = hf.from_pretrained(path, mtp="drop" if cfg.model.num_nextn_predict_layers == 0 else "auto")
    else:
        model = _load_pretraining_run(path)
    differ = [f.name for f in dataclasses.fields(ModelConfig)
              if f.name not in _EXECUTION_FIELDS and getattr(cfg.model, f.name) != getattr(model.cfg, f.name)]
    if differ:
        shown = "; ".join(f"{n}: run {getattr(cfg.model, n)!r}, checkpoint {getattr(model.cfg, n)!r}"
                          for n in differ[:4])
        raise ConfigError(f"init_from: the model in {path} does not match the run's `model` config ({shown}"
                          f"{'; ...' if len(differ) > 4 else ''}); set `model` to the checkpoint's architecture")
    # the run's execution settings (moe_impl, dtypes, ...) around the checkpoint's weights
    graphdef = nnx.split(nnx.eval_shape(lambda: init(cfg.model)), nnx.Param, ...)[0]
    _, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.tree.map(lambda x: jnp.asarray(x, cfg.model.param_dtype), params)
    return nnx.merge(graphdef, params, rest)


# ----------------------------------------------------------------------------------------- learners
def _shard_rl_state(state, tx, mesh_cfg):
    """The learner's RLState laid out on `mesh_cfg`'s mesh like pretraining's (c2jax.mesh rules: FSDP /
    expert-parallel parameters, the KL reference alike); the optimizer state follows its parameters."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from c2jax.mesh import make_mesh, param_rules, place_on_mesh, shard_state

    devices = jax.devices()
    wanted = mesh_cfg.resolve(len(devices)).num_devices if -1 in mesh_cfg.shape else mesh_cfg.num_devices
    if wanted > len(devices):
        raise ValueError(f"mesh {dict(zip(mesh_cfg.axis_names, mesh_cfg.shape))} needs {wanted} devices; the "
                         f"learner sees {len(devices)} ({devices[0].platform})")
    mesh = make_mesh(mesh_cfg, devices[:wanted] if jax.process_count() == 1 else None)
    rules = param_rules(mesh_cfg)
    params = shard_state(state.params, mesh, rules)
    ref = None if state.ref_params is None else shard_state(state.ref_params, mesh, rules)
    state = state._replace(step=jax.device_put(state.step, NamedSharding(mesh, PartitionSpec())), params=params,
                           model_state=shard_state(state.model_state, mesh, rules), ref_params=ref,
                           opt_state=place_on_mesh(jax.jit(tx.init)(params), mesh))
    return mesh, state


def _bounds(index, shape) -> tuple[tuple[int, int], ...]:
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


def shard_owner(holders: dict[tuple, set[int]], ordinal: int) -> dict[tuple, int]:
    """The process that encodes each distinct shard of a weight: `holders` maps a shard's bounds to the
    processes holding a replica of it; shard j of weight `ordinal` goes to holder (ordinal + j) mod count,
    so replicated weights and replicated shards are spread over the processes. Pure: every process computes
    the same owners."""
    return {b: sorted(holders[b])[(ordinal + j) % len(holders[b])] for j, b in enumerate(sorted(holders))}


def restore_learner_model(cfg: RLSystemConfig, run_dir: Path):
    """(model, version) from an RL run's newest learner checkpoint, restored in this process (outside Ray) as the
    learner restores it; a ValueError when the run holds no checkpoint."""
    learner = RLLearner(cfg, run_dir)
    try:
        if not learner.ckpt.steps():
            raise ValueError(f"{Path(run_dir) / 'checkpoints'} holds no RL checkpoint")
        version = learner.restore()
        return learner.model(), version
    finally:
        learner.ckpt.close()


class RLLearner:
    """rl_step (jitted, donated) on the model, sharded over `cfg.mesh` when it spans several devices;
    Orbax checkpoints under <run>/checkpoints."""

    def __init__(self, cfg: RLSystemConfig, run_dir: Path):
        import jax

        from c2jax.rl.learner import init_rl_state, make_optimizer, make_rl_step
        from c2jax.train.checkpoint import Checkpointer
        from c2jax.train.config import CheckpointConfig

        tx = make_optimizer(cfg.rl)
        graphdef, self.state = init_rl_state(initial_model(cfg), tx, cfg.rl)
        self.cfg, self.mesh = cfg, None
        if jax.process_count() > 1:  # one job over several processes: the mesh must span all of them
            wanted = cfg.mesh.resolve(jax.device_count()).num_devices if -1 in cfg.mesh.shape else cfg.mesh.num_devices
            if wanted != jax.device_count():
                raise ValueError(f"mesh {cfg.mesh.sizes} spans {wanted} devices, but a learner over "
                                 f"{jax.process_count()} processes must span all {jax.device_count()} "
                                 "(set one mesh axis to -1)")
        if -1 in cfg.mesh.shape or cfg.mesh.num_devices != 1:
            self.mesh, self.state = _shard_rl_state(self.state, tx, cfg.mesh)
            self.step_fn = make_rl_step(graphdef, tx, cfg.rl, mesh=self.mesh, mesh_config=cfg.mesh,
                                        state_shardings=jax.tree.map(lambda x: x.sharding, self.state))
        else:
            self.step_fn = make_rl_step(graphdef, tx, cfg.rl)
        self.ckpt = Checkpointer(Path(run_dir) / "checkpoints",
                                 CheckpointConfig(every=cfg.checkpoint.every, keep_last=cfg.checkpoint.keep_last,
                                                  async_save=False))

    @property
    def version(self) -> int:
        return int(self.state.step)

    def restore(self) -> int:
        found = self.ckpt.restore_latest(self.state)
        if found is not None:
            self.state = found[1]
        return self.version

    def model(self):
        """The current weights as an nnx model (outside jit: eval, export)."""
        from flax import nnx

        from c2jax.models.transformer import init

        graphdef = nnx.split(nnx.eval_shape(lambda: init(self.cfg.model, seed=0)), nnx.Param, ...)[0]
        return nnx.merge(graphdef, self.state.params, self.state.model_state)

    def train(self, batch) -> dict[str, float]:
        import jax
        import jax.numpy as jnp

        self.state, metrics = self.step_fn(self.state, jax.tree.map(jnp.asarray, batch))
        return {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}

    def weights(self) -> dict[str, np.ndarray]:
        """Full weights on the host. Across processes (`jax.process_count() > 1`) a collective: every
        process calls it (each holds only its shards, so they are replicated first)."""
        import jax

        if jax.process_count() == 1:
            return flatten_weights(self.state.params, self.state.model_state)
        from jax.sharding import NamedSharding, PartitionSpec

        whole = jax.jit(lambda t: t, out_shardings=NamedSharding(self.mesh, PartitionSpec()))(
            (self.state.params, self.state.model_state))
        return flatten_weights(*whole)

    def owned_shards(self) -> tuple[dict[str, np.ndarray], dict]:
        """(pieces, layout): host copies of the weight shards this process owns, named by
        `weight_sync.piece_name`, and layout: piece -> (weight name, global shape, bounds). Every distinct
        shard of a weight has one owner among the processes that hold a replica of it, rotated over shards
        and weights (`shard_owner`), so the processes split the encoding and the bytes sent; across processes
        the owned pieces tile every weight once. In one process: the whole weights, one piece each."""
        import jax

        from c2jax.rl.system.weight_sync import piece_name

        me = jax.process_index()
        pieces, layout = {}, {}
        leaves = [(f"{prefix}/{_name(path)}", leaf)
                  for prefix, tree in (("params", self.state.params), ("model_state", self.state.model_state))
                  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]
        for ordinal, (name, leaf) in enumerate(leaves):
            shape = tuple(np.shape(leaf))
            if not isinstance(leaf, jax.Array):
                bounds = tuple((0, n) for n in shape)
                if me == 0:
                    pieces[piece_name(name, bounds)] = np.array(leaf, copy=True)
                    layout[piece_name(name, bounds)] = (name, shape, bounds)
                continue
            holders: dict[tuple, set[int]] = {}
            for device, index in leaf.sharding.devices_indices_map(shape).items():
                holders.setdefault(_bounds(index, shape), set()).add(device.process_index)
            owners = shard_owner(holders, ordinal)
            for shard in leaf.addressable_shards:
                bounds = _bounds(shard.index, shape)
                key = piece_name(name, bounds)
                if owners[bounds] == me and key not in pieces:
                    pieces[key] = np.array(shard.data, copy=True)
                    layout[key] = (name, shape, bounds)
        return pieces, layout

    # multi-process batches ---------------------------------------------------------------------------
    def _batch_sharding(self):
        from jax.sharding import NamedSharding

        from c2jax.mesh import activation_rules, batch_spec

        if self.mesh is None:
            raise ValueError("the learner has no mesh: set `mesh` (one axis -1) to split batches over processes")
        return NamedSharding(self.mesh, batch_spec(self.mesh, activation_rules(self.cfg.mesh)))

    def row_blocks(self) -> tuple[tuple[int, ...], int]:
        """(blocks, count): the mesh splits a batch's rows into `count` equal blocks (its batch axes); this
        process's devices hold `blocks` of them. A batch of R rows gives this process rows
        [b * R / count, (b + 1) * R / count) for each b in blocks."""
        from c2jax import distributed

        sharding = self._batch_sharding()
        spec = sharding.spec
        size = lambda axes: int(np.prod([self.mesh.shape[a] for a in  # noqa: E731
                                         ((axes,) if isinstance(axes, str) else (axes or ()))]))
        count, seq = size(spec[0] if len(spec) else None), size(spec[1] if len(spec) > 1 else None)
        return distributed.data_shard(sharding, (count, seq)).rows, count

    def global_batch(self, local, rows: tuple[int, ...], global_rows: int):
        """The global RLBatch from this process's `rows` (their indices in the global batch of
        `global_rows`, in order) of every [B, S, ...] field; group_rewards (per group, not per row) whole
        in every process."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from c2jax import distributed

        sharding = self._batch_sharding()
        seq_len = np.shape(local.input_ids)[1]
        shard = distributed.data_shard(sharding, (global_rows, seq_len))
        if tuple(rows) != shard.rows:
            raise ValueError(f"process {jax.process_index()} was sent rows {list(rows)[:8]} of a {global_rows}-row "
                             f"batch, but its devices hold rows {list(shard.rows)[:8]}")
        fields = {k: v for k, v in local._asdict().items() if v is not None and k != "group_rewards"}
        arrays = distributed.global_batch(fields, sharding, shard)
        if local.group_rewards is not None:
            gr = np.asarray(local.group_rewards)
            arrays["group_rewards"] = jax.make_array_from_process_local_data(
                NamedSharding(self.mesh, PartitionSpec()), gr, gr.shape)
        return local._replace(**arrays)

    def save(self) -> None:
        self.ckpt.save(self.version, self.state, {"version": self.version})
        self.ckpt.wait()


class FakeLearner:
    """Exact REINFORCE on a categorical policy: logits += lr * sum_t A_t (onehot(y_t) - softmax(logits)) / N,
    plus `frozen` parameters that never change (so deltas are mostly zeros, as in real RL steps)."""

    def __init__(self, cfg: RLSystemConfig, run_dir: Path):
        rng = np.random.default_rng(cfg.seed)
        self.lr, self.norm = cfg.rl.learning_rate, cfg.rl.loss.constant_normalizer
        self.params = {"logits": np.zeros(cfg.backend.fake_vocab, np.float32),
                       "frozen": rng.normal(size=cfg.backend.fake_frozen_params).astype(np.float32)}
        self.step = 0
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = cfg.checkpoint.keep_last

    @property
    def version(self) -> int:
        return self.step

    def restore(self) -> int:
        ckpts = sorted(self.dir.glob("fake-*.npz"), key=lambda p: int(p.stem.split("-")[1]))
        if ckpts:
            with np.load(ckpts[-1]) as z:
                self.params = {k: z[k] for k in ("logits", "frozen")}
                self.step = int(z["step"])
        return self.step

    def train(self, batch) -> dict[str, float]:
        mask = np.asarray(batch.loss_mask, bool)
        y, adv = np.asarray(batch.targets)[mask], np.asarray(batch.advantages)[mask]
        logits = self.params["logits"].astype(np.float64)
        p = np.exp(logits - np.logaddexp.reduce(logits))
        grad = (np.bincount(y, weights=adv, minlength=p.size) - adv.sum() * p) / self.norm
        self.params["logits"] = (logits + self.lr * grad).astype(np.float32)
        stale = self.step - np.asarray(batch.policy_versions)[mask]
        self.step += 1
        return {"tokens_trained": float(mask.sum()), "staleness/max": float(stale.max(initial=0)),
                "staleness/mean": float(stale.mean()) if stale.size else 0.0, "policy_version": float(self.step - 1),
                "min_token_version": float(np.asarray(batch.policy_versions)[mask].min(initial=self.step)),
                "advantage/mean": float(adv.mean()) if adv.size else 0.0}

    def weights(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.params.items()}

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f"tmp-{self.step}.npz"
        with open(tmp, "wb") as f:
            np.savez(f, step=self.step, **self.params)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / f"fake-{self.step}.npz")  # atomic: a crash leaves the previous one
        for old in sorted(self.dir.glob("fake-*.npz"), key=lambda p: int(p.stem.split("-")[1]))[:-self.keep]:
            old.unlink()


def make_learner(cfg: RLSystemConfig, run_dir: Path):
    if cfg.backend.learner == "fake":
        return FakeLearner(cfg, run_dir)
    cfg = on_this_device(cfg)
    record_execution(cfg, run_dir, "learner")
    return RLLearner(cfg, run_dir)
