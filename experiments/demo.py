"""`make demo`: the model end to end on CPU with embedded defaults.

1. Print `c2jax info` for the full Kimi K2.5 preset (1T parameters, abstract shapes only).
2. Train a byte-level variant of the `small` preset on Python standard-library source found on this
   machine (no downloads), with held-out files for eval loss.
3. Save it in Hugging Face DeepseekV3 format, load it back with `transformers`, and check that both
   frameworks give the same logits.

Everything is written under runs/demo/ (resolved config, metrics JSONL, HF checkpoint).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from c2jax.config import RunConfig, save_resolved
from c2jax.info import format_report, report
from c2jax.train.step import init_train_state, make_train_step
from models import hf
from models.config import preset
from models.layers import softmax_cross_entropy
from models.transformer import forward, init


def stdlib_corpus(max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes of the standard library's .py files; every 10th file is held out for eval."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = bytearray(), bytearray()
    for i, path in enumerate(sorted(root.glob("*.py"))):
        data = path.read_bytes()
        (held if i % 10 == 0 else train).extend(data + b"\n\n")
        if len(train) >= max_bytes:
            break
    return np.frombuffer(bytes(train), np.uint8).astype(np.int32), np.frombuffer(bytes(held), np.uint8).astype(np.int32)


def batches(data: np.ndarray, batch: int, seq: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq - 1, batch)
        yield np.stack([data[s : s + seq + 1] for s in starts])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--out", default="runs/demo")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    print("== c2jax info kimi-k2.5 (abstract shapes, nothing allocated)")
    print(format_report("kimi-k2.5", report(preset("kimi-k2.5"), {"fsdp": 64, "expert": 8}, 32768)))

    cfg = RunConfig(name="demo", model=preset("small").replace(vocab_size=256, num_nextn_predict_layers=0))
    save_resolved(cfg, out)
    train, held = stdlib_corpus(4_000_000)
    print(f"\n== training {cfg.model.num_hidden_layers}-layer MoE on {len(train) / 1e6:.1f} MB of stdlib source "
          f"({len(held) / 1e6:.1f} MB held out)")
    model = init(cfg.model, seed=cfg.seed)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(optax.warmup_cosine_decay_schedule(
        0.0, 3e-3, 10, args.steps, 3e-4), weight_decay=0.1))
    graphdef, state = init_train_state(model, tx)
    train_step = make_train_step(graphdef, tx, router_bias_rate=1e-2)
    eval_batch = next(batches(held, args.batch, args.seq, seed=1))

    @jax.jit
    def eval_loss(params, model_state, tokens):
        logits = forward(graphdef, nnx.merge_state(params, model_state), tokens[:, :-1], return_mtp=False).logits
        return softmax_cross_entropy(logits, tokens[:, 1:]).mean()

    metrics_path = out / "metrics.jsonl"
    with metrics_path.open("w") as log:
        t0 = time.perf_counter()
        for step, tokens in zip(range(args.steps), batches(train, args.batch, args.seq, seed=0)):
            state, metrics = train_step(state, jnp.asarray(tokens))
            # scalars as numbers, per-layer metrics (expert load per MoE layer) as lists
            row = {"step": step + 1, **{k: float(v) if v.ndim == 0 else v.tolist() for k, v in metrics.items()}}
            if step % 10 == 0 or step == args.steps - 1:
                row["eval_loss"] = float(eval_loss(state.params, state.model_state, jnp.asarray(eval_batch)))
                print(f"step {step + 1:4d}  loss {row['loss']:.3f}  eval {row['eval_loss']:.3f}  "
                      f"max expert load {row.get('max_expert_load', 0):.2f}  {time.perf_counter() - t0:6.1f}s")
            log.write(json.dumps(row) + "\n")

    print("\n== Hugging Face round trip")
    trained = nnx.merge(graphdef, state.params, state.model_state)
    ckpt = out / "hf"
    hf.save_pretrained(trained, ckpt)
    import torch
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = eval_batch[:2, : args.seq]
    with torch.no_grad():
        ref = hf_model(torch.from_numpy(ids).long()).logits.numpy()
    ours = np.asarray(trained(jnp.asarray(ids)).logits)
    rel = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    print(f"saved {ckpt}; transformers DeepseekV3ForCausalLM logits vs c2jax: relative L2 error {rel:.2e}")
    print(f"\nwrote {out}/config.yaml, {metrics_path}, {ckpt}/")
    if rel > 1e-4:
        raise SystemExit(f"HF parity failed: relative error {rel:.2e} > 1e-4")


if __name__ == "__main__":
    main()
