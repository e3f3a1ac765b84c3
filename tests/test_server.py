"""The OpenAI-compatible server answers the real `openai` client over loopback, and its token endpoint
returns what the engine returns."""

from __future__ import annotations

import json
import urllib.request

import pytest
from flax import nnx

from c2jax.models.config import preset
from c2jax.models.inference import EngineConfig, InferenceEngine, Request
from c2jax.models.inference.server import InferenceServer
from c2jax.models.transformer import init

openai = pytest.importorskip("openai")
tokenizers = pytest.importorskip("tokenizers")

CFG = preset("tiny")
ENGINE = EngineConfig(slots=2, max_len=64, chunk_steps=4)  # same shapes as test_inference: shared compiles


def _char_tokenizer():
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.decoder = tokenizers.decoders.Fuse()
    return tok


@pytest.fixture(scope="module")
def served():
    graphdef, state = nnx.split(init(CFG, seed=0))
    tok = _char_tokenizer()
    server = InferenceServer(InferenceEngine(CFG, graphdef, state, config=ENGINE), tok).start()
    yield server, tok, (graphdef, state)
    server.close()


def test_openai_client_chat_and_completions(served):
    server, tok, _ = served
    assert server.url.startswith("http://127.0.0.1:")
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    chat = client.chat.completions.create(model="c2jax", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0.0, logprobs=True)
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert chat.usage.completion_tokens <= 5 and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.content) == chat.usage.completion_tokens
    prompt = "def f(x):"
    comp = client.completions.create(model="c2jax", prompt=prompt, max_tokens=6, temperature=0.0)
    # greedy and the same engine numerics: the text is the engine's own continuation
    want = server.worker.submit(Request(tok.encode(prompt).ids, 6, temperature=0.0)).result()
    assert comp.choices[0].text == tok.decode(want.token_ids)
    assert [m.id for m in client.models.list().data] == ["c2jax"]


def test_token_endpoint_and_errors(served):
    server, _, _ = served
    body = {"prompt_ids": [5, 6, 7], "max_new_tokens": 4, "temperature": 0.8, "seed": 3}
    req = urllib.request.Request(server.url + "/generate_tokens", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        out = json.loads(r.read())
    want = server.worker.submit(Request([5, 6, 7], 4, temperature=0.8, seed=3)).result()
    assert out["token_ids"] == want.token_ids and out["policy_versions"] == [0] * 4
    assert len(out["expert_ids"]) == 4 and out["finish_reason"] == "length"
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="cache window"):
        client.completions.create(model="c2jax", prompt="x" * 70, max_tokens=4)
