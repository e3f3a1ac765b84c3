"""The pretraining run: phases, MTP initialisation, eval, checkpoints, NaN rollback, logging.

Side effects live here; the math is in step.py / losses.py. A batch source is any iterator of batch
dicts with Grain-style `get_state()` / `set_state()`; by default it is built by c2jax.data.

Across processes (`distributed.enabled`, c2jax/distributed.py) the same loop runs in every process: the mesh
spans every process's devices; each process opens its own shard of the data (the batch source is called with
`shard=`, a `c2jax.distributed.DataShard`: its rows of every global batch) and assembles the global batch
with `jax.make_array_from_process_local_data`; checkpoints are one Orbax multi-process save whose meta holds
every process's data-iterator state; metrics, TensorBoard, the progress bar and the resolved config are
written by process 0 only. Held-out eval reads the whole held-out set in every process (it is small).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from c2jax import distributed
from c2jax.config import save
from c2jax.mesh import activation_rules, batch_spec
from c2jax.models.config import ConfigError, ModelConfig
from c2jax.models.flops import training_flops_per_token
from c2jax.models.moe_dispatch import resolve_loaded_moe_kernel, resolve_moe_kernel
from c2jax.models.transformer import Transformer, init
from c2jax.train.checkpoint import Checkpointer
from c2jax.train.config import PhaseConfig, PretrainConfig
from c2jax.train.evaluate import codebase_nll, eval_loss, make_eval_step, read_codebase
from c2jax.train.metrics import MetricsWriter, device_peak_flops, measure_peak_flops
from c2jax.train.optim import make_optimizer
from c2jax.train.step import TrainState, init_train_state, make_train_step, offload_shardings

# (cfg, phase, split) -> iterator of batches; in a multi-process run also `shard=` (c2jax.distributed.DataShard):
# then it yields only this process's `shard.local_rows` rows of each global batch, from data shard
# `shard.index` of `shard.count`, deterministically and resumably (get_state/set_state)
BatchSource = Callable[..., Iterator[dict]]


def _phase_data_config(cfg: PretrainConfig, phase: PhaseConfig):
    from c2jax.config import load
    from c2jax.data.config import DataConfig

    loss_mask = [("loss_mask", phase.loss_mask)] if phase.loss_mask is not None else []
    return load(DataConfig, phase.data or cfg.data, loss_mask, path="data")


def data_batches(cfg: PretrainConfig, phase: PhaseConfig, split: str,
                 shard: distributed.DataShard | None = None) -> Iterator[dict]:
    """The c2jax.data pipeline for this phase (its own data file and loss mask if it names them); with a
    shard, only that shard of every source and `shard.local_rows` rows per batch."""
    from c2jax.data.pipeline import build_batches

    kw = {} if shard is None else dict(batch_size=shard.local_rows, process_index=shard.index,
                                       process_count=shard.count)
    kw.setdefault("batch_size", phase.batch_size or None)
    return build_batches(_phase_data_config(cfg, phase), split, seq_len=phase.seq_len or None, **kw)


def phase_batch_shape(cfg: PretrainConfig, phase: PhaseConfig) -> tuple[int, int]:
    """(global batch rows, sequence length) of a phase: the phase's, else its data config's."""
    if phase.batch_size and phase.seq_len:
        return phase.batch_size, phase.seq_len
    data = _phase_data_config(cfg, phase)
    return phase.batch_size or data.batch_size, phase.seq_len or data.seq_len


def data_eval_sources(cfg: PretrainConfig, phase: PhaseConfig) -> Mapping[str, Callable[[], Iterator[dict]]]:
    from c2jax.config import load
    from c2jax.data.config import DataConfig
    from c2jax.data.pipeline import eval_sources

    sources = eval_sources(load(DataConfig, cfg.data, path="data"), seq_len=phase.seq_len or None,
                           batch_size=phase.batch_size or None)  # fresh one-pass iterators per eval
    return {name: (lambda it=it: it) for name, it in sources.items()}


def phase_model_config(cfg: PretrainConfig, phase: PhaseConfig) -> ModelConfig:
    model = cfg.model
    if phase.rope_scaling is not None:
        model = model.replace(rope_scaling=phase.rope_scaling)
    return model


def _stack(batches: list[dict]) -> dict:
    if len(batches) == 1:
        return batches[0]
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def reinit_mtp(state: TrainState, tx, model_cfg: ModelConfig, seed: int) -> TrainState:
    """Fresh MTP parameters (a new init, seeded from the run seed and step) and fresh optimizer state for
    them; every other parameter and optimizer leaf is kept."""
    fresh_model = init(model_cfg, seed=seed + 7919 + int(state.step))
    _, fresh_params, _ = nnx.split(fresh_model, nnx.Param, ...)
    params = jax.tree_util.tree_map_with_path(
        lambda p, old, new: new if _under_mtp(p) else old, state.params, fresh_params)
    fresh_opt = tx.init(params)
    opt_state = jax.tree_util.tree_map_with_path(
        lambda p, old, new: new if _under_mtp(p) else old, state.opt_state, fresh_opt)
    return state._replace(params=params, opt_state=opt_state)


def _under_mtp(path) -> bool:
    return any(getattr(k, "key", None) == "mtp" for k in path)


def reset_moments(opt_state, fresh_opt_state):
    """A fresh optimizer state (zero moments, bias-correction counts at 0) that keeps the LR schedule's
    step counters, so the schedule continues across the reset instead of warming up again."""
    is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    return jax.tree.map(lambda new, old: old if is_schedule(new) else new, fresh_opt_state, opt_state,
                        is_leaf=is_schedule)


# ModelConfig fields a run decides even when the architecture comes from a Hugging Face checkpoint
_EXECUTION_FIELDS = ("moe_impl", "moe_kernel", "scan_layers", "remat_policy", "dtype", "param_dtype")


def load_hf_for_pretraining(path: str | Path, run_model: ModelConfig, seed: int) -> Transformer:
    """A model for continued pretraining from a DeepseekV3-format checkpoint (`c2jax.models.hf.from_pretrained`).

    The architecture is the checkpoint's (a warning lists the run's `model` fields it overrides); the
    execution settings (`_EXECUTION_FIELDS`) are the run's. The MTP depth is the run's
    `model.num_nextn_predict_layers`: MTP modules the checkpoint holds are loaded, modules it lacks are
    freshly initialised (Composer 2 initialises MTP from scratch; `mtp_init_step` re-draws them anyway),
    and with depth 0 checkpoint MTP tensors are dropped."""
    from c2jax.models import hf

    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"init_from_hf: {path} has no config.json (expected a DeepseekV3-format checkpoint)")
    want = run_model.num_nextn_predict_layers
    overrides = {k: getattr(run_model, k) for k in _EXECUTION_FIELDS}
    with warnings.catch_warnings():  # "config asks for MTP, checkpoint has none": handled below
        warnings.filterwarnings("ignore", message=".*has no MTP tensors.*")
        model = hf.from_pretrained(path, mtp="drop" if want == 0 else "auto", **overrides)
    have = model.cfg.num_nextn_predict_layers
    if have and have != want:
        raise ConfigError(f"init_from_hf: the checkpoint holds {have} MTP module(s) but the run's "
                          f"model.num_nextn_predict_layers is {want}; set it to {have} or 0")
    ignore = set(_EXECUTION_FIELDS) | {"num_nextn_predict_layers"}
    differ = sorted(f.name for f in dataclasses.fields(ModelConfig)
                    if f.name not in ignore and getattr(run_model, f.name) != getattr(model.cfg, f.name))
    if differ:
        warnings.warn(f"init_from_hf: the model architecture comes from {path}; the run config's model "
                      f"fields {differ} are replaced by the checkpoint's", stacklevel=2)
    if want > have:  # fresh MTP modules around the loaded trunk
        full = init(model.cfg.replace(num_nextn_predict_layers=want), seed=seed)
        graphdef, state = nnx.split(full)
        pure = nnx.to_pure_dict(state)
        loaded = nnx.to_pure_dict(nnx.state(model))
        pure.update({k: v for k, v in loaded.items() if k != "mtp"})
        nnx.replace_by_pure_dict(state, pure)
        model = nnx.merge(graphdef, state)
    return model


# overrides that name the model's grouped kernel themselves (the user's choice, kept on resume)
_KERNEL_OVERRIDES = ("model", "model.moe_kernel")


def resumed_config(cfg: PretrainConfig, source, overrides=()) -> PretrainConfig:
    """`cfg`, loaded from `source` with `overrides` (c2jax.config.load), ready to run on this device. Where `source`
    is the config.yaml a run saved in its own run directory (cfg.run_dir: resuming that run) and no override names
    model.moe_kernel, the saved kernel is the record of the device the run last ran on (a moe_impl="grouped" run
    written on an H100 names mosaic_sm90): one not native here is replaced by what the registry picks here
    (models.moe_dispatch.resolve_loaded_moe_kernel, one printed line naming both), so a CPU resume neither runs
    Pallas' Mosaic GPU interpreter (seconds a GEMM) nor stops at its refusal of the model's shapes. A kernel the
    user names (an override, or their own YAML: any source but the run directory's saved config) is kept, as is a
    saved kernel native here. Call it after distributed.initialize (it asks JAX for the device); `c2jax pretrain`
    does."""
    if not isinstance(source, (str, Path)) or not Path(source).is_file():
        return cfg
    saved = cfg.run_dir / "config.yaml"
    if not saved.is_file() or not Path(source).samefile(saved):
        return cfg
    for override in overrides:
        key = override[0] if isinstance(override, tuple) else override.partition("=")[0]
        if key.strip() in _KERNEL_OVERRIDES:
            return cfg
    model = resolve_loaded_moe_kernel(cfg.model, f"resuming {cfg.run_dir}")
    return cfg if model is cfg.model else dataclasses.replace(cfg, model=model)


class Trainer:
    def __init__(self, cfg: PretrainConfig, batches: BatchSource = data_batches,
                 eval_sources: Callable[[PretrainConfig, PhaseConfig], Mapping] | None = data_eval_sources,
                 tensorboard: bool = True):
        self.batches, self.eval_sources = batches, eval_sources
        self._eval_steps: dict[str, Callable] = {}
        model = self._initial_model(cfg)
        # the architecture actually trained, and for moe_impl="grouped" the kernel the registry runs on this device
        cfg = self.cfg = dataclasses.replace(cfg, model=resolve_moe_kernel(model.cfg))
        if batches is data_batches:
            _check_vocab(cfg)
        self.run_dir = cfg.run_dir
        self.primary = distributed.is_primary()  # process 0 writes metrics, TensorBoard, console, config
        if self.primary:
            save(cfg, self.run_dir)
        self.writer = MetricsWriter(self.run_dir, tensorboard=tensorboard, enabled=self.primary)
        self.ckpt = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint)
        self.tx, self.schedule = make_optimizer(cfg.optimizer, cfg.total_steps)
        self.graphdef, state = init_train_state(model, self.tx, seed=cfg.seed)
        self.has_mtp = model.mtp is not None
        self.mesh = self.state_shardings = None
        if _mesh_devices(cfg) > 1 or jax.process_count() > 1 or cfg.optimizer.offload:
            state = self._shard(state)
        self.state = state
        self.meta: dict[str, Any] = {"phase": 0, "data_state": None, "mtp_initialized": False,
                                     "optimizer_reset_phases": [], "skipped_total": 0, "rollbacks": 0}
        self._steps: dict[tuple, Callable] = {}
        self._codebase_tokens: np.ndarray | None = None
        self.losses: list[float] = []

    @staticmethod
    def _initial_model(cfg: PretrainConfig) -> Transformer:
        if cfg.init_from_hf:
            return load_hf_for_pretraining(cfg.init_from_hf, cfg.model, cfg.seed)
        return init(cfg.model, seed=cfg.seed)

    def _place(self, state: TrainState) -> TrainState:
        """Put a state assembled on the host (fresh MTP or optimizer leaves) back onto the run's mesh."""
        return state if self.state_shardings is None else jax.device_put(state, self.state_shardings)

    def _shard(self, state: TrainState) -> TrainState:
        from jax.sharding import NamedSharding, PartitionSpec

        from c2jax.mesh import make_mesh, param_rules, place_on_mesh, shard_state

        # one process may run on a subset of its devices (the first N); across processes the mesh spans all
        if jax.process_count() > 1 and _mesh_devices(self.cfg) != jax.device_count():
            raise ConfigError(f"mesh {dict(zip(self.cfg.mesh.axis_names, self.cfg.mesh.shape))} spans "
                              f"{_mesh_devices(self.cfg)} devices, but a run over {jax.process_count()} processes "
                              f"must span all {jax.device_count()} (set one axis to -1)")
        devices = jax.devices()[:_mesh_devices(self.cfg)] if jax.process_count() == 1 else None
        self.mesh = make_mesh(self.cfg.mesh, devices)
        rules = param_rules(self.cfg.mesh)
        params = shard_state(state.params, self.mesh, rules)
        model_state = shard_state(state.model_state, self.mesh, rules)
        opt_state = place_on_mesh(jax.jit(self.tx.init)(params), self.mesh)
        if self.cfg.optimizer.offload:  # Adam moments in host memory between steps (make_train_step)
            opt_state = jax.device_put(opt_state, offload_shardings(jax.tree.map(lambda x: x.sharding, opt_state)))
        replicated = NamedSharding(self.mesh, PartitionSpec())
        state = TrainState(jax.device_put(state.step, replicated), params, model_state, opt_state,
                           jax.device_put(state.rng, replicated))
        self.state_shardings = jax.tree.map(lambda x: x.sharding, state)
        return state

    def _batch_sharding(self, phase: PhaseConfig):
        """Rows split over the data-parallel axes; the micro-batch axis of accumulation is not split."""
        if self.mesh is None:
            return None
        from jax.sharding import NamedSharding, PartitionSpec

        spec = batch_spec(self.mesh, activation_rules(self.cfg.mesh))  # rows over batch axes, sequence over CP
        return NamedSharding(self.mesh, PartitionSpec(None, *spec) if phase.grad_accum > 1 else spec)

    def open_batches(self, phase: PhaseConfig, split: str = "train"):
        """(iterator, shard): the phase's batch source, in a multi-process run only this process's shard of it
        (shard None in one process)."""
        if jax.process_count() == 1:
            return self.batches(self.cfg, phase, split), None
        rows, seq = phase_batch_shape(self.cfg, phase)
        shape = (phase.grad_accum, rows, seq) if phase.grad_accum > 1 else (rows, seq)
        shard = distributed.data_shard(self._batch_sharding(phase), shape, row_axis=len(shape) - 2)
        try:
            return self.batches(self.cfg, phase, split, shard=shard), shard
        except TypeError as e:
            if "unexpected keyword argument 'shard'" not in str(e):
                raise
            raise ConfigError(f"batch source {self.batches!r} takes no `shard=` argument, which a run over "
                              f"{jax.process_count()} processes needs (see loop.BatchSource)") from e

    # -- pieces ------------------------------------------------------------------------------------
    def train_step(self, phase: PhaseConfig, train_mtp: bool):
        model_cfg = phase_model_config(self.cfg, phase)
        key = (model_cfg, phase.grad_accum > 1, train_mtp)  # phases that differ only in shapes share one jit
        if key not in self._steps:
            graphdef = nnx.split(nnx.eval_shape(lambda: init(model_cfg)), nnx.Param, ...)[0]
            loss = self.cfg.loss
            self._steps[key] = make_train_step(
                graphdef, self.tx, loss.router_bias_rate, z_loss=loss.z_loss, mtp_weight=loss.mtp_weight,
                train_mtp=train_mtp, router_aux_loss=loss.router_aux_loss, state_shardings=self.state_shardings,
                batch_sharding=self._batch_sharding(phase), donate=True, mesh=self.mesh,
                rules=activation_rules(self.cfg.mesh) if self.mesh is not None else None)
        return self._steps[key]

    def save(self) -> None:
        state = self.state
        if self.cfg.checkpoint.async_save and jax.default_backend() == "cpu":
            # on CPU, Orbax's "device to host" copy can alias the device buffer, which the next (donating)
            # step may overwrite while the background write is still running
            state = _copy_tree(state)
        meta = dict(self.meta)
        if jax.process_count() > 1:  # every process's iterator position, in the one meta file process 0 writes
            meta["data_state"] = {_PER_PROCESS: distributed.allgather_json(meta["data_state"])}
        self.ckpt.save(int(self.state.step), state, meta)

    def restore(self) -> bool:
        found = self.ckpt.restore_latest(self.state)
        if found is None:
            return False
        step, self.state, meta = found
        meta["data_state"] = _own_data_state(meta.get("data_state"), self.ckpt.directory / str(step))
        self.meta.update(meta)
        return True

    def evaluate(self, phase: PhaseConfig) -> dict[str, float]:
        cfg, out = self.cfg, {}
        if phase.name not in self._eval_steps:  # one jitted eval step per phase: no retrace per eval
            graphdef = nnx.split(nnx.eval_shape(lambda: init(phase_model_config(cfg, phase))), nnx.Param, ...)[0]
            self._eval_steps[phase.name] = make_eval_step(graphdef)
        eval_step = self._eval_steps[phase.name]
        if self.eval_sources is not None:
            for name, make in self.eval_sources(cfg, phase).items():
                out[f"eval_loss/{name}"] = eval_loss(eval_step, self.state.params, self.state.model_state,
                                                     make(), cfg.eval.batches)
        if cfg.eval.codebase:
            if self._codebase_tokens is None:  # read and tokenized once per run
                self._codebase_tokens = read_codebase(cfg.eval.codebase, _tokenizer(cfg).encode,
                                                      cfg.eval.codebase_max_tokens, cfg.eval.codebase_languages)
            out.update(codebase_nll(eval_step, self.state.params, self.state.model_state, self._codebase_tokens,
                                    cfg.eval.codebase_window))
        return out

    # -- the run -----------------------------------------------------------------------------------
    def run(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train to the end of the last phase (or for `stop_after` more steps). Resumes from the newest
        good checkpoint in the run directory."""
        cfg = self.cfg
        self.restore()
        start = int(self.state.step)
        flops_token = {}
        peak = device_peak_flops(jax.devices()[0]) or measure_peak_flops()
        peak *= max(_mesh_devices(cfg), 1)
        bar = None
        if cfg.progress and self.primary:
            from c2jax.progress import progress

            bar = progress(cfg.total_steps, initial=start, desc=cfg.name, unit="step")
        it, it_phase, shard, bad = None, None, None, 0
        last = time.perf_counter()
        step = start
        end = cfg.total_steps if stop_after is None else min(cfg.total_steps, start + stop_after)
        while step < end:
            index, phase, _ = cfg.phase_at(step)
            if it is None or it_phase != index:
                if it is not None:  # a phase boundary: checkpoint before the data changes
                    self.meta.update(phase=index, data_state=None)
                    self.save()
                it, shard = self.open_batches(phase)
                if self.meta.get("phase") == index and self.meta.get("data_state") is not None:
                    it.set_state(self.meta["data_state"])
                self.meta["phase"], it_phase = index, index
            if self.has_mtp and step >= cfg.mtp_init_step and not self.meta["mtp_initialized"]:
                self.state = self._place(reinit_mtp(self.state, self.tx, phase_model_config(cfg, phase), cfg.seed))
                self.meta["mtp_initialized"] = True
            if phase.reset_optimizer and index not in self.meta["optimizer_reset_phases"]:
                fresh = jax.jit(self.tx.init)(self.state.params)
                self.state = self._place(self.state._replace(opt_state=reset_moments(self.state.opt_state, fresh)))
                self.meta["optimizer_reset_phases"] = [*self.meta["optimizer_reset_phases"], index]
            train_mtp = self.has_mtp and (phase.train_mtp if phase.train_mtp is not None
                                          else self.meta["mtp_initialized"])
            batch = _stack([next(it) for _ in range(phase.grad_accum)])
            if shard is not None:  # this process's rows -> the global batch
                batch = distributed.global_batch(batch, self._batch_sharding(phase), shard,
                                                 row_axis=batch["input_ids"].ndim - 2)
            self.state, metrics = self.train_step(phase, train_mtp)(self.state, batch)
            self.meta["data_state"] = it.get_state()
            skipped = int(metrics["skipped"])
            bad = bad + 1 if skipped else 0
            self.meta["skipped_total"] += skipped
            if bad >= cfg.max_bad_steps:
                # keep the data position (do not replay the batches that blew up) and the counters
                kept = {k: self.meta[k] for k in ("data_state", "skipped_total", "rollbacks")}
                if self.restore():
                    self.meta.update(kept, rollbacks=kept["rollbacks"] + 1)
                bad, step = 0, int(self.state.step)
                continue
            step = int(self.state.step) if not skipped else step + 1
            if skipped:
                self.state = self.state._replace(step=self.state.step + 1)  # the batch is consumed
            self.losses.append(float(metrics["loss"]))
            seq = batch["input_ids"].shape[-1]
            if step % cfg.log_every == 0 or step == end:
                now = time.perf_counter()
                tokens = float(np.prod(batch["input_ids"].shape))
                if seq not in flops_token:
                    flops_token[seq] = training_flops_per_token(phase_model_config(cfg, phase), seq, train_mtp)
                host = {k: np.asarray(v) for k, v in metrics.items()}
                elapsed = (now - last) / cfg.log_every
                host.update(lr=float(self.schedule(step - 1)), phase=index, tokens_per_s=tokens / elapsed,
                            skipped_total=self.meta["skipped_total"], rollbacks=self.meta["rollbacks"])
                host["mfu"] = host["tokens_per_s"] * flops_token[seq] / peak
                self.writer.write(step, host)
                last = now
            every = cfg.eval.every if phase.eval_every is None else phase.eval_every
            if every and step % every == 0 and (self.eval_sources is not None or cfg.eval.codebase):
                self.writer.write(step, self.evaluate(phase), kind="eval")
            if step % cfg.checkpoint.every == 0 or step == cfg.total_steps:
                self.save()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{self.losses[-1]:.3f}", phase=phase.name)
        if bar is not None:
            bar.close()
        self.ckpt.wait()
        if cfg.export_hf and step == cfg.total_steps:
            self.export_hf(self.run_dir / "hf")
        return {"step": step, "losses": self.losses, "meta": self.meta}

    def export_hf(self, path: Path) -> None:
        """Write the current weights as a DeepseekV3-format checkpoint (`c2jax.models.hf.save_pretrained`), with
        the model config of the last phase (e.g. its RoPE scaling)."""
        from c2jax.models import hf

        model_cfg = phase_model_config(self.cfg, self.cfg.phases[-1])
        graphdef = nnx.split(nnx.eval_shape(lambda: init(model_cfg)), nnx.Param, ...)[0]
        params, model_state = self.state.params, self.state.model_state
        if jax.process_count() > 1:  # every process holds only its shards: replicate, then process 0 writes
            from jax.sharding import NamedSharding, PartitionSpec

            params, model_state = jax.jit(lambda t: t, out_shardings=NamedSharding(self.mesh, PartitionSpec()))(
                (params, model_state))
            params, model_state = jax.tree.map(np.asarray, (params, model_state))
        if self.primary:
            hf.save_pretrained(nnx.merge(graphdef, params, model_state), path)

    def close(self) -> None:
        self.ckpt.close()
        self.writer.close()


_PER_PROCESS = "c2jax_data_state_per_process"


def _own_data_state(data_state, where):
    """This process's data-iterator state from a checkpoint's meta: the state itself in a one-process
    checkpoint, this process's entry in a multi-process one. Resuming with another process count would
    change every process's data shard, so it is an error."""
    count = jax.process_count()
    if isinstance(data_state, dict) and _PER_PROCESS in data_state:
        states = data_state[_PER_PROCESS]
        if len(states) != count:
            raise ConfigError(f"checkpoint {where} was written by {len(states)} processes; resuming its data "
                              f"position needs the same number, not {count}")
        return states[jax.process_index()]
    if data_state is not None and count > 1:
        raise ConfigError(f"checkpoint {where} was written by one process; resuming its data position needs one "
                          f"process, not {count}")
    return data_state


@jax.jit
def _copy_tree(tree):
    return jax.tree.map(jnp.copy, tree)  # one compiled program, not one dispatch per leaf


def _tokenizer(cfg: PretrainConfig):
    from c2jax.config import load
    from c2jax.data.config import DataConfig
    from c2jax.data.tokenizer import load_tokenizer

    return load_tokenizer(load(DataConfig, cfg.data, path="data").tokenizer)


def _check_vocab(cfg: PretrainConfig) -> None:
    """Token ids at or above the model's vocab_size would index past the embedding table silently."""
    from c2jax.config import load
    from c2jax.data.config import DataConfig
    from c2jax.data.tokenizer import load_tokenizer

    datas = [("data", cfg.data)] + [(f"phases.{p.name}.data", p.data) for p in cfg.phases if p.data]
    for where, data in datas:
        tok = load_tokenizer(load(DataConfig, data, path=where).tokenizer)
        if tok.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"{where}.tokenizer: {tok!r} has {tok.vocab_size} token ids but "
                              f"model.vocab_size is {cfg.model.vocab_size}")


def _mesh_devices(cfg: PretrainConfig) -> int:
    """Devices the run's mesh spans (a -1 axis takes every available device)."""
    return cfg.mesh.resolve(len(jax.devices())).num_devices if -1 in cfg.mesh.shape else cfg.mesh.num_devices
