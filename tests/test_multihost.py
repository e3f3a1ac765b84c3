"""Multi-process pretraining over loopback: `c2jax pretrain ... distributed.enabled=true` as 2 processes x 4
fake CPU devices (gloo collectives) against 1 process x 8 devices on the same 2 x 4 mesh and the same data;
kill -9 of one process (the other aborts within the heartbeat timeout, naming the dead task) and a restart
of both that resumes from the last checkpoint to the uninterrupted run's losses, bit for bit.

The 2-process runs are the documented launch recipes, run as subprocesses of the real CLI: the uninterrupted
one with a SLURM environment (srun's variables, one process per "host"), the killed and resumed ones with
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID. Every process has a timeout, so nothing hangs.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from c2jax import distributed
from c2jax.config import load
from c2jax.train.config import PretrainConfig
from c2jax.train.loop import Trainer, data_batches

ROOT = Path(__file__).resolve().parent.parent
HEARTBEAT_S = 10
STEPS = 6
PROC_TIMEOUT_S = 300  # per run; one takes ~40 s warm on the shared 2-core VM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _corpus(path: Path) -> Path:
    rng = np.random.default_rng(0)
    words = "def class return import for while if else lambda yield self value index data batch shard".split()
    with open(path, "w") as f:
        for _ in range(240):
            f.write(json.dumps({"text": " ".join(rng.choice(words, rng.integers(5, 60)))}) + "\n")
    return path


def _write_config(tmp: Path, name: str) -> Path:
    cfg = dict(
        name=name, output_dir=str(tmp / "runs"), seed=0, log_every=1, progress=False, mtp_init_step=0,
        model=dict(preset="tiny", vocab_size=264, moe_impl="dense", num_hidden_layers=2),
        mesh=dict(data=2, fsdp=-1),  # 2 x 4: rows over data x fsdp, so each process holds half of every batch
        data=dict(tokenizer="bytes", sources=[dict(name="text", kind="jsonl", path=str(tmp / "corpus.jsonl"),
                                                   heldout_fraction=0.1)]),
        # a second phase with gradient accumulation: [micro-batches, rows, seq] batches, rows on axis 1
        phases=[dict(name="main", steps=4, seq_len=32, batch_size=8),
                dict(name="accum", steps=STEPS - 4, seq_len=32, batch_size=8, grad_accum=2)],
        checkpoint=dict(every=2, keep_last=4), eval=dict(every=3, batches=1), export_hf=True,
        optimizer=dict(lr=3e-3, warmup_steps=2),
        distributed=dict(heartbeat_timeout_s=HEARTBEAT_S, initialization_timeout_s=60))
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _c2jax() -> list[str]:
    exe = Path(sys.executable).parent / "c2jax"
    if exe.exists():  # the installed console script, as a launch recipe runs it
        return [str(exe)]
    return [sys.executable, "-c", "from c2jax.cli import main; raise SystemExit(main())"]


def _launch(config: Path, launcher: str, port: int) -> list[subprocess.Popen]:
    """Both processes of a 2-process run, each with 4 fake CPU devices, talking over 127.0.0.1:port."""
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "").strip()
    base = dict(os.environ, JAX_PLATFORMS="cpu",  # the compilation cache: conftest's, inherited
                XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=4",
                JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}", PYTHONUNBUFFERED="1")
    procs = []
    for i in range(2):
        if launcher == "env":  # the plain recipe
            env = dict(base, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
        else:  # what `srun --ntasks=2 --ntasks-per-node=1` sets, the node list pointing at loopback
            env = dict(base, SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS="2",
                       SLURM_PROCID=str(i), SLURM_LOCALID="0", SLURM_STEP_NUM_NODES="2", JAX_COORDINATOR_PORT=str(port))
        # output to a file, not a pipe: nobody reads a pipe while the kill test polls, and a full one blocks
        log = open(config.with_suffix(f".{i}.log"), "w+b")
        procs.append(subprocess.Popen([*_c2jax(), "pretrain", "--config", str(config), "distributed.enabled=true"],
                                      env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        procs[-1].log = log
    return procs


def _output(p) -> str:
    p.log.seek(0)
    return p.log.read().decode(errors="replace")


def _wait(procs, timeout: float) -> None:
    """Wait for every process, killing all of them (SIGKILL) if any is still running after `timeout` s."""
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.time(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _finish(procs, timeout=PROC_TIMEOUT_S) -> list[str]:
    _wait(procs, timeout)
    outs = [_output(p) for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, _tail(out)
    return outs


def _tail(out: str, n: int = 4000) -> str:
    return "\n".join(line for line in out.splitlines() if "Gloo" not in line and "spmd_partitioner" not in line)[-n:]


def _rows(run_dir: Path, kind="train") -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == kind}


class _Shards:
    """The 2-process run's global batches in one process: shard 0's rows, then shard 1's (process i's devices
    hold rows [4i, 4i + 4) of the 2 x 4 mesh), each shard read exactly as its process reads it."""

    def __init__(self, cfg, phase, split):
        rows = phase.batch_size // 2
        self.its = [data_batches(cfg, phase, split, shard=distributed.DataShard(i, 2, tuple(range(rows)), 2 * rows))
                    for i in range(2)]

    def __iter__(self):
        return self

    def __next__(self):
        parts = [next(it) for it in self.its]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def get_state(self):
        return [it.get_state() for it in self.its]

    def set_state(self, state):
        for it, s in zip(self.its, state):
            it.set_state(s)


def _committed(run_dir: Path) -> list[int]:
    ckpts = run_dir / "checkpoints"
    return sorted(int(d.name) for d in ckpts.iterdir() if d.name.isdigit()) if ckpts.is_dir() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 1-process reference (in this process: conftest's 8 devices), then the 2-process run: started with
    the SLURM recipe, process 1 killed (-9) once step 3 is logged and the step-2 checkpoint committed, and
    restarted with the environment-variable recipe."""
    tmp = tmp_path_factory.mktemp("multihost")
    _corpus(tmp / "corpus.jsonl")
    assert len(jax.devices()) == 8
    t = time.perf_counter()
    trainer = Trainer(load(PretrainConfig, _write_config(tmp, "ref"), []), batches=_Shards, tensorboard=False)
    try:
        trainer.run()
    finally:
        trainer.close()
    seconds = {"reference": time.perf_counter() - t}

    config, run_dir = _write_config(tmp, "two"), tmp / "runs" / "two"
    t = time.perf_counter()
    procs = _launch(config, "slurm", _free_port())
    try:
        while time.perf_counter() - t < PROC_TIMEOUT_S and all(p.poll() is None for p in procs):
            if (run_dir / "metrics.jsonl").exists() and len(_rows(run_dir)) >= 3 and _committed(run_dir):
                break
            time.sleep(0.02)
        assert all(p.poll() is None for p in procs), _tail(_output(procs[0]))
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.perf_counter()
        _wait(procs[:1], HEARTBEAT_S + 60)
        seconds["detection"] = time.perf_counter() - killed_at
    finally:
        _wait(procs, 0)
    first = dict(rows=_rows(run_dir), out=_output(procs[0]), rc=procs[0].returncode, checkpoints=_committed(run_dir))
    seconds["killed run"] = time.perf_counter() - t
    t = time.perf_counter()
    outs = _finish(_launch(config, "env", _free_port()))
    seconds["resumed run"] = time.perf_counter() - t
    print("\n" + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    return dict(ref=tmp / "runs" / "ref", two=run_dir, first=first, outs=outs, seconds=seconds)


def test_two_processes_equal_one_process_on_the_same_mesh_and_data(runs):
    ref, two = _rows(runs["ref"]), _rows(runs["two"])
    assert sorted(ref) == sorted(two) == list(range(1, STEPS + 1))
    for key in ("loss", "ce_loss", "grad_norm", "tokens"):
        np.testing.assert_allclose([two[s][key] for s in two], [ref[s][key] for s in ref], rtol=2e-6, err_msg=key)
    ref_eval, two_eval = _rows(runs["ref"], "eval"), _rows(runs["two"], "eval")
    assert sorted(ref_eval) == sorted(two_eval) == [3, 6]
    for s in ref_eval:
        np.testing.assert_allclose(two_eval[s]["eval_loss/text"], ref_eval[s]["eval_loss/text"], rtol=2e-6)
    # one 8-device job; console output from process 0 only
    assert "process 0 of 2, 4 of 8 devices" in runs["outs"][0]
    assert "process 1 of 2, 4 of 8 devices" in runs["outs"][1]
    assert f"step {STEPS}/{STEPS}" in runs["outs"][0] and f"step {STEPS}/{STEPS}" not in runs["outs"][1]
    # the HF export gathers every process's shards: the same weights as the 1-process run's
    from safetensors.numpy import load_file

    ref_w = {k: v for f in sorted((runs["ref"] / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    two_w = {k: v for f in sorted((runs["two"] / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert ref_w.keys() == two_w.keys() and ref_w
    for k in ref_w:
        np.testing.assert_allclose(two_w[k], ref_w[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_kill_9_of_one_process_aborts_the_other_and_both_resume_to_the_same_losses(runs):
    first, seconds = runs["first"], runs["seconds"]
    logged = sorted(first["rows"])
    assert 3 <= len(logged) < STEPS, "the kill came too late"
    # the survivor aborted on its own, naming the dead task, within the heartbeat timeout (plus slack for load)
    assert first["rc"] not in (0, None), _tail(first["out"])
    assert "stopped sending heartbeats" in first["out"] and "Terminating process" in first["out"], _tail(first["out"])
    assert seconds["detection"] < HEARTBEAT_S + 15, seconds
    # the restart resumed from the last committed checkpoint, before the last logged step, and recomputed the
    # steps after it bit for bit; every process's data position came back (else the losses would differ)
    last = first["checkpoints"][-1]
    assert 2 <= last < logged[-1]
    resumed = _rows(runs["two"])
    assert [resumed[s]["loss"] for s in logged] == [first["rows"][s]["loss"] for s in logged]
    lines = [json.loads(x) for x in (runs["two"] / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in lines if r["kind"] == "train"]
    assert train_steps == logged + list(range(last + 1, STEPS + 1))


class _Dev:
    def __init__(self, process_index):
        self.process_index = process_index


class _Layout:
    """A stand-in sharding: device -> index, as `Sharding.devices_indices_map` gives it."""

    def __init__(self, rows_by_device, shape):
        self.map = {_Dev(p): tuple(slice(r, r + n) if axis == row_axis else slice(None) for axis in range(len(shape)))
                    for p, r, n, row_axis in rows_by_device}

    def devices_indices_map(self, shape):
        return self.map


@pytest.mark.parametrize("layout, shards", [
    # 2 processes x 2 devices, rows in process order: process 1 holds rows 4..7
    ([(0, 0, 2, 0), (0, 2, 2, 0), (1, 4, 2, 0), (1, 6, 2, 0)], {0: (0, (0, 1, 2, 3)), 1: (1, (4, 5, 6, 7))}),
    # interleaved: process 0 holds rows 0-1 and 4-5 (make_array_from_process_local_data maps them in order)
    ([(0, 0, 2, 0), (1, 2, 2, 0), (0, 4, 2, 0), (1, 6, 2, 0)], {0: (0, (0, 1, 4, 5)), 1: (1, (2, 3, 6, 7))}),
    # replicas: 4 processes, two of them per half of the rows (e.g. context parallelism across processes)
    ([(0, 0, 4, 0), (1, 0, 4, 0), (2, 4, 4, 0), (3, 4, 4, 0)],
     {0: (0, (0, 1, 2, 3)), 1: (0, (0, 1, 2, 3)), 2: (1, (4, 5, 6, 7)), 3: (1, (4, 5, 6, 7))}),
    # micro-batched [A, B, S]: rows are axis 1
    ([(0, 0, 4, 1), (1, 4, 4, 1)], {0: (0, (0, 1, 2, 3)), 1: (1, (4, 5, 6, 7))}),
])
def test_data_shard_groups_processes_by_the_rows_their_devices_hold(monkeypatch, layout, shards):
    row_axis = layout[0][3]
    shape = (2, 8, 16) if row_axis else (8, 16)
    sharding = _Layout(layout, shape)
    count = len({index for index, _ in shards.values()})
    for process, (index, rows) in shards.items():
        monkeypatch.setattr(jax, "process_index", lambda p=process: p)
        shard = distributed.data_shard(sharding, shape, row_axis=row_axis)
        assert (shard.index, shard.count, shard.rows, shard.local_rows, shard.global_rows) == (
            index, count, rows, len(rows), 8)


def test_data_shard_rejects_overlapping_row_sets(monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    sharding = _Layout([(0, 0, 4, 0), (1, 2, 4, 0)], (8, 16))
    with pytest.raises(distributed.ConfigError, match="overlapping or unequal"):
        distributed.data_shard(sharding, (8, 16))


def test_resuming_needs_the_process_count_that_wrote_the_checkpoint(monkeypatch):
    from c2jax.train.loop import _PER_PROCESS, _own_data_state

    two = {_PER_PROCESS: [{"pos": 0}, {"pos": 1}]}
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert _own_data_state(two, "ckpt/4") == {"pos": 1}
    assert _own_data_state(None, "ckpt/4") is None
    with pytest.raises(distributed.ConfigError, match="written by one process"):
        _own_data_state({"pos": 0}, "ckpt/4")
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    with pytest.raises(distributed.ConfigError, match="written by 2 processes"):
        _own_data_state(two, "ckpt/4")
    assert _own_data_state({"pos": 0}, "ckpt/4") == {"pos": 0}
