"""A deterministic synthetic batch source with Grain-style state: documents sampled from a fixed sparse
first-order Markov chain. Its true conditional entropy is known (log `branching`), far below its unigram
entropy, so a model that learns context visibly beats the unigram baseline. For tests and benchmarks
that must not depend on a corpus."""

from __future__ import annotations

import numpy as np


class MarkovSource:
    def __init__(self, vocab: int, seq_len: int, batch_size: int, seed: int = 0, branching: int = 2,
                 doc_len: int = 24, stream: int = 0):
        rng = np.random.default_rng(seed)
        # every token has `branching` equally likely successors, among tokens 1.. (0 is never emitted)
        self.successors = rng.integers(1, vocab, size=(vocab, branching))
        self.vocab, self.seq_len, self.batch_size = vocab, seq_len, batch_size
        self.seed, self.stream, self.doc_len = seed, stream, doc_len
        self.index = 0

    def get_state(self) -> dict:
        return {"index": self.index}

    def set_state(self, state: dict) -> None:
        self.index = int(state["index"])

    def __iter__(self):
        return self

    def _row(self, rng) -> dict[str, np.ndarray]:
        """One packed row of documents (segment ids 1, 2, ...; positions restart per document)."""
        length = self.seq_len + 1
        tokens, segs, pos = [], [], []
        seg = 0
        while len(tokens) < length:
            seg += 1
            t = int(rng.integers(1, self.vocab))
            for p in range(self.doc_len):
                tokens.append(t)
                segs.append(seg)
                pos.append(p)
                t = int(self.successors[t, rng.integers(self.successors.shape[1])])
        tokens, segs, pos = (np.asarray(a[:length], np.int32) for a in (tokens, segs, pos))
        same = segs[1:] == segs[:-1]  # the last token of a document has no target in it
        return {"input_ids": tokens[:-1], "targets": tokens[1:], "segment_ids": segs[:-1],
                "positions": pos[:-1], "loss_mask": same.astype(np.float32)}

    def __next__(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.stream, self.index])
        self.index += 1
        rows = [self._row(rng) for _ in range(self.batch_size)]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def unigram_entropy(batches: list[dict]) -> float:
    """Entropy (nats) of the empirical unigram distribution of the trained targets."""
    counts = np.zeros(max(int(b["targets"].max()) for b in batches) + 1)
    for b in batches:
        np.add.at(counts, b["targets"][b["loss_mask"] > 0], 1)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
