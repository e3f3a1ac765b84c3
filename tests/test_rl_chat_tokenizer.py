"""`env.tokenizer`: the RL system and the eval checkpoint agent tokenize with the byte tokenizer ("") or a
trained Hugging Face tokenizer.json (chat special tokens added). No Ray: the pieces are built directly."""

from __future__ import annotations

import re

import pytest

from c2jax.config import load, save
from c2jax.rl.harness.chat_format import CHAT_SPECIAL_TOKENS
from c2jax.rl.system.config import RLSystemConfig

SENTENCES = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
             "Fix the failing test in tests/test_math.py, then run pytest.", "print('hello, world')\n"] * 20


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    """A tiny byte-level BPE (at most 400 ids: training stops when the text has no more pairs to merge)
    without the chat tokens, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    assert tok.token_to_id("<|im_start|>") is None  # the chat tokens come from chat_tokenizer
    assert 300 < tok.get_vocab_size() <= 400  # 256 bytes and some merges
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


def _base_vocab(path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path)).get_vocab_size()


def test_empty_spec_is_the_byte_tokenizer():
    from c2jax.rl.system.config import EnvConfig
    from c2jax.rl.system.envs import byte_tokenizer, chat_tokenizer

    assert EnvConfig().tokenizer == ""  # the default stays the byte tokenizer
    assert chat_tokenizer("").get_vocab() == byte_tokenizer().get_vocab()
    assert chat_tokenizer().get_vocab_size() == 264


def test_a_trained_bpe_gets_the_chat_tokens_and_round_trips_a_conversation(bpe_path):
    from c2jax.rl.harness import ChatRenderer
    from c2jax.rl.system.envs import chat_tokenizer

    for spec in (str(bpe_path), str(bpe_path.parent)):  # the file, or the directory holding tokenizer.json
        tok = chat_tokenizer(spec)
        ids = {t: tok.token_to_id(t) for t in CHAT_SPECIAL_TOKENS}
        assert all(i is not None for i in ids.values()), ids
        assert tok.get_vocab_size() == _base_vocab(bpe_path) + len(CHAT_SPECIAL_TOKENS)
        renderer = ChatRenderer(tok)
        messages = [{"role": "system", "content": "You fix code."},
                    {"role": "user", "content": "The quick brown fox: def add(a, b)"},
                    {"role": "tool", "content": "1 passed"}]
        ids = renderer.render_prompt(messages)
        assert len(ids) < len(renderer.decode(ids).encode())  # merges: fewer tokens than bytes
        text = renderer.decode(ids)
        for m in messages:
            assert f"<|im_start|>{m['role']}\n" in text
        assert "The quick brown fox: def add(a, b)" in text and "<tool_response>\n1 passed\n</tool_response>" in text
        assert text.endswith("<|im_start|>assistant\n")
    a, b = chat_tokenizer(str(bpe_path)), chat_tokenizer(str(bpe_path))
    assert a is not b  # each caller gets its own (mutable) Tokenizer; the parsed file is cached


def test_a_missing_or_broken_tokenizer_names_env_tokenizer_and_the_path(tmp_path):
    from c2jax.rl.system.envs import chat_tokenizer

    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(ValueError, match=r"env\.tokenizer.*nope/tokenizer\.json"):
        chat_tokenizer(str(missing))
    with pytest.raises(ValueError, match=r"env\.tokenizer.*empty_dir/tokenizer\.json"):
        (tmp_path / "empty_dir").mkdir()
        chat_tokenizer(str(tmp_path / "empty_dir"))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"env\.tokenizer.*broken\.json"):
        chat_tokenizer(str(broken))


def test_the_reconciler_refuses_a_model_vocabulary_smaller_than_the_tokenizer(bpe_path):
    from c2jax.rl.system.reconciler import check_tokenizer_vocab

    def cfg(*extra):
        return load(RLSystemConfig, None, ["model.preset=tiny", "env.kind=ladder", "backend.policy=engine", *extra])

    n = _base_vocab(bpe_path) + len(CHAT_SPECIAL_TOKENS)
    named = rf"tokenizer {re.escape(str(bpe_path))} \(env\.tokenizer\) has {n} ids .* model\.vocab_size={n - 1}"
    with pytest.raises(ValueError, match=named):
        check_tokenizer_vocab(cfg(f"model.vocab_size={n - 1}", f"env.tokenizer={bpe_path}"))
    assert check_tokenizer_vocab(cfg(f"model.vocab_size={n}", f"env.tokenizer={bpe_path}")).get_vocab_size() == n
    with pytest.raises(ValueError, match=r"env\.tokenizer.*missing\.json"):  # the driver fails before any actor
        check_tokenizer_vocab(cfg(f"env.tokenizer={bpe_path.parent / 'missing.json'}"))
    # unchanged for the default
    with pytest.raises(ValueError, match=r"byte tokenizer has 264 ids .* model\.vocab_size=200"):
        check_tokenizer_vocab(cfg("model.vocab_size=200"))
    assert check_tokenizer_vocab(cfg("model.vocab_size=264")).get_vocab_size() == 264


def test_rollout_worker_and_environment_host_use_the_configured_tokenizer(bpe_path, tmp_path):
    from c2jax.rl.system.actors import RolloutWorker
    from c2jax.rl.system.envs import EnvironmentHost, chat_tokenizer

    cfg = load(RLSystemConfig, None, ["backend.learner=fake", "backend.policy=fake", "env.kind=text",
                                      "env.text_tasks=x", "env.text_eval_tasks=y", f"env.tokenizer={bpe_path}",
                                      f"output_dir={tmp_path}", "dashboard=false"])
    worker = RolloutWorker(cfg, [], {}, "w0")  # a plain class until spawn() wraps it for Ray
    assert worker.renderer.tokenizer.get_vocab() == chat_tokenizer(str(bpe_path)).get_vocab()
    r = worker.renderer
    host = EnvironmentHost(cfg.env, {"t1": "return a + b"})
    assert host.grade_text("t1", r.encode_env("return a + b") + [r.im_end_id] + r.encode_env("junk")) == 1.0
    # the BPE's ids (<|im_start|> = first new id, <|im_end|> next), not the byte tokenizer's 257
    assert host._renderer.im_end_id == r.im_end_id == _base_vocab(bpe_path) + 1


def test_the_checkpoint_agent_loads_the_rl_runs_tokenizer(tmp_path):
    from c2jax.rl.eval.agents import load_checkpoint_engine
    cfg = load(RLSystemConfig, None, ["model.preset=tiny", f"env.tokenizer={tmp_path / 'gone.json'}",
                                      f"output_dir={tmp_path}", "name=run"])
    save(cfg, cfg.run_dir)
    (cfg.run_dir / "checkpoints").mkdir()
    with pytest.raises(ValueError, match=r"checkpoint agent: RL run .*env\.tokenizer.*gone\.json"):
        load_checkpoint_engine(cfg.run_dir)
