"""Held-out eval loss and the codebase perplexity metric (sum of NLL over a rolling window)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from c2jax.train.step import as_batch


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
    """Rows of one window each, [window] arrays, scoring every token exactly once with up to `window`
    tokens of context: window w starts at w * stride and scores only the tokens the previous window did
    not (the 'sliding-window perplexity' of HF's perplexity guide). The last window is padded to the
    full length (segment id 0, loss mask 0) so every row has one shape."""
    if window < 2:
        raise ValueError(f"codebase_window must be >= 2, got {window}")
    stride = stride or window // 2
    n = len(tokens) - 1
    scored_until = 0
    start = 0
    while scored_until < n:
        end = min(start + window, n)
        seq, pad = end - start, window - (end - start)
        ids = np.pad(tokens[start:end], (0, pad)).astype(np.int32)
        tgt = np.pad(tokens[start + 1:end + 1], (0, pad)).astype(np.int32)
        mask = np.pad((np.arange(start, end) >= scored_until).astype(np.float32), (0, pad))
        yield {"input_ids": ids, "targets": tgt, "segment_ids": np.pad(np.ones(seq, np.int32), (0, pad)),
               "positions": np.pad(np.arange(seq, dtype=np.int32), (0, pad)), "loss_mask": mask}
        scored_until = end
        start = max(end + stride - window, 0)


def read_codebase(root: str | Path, encode: Callable[[str], list[int]], max_tokens: int,
                  languages: tuple[str, ...] = ()) -> np.ndarray:
    """Token ids of the code files under `root`, up to max_tokens: the files the data pipeline's source
    tree reader keeps (c2jax.data.source_tree: `.gitignore` honoured, `.git/` and symlinks skipped; only
    `languages` if given, else every known language), in sorted path order, each followed by a newline."""
    from c2jax.data.source_tree import list_files

    root = Path(root).expanduser()
    ids: list[int] = []
    for rel, _ in list_files(root, tuple(languages), (), True, 1_000_000):
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids.extend(encode(text + "\n"))
        if len(ids) >= max_tokens:
            break
    if len(ids) < 2:
        raise ValueError(f"codebase {root}: no code files with tokens found")
    return np.asarray(ids[:max_tokens], np.int64)


def codebase_nll(eval_step, params, model_state, tokens: np.ndarray, window: int,
                 batch_size: int = 8) -> dict[str, float]:
    """Sum and mean of NLL (nats) over a rolling window across the whole token stream, `batch_size`
    windows per call (one compiled shape: a short last batch is filled with all-masked rows)."""
    total = count = 0.0
    rows = list(rolling_windows(tokens, window))
    empty = {k: np.zeros_like(v) for k, v in rows[0].items()}
    for i in range(0, len(rows), batch_size):
        group = rows[i:i + batch_size]
        group += [empty] * (batch_size - len(group))
        s, n = eval_step(params, model_state, {k: np.stack([r[k] for r in group]) for k in group[0]})
        total, count = total + float(s), count + float(n)
    return {"codebase_nll_sum": total, "codebase_nll_per_token": total / count, "codebase_tokens": count}
