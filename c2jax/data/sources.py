"""Random-access readers of documents: JSONL, Parquet and ArrayRecord files.

Every reader is a Grain `RandomAccessDataSource` (`__len__`, `__getitem__`) whose item is a *record*,
returned as a list of documents (a file of a source tree is one record, and an SFT corpus built from a
Python file yields one document per function). A document is a dict with one of

    {"text": str}                                  plain text or code (optionally "language")
    {"prompt": str, "completion": str}             an SFT pair
    {"messages": [{"role": str, "content": str}]}  an SFT conversation; assistant turns are trained

`open_source(cfg)` picks the reader for a `SourceConfig`.
"""

from __future__ import annotations

import functools
import glob
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from c2jax.data.config import SourceConfig
from c2jax.models.config import ConfigError

Document = dict[str, Any]
_SUFFIXES = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",), "arrayrecord": (".array_record", ".arrayrecord")}


def expand_paths(pattern: str, suffixes: tuple[str, ...]) -> list[Path]:
    """A file, a glob, or a directory (its files ending in one of `suffixes`, recursively); sorted."""
    pattern = os.path.expanduser(pattern)
    if os.path.isdir(pattern):
        paths = [p for p in Path(pattern).rglob("*") if p.is_file() and p.name.endswith(suffixes)]
    else:
        paths = [Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
    if not paths:
        raise ConfigError(f"{pattern}: no files found (expected a file, a glob or a directory of {suffixes})")
    return sorted(paths)


def record_to_document(record: Any, cfg: SourceConfig, where: str) -> Document:
    """Pick the configured fields out of one JSON object / Parquet row."""

    def get(key: str):
        if not isinstance(record, Mapping) or key not in record:
            keys = list(record) if isinstance(record, Mapping) else type(record).__name__
            raise ConfigError(f"source {cfg.name!r}, {where}: no field {key!r} (record has {keys})")
        return record[key]

    if cfg.messages_field:
        messages = get(cfg.messages_field)
        if not isinstance(messages, list) or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ConfigError(f"source {cfg.name!r}, {where}: {cfg.messages_field!r} must be a list of "
                              "{role: str, content: str}")
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
    if cfg.prompt_field:
        prompt, completion = get(cfg.prompt_field), get(cfg.completion_field)
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ConfigError(f"source {cfg.name!r}, {where}: prompt and completion must be strings")
        return {"prompt": prompt, "completion": completion}
    text = get(cfg.text_field)
    if not isinstance(text, str):
        raise ConfigError(f"source {cfg.name!r}, {where}: field {cfg.text_field!r} must be a string, "
                          f"got {type(text).__name__}")
    return {"text": text}


class _MultiFile:
    """Global record index -> (file, index in file) over files of known record counts."""

    def __init__(self, paths: list[Path], counts: list[int], max_records: int | None):
        self.paths = paths
        self._ends = np.cumsum(counts)
        total = int(self._ends[-1]) if counts else 0
        self._len = total if max_records is None else min(total, max_records)

    def __len__(self) -> int:
        return self._len

    def locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self._len:
            raise IndexError(index)
        f = int(np.searchsorted(self._ends, index, side="right"))
        return f, index - (int(self._ends[f - 1]) if f else 0)


class JsonlSource(_MultiFile):
    """One JSON object per line; line offsets are indexed once so that shuffled reads seek directly."""

    def __init__(self, cfg: SourceConfig):
        self.cfg = cfg
        paths = expand_paths(cfg.path, _SUFFIXES["jsonl"])
        self._offsets = [_line_offsets(p) for p in paths]
        super().__init__(paths, [len(o) for o in self._offsets], cfg.max_documents)

    def __getitem__(self, index: int) -> list[Document]:
        f, i = self.locate(index)
        with open(self.paths[f], "rb") as fh:
            fh.seek(int(self._offsets[f][i]))
            line = fh.readline()
        where = f"{self.paths[f]} record {i} (non-blank line {i + 1})"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"source {self.cfg.name!r}, {where}: invalid JSON: {e}") from None
        return [record_to_document(record, self.cfg, where)]


def _line_offsets(path: Path) -> np.ndarray:
    """Byte offsets of the non-blank lines."""
    data = path.read_bytes()
    starts = np.concatenate([[0], np.flatnonzero(np.frombuffer(data, np.uint8) == ord("\n")) + 1])
    keep = [s for s, e in zip(starts, list(starts[1:]) + [len(data)]) if data[s:e].strip()]
    return np.asarray(keep, dtype=np.int64)


class ParquetSource(_MultiFile):
    """Rows of Parquet files. Reads a whole row group per miss (cached), so a global shuffle over files
    much larger than memory is slow: convert those to ArrayRecord, which is built for random access."""

    def __init__(self, cfg: SourceConfig):
        import pyarrow.parquet as pq

        self.cfg = cfg
        paths = expand_paths(cfg.path, _SUFFIXES["parquet"])
        metas = [pq.ParquetFile(p).metadata for p in paths]
        self._group_ends = [np.cumsum([m.row_group(g).num_rows for g in range(m.num_row_groups)]) for m in metas]
        self._columns = [c for c in (cfg.messages_field, cfg.prompt_field, cfg.completion_field) if c] or [
            cfg.text_field]
        super().__init__(paths, [m.num_rows for m in metas], cfg.max_documents)

    @functools.lru_cache(maxsize=8)  # noqa: B019 - readers live as long as the pipeline
    def _row_group(self, f: int, g: int) -> dict[str, list]:
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(self.paths[f]).read_row_group(g, columns=self._columns)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"source {self.cfg.name!r}, {self.paths[f]}: {e}") from None
        return table.to_pydict()

    def __getitem__(self, index: int) -> list[Document]:
        f, i = self.locate(index)
        ends = self._group_ends[f]
        g = int(np.searchsorted(ends, i, side="right"))
        columns = self._row_group(f, g)
        row_in_group = i - (int(ends[g - 1]) if g else 0)
        row = {k: v[row_in_group] for k, v in columns.items()}
        return [record_to_document(row, self.cfg, f"{self.paths[f]} row {i}")]


class ArrayRecordSource:
    """Records of ArrayRecord files, via Grain's reader: UTF-8 JSON objects or raw UTF-8 text."""

    def __init__(self, cfg: SourceConfig):
        import grain

        self.cfg = cfg
        self.paths = expand_paths(cfg.path, _SUFFIXES["arrayrecord"])
        self._source = grain.sources.ArrayRecordDataSource([str(p) for p in self.paths])
        total = len(self._source)
        self._len = total if cfg.max_documents is None else min(total, cfg.max_documents)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> list[Document]:
        if not 0 <= index < self._len:
            raise IndexError(index)
        raw = self._source[index]
        where = f"{self.cfg.path} record {index}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"source {self.cfg.name!r}, {where}: record is not UTF-8") from None
        if self.cfg.record_format == "text":
            return [{"text": text}]
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"source {self.cfg.name!r}, {where}: invalid JSON ({e}); set "
                              "record_format: text for plain-text records") from None
        return [record_to_document(record, self.cfg, where)]


def open_source(cfg: SourceConfig):
    """The reader of `cfg`; listing a directory tree is cached, so repeated pipelines start fast."""
    from c2jax.data import demo_corpus, source_tree

    readers = {
        "jsonl": JsonlSource, "parquet": ParquetSource, "arrayrecord": ArrayRecordSource,
        "source_tree": source_tree.SourceTreeSource, "stdlib_code": demo_corpus.stdlib_code,
        "stdlib_docs": demo_corpus.stdlib_docs, "stdlib_sft": demo_corpus.stdlib_sft,
    }
    if cfg.kind in ("jsonl", "parquet", "arrayrecord"):  # re-index a file rewritten since it was read
        stamp = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size)
                      for p in expand_paths(cfg.path, _SUFFIXES[cfg.kind]))
    else:
        stamp = ()
    reader = _cached_reader(readers[cfg.kind], cfg, stamp)
    if len(reader) == 0:
        raise ConfigError(f"source {cfg.name!r} ({cfg.kind} {cfg.path or ''}): no documents found")
    return reader


@functools.lru_cache(maxsize=32)
def _cached_reader(factory, cfg: SourceConfig, stamp: tuple):
    return factory(cfg)


__all__ = ["ArrayRecordSource", "Document", "JsonlSource", "ParquetSource", "expand_paths", "open_source",
           "record_to_document"]
