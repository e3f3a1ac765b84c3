"""Typed configs of the data pipeline: where documents come from, how they are mixed, tokenized, packed.

Read by `c2jax.config.load(DataConfig, ...)` (type-checked, dotted error names), so a YAML `data:` section such as

    data:
      tokenizer: runs/tok/tokenizer.json
      seq_len: 2048
      batch_size: 16
      sources:
        - {name: code, kind: source_tree, path: ~/src, weight: 0.7, languages: [python, rust]}
        - {name: docs, kind: jsonl, path: data/docs/*.jsonl, weight: 0.2}
        - {name: sft, kind: jsonl, path: data/sft.jsonl, weight: 0.1,
           prompt_field: prompt, completion_field: completion}

maps one to one onto `DataConfig`. See docs/data.md for the semantics of every field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from c2jax.models.config import ConfigError

SourceKind = Literal["jsonl", "parquet", "arrayrecord", "source_tree", "stdlib_code", "stdlib_docs", "stdlib_sft"]

# The demo corpus (`make demo`): built on the fly from the Python on this machine, no download.
_DEMO_KINDS = ("stdlib_code", "stdlib_docs", "stdlib_sft")


@dataclass(frozen=True)
class SourceConfig:
    """One source of documents.

    kind: jsonl | parquet | arrayrecord (files; `path` is a file, a directory or a glob) | source_tree
      (a directory of code) | stdlib_code / stdlib_docs / stdlib_sft (the demo corpus: source, docstrings
      and docs, and docstring -> body pairs from the standard library and site-packages; `path`, when
      given, replaces those roots with one directory).
    weight: share of this source in the mixture's *tokens* (weights are normalised over sources).
    Record fields (jsonl, parquet, arrayrecord with record_format json): a plain document is
      `text_field`; an SFT example is `prompt_field` + `completion_field`, or `messages_field` (a list of
      {role, content}); setting either SFT form makes the source SFT-style.
    record_format (arrayrecord): "json" (each record a UTF-8 JSON object) or "text" (the record is the text).
    languages / excludes / respect_gitignore / max_file_bytes (source trees): keep only files of these
      languages (empty: every known language), drop paths matching these gitignore-style patterns, honour
      `.gitignore` files found in the tree, skip files larger than this (generated or minified code).
    heldout_fraction: documents whose sha256 falls below this fraction of the hash space form the eval
      split, all others the train split; a document's split depends only on its content.
    max_documents: read at most this many records (files for source trees), e.g. to bound a demo.
    """

    name: str
    kind: SourceKind
    path: str = ""
    weight: float = 1.0
    text_field: str = "text"
    prompt_field: str = ""
    completion_field: str = ""
    messages_field: str = ""
    record_format: Literal["json", "text"] = "json"
    languages: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    respect_gitignore: bool = True
    max_file_bytes: int = 1_000_000
    heldout_fraction: float = 0.01
    max_documents: int | None = None

    def __post_init__(self):
        if not self.name:
            raise ConfigError("name: a source needs a non-empty name")
        if not self.weight > 0:
            raise ConfigError(f"weight: must be positive, got {self.weight!r}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ConfigError(f"heldout_fraction: must be in [0, 1), got {self.heldout_fraction!r}")
        if bool(self.prompt_field) != bool(self.completion_field):
            raise ConfigError("prompt_field and completion_field: set both (SFT pairs) or neither")
        if self.messages_field and self.prompt_field:
            raise ConfigError("messages_field: set either messages_field or prompt/completion fields, not both")
        if self.kind in ("jsonl", "parquet", "arrayrecord", "source_tree") and not self.path:
            raise ConfigError(f"path: a {self.kind} source needs a path")
        if self.max_file_bytes <= 0:
            raise ConfigError(f"max_file_bytes: must be positive, got {self.max_file_bytes!r}")
        if self.max_documents is not None and self.max_documents <= 0:
            raise ConfigError(f"max_documents: must be positive, got {self.max_documents!r}")

    @property
    def is_sft(self) -> bool:
        return bool(self.prompt_field or self.messages_field) or self.kind == "stdlib_sft"


def demo_sources() -> tuple[SourceConfig, ...]:
    """Code-dominated mix from this machine's Python: 70% code, 20% docs, 10% SFT pairs (by tokens)."""
    weights = {"stdlib_code": 0.7, "stdlib_docs": 0.2, "stdlib_sft": 0.1}
    return tuple(SourceConfig(name=k.removeprefix("stdlib_"), kind=k, weight=weights[k]) for k in _DEMO_KINDS)


@dataclass(frozen=True)
class DataConfig:
    """The training data of one phase.

    tokenizer: "bytes" (256 bytes + pad/bos/eos), or a local path to a Hugging Face tokenizer.json, a
      tiktoken BPE file (*.model / *.tiktoken, Kimi's format), or a directory holding one of them.
    seq_len, batch_size: shape of a batch, [batch_size, seq_len]; `build_batches` can override both per
      phase.
    loss_mask: "all" trains on every token; "completion" excludes SFT prompt tokens (plain documents count
      as completion throughout).
    packing_bins: rows packed at once by first-fit (more bins, less padding; 0 means 4 x batch_size).
    """

    sources: tuple[SourceConfig, ...] = field(default_factory=demo_sources)
    tokenizer: str = "bytes"
    seq_len: int = 512
    batch_size: int = 8
    seed: int = 0
    loss_mask: Literal["all", "completion"] = "all"
    add_bos: bool = True
    packing_bins: int = 0

    def __post_init__(self):
        if not self.sources:
            raise ConfigError("sources: at least one source is required")
        names = [s.name for s in self.sources]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"sources: duplicate source names {duplicates}")
        for name in ("seq_len", "batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)!r}")
        if self.packing_bins < 0:
            raise ConfigError(f"packing_bins: must be >= 0, got {self.packing_bins!r}")

    def source(self, name: str) -> SourceConfig:
        for s in self.sources:
            if s.name == name:
                return s
        raise ConfigError(f"sources: no source named {name!r}; have {[s.name for s in self.sources]}")


__all__ = ["DataConfig", "SourceConfig", "SourceKind", "demo_sources"]
