"""`c2jax tokenizer train|encode`: train a code-aware byte-level BPE on a local corpus; inspect encodings."""

from __future__ import annotations

import json
import sys
import time


def add_parser(subparsers):
    p = subparsers.add_parser("tokenizer", help="train a byte-level BPE on local code, or encode text")
    actions = p.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    train = actions.add_parser("train", help="train a code-aware byte-level BPE (writes DIR/tokenizer.json)")
    train.add_argument("--corpus", nargs="+", required=True, metavar="DIR_OR_FILE",
                       help="files and directories (their code/text files; .gitignore respected); "
                            "'stdlib' means this machine's standard library and site-packages")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--out", required=True, metavar="DIR")
    train.add_argument("--max-bytes", type=int, default=200_000_000, help="stop reading the corpus after this")
    train.add_argument("--min-frequency", type=int, default=2)
    encode = actions.add_parser("encode", help="print the ids and pieces of TEXT")
    encode.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer path")
    encode.add_argument("text")
    return p


def _train(args) -> int:
    from c2jax.data.bpe import corpus_texts, train_bpe
    from c2jax.data.demo_corpus import default_roots
    from c2jax.data.tokenizer import load_tokenizer

    paths = []
    for c in args.corpus:
        paths += list(default_roots()) if c == "stdlib" else [c]
    seen = {"bytes": 0, "files": 0}
    sample: list[str] = []

    def texts():
        for text in corpus_texts(paths, args.max_bytes):
            seen["bytes"] += len(text.encode("utf-8"))
            seen["files"] += 1
            if len(sample) < 64:
                sample.append(text)
            yield text

    try:
        start = time.perf_counter()
        path = train_bpe(texts(), args.vocab_size, args.out, args.min_frequency)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = load_tokenizer(str(path))
    ratio = sum(len(t.encode()) for t in sample) / max(1, sum(len(tok.encode(t)) for t in sample))
    print(json.dumps({"tokenizer": str(path), "vocab_size": tok.vocab_size, "files": seen["files"],
                      "bytes": seen["bytes"], "bytes_per_token_on_first_files": round(ratio, 3),
                      "seconds": round(time.perf_counter() - start, 1)}))
    return 0


def _encode(args) -> int:
    from c2jax.data.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    ids = tok.encode(args.text)
    print(json.dumps({"ids": ids, "pieces": [tok.decode([i]) for i in ids]}, ensure_ascii=False))
    return 0


def run(args) -> int:
    return _train(args) if args.tokenizer_command == "train" else _encode(args)
