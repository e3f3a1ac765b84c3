"""Pretraining: SFT masking, MTP self-distillation math, exact accumulation, NaN skip, router-bias
balancing, and a short CPU run whose eval loss falls well below the unigram entropy of its data."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

from c2jax.config import from_dict
from c2jax.train.config import PretrainConfig
from c2jax.train.loop import Trainer
from c2jax.train.losses import mtp_self_distillation
from c2jax.train.step import init_train_state, make_train_step
from c2jax.train.synthetic import MarkovSource, unigram_entropy
from models.config import preset
from models.transformer import forward, init

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
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
               JAX_COMPILATION_CACHE_DIR=str(ROOT / ".jax_cache"))
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


def test_resume_after_kill_9_gives_the_same_losses_bitwise(tmp_path):
    procs = [_worker(tmp_path, "straight"), _worker(tmp_path, "killed")]
    try:
        straight, killed = procs
        metrics = tmp_path / "killed" / "metrics.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline and killed.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
                break
            time.sleep(0.05)
        assert killed.poll() is None, killed.stdout.read().decode()[-3000:]
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert len(metrics.read_text().splitlines()) < 8
        procs.append(_worker(tmp_path, "killed"))
        for p in (straight, procs[-1]):
            out = p.communicate(timeout=300)[0].decode()
            assert p.returncode == 0, out[-3000:]
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
