"""A token-weighted mixture of Grain iterators.

Not `grain.IterDataset.mix`: Grain's mix interleaves *elements* in fixed proportions and stops when any
input ends. Here the weights are shares of *tokens* (a 2,049-token code chunk and a 60-token SFT pair
count by their length), and an exhausted input (a finite eval split, or `num_epochs` set) drops out while
the others continue, so a pass over finite data reads every document once.

Rule (deterministic, no sampling noise): the next element comes from the live input whose tokens so far,
divided by its weight, is smallest (ties: the first). After T tokens, input i has received
w_i / sum(w) * T tokens up to one element's length.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grain


class _TokenMixIterator(grain.DatasetIterator):
    def __init__(self, parents: dict[str, grain.DatasetIterator], weights: dict[str, float], length_key: str):
        super().__init__(list(parents.values()))
        self._named = parents
        self._weights = weights
        self._length_key = length_key
        self._tokens = dict.fromkeys(parents, 0)
        self._exhausted: set[str] = set()

    def __next__(self):
        while True:
            live = [n for n in self._named if n not in self._exhausted]
            if not live:
                raise StopIteration
            name = min(live, key=lambda n: self._tokens[n] / self._weights[n])
            try:
                element = next(self._named[name])
            except StopIteration:
                self._exhausted.add(name)
                continue
            self._tokens[name] += len(element[self._length_key])
            return element

    def get_state(self) -> dict[str, Any]:
        return {
            "parents": {n: p.get_state() for n, p in self._named.items()},
            "tokens": dict(self._tokens),
            "exhausted": sorted(self._exhausted),
        }

    def set_state(self, state: Mapping[str, Any]):
        if set(state["parents"]) != set(self._named):
            raise ValueError(f"iterator state is for sources {sorted(state['parents'])}, "
                             f"this pipeline has {sorted(self._named)}")
        for name, parent in self._named.items():
            parent.set_state(state["parents"][name])
        self._tokens = {n: int(state["tokens"][n]) for n in self._named}
        self._exhausted = set(state["exhausted"])

    def __str__(self) -> str:
        return f"TokenMixIterator(weights={self._weights})"


class TokenMixIterDataset(grain.IterDataset):
    """Mix named IterDatasets so that each gets `weights[name]` / sum of the *tokens* (len of `length_key`)."""

    def __init__(self, parents: Mapping[str, grain.IterDataset], weights: Mapping[str, float],
                 length_key: str = "tokens"):
        if set(parents) != set(weights):
            raise ValueError(f"parents {sorted(parents)} and weights {sorted(weights)} name different sources")
        if any(not w > 0 for w in weights.values()):
            raise ValueError(f"weights must be positive, got {dict(weights)}")
        super().__init__(list(parents.values()))
        self._named = dict(parents)
        self._weights = dict(weights)
        self._length_key = length_key

    def __iter__(self) -> _TokenMixIterator:
        return _TokenMixIterator({n: iter(p) for n, p in self._named.items()}, self._weights, self._length_key)

    def __str__(self) -> str:
        return f"TokenMixIterDataset(weights={self._weights})"


__all__ = ["TokenMixIterDataset"]
