"""The demo's BPE chat tokenizer: SFT prompts tokenized by its data view equal the ids the RL harness renders,
multi-turn conversations (tool results between <tool_response> markers) included; ladder words are one token."""

import json

from tokenizers import Tokenizer


def test_sft_prompts_tokenize_to_the_harness_ids(tmp_path):
    from c2jax.rl.harness import ChatRenderer
    from c2jax.rl.harness.chat_format import CHAT_SPECIAL_TOKENS, render_messages_text
    from c2jax.rl.tasks.ladder import ANSWER_WORDS
    from experiments.demo.pipeline import DemoConfig, episode_config, ladder, sandbox_factory
    from experiments.demo.tokenizer import conversation_ids, train_chat_tokenizer
    from experiments.demo.transcripts import write_transcripts

    cfg = DemoConfig(rungs="echo,lookup", sandbox="local")
    tasks = ladder(tmp_path / "tasks", 0, 100, cfg.rung_list, lookup_keys=2)
    stats = write_transcripts(tasks, tmp_path / "t.jsonl", episode_config(cfg), sandbox_factory(cfg),
                              grade_first=2, conversations_out=tmp_path / "c.jsonl")
    records = [json.loads(line) for line in (tmp_path / "t.jsonl").open()]
    paths = train_chat_tokenizer([r["prompt"] + r["completion"] for r in records], 1024, tmp_path / "tok")
    harness, data = Tokenizer.from_file(str(paths["harness"])), Tokenizer.from_file(str(paths["data"]))
    assert harness.get_vocab_size() == data.get_vocab_size() + len(CHAT_SPECIAL_TOKENS) - 4 <= 1024
    renderer = ChatRenderer(harness)
    turns = 0
    for conv in map(json.loads, (tmp_path / "c.jsonl").open()):
        msgs = conv["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                text = render_messages_text(msgs[:i])
                assert data.encode(text, add_special_tokens=False).ids == conversation_ids(renderer, data, msgs[:i])
                turns += 1
    assert turns == stats["records"] == 4 * 100  # echo: write + closing turn; lookup: read + write
    # a tool result is wrapped by the special <tool_response> ids in both views; model-written tags are text
    lookup_write = next(r for r in records if "<tool_response>" in r["prompt"] and '"answer.txt"' in r["completion"])
    ids = data.encode(lookup_write["prompt"], add_special_tokens=False).ids
    assert renderer.special_ids["<tool_response>"] in ids and renderer.special_ids["<tool_call>"] not in ids
    # trained on the transcripts, every answer word is one token, with or without a leading space
    assert all(len(data.encode(w).ids) == len(data.encode(" " + w).ids) == 1 for w in ANSWER_WORDS)
