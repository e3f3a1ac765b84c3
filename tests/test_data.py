"""The data pipeline (c2jax/data): packing, masking, mixture, held-out split, resume, readers, tokenizers."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math

import numpy as np
import pytest

from c2jax.config import ConfigError, from_dict
from c2jax.data.config import DataConfig, SourceConfig
from c2jax.data.pipeline import build_batches, eval_sources, take
from c2jax.data.source_tree import SourceTreeSource, language_of
from c2jax.data.tokenizer import KIMI_PATTERN, ByteTokenizer, load_tokenizer

BYTES = ByteTokenizer()
PAD, BOS, EOS = BYTES.pad_id, BYTES.bos_id, BYTES.eos_id


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def texts(n, seed=0, lo=3, hi=40, alphabet="abcdefghij \n"):
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(alphabet), rng.integers(lo, hi))) + f"#{i}" for i in range(n)]


def data_config(sources, **kw):
    base = {"seq_len": 16, "batch_size": 4, "seed": 0, "tokenizer": "bytes"}
    return DataConfig(sources=tuple(sources), **{**base, **kw})


def jsonl_source(path, name="a", **kw):
    return SourceConfig(name=name, kind="jsonl", path=path, heldout_fraction=kw.pop("heldout_fraction", 0.0), **kw)


def segments(batch):
    """(row, segment id, input token ids, the target after the last input) of every document chunk."""
    out = []
    for r in range(batch["input_ids"].shape[0]):
        seg = batch["segment_ids"][r]
        for s in range(1, seg.max() + 1):
            idx = np.flatnonzero(seg == s)
            out.append((r, s, idx, batch["input_ids"][r, idx], batch["targets"][r, idx[-1]]))
    return out


# Packing ------------------------------------------------------------------------------------------

def test_packed_rows_have_documents_numbered_positions_restarting_and_boundary_masks(tmp_path):
    docs = texts(60, lo=1, hi=50)
    cfg = data_config([jsonl_source(write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in docs]))])
    seen = []
    for batch in take(build_batches(cfg, "train", num_epochs=1), 100):
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
            "input_ids": ((4, 16), np.int32), "targets": ((4, 16), np.int32), "segment_ids": ((4, 16), np.int32),
            "positions": ((4, 16), np.int32), "loss_mask": ((4, 16), np.float32)}
        seg = batch["segment_ids"]
        for r in range(4):
            real = seg[r][seg[r] > 0]
            assert np.all(real == np.sort(real)) and set(real) == set(range(1, real.max(initial=0) + 1))
            assert np.all(seg[r][len(real):] == 0)  # padding only at the end
        np.testing.assert_array_equal(batch["input_ids"][seg == 0], PAD)
        np.testing.assert_array_equal(batch["loss_mask"][seg == 0], 0)
        for r, _s, idx, ids, last_target in segments(batch):
            np.testing.assert_array_equal(batch["positions"][r, idx], np.arange(len(idx)))
            np.testing.assert_array_equal(batch["targets"][r, idx[:-1]], ids[1:])
            mask = batch["loss_mask"][r, idx]
            assert np.all(mask[:-1] == 1)
            # the last target belongs to this document only when the document runs to the end of the row
            assert mask[-1] == (idx[-1] == 15 and mask[-1] == 1)
            seen.append(tuple(int(t) for t in ids) + ((int(last_target),) if mask[-1] else ()))
    # reference: [bos] + bytes + [eos], cut into rows of 17 tokens that overlap by one
    expected = []
    for t in docs:
        ids = (BOS, *t.encode(), EOS)
        expected += [ids[s:s + 17] for s in range(0, len(ids) - 1, 16)]
    assert sorted(seen) == sorted(expected)


def test_long_document_chunks_overlap_by_one_so_every_token_is_a_target_once(tmp_path):
    doc = "x" * 5 + "y" * 30 + "z" * 9  # 44 bytes + bos + eos = 46 tokens, rows of 17
    cfg = data_config([jsonl_source(write_jsonl(tmp_path / "a.jsonl", [{"text": doc}]))], batch_size=1,
                      packing_bins=1)  # one bin: rows come out in document order
    targets = []
    for batch in take(build_batches(cfg, "train", num_epochs=1), 10):
        targets += list(batch["targets"][0][batch["loss_mask"][0] > 0])
    assert targets == [*doc.encode(), EOS]  # bos is the only token never predicted


def test_packed_logits_equal_each_document_alone(tmp_path):
    """The model's attention honours segment_ids and positions: packing changes nothing per document."""
    import jax
    import jax.numpy as jnp

    from c2jax.models.config import preset
    from c2jax.models.transformer import init

    docs = ["abc def", "hello world!", "xy", "0123456789 packing test"]
    cfg = data_config([jsonl_source(write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in docs]))],
                      seq_len=48, batch_size=1, packing_bins=1)
    batch = next(build_batches(cfg, "train", num_epochs=1))
    chunks = segments(batch)
    assert len(chunks) >= 3, batch["segment_ids"]
    # reference rows: each document alone from position 0, then padding (causal: it cannot affect the
    # document); one segment per row, i.e. no cross-document masking involved
    alone = np.full((len(chunks), 48), PAD, np.int32)
    for i, (_, _, _, chunk_ids, _) in enumerate(chunks):
        alone[i, :len(chunk_ids)] = chunk_ids
    ids = np.concatenate([batch["input_ids"], alone])
    pos = np.concatenate([batch["positions"], np.broadcast_to(np.arange(48, dtype=np.int32), alone.shape)])
    seg = np.concatenate([batch["segment_ids"], np.ones_like(alone)])
    model = init(dataclasses.replace(preset("tiny"), vocab_size=BYTES.vocab_size, dtype="float32"), seed=0)
    logits = np.asarray(jax.jit(lambda i, p, s: model(i, positions=p, segment_ids=s, return_mtp=False).logits)(
        jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg)))
    for i, (_, _, idx, _, _) in enumerate(chunks):
        np.testing.assert_allclose(logits[0, idx], logits[1 + i, :len(idx)], atol=2e-5, rtol=2e-5)


# SFT masking ------------------------------------------------------------------------------------------

def test_completion_mask_trains_only_completion_tokens_and_eos(tmp_path):
    pairs = [{"q": f"Question {i}: what is {i}+{i}?", "a": f" It is {2 * i}."} for i in range(12)]
    src = jsonl_source(write_jsonl(tmp_path / "sft.jsonl", pairs), prompt_field="q", completion_field="a")
    for mode in ("completion", "all"):
        cfg = data_config([src], seq_len=64, loss_mask=mode)
        trained = []
        for batch in take(build_batches(cfg, "train", num_epochs=1), 20):
            for r, _s, idx, _ids, _last in segments(batch):
                mask = batch["loss_mask"][r, idx]
                trained.append(bytes(t for t in batch["targets"][r, idx][mask > 0] if t < 256).decode())
                if mode == "completion":
                    assert batch["targets"][r, idx][mask > 0][-1] == EOS
        answers = sorted(p["a"] for p in pairs) if mode == "completion" else sorted(p["q"] + p["a"] for p in pairs)
        assert sorted(trained) == answers


def test_messages_mask_trains_assistant_turns_only(tmp_path):
    convo = {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
                          {"role": "assistant", "content": "6"}]}
    src = jsonl_source(write_jsonl(tmp_path / "chat.jsonl", [convo]), messages_field="messages")
    batch = next(build_batches(data_config([src], seq_len=256, loss_mask="completion"), "train", num_epochs=1))
    trained = bytes(t for t in batch["targets"][0][batch["loss_mask"][0] > 0] if t < 256).decode()
    assert trained == "4<|im_end|>\n6<|im_end|>\n"


# Mixture, held-out split, determinism, resume ---------------------------------------------------------

def test_mixture_token_shares_match_weights(tmp_path):
    """Deterministic token-weighted rule: after T tokens each source's share is within one packing window
    (packing_bins rows of seq_len + 1, plus one chunk) of its weight. Sources differ in document length."""
    a = jsonl_source(write_jsonl(tmp_path / "a.jsonl", [{"text": "a" * n} for n in range(5, 60)]), name="a",
                     weight=3.0)
    b = jsonl_source(write_jsonl(tmp_path / "b.jsonl", [{"text": "b" * 7}] * 20), name="b", weight=1.0)
    cfg = data_config([a, b], seq_len=32, batch_size=4, packing_bins=8)
    counts = {"a": 0, "b": 0}
    for batch in take(build_batches(cfg, "train"), 60):
        ids = batch["input_ids"]
        counts["a"] += int((ids == ord("a")).sum())
        counts["b"] += int((ids == ord("b")).sum())
    total = sum(counts.values())
    # bos/eos are not counted above; each document adds 2 of them, so compare within the stated bound
    tolerance = (8 + 1) * 33 / total + 2 * 2 / 9
    assert abs(counts["a"] / total - 0.75) <= tolerance, counts
    assert total > 5000


def test_heldout_split_is_disjoint_by_content_hash_and_covers_everything(tmp_path):
    docs = texts(300, seed=1)
    records = [{"text": t} for t in docs] + [{"text": docs[0]}, {"text": docs[1]}]  # duplicates
    src = jsonl_source(write_jsonl(tmp_path / "a.jsonl", records), heldout_fraction=0.2)
    cfg = data_config([src], seq_len=64, batch_size=8)

    def read(split):
        out = []
        for batch in take(build_batches(cfg, split, num_epochs=1), 1000):
            for _r, _s, _idx, ids, last in segments(batch):
                out.append(bytes(t for t in ids if t < 256).decode() + chr(last) * int(last < 256))
        return out

    train, held = read("train"), read("eval")
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(docs + docs[:2])
    # independent rule: sha256 of the canonical JSON content, first 8 bytes < 0.2 * 2^64
    digest = lambda t: hashlib.sha256(json.dumps({"text": t}, sort_keys=True).encode()).digest()[:8]
    assert sorted(held) == sorted(t for t in docs + docs[:2] if int.from_bytes(digest(t), "big") < 0.2 * 2**64)
    assert abs(len(held) / len(docs) - 0.2) < 4 * math.sqrt(0.2 * 0.8 / len(docs))
    assert set(eval_sources(cfg)) == {"a"}


def test_order_is_deterministic_and_iterator_state_resumes_exactly(tmp_path):
    a = jsonl_source(write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts(80, 2)]), name="a", weight=2)
    b = jsonl_source(write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in texts(30, 3)]), name="b")
    cfg = data_config([a, b], packing_bins=6)
    first, again = take(build_batches(cfg), 12), take(build_batches(cfg), 12)
    for x, y in zip(first, again):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    other_seed = take(build_batches(dataclasses.replace(cfg, seed=1)), 12)
    assert any(not np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(first, other_seed))

    it = build_batches(cfg)
    take(it, 5)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    expected = take(it, 30)  # crosses epochs of both sources
    resumed = build_batches(cfg)
    resumed.set_state(state)
    for x, y in zip(expected, take(resumed, 30)):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


# Readers -------------------------------------------------------------------------------------------------

def _texts_of(cfg, split="train"):
    out = set()
    for batch in take(build_batches(cfg, split, num_epochs=1), 100):
        for _r, _s, _idx, ids, last in segments(batch):
            out.add(bytes(t for t in ids if t < 256).decode() + chr(last) * int(last < 256))
    return out


def test_parquet_and_arrayrecord_readers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter

    docs = texts(25, seed=4)
    pq.write_table(pa.table({"body": docs, "other": list(range(25))}), tmp_path / "d.parquet", row_group_size=7)
    src = SourceConfig(name="p", kind="parquet", path=str(tmp_path / "*.parquet"), text_field="body",
                       heldout_fraction=0.0)
    assert _texts_of(data_config([src], seq_len=64)) == set(docs)
    for fmt in ("json", "text"):
        writer = ArrayRecordWriter(str(tmp_path / f"{fmt}.array_record"), "group_size:1")
        for t in docs:
            writer.write((json.dumps({"text": t}) if fmt == "json" else t).encode())
        writer.close()
        src = SourceConfig(name="r", kind="arrayrecord", path=str(tmp_path / f"{fmt}.array_record"),
                           record_format=fmt, heldout_fraction=0.0)
        assert _texts_of(data_config([src], seq_len=64)) == set(docs)


def test_reader_errors_name_the_problem(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"body": "x"}])
    with pytest.raises(ConfigError, match=r"no field 'text'.*body"):
        next(build_batches(data_config([jsonl_source(path)])))
    with pytest.raises(ConfigError, match="no files found"):
        build_batches(data_config([jsonl_source(str(tmp_path / "missing*.jsonl"))]))
    with pytest.raises(ConfigError, match=r"sources\[0\]: weight: must be positive"):
        from_dict(DataConfig, {"sources": [{"name": "a", "kind": "jsonl", "path": path, "weight": 0}]})
    with pytest.raises(ConfigError, match=r"sources\[0\]\.kind"):
        from_dict(DataConfig, {"sources": [{"name": "a", "kind": "csv", "path": path}]})


def test_source_tree_respects_gitignore_excludes_and_tags_languages(tmp_path):
    root = tmp_path / "repo"
    files = {"main.py": "print(1)\n", "lib/util.rs": "fn main() {}\n", "lib/gen.py": "x = 1\n",
             "lib/.gitignore": "gen.py\n", ".gitignore": "build/\n*.log\n!keep.log\n", "build/out.py": "y\n",
             "notes.md": "# notes\n", "Makefile": "all:\n", "vendor/dep.py": "z\n", "img.png": "\x89PNG",
             "bad.py": None, ".git/config.py": "secret\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            (root / rel).write_bytes(b"\xff\xfe not utf-8")
        else:
            (root / rel).write_text(text)
    src = SourceConfig(name="t", kind="source_tree", path=str(root), excludes=("vendor/",), heldout_fraction=0.0)
    reader = SourceTreeSource(src)
    docs = {d["path"]: d["language"] for i in range(len(reader)) for d in reader[i]}
    assert docs == {"main.py": "python", "lib/util.rs": "rust", "notes.md": "markdown", "Makefile": "makefile"}
    only = SourceTreeSource(dataclasses.replace(src, languages=("python",), respect_gitignore=False))
    assert sorted(f[1] for f in only.files) == ["bad.py", "build/out.py", "lib/gen.py", "main.py"]
    assert language_of("x/CMakeLists.txt") == "cmake" and language_of("a.tsx") == "typescript"
    assert _texts_of(data_config([src], seq_len=64)) == {"print(1)\n", "fn main() {}\n", "# notes\n", "all:\n"}


def test_demo_corpus_kinds_on_a_small_tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        '"""Module doc."""\n\n\ndef add(a, b):\n    """Add two numbers."""\n    c = a + b\n    return c\n\n\n'
        'class Box:\n    """A box."""\n\n    def size(self):\n        """Its size."""\n        n = 3\n'
        '        return n\n')
    (tmp_path / "README.md").write_text("Read me.\n")
    kinds = {k: SourceConfig(name=k, kind=k, path=str(tmp_path), heldout_fraction=0.0)
             for k in ("stdlib_code", "stdlib_docs", "stdlib_sft")}
    from c2jax.data.sources import open_source

    code, docs, sft = (open_source(kinds[k]) for k in kinds)
    assert [d["path"] for d in code[0]] == ["pkg/mod.py"]
    assert sorted(d["text"] for i in range(len(docs)) for d in docs[i]) == [
        "Read me.\n", "pkg.mod\n\nModule doc.\n\nadd:\nAdd two numbers.\n\nBox:\nA box.\n\nBox.size:\nIts size.\n"]
    assert sft[0] == [
        {"prompt": 'def add(a, b):\n    """Add two numbers."""\n', "completion": "    c = a + b\n    return c\n"},
        {"prompt": 'def size(self):\n    """Its size."""\n', "completion": "    n = 3\n    return n\n"}]


# Tokenizers --------------------------------------------------------------------------------------------

def test_byte_tokenizer():
    tok = load_tokenizer("bytes")
    assert tok.encode("hé") == [104, 195, 169] and tok.decode(tok.encode("hé\n")) == "hé\n"
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 256, 257, 258)


def test_tiktoken_file_kimi_layout(tmp_path):
    ranks = {bytes([i]): i for i in range(256)} | {b"de": 256, b"def": 257, b" x": 258}
    path = tmp_path / "tiktoken.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    tok = load_tokenizer(str(path))  # no config: <|pad|>, <|bos|>, <|eos|> appended
    assert tok.encode("def x") == [257, 258] and tok.decode([257, 258]) == "def x"
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (262, 259, 260, 261)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {"259": {"content": "[BOS]"}, "260": {"content": "[EOS]"}},
        "bos_token": "[BOS]", "eos_token": "[EOS]"}))
    kimi = load_tokenizer(str(tmp_path))  # the directory; Kimi reserves 256 ids after the base vocabulary
    assert (kimi.vocab_size, kimi.bos_id, kimi.eos_id, kimi.pad_id) == (259 + 256, 259, 260, 260)
    import tiktoken

    # Kimi's pattern splits Han runs from letters: a merge across "文|E" exists but must not fire
    wen = "文".encode()
    merges = {wen[:2]: 259, wen: 260, wen + b"E": 261, b"En": 262}
    enc = tiktoken.Encoding("k", pat_str=KIMI_PATTERN, mergeable_ranks=ranks | merges, special_tokens={})
    pieces = [enc.decode_single_token_bytes(t) for t in enc.encode_ordinary("中文English混合")]
    assert b"".join(pieces).decode() == "中文English混合"
    assert wen in pieces and b"En" in pieces and wen + b"E" not in pieces
    loose = tiktoken.Encoding("k", pat_str=r".+", mergeable_ranks=ranks | merges, special_tokens={})
    assert wen + b"E" in [loose.decode_single_token_bytes(t) for t in loose.encode_ordinary("文English")]
    with pytest.raises(ConfigError, match="expected 'base64-token rank'"):
        bad = tmp_path / "bad.tiktoken"
        bad.write_text("not base64!! x\n")
        load_tokenizer(str(bad))


def test_tokenizer_train_cli_then_hf_loader_and_pipeline(tmp_path):
    from c2jax.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    code = "class HTTPServer:\n    def getHTTPResponse(self, max_seq_len=2048):\n        return x -> y\n"
    for i in range(30):
        (corpus / f"m{i}.py").write_text(code.replace("x", f"x{i}") * 5)
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--corpus", str(corpus), "--vocab-size", "400", "--out", str(out)]) == 0
    tok = load_tokenizer(str(out / "tokenizer.json"))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2) and 259 < tok.vocab_size <= 400
    sample = "def f(ünï):\n\tif a->b: return 123456 # 中文\n"
    assert tok.decode(tok.encode(sample)) == sample
    assert len(tok.encode(code)) < len(code) / 2  # merges learned from the corpus
    pieces = [tok.decode([i]) for i in tok.encode("\n        return")]
    assert pieces[0] == "\n        "  # newline + indentation is one pre-token
    src = SourceConfig(name="t", kind="source_tree", path=str(corpus), heldout_fraction=0.0)
    ids = np.stack([b["input_ids"] for b in take(build_batches(data_config([src], tokenizer=str(out), seq_len=32)), 8)])
    assert ids.max() < tok.vocab_size and (ids == tok.bos_id).sum() >= 4


def test_process_shards_partition_each_source(tmp_path):
    docs = [f"doc{i:03d}" for i in range(40)]
    cfg = data_config([jsonl_source(write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in docs]))])

    def read(index):
        out = []
        for batch in take(build_batches(cfg, num_epochs=1, process_index=index, process_count=2), 100):
            out += [bytes(t for t in ids if t < 256).decode() for _, _, _, ids, _ in segments(batch)]
        return out

    first, second = read(0), read(1)
    assert len(first) == len(second) == 20 and sorted(first + second) == docs


def test_a_source_with_no_training_documents_fails_clearly(tmp_path):
    from c2jax.data.packing import split_of

    held = next(t for t in texts(50, seed=5) if split_of({"text": t}, 0.5) == "eval")
    src = jsonl_source(write_jsonl(tmp_path / "a.jsonl", [{"text": held}]), heldout_fraction=0.5)
    with pytest.raises(ConfigError, match="gave no train documents"):
        next(build_batches(data_config([src])))
    assert next(build_batches(data_config([src]), "eval"))["loss_mask"].sum() == len(held) + 1
