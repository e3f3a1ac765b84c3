"""The demo's tokenizers: one byte-level BPE trained on this machine's text, in two views.

    chat_tokenizer.json   the harness's view (c2jax.rl.harness.ChatRenderer, the RL system's `env.tokenizer`, the
                          eval agents): every chat token special (<|im_start|>, <|im_end|>, <tool_call>, ...)
    tokenizer.json        the data pipeline's view (pretraining, SFT): the same ids, but only the tokens the
                          renderer inserts by id are special: the turn markers and the <tool_response> markers
                          around tool results. The renderer encodes all other text (the system prompt's
                          "<tool_call>" examples included) as plain characters, and the model writes its tool
                          calls as text, so SFT data tokenized by this view gives exactly the ids the policy sees

The BPE uses c2jax.data.bpe's code pre-tokenizer (words, identifiers, digit groups and punctuation runs never
merge with each other), so a word of the ladder's answer vocabulary is one token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

HARNESS_FILE, DATA_FILE = "chat_tokenizer.json", "tokenizer.json"


def data_special_tokens() -> tuple[str, ...]:
    from c2jax.rl.harness.chat_format import IM_END, IM_START, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN

    return IM_START, IM_END, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE


def data_tokenizer(harness_tokenizer):
    """The harness tokenizer's ids with only `data_special_tokens()` special (see the module docstring)."""
    from tokenizers import Tokenizer

    keep = data_special_tokens()
    spec = json.loads(harness_tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in keep]
    return Tokenizer.from_str(json.dumps(spec))


def train_chat_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> dict[str, Path]:
    """Trains the BPE on `texts` (the data view's specials are never merged into), adds the other chat special
    tokens and writes both views under `out_dir`. The vocabulary is at most `vocab_size` (fewer when the
    text runs out of pairs to merge)."""
    from tokenizers import pre_tokenizers, trainers

    from c2jax.data.bpe import code_tokenizer
    from c2jax.rl.harness import add_chat_special_tokens
    from c2jax.rl.harness.chat_format import CHAT_SPECIAL_TOKENS

    keep = data_special_tokens()
    tok = code_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - (len(CHAT_SPECIAL_TOKENS) - len(keep)), min_frequency=2,
                                  special_tokens=list(keep), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    add_chat_special_tokens(tok)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"harness": out / HARNESS_FILE, "data": out / DATA_FILE}
    tok.save(str(paths["harness"]))
    data_tokenizer(tok).save(str(paths["data"]))
    return paths


def conversation_ids(renderer, data_tok, messages: list[dict]) -> list[int]:
    """The ids the policy sees before the next assistant turn of an episode with these messages: environment
    messages rendered by the harness, assistant turns as the model writes them (the data view's encoding of
    the text) closed by <|im_end|>\\n, then the assistant header."""
    from c2jax.rl.harness.chat_format import message_body

    ids: list[int] = []
    for m in messages:
        if m["role"] == "assistant":
            ids += [*renderer.header("assistant"), *data_tok.encode(message_body(m), add_special_tokens=False).ids,
                    renderer.im_end_id, *renderer.encode_env("\n")]
        else:
            ids += renderer.render_message(m)
    return ids + renderer.header("assistant")
