"""Train a byte-level BPE (Hugging Face `tokenizers`) with a code-aware pre-tokenizer.

The pre-tokenizer decides where BPE merges may never cross. For code (the CPT mix is code-dominated):

  1. `(?:\\r?\\n)+[ \\t]*`   a line break (blank lines included) *with the next line's indentation*, so
                            indentation levels become single tokens and never fuse with the code after them
  2-4. identifiers          split at case changes and underscores: `getHTTPResponse` -> get|HTTP|Response,
                            `max_seq_len` -> max|_seq|_len; a leading space or `_` stays on the word
  5. `\\p{N}{1,3}`           digits in groups of at most three (as GPT-4 / Kimi), so numbers stay compositional
  6. ` ?[^\\s\\p{L}\\p{N}]{1,3}` operators and punctuation in runs of at most three: `->`, `**=`, `):`, `'''`
  7-8. other whitespace     a space run keeps its last space for the following word (GPT-2's rule)

Bytes are then mapped by the ByteLevel alphabet, so any input encodes (no unknown token). Specials
<|pad|>, <|bos|>, <|eos|> take ids 0, 1, 2.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from c2jax.data.tokenizer import SPECIAL_TOKENS

CODE_PATTERN = "|".join([
    r"(?:\r?\n)+[ \t]*",
    r"[ _]?\p{Lu}?\p{Ll}+",
    r"[ _]?\p{Lu}+(?!\p{Ll})",
    r"[ _]?\p{L}+",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]{1,3}",
    r"[ \t]+(?![^ \t\r\n])",
    r"\s+",
])


def code_tokenizer():
    """An untrained byte-level BPE with the code-aware pre-tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CODE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | Path, min_frequency: int = 2) -> Path:
    """Train on `texts`, write out_dir/tokenizer.json (+ tokenizer_config.json naming the specials)."""
    from tokenizers import pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {len(alphabet) + len(SPECIAL_TOKENS)} (256 bytes + specials), "
                         f"got {vocab_size}")
    tok = code_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    tok.save(str(path))
    pad, bos, eos = SPECIAL_TOKENS
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": pad},
        indent=2) + "\n")
    return path


def corpus_texts(paths: Iterable[str | Path], max_bytes: int) -> Iterator[str]:
    """UTF-8 texts of files and of directories' code/text files (gitignore respected), up to max_bytes."""
    from c2jax.data.source_tree import list_files

    total = 0
    for path in map(Path, paths):
        if path.is_dir():
            files = [path / rel for rel, _ in list_files(path, (), (), True, 10_000_000)]
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"corpus {path}: no such file or directory")
        for f in files:
            try:
                text = f.read_bytes().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            yield text
            total += len(text)
            if total >= max_bytes:
                return


__all__ = ["CODE_PATTERN", "code_tokenizer", "corpus_texts", "train_bpe"]
