"""Tokenizers behind one small interface, loaded from local files only (no hub downloads).

`load_tokenizer(spec)`:
  "bytes"                    ByteTokenizer: ids 0..255 are bytes, then <|pad|>, <|bos|>, <|eos|>.
  path/to/tokenizer.json     a Hugging Face `tokenizers` file (what `c2jax tokenizer train` writes).
  path/to/tiktoken.model     a tiktoken BPE file, Kimi's format: one "base64(token) rank" per line.
                             Special tokens come from a tokenizer_config.json next to it when present
                             (`added_tokens_decoder`, `bos_token`, `eos_token`, `pad_token`, Kimi's
                             layout: 256 reserved ids after the base vocabulary); otherwise <|pad|>,
                             <|bos|>, <|eos|> are appended.
  a directory                holding tokenizer.json, else tiktoken.model / *.tiktoken.
"""

from __future__ import annotations

import abc
import base64
import functools
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from c2jax.models.config import ConfigError

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")
_EOS_CANDIDATES = ("<|eos|>", "<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|end_of_text|>", "<|im_end|>")
_BOS_CANDIDATES = ("<|bos|>", "<s>", "<bos>", "[BOS]", "<|begin_of_text|>", "<|startoftext|>")
_PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")

# Kimi K2's pre-tokenizer regex: the o200k pattern (case-aware letter runs with English contractions,
# 1-3 digit groups, punctuation runs, newline-aware whitespace) with CJK ideographs split off as their
# own branch and subtracted from the letter classes.
_LETTERS_NO_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_NO_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_NO_HAN_UPPER}*{_LETTERS_NO_HAN_LOWER}+{_CONTRACTIONS}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_NO_HAN_UPPER}+{_LETTERS_NO_HAN_LOWER}*{_CONTRACTIONS}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


class Tokenizer(abc.ABC):
    """encode(str) -> ids without special tokens; ids of the specials are attributes."""

    vocab_size: int
    eos_id: int
    bos_id: int | None
    pad_id: int
    name: str

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """int32 arrays, the pipeline's fast path."""
        return [np.asarray(ids, np.int32) for ids in self.encode_batch(texts)]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes; a universal baseline whose vocabulary (259) fits any model."""

    def __init__(self):
        self.name = "bytes"
        self.pad_id, self.bos_id, self.eos_id = 256, 257, 258
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def _find(vocab: dict[str, int], preferred: str | None, candidates: Sequence[str]) -> int | None:
    for token in ([preferred] if preferred else []) + list(candidates):
        if token in vocab:
            return vocab[token]
    return None


def _config_token(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(directory: Path) -> dict:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from None


def _specials(path: Path, vocab: dict[str, int], config: dict) -> tuple[int, int | None, int]:
    eos = _find(vocab, _config_token(config, "eos_token"), _EOS_CANDIDATES)
    if eos is None:
        raise ConfigError(f"{path}: no end-of-text token; expected one of {list(_EOS_CANDIDATES)} or an "
                          "eos_token in tokenizer_config.json")
    bos = _find(vocab, _config_token(config, "bos_token"), _BOS_CANDIDATES)
    pad = _find(vocab, _config_token(config, "pad_token"), _PAD_CANDIDATES)
    return eos, bos, eos if pad is None else pad


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` file; batches encode in parallel in Rust."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as RustTokenizer

        self.name = str(path)
        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as e:  # the Rust error says what is malformed
            raise ConfigError(f"{path}: not a valid tokenizer.json: {e}") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.eos_id, self.bos_id, self.pad_id = _specials(path, vocab, _read_config(path.parent))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse "base64(token) rank" lines. Not `tiktoken.load.load_tiktoken_bpe`: it caches files by their
    path in a temp dir, so a file rewritten at the same path would be served stale."""
    ranks = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ConfigError(f"{path}:{n}: expected 'base64-token rank', got {line[:80]!r}") from None
    if not ranks:
        raise ConfigError(f"{path}: empty tiktoken BPE file")
    return ranks


class TiktokenTokenizer(Tokenizer):
    def __init__(self, path: Path, pattern: str = KIMI_PATTERN):
        import tiktoken

        self.name = str(path)
        ranks = read_tiktoken_ranks(path)
        base = max(ranks.values()) + 1
        config = _read_config(path.parent)
        added = config.get("added_tokens_decoder", {})
        if added:  # Kimi: named specials at given ids, the rest of 256 reserved ids after the base
            specials = {v["content"]: int(k) for k, v in added.items()}
            taken = set(specials.values())
            size = max(base + 256, max(taken) + 1)
            specials.update({f"<|reserved_token_{i}|>": i for i in range(base, size) if i not in taken})
        else:
            specials = {t: base + i for i, t in enumerate(SPECIAL_TOKENS)}
            size = base + len(SPECIAL_TOKENS)
        self._enc = tiktoken.Encoding(name=path.stem, pat_str=config.get("pat_str", pattern),
                                      mergeable_ranks=ranks, special_tokens=specials)
        self.vocab_size = size
        self.eos_id, self.bos_id, self.pad_id = _specials(path, specials, config)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")


def _resolve(path: Path) -> Path:
    if path.is_dir():
        for candidate in [path / "tokenizer.json", path / "tiktoken.model", *sorted(path.glob("*.tiktoken"))]:
            if candidate.is_file():
                return candidate
        raise ConfigError(f"tokenizer {path}: directory holds no tokenizer.json, tiktoken.model or *.tiktoken")
    if not path.is_file():
        raise ConfigError(f"tokenizer {path}: no such file (expected 'bytes' or a local tokenizer path)")
    return path


@functools.lru_cache(maxsize=16)
def _load(spec: str, mtime: float) -> Tokenizer:
    if spec == "bytes":
        return ByteTokenizer()
    path = _resolve(Path(spec).expanduser())
    if path.suffix == ".json":
        return HFTokenizer(path)
    return TiktokenTokenizer(path)


def load_tokenizer(spec: str) -> Tokenizer:
    """A cached tokenizer for `spec` ("bytes" or a local path); reloaded when the file changes."""
    if spec == "bytes":
        return _load(spec, 0.0)
    path = Path(spec).expanduser()
    mtime = _resolve(path).stat().st_mtime if path.exists() else 0.0
    return _load(spec, mtime)


__all__ = ["KIMI_PATTERN", "SPECIAL_TOKENS", "ByteTokenizer", "HFTokenizer", "TiktokenTokenizer", "Tokenizer",
           "load_tokenizer", "read_tiktoken_ranks"]
