"""Held-out eval loss and the codebase perplexity metric (sum of NLL over a rolling window)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from c2jax.train.step import as_batch

CODE_SUFFIXES = (".py", ".rs", ".go", ".c", ".h", ".cc", ".cpp", ".hpp", ".js", ".ts", ".java", ".sh", ".md")


def make_eval_step(graphdef):
    """eval_step(params, model_state, batch) -> (sum of masked NLL, token count) over the batch."""

    @jax.jit
    def eval_step(params, model_state, batch):
        batch = as_batch(batch)
        model = nnx.merge(graphdef, params, model_state)
        out = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                    return_mtp=False)
        losses = model.token_losses(out.hidden, batch["targets"])
        mask = batch["loss_mask"].astype(jnp.float32)
        return jnp.sum(losses * mask), jnp.sum(mask)

    return eval_step


def eval_loss(eval_step, params, model_state, batches: Iterable[dict], max_batches: int) -> float:
    nll = count = 0.0
    for i, batch in enumerate(batches):
        if i >= max_batches:
            break
        s, n = eval_step(params, model_state, batch)
        nll, count = nll + float(s), count + float(n)
    if count == 0:
        raise ValueError("eval: the held-out source produced no tokens")
    return nll / count


def rolling_windows(tokens: np.ndarray, window: int, stride: int | None = None) -> Iterator[dict]:
    """Batches of one window each, scoring every token exactly once with up to `window` tokens of context:
    window w starts at w * stride and scores only the tokens the previous window did not (the
    'sliding-window perplexity' of HF's perplexity guide)."""
    stride = stride or window // 2
    n = len(tokens) - 1
    scored_until = 0
    start = 0
    while scored_until < n:
        end = min(start + window, n)
        ids = tokens[start:end]
        tgt = tokens[start + 1:end + 1]
        mask = (np.arange(start, end) >= scored_until).astype(np.float32)
        seq = len(ids)
        yield {"input_ids": ids[None].astype(np.int32), "targets": tgt[None].astype(np.int32),
               "segment_ids": np.ones((1, seq), np.int32), "positions": np.arange(seq, dtype=np.int32)[None],
               "loss_mask": mask[None]}
        scored_until = end
        start = max(end + stride - window, 0)


def read_codebase(root: str | Path, encode: Callable[[str], list[int]], max_tokens: int) -> np.ndarray:
    """Token ids of the code files under `root` (sorted paths, hidden dirs skipped), up to max_tokens."""
    ids: list[int] = []
    for path in sorted(Path(root).rglob("*")):
        if any(part.startswith(".") for part in path.relative_to(root).parts) or path.suffix not in CODE_SUFFIXES:
            continue
        if not path.is_file():
            continue
        ids.extend(encode(path.read_text(errors="replace") + "\n"))
        if len(ids) >= max_tokens:
            break
    if len(ids) < 2:
        raise ValueError(f"codebase {root}: no code files with tokens found")
    return np.asarray(ids[:max_tokens], np.int64)


def codebase_nll(eval_step, params, model_state, tokens: np.ndarray, window: int) -> dict[str, float]:
    """Sum and mean of NLL (nats) over a rolling window across the whole token stream."""
    total = count = 0.0
    for batch in rolling_windows(tokens, window):
        s, n = eval_step(params, model_state, batch)
        total, count = total + float(s), count + float(n)
    return {"codebase_nll_sum": total, "codebase_nll_per_token": total / count, "codebase_tokens": count}
