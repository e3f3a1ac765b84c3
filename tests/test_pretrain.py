"""Pretraining: SFT masking, MTP self-distillation math, exact accumulation, NaN skip, router-bias
balancing, exact resume after kill -9, a short CPU run whose eval loss falls well below the unigram
entropy of its data, and one run on a 2 x 2 mesh (HF init, Muon, the c2jax.data pipeline, optimizer
reset, codebase NLL against transformers, HF export)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from c2jax.config import from_dict
from c2jax.models.config import preset
from c2jax.models.transformer import forward, init
from c2jax.train.config import PretrainConfig
from c2jax.train.loop import Trainer
from c2jax.train.losses import mtp_self_distillation, mtp_self_distillation_chunked
from c2jax.train.step import init_train_state, make_train_step
from c2jax.train.synthetic import MarkovSource, unigram_entropy

CFG = preset("tiny").replace(moe_impl="dense")
ROOT = Path(__file__).resolve().parent.parent


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_mtp_kl_matches_numpy_reference():
    rng = np.random.default_rng(0)
    b, s, v, d = 2, 6, 5, 2
    main = rng.normal(size=(b, s, v)).astype(np.float32)
    mtp = rng.normal(size=(d, b, s, v)).astype(np.float32)
    seg = np.array([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 0]], np.int32)
    mask = np.array([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 0]], np.float32)
    kl, w, agree = mtp_self_distillation(main, mtp, seg, mask)
    ref_kl = ref_w = ref_agree = 0.0
    for j in range(d):
        k = j + 1
        for bi in range(b):
            for t in range(s - k):
                if seg[bi, t] == 0 or seg[bi, t + k] != seg[bi, t] or mask[bi, t + k] == 0:
                    continue
                p = _log_softmax(main[bi, t + k].astype(np.float64))
                q = _log_softmax(mtp[j, bi, t].astype(np.float64))
                ref_kl += float(np.sum(np.exp(p) * (p - q)))
                ref_w += 1
                ref_agree += float(np.argmax(p) == np.argmax(q))
    np.testing.assert_allclose(float(kl), ref_kl, rtol=1e-5)
    assert float(w) == ref_w and float(agree) == ref_agree


@pytest.mark.parametrize("chunk", [0, 6, 5, 100])
def test_chunked_mtp_distillation_equals_the_logits_version_in_value_and_gradients(chunk):
    """From the head's inputs, in chunks of 6 (dividing D*B*S = 24), 5 (padded), or one pass: KL sum, weight
    sum and agreement equal the logits version, and so do the gradients w.r.t. head and MTP hidden states
    (the teacher is detached in both)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    b, s, v, dim, depth = 2, 6, 11, 4, 2
    main_h = jnp.asarray(rng.normal(size=(b, s, dim)), jnp.float32)
    mtp_h = jnp.asarray(rng.normal(size=(depth, b, s, dim)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(dim, v)), jnp.float32)
    seg = jnp.array([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 0]], jnp.int32)
    mask = jnp.array([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 0]], jnp.float32)

    def chunked(w, mtp_h, main_h):
        return mtp_self_distillation_chunked(w, main_h, mtp_h, seg, mask, chunk)

    def reference(w, mtp_h, main_h):
        return mtp_self_distillation(main_h @ w, mtp_h @ w, seg, mask)

    out, ref = chunked(w, mtp_h, main_h), reference(w, mtp_h, main_h)
    for a, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(float(a), float(r), rtol=1e-5)
    grads = jax.grad(lambda *a: chunked(*a)[0], argnums=(0, 1, 2))(w, mtp_h, main_h)
    grads_ref = jax.grad(lambda *a: reference(*a)[0], argnums=(0, 1, 2))(w, mtp_h, main_h)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(grads[2]).max()) == 0.0  # nothing flows into the teacher


def _batch(seed=0, b=4, s=16):
    return next(MarkovSource(CFG.vocab_size, s, b, seed=seed))


def test_sft_mask_excludes_prompt_tokens():
    tx = optax.sgd(0.1)
    graphdef, state = init_train_state(init(CFG, seed=0), tx)
    batch = _batch()
    batch["loss_mask"][:, :8] = 0.0  # the "prompt"
    step = make_train_step(graphdef, tx)
    out = forward(graphdef, nnx.merge_state(state.params, state.model_state), batch["input_ids"],
                  positions=batch["positions"], segment_ids=batch["segment_ids"])
    logp = _log_softmax(np.asarray(out.logits, np.float64))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    expected = (nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    new, metrics = step(state, batch)
    np.testing.assert_allclose(float(metrics["ce_loss"]), expected, rtol=1e-5)
    # changing the prompt's targets changes nothing: no gradient flows from masked tokens
    other = dict(batch, targets=batch["targets"].copy())
    other["targets"][:, :8] = (other["targets"][:, :8] + 1) % CFG.vocab_size
    new2, metrics2 = step(state, other)
    assert float(metrics2["ce_loss"]) == float(metrics["ce_loss"])
    jax.tree.map(np.testing.assert_array_equal, new.params, new2.params)


def test_grad_accumulation_equals_full_batch():
    tx = optax.sgd(1.0)  # params move by exactly -grad, so the parameters compare the gradients
    graphdef, state = init_train_state(init(CFG, seed=0), tx)
    batch = _batch(b=4)
    batch["loss_mask"][0, :10] = 0.0  # unequal token counts per micro-batch: the mean must be global
    step = make_train_step(graphdef, tx, router_bias_rate=1e-2)
    full, m_full = step(state, batch)
    micro = {k: v.reshape(2, 2, *v.shape[1:]) for k, v in batch.items()}
    acc, m_acc = step(state, micro)
    np.testing.assert_allclose(float(m_acc["loss"]), float(m_full["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m_acc["grad_norm"]), float(m_full["grad_norm"]), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), acc.params, full.params)
    jax.tree.map(np.testing.assert_array_equal, acc.model_state, full.model_state)


def test_nan_loss_step_is_skipped_and_state_unchanged():
    tx = optax.adam(1e-2)
    graphdef, state = init_train_state(init(CFG, seed=0), tx)
    batch = _batch()
    batch["loss_mask"][0, 3] = np.nan
    new, metrics = make_train_step(graphdef, tx, router_bias_rate=1e-2)(state, batch)
    assert int(metrics["skipped"]) == 1
    jax.tree.map(np.testing.assert_array_equal, (new.params, new.model_state, new.opt_state, new.step),
                 (state.params, state.model_state, state.opt_state, state.step))


def test_router_bias_moves_a_skewed_router_toward_balance():
    tx = optax.sgd(0.0)  # isolate the bias update: the optimizer changes nothing
    graphdef, state = init_train_state(init(CFG, seed=0), tx)
    bias = state.model_state["moe_layers"]["mlp"]["e_score_correction_bias"]
    skew = np.zeros(bias.get_value().shape, np.float32)
    skew[:, :2] = 0.5  # two of eight experts win almost every top-2 choice
    bias.set_value(skew)
    step = make_train_step(graphdef, tx, router_bias_rate=0.02)
    batch = _batch(b=8)
    loads = []
    for _ in range(30):
        state, metrics = step(state, batch)
        loads.append(float(metrics["max_expert_load"]))
    assert loads[0] > 3.0  # skewed: near 8 / 2 = 4x the mean load
    assert np.mean(loads[-5:]) < 0.75 * loads[0]
    final = np.asarray(state.model_state["moe_layers"]["mlp"]["e_score_correction_bias"].get_value())
    # the two favoured experts started 0.5 above the rest; the sign rule has pulled them down
    assert np.all(final[:, :2].mean(-1) - final[:, 2:].mean(-1) < 0.5 - 0.2)


def run_config(tmp_path, name, steps=8, **kw):
    data = dict(name=name, output_dir=str(tmp_path), model=dict(CFG.__dict__), log_every=1, progress=False,
                phases=[dict(name="main", steps=steps // 2, seq_len=16, batch_size=4),
                        dict(name="sft", steps=steps - steps // 2, seq_len=16, batch_size=4, grad_accum=2)],
                mtp_init_step=2, checkpoint=dict(every=2, keep_last=2), eval=dict(every=0),
                optimizer=dict(lr=3e-3, warmup_steps=2))
    data.update(kw)
    return from_dict(PretrainConfig, data)


def markov_batches(cfg, phase, split):
    return MarkovSource(cfg.model.vocab_size, phase.seq_len, phase.batch_size, seed=0,
                        stream={"train": 0, "eval": 1}[split])


WORKER = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_pretrain import markov_batches, run_config
from c2jax.train.loop import Trainer
t = Trainer(run_config(Path({tmp!r}), {name!r}), batches=markov_batches, eval_sources=None, tensorboard=False)
t.run()
t.close()
"""


def _worker(tmp_path, name):
    # one device (drop conftest's 8 fake ones) but the same faster-compiling LLVM level; the runs share the
    # compilation cache, so only the first compiles
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "").strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)  # conftest's compilation cache, inherited
    code = WORKER.format(tests=str(ROOT / "tests"), tmp=str(tmp_path), name=name)
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {}
    for r in rows:
        if r["kind"] == "train":
            by_step[r["step"]] = r["loss"]  # a resumed run rewrites the steps after its checkpoint
    return [by_step[s] for s in sorted(by_step)]


def _wait_for_lines(path: Path, lines: int, proc, timeout_s: float = 300.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return
        time.sleep(0.05)


def test_resume_after_kill_9_gives_the_same_losses_bitwise(tmp_path):
    # the killed run starts once the straight run has finished, so every program it needs (three train-step
    # variants: before and after MTP init, and the grad-accumulating SFT phase) is in the shared compilation
    # cache: overlapping them made both compile the later variants at once (92-137 s under two xdist workers,
    # 117 s of an earlier CI run with a one-step overlap)
    straight = _worker(tmp_path, "straight")
    procs = [straight]
    try:
        out = straight.communicate(timeout=300)[0].decode()
        assert straight.returncode == 0, out[-3000:]
        killed = _worker(tmp_path, "killed")
        procs.append(killed)
        metrics = tmp_path / "killed" / "metrics.jsonl"
        _wait_for_lines(metrics, 5, killed)
        assert killed.poll() is None, killed.stdout.read().decode()[-3000:]
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert len(metrics.read_text().splitlines()) < 8
        resumed = _worker(tmp_path, "killed")
        procs.append(resumed)
        out = resumed.communicate(timeout=300)[0].decode()
        assert resumed.returncode == 0, out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    expected = _losses(tmp_path / "straight")
    assert len(expected) == 8
    assert _losses(tmp_path / "killed") == expected  # exact float equality, step by step


def test_short_cpu_run_beats_the_unigram_entropy(tmp_path):
    cfg = run_config(tmp_path, "learn", steps=1, phases=[dict(name="main", steps=150, seq_len=32, batch_size=8)],
                     mtp_init_step=0, log_every=25, eval=dict(every=150, batches=4),
                     checkpoint=dict(every=150, keep_last=1), optimizer=dict(lr=1e-2, warmup_steps=10))
    data = [next(markov_batches(cfg, cfg.phases[0], "eval")) for _ in range(4)]
    entropy = unigram_entropy(data)
    trainer = Trainer(cfg, batches=markov_batches,
                      eval_sources=lambda c, p: {"markov": lambda: markov_batches(c, p, "eval")})
    trainer.run()
    trainer.close()
    rows = [json.loads(x) for x in (tmp_path / "learn" / "metrics.jsonl").read_text().splitlines()]
    eval_loss = [r for r in rows if r["kind"] == "eval"][-1]["eval_loss/markov"]
    # the chain's conditional entropy is log 2 = 0.69 nats; its unigram entropy is ~4.7
    assert eval_loss < entropy - 1.5, (eval_loss, entropy)
    train = [r for r in rows if r["kind"] == "train"]
    for key in ("mtp_loss", "mtp_acceptance", "grad_norm", "lr", "tokens_per_s", "mfu", "router_bias_norm",
                "expert_entropy/layer0", "expert_max_over_mean/layer0"):
        assert key in train[-1], key
    assert list((tmp_path / "learn" / "tensorboard").iterdir())
    assert (tmp_path / "learn" / "config.yaml").exists()


def _code_tree(root: Path) -> Path:
    """A tiny repository: Python files, plus one that its .gitignore excludes."""
    root.mkdir()
    for i in range(8):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {i + j} + {i * j}\n\n" for j in range(4))
        (root / f"mod{i}.py").write_text(f'"""Module {i}."""\n\n{body}')
    (root / "build.py").write_text("IGNORED = True\n" * 50)
    (root / ".gitignore").write_text("build.py\n")
    return root


def _reference_window_nll(logp_fn, ids: np.ndarray, window: int) -> float:
    """Rolling-window NLL, stated directly: windows of `window` inputs start every window // 2 tokens,
    and each next-token prediction is scored once, in the first window that contains its input."""
    stride, n = window // 2, len(ids) - 1
    total = 0.0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        logp = logp_fn(ids[begin:end])  # [end - begin, V]
        for i in range(begin, end):
            first = 0 if i < window else (i - window) // stride + 1
            if first * stride == begin:
                total -= float(logp[i - begin, ids[i + 1]])
        if end == n:
            break
    return total


def test_mesh_run_from_hf_with_muon_on_the_data_pipeline_exports_back(tmp_path):
    """One short run covering: initialisation from a Hugging Face checkpoint (c2jax.models.hf.save_pretrained
    of a model without MTP: the MTP module is created fresh), a 2 x 2 (data x fsdp) mesh, Muon, the real
    c2jax.data pipeline over a source tree, a phase that resets the optimizer, per-source eval loss and the
    codebase NLL metric, and the export back to HF format, checked against transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from c2jax.data.packing import split_of
    from c2jax.models import hf

    base_cfg = CFG.replace(vocab_size=260, num_nextn_predict_layers=0)  # bytes tokenizer: 259 ids
    base = init(base_cfg, seed=1)
    hf.save_pretrained(base, tmp_path / "base")
    repo = _code_tree(tmp_path / "repo")
    texts = {p.name: p.read_text() for p in sorted(repo.glob("mod*.py"))}
    splits = [split_of({"text": t, "language": "python", "path": n}, 0.25) for n, t in texts.items()]
    assert "eval" in splits and "train" in splits  # the fixture has both splits

    source = dict(name="code", kind="source_tree", path=str(repo), heldout_fraction=0.25)
    cfg = from_dict(PretrainConfig, dict(
        name="hfmesh", output_dir=str(tmp_path), model=dict(CFG.__dict__), init_from_hf=str(tmp_path / "base"),
        mesh=dict(data=2, fsdp=2), data=dict(tokenizer="bytes", sources=[source], seq_len=32, batch_size=4),
        optimizer=dict(name="muon", lr=1e-3, warmup_steps=1),
        phases=[dict(name="main", steps=2), dict(name="again", steps=1, reset_optimizer=True)],
        mtp_init_step=0, log_every=1, progress=False, checkpoint=dict(every=100),
        eval=dict(every=3, batches=1, codebase=str(repo), codebase_window=16, codebase_max_tokens=120),
        export_hf=True))
    with pytest.warns(UserWarning, match="vocab_size"):  # the run's model section differs from the checkpoint
        trainer = Trainer(cfg, tensorboard=False)
    assert trainer.cfg.model.vocab_size == 260 and trainer.cfg.model.num_nextn_predict_layers == 1
    loaded = nnx.to_pure_dict(trainer.state.params)
    source_params = nnx.to_pure_dict(nnx.split(base, nnx.Param, ...)[1])
    assert set(loaded) - set(source_params) == {"mtp"}
    jax.tree.map(np.testing.assert_array_equal, {k: loaded[k] for k in source_params}, source_params)
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(trainer.state.params)} == {4}

    try:
        out = trainer.run()
    finally:
        trainer.close()
    assert out["step"] == 3 and np.all(np.isfinite(out["losses"]))
    assert trainer.meta["data_state"] is not None and trainer.meta["optimizer_reset_phases"] == [1]
    assert trainer.ckpt.steps() == [2, 3]  # the phase boundary and the end

    # Muon ran; its moments restarted with the second phase while the LR schedule kept counting
    leaves = jax.tree.leaves(trainer.state.opt_state, is_leaf=lambda x: isinstance(
        x, (optax.contrib.MuonState, optax.ScaleByAdamState, optax.ScaleByScheduleState)))
    counts = {type(x).__name__: int(x.count) for x in leaves if hasattr(x, "count")}
    assert counts == {"MuonState": 1, "ScaleByAdamState": 1, "ScaleByScheduleState": 3}, counts

    rows = [json.loads(x) for x in (tmp_path / "hfmesh" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 3 and all(r["tokens"] > 0 and np.isfinite(r["mtp_loss"]) for r in train)
    evals = [r for r in rows if r["kind"] == "eval"][-1]
    assert np.isfinite(evals["eval_loss/code"])

    # the export is a DeepseekV3 checkpoint: c2jax reloads it bit-exactly (MTP included) ...
    reloaded = hf.from_pretrained(tmp_path / "hfmesh" / "hf", mtp="require", moe_impl="dense")
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.split(reloaded, nnx.Param, ...)[1]),
                 jax.tree.map(np.asarray, nnx.to_pure_dict(trainer.state.params)))
    # ... and transformers' DeepseekV3ForCausalLM on it reproduces the run's codebase NLL, computed
    # independently from the files' UTF-8 bytes (the bytes tokenizer) in sorted order, build.py ignored
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "hfmesh" / "hf", torch_dtype=torch.float32, attn_implementation="eager").eval()
    ids = np.frombuffer("".join(t + "\n" for t in texts.values()).encode(), np.uint8)[:120].astype(np.int64)

    def logp(x):
        with torch.no_grad():
            return torch.log_softmax(model(torch.from_numpy(x)[None]).logits[0].double(), -1).numpy()

    expected = _reference_window_nll(logp, ids, 16)
    assert evals["codebase_tokens"] == 119
    np.testing.assert_allclose(evals["codebase_nll_sum"], expected, rtol=2e-5)


class _Stream:
    """A MarkovSource whose batches at `nan_at` get a NaN loss mask (a blow-up) or, with drop=True, are
    left out of the stream altogether."""

    def __init__(self, cfg, phase, nan_at=(), drop=False):
        self.src, self.nan_at, self.drop = markov_batches(cfg, phase, "train"), set(nan_at), drop

    def get_state(self):
        return self.src.get_state()

    def set_state(self, state):
        self.src.set_state(state)

    def __next__(self):
        index, batch = self.src.index, next(self.src)
        if index in self.nan_at:
            if self.drop:
                return next(self)
            batch["loss_mask"][0, 0] = np.nan
        return batch


def test_nan_steps_in_a_row_roll_back_to_the_last_checkpoint(tmp_path):
    """Batches 3 and 4 blow up; with max_bad_steps=2 the second rolls the run back to the step-3 checkpoint
    and training continues with batch 5. The result is exactly the train step applied, from the same
    initial state, to a stream that never had batches 3 and 4; both NaN steps are counted."""
    cfg = run_config(tmp_path, "rollback", steps=1, phases=[dict(name="main", steps=6, seq_len=16, batch_size=4)],
                     mtp_init_step=100, max_bad_steps=2, log_every=6,
                     checkpoint=dict(every=3, keep_last=2, async_save=False))
    trainer = Trainer(cfg, eval_sources=None, tensorboard=False,
                      batches=lambda c, p, s: _Stream(c, p, nan_at=(3, 4)))
    _, initial = init_train_state(init(cfg.model, seed=cfg.seed), trainer.tx, seed=cfg.seed)
    try:
        out = trainer.run()
    finally:
        trainer.close()
    assert out["step"] == 6 and out["meta"]["skipped_total"] == 2 and out["meta"]["rollbacks"] == 1
    step, state = trainer.train_step(cfg.phases[0], False), initial
    clean = _Stream(cfg, cfg.phases[0], nan_at=(3, 4), drop=True)
    for _ in range(6):
        state, _ = step(state, next(clean))
    jax.tree.map(np.testing.assert_array_equal, (trainer.state.params, trainer.state.model_state,
                                                 trainer.state.opt_state, trainer.state.step),
                 (state.params, state.model_state, state.opt_state, state.step))


def test_optimizer_offload_trains_the_same_and_resumes(tmp_path):
    """optimizer.offload: Adam moments in host memory between steps, through an MTP init, a grad-accumulating
    phase and a checkpoint resume: the same losses as moments on the device, and they stay in host memory."""
    def run(name, steps, offload):
        cfg = run_config(tmp_path, name, steps=steps, optimizer=dict(lr=3e-3, warmup_steps=2, offload=offload))
        trainer = Trainer(cfg, batches=markov_batches, eval_sources=None, tensorboard=False)
        try:
            trainer.run()
        finally:
            trainer.close()
        return trainer

    on_device = run("device", 6, False)
    offloaded = run("host", 6, True)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(offloaded.state.opt_state)} == {"pinned_host"}
    assert _losses(tmp_path / "host") == pytest.approx(_losses(tmp_path / "device"), rel=1e-6)
    # resume: drop the final checkpoint, so the run restores step 4 (moments back into host memory) and redoes 5-6
    checkpoints = tmp_path / "host" / "checkpoints"
    assert offloaded.ckpt.steps() == [4, 6]
    shutil.rmtree(checkpoints / "6")
    resumed = run("host", 6, True)
    assert int(resumed.state.step) == 6
    assert {x.sharding.memory_kind for x in jax.tree.leaves(resumed.state.opt_state)} == {"pinned_host"}
    assert _losses(tmp_path / "host") == pytest.approx(_losses(tmp_path / "device"), rel=1e-6)
    for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(on_device.state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_cpt_of_a_qwen3_moe_checkpoint_on_an_ep_mesh_resumes_and_exports_to_transformers(tmp_path):
    """Continued pretraining of the report's ablation family: a Qwen3-MoE checkpoint built by transformers, trained
    on a 2 x 2 (fsdp x expert) mesh with the family's load-balancing loss (no selection bias), stopped after 2 steps
    and resumed to 3 from its checkpoint; the export is a Qwen3MoeForCausalLM whose logits transformers reproduces."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from c2jax.models import hf

    model_cfg = preset("tiny-qwen3-moe").replace(vocab_size=64, moe_impl="dense")
    hf_cfg = hf.config_to_hf(model_cfg)
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")

    def config_for(steps):
        return run_config(tmp_path, "qwen3", model=dict(model_cfg.__dict__), init_from_hf=str(tmp_path / "base"),
                          mesh=dict(fsdp=2, expert=2), phases=[dict(name="cpt", steps=steps, seq_len=16, batch_size=4)],
                          loss=dict(router_aux_loss=1e-2, router_bias_rate=0.0), checkpoint=dict(every=1, keep_last=2),
                          export_hf=True)

    for steps in (2, 3):
        trainer = Trainer(config_for(steps), batches=markov_batches, eval_sources=None, tensorboard=False)
        try:
            out = trainer.run()
        finally:
            trainer.close()
        assert out["step"] == steps and trainer.ckpt.steps()[-1] == steps
    rows = [json.loads(x) for x in (tmp_path / "qwen3" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]  # the second run resumed at step 3, it did not start over
    assert all(np.isfinite(r["router_aux_loss"]) and r["router_aux_loss"] > 0 for r in train)

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3" / "hf", dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    ids = np.arange(12, dtype=np.int64)[None] % 64
    with torch.no_grad():
        want = exported(torch.from_numpy(ids)).logits.numpy()
    ours = hf.from_pretrained(tmp_path / "qwen3" / "hf")
    got = np.asarray(forward(*nnx.split(ours), ids).logits)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4


def test_resuming_a_run_directory_written_on_another_device_re_resolves_its_moe_kernel(tmp_path, monkeypatch,
                                                                                        capsys):
    """A run's config.yaml names the grouped kernel of the device it ran on (here: mosaic_sm90, as on an H100).
    `c2jax pretrain --config <run>/config.yaml` on this CPU resumes it on the kernel the registry picks here (xla),
    saying so in one line; a kernel named by an override, or by the user's own YAML, is kept."""
    import yaml

    from c2jax import cli
    from c2jax.config import load
    from c2jax.kernels import dispatch
    from c2jax.train import loop

    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    model = CFG.replace(moe_impl="grouped", num_hidden_layers=1, first_k_dense_replace=0,
                        num_nextn_predict_layers=0)
    cfg = run_config(tmp_path, "moved", model=dict(model.__dict__), mtp_init_step=0,
                     phases=[dict(name="main", steps=2, seq_len=16, batch_size=2)],
                     checkpoint=dict(every=1, keep_last=2))
    trainer = Trainer(cfg, batches=markov_batches, eval_sources=None, tensorboard=False)
    trainer.run(stop_after=1)
    trainer.close()
    saved = tmp_path / "moved" / "config.yaml"
    data = yaml.safe_load(saved.read_text())
    assert data["model"]["moe_kernel"] == "xla"  # what ran here
    data["model"]["moe_kernel"] = "mosaic_sm90"  # the run directory as an H100 wrote it
    saved.write_text(yaml.safe_dump(data, sort_keys=False))
    capsys.readouterr()

    # kept: an override naming the kernel, and the same YAML as the user's own file (not the run's saved config)
    named = loop.resumed_config(load(PretrainConfig, saved, ["model.moe_kernel=mosaic_sm90"]), str(saved),
                                ["model.moe_kernel=mosaic_sm90"])
    assert named.model.moe_kernel == "mosaic_sm90"
    own = tmp_path / "mine.yaml"
    own.write_text(saved.read_text())
    assert loop.resumed_config(load(PretrainConfig, own), str(own)).model.moe_kernel == "mosaic_sm90"
    assert capsys.readouterr().out == ""

    # the CLI resumes the saved run at step 1 and runs step 2 on xla (the Trainer with this test's batches)
    made = []

    def trainer_here(cfg):
        made.append(Trainer(cfg, batches=markov_batches, eval_sources=None, tensorboard=False))
        return made[-1]

    monkeypatch.setattr(loop, "Trainer", trainer_here)
    assert cli.main(["pretrain", "--config", str(saved)]) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if "moe_kernel" in x]
    assert len(lines) == 1 and "'mosaic_sm90'" in lines[0] and "'xla' instead" in lines[0], out
    assert str(tmp_path / "moved") in lines[0]
    assert made[0].cfg.model.moe_kernel == "xla"
    assert yaml.safe_load(saved.read_text())["model"]["moe_kernel"] == "xla"  # the kernel that ran, recorded
    assert [r["step"] for r in map(json.loads, (tmp_path / "moved" / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"] == [1, 2]  # resumed at step 1, not started over
