"""Token-level rendering that keeps token-in/token-out.

A conversation is one growing list of token ids. Environment text (system prompt, task, tool results,
role headers) is tokenized piece by piece and appended with loss mask 0; tokens the policy sampled are
appended exactly as sampled, with mask 1, and are never decoded and re-encoded. Re-tokenizing the
decoded text would not round-trip in general (a sampler may emit "h","e","l","l","o" where the
tokenizer would give "hello"), and training on tokens the sampler did not produce biases the policy
gradient (rl.md §5: verl reports PPO "not even converged" with re-applied chat templates; TRL issue
#5224). Each prompt the policy sees is therefore an exact prefix-extension of the previous one.

Environment text is encoded with `encode_special_tokens=True` on a private copy of the tokenizer, so
a file or command output containing the literal text "<|im_end|>" cannot forge a turn boundary; the
role markers themselves are inserted by id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

from c2jax.rl.harness.chat_format import (
    CHAT_SPECIAL_TOKENS,
    IM_END,
    IM_START,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    message_body,
)


@dataclass
class TokenTranscript:
    """Token ids with per-token loss mask, sampler logprob and policy version (-1: not sampled)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend_env(self, ids: list[int]) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.policy_versions.extend([-1] * len(ids))

    def extend_model(self, ids: list[int], logprobs: list[float], policy_versions: list[int]) -> None:
        if not (len(ids) == len(logprobs) == len(policy_versions)):
            raise ValueError(f"sampled tokens ({len(ids)}), logprobs ({len(logprobs)}) and policy versions "
                             f"({len(policy_versions)}) must have the same length")
        self.token_ids.extend(int(i) for i in ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(float(x) for x in logprobs)
        self.policy_versions.extend(int(v) for v in policy_versions)

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)


class ChatRenderer:
    """Turns OpenAI-style environment messages into token ids for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        ids = {t: tokenizer.token_to_id(t) for t in CHAT_SPECIAL_TOKENS}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer lacks the chat special tokens {missing}; call "
                             "c2jax.rl.harness.add_chat_special_tokens(tokenizer) first")
        self.special_ids = ids
        self.im_start_id, self.im_end_id = ids[IM_START], ids[IM_END]
        self._env_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self._env_tokenizer.encode_special_tokens = True

    def encode_env(self, text: str) -> list[int]:
        """Environment text; chat special tokens appearing in it are tokenized as plain characters."""
        return self._env_tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def encode_model_text(self, text: str) -> list[int]:
        """Text the model wrote, as the tokenizer would split it (special tokens recognised); used only to
        build SFT-style data, never for sampled RL tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def header(self, role: str) -> list[int]:
        return [self.im_start_id, *self.encode_env(f"{role}\n")]

    def render_message(self, message: dict) -> list[int]:
        """An environment message (system, user or tool) as `<|im_start|>role\\n body <|im_end|>\\n`."""
        if message["role"] == "assistant":
            raise ValueError("assistant turns come from the sampler's tokens; do not re-render them")
        body = message_body(message)
        if message["role"] == "tool":
            # The <tool_response> markers are real special tokens; only the output between them is text.
            inner = body[len(TOOL_RESPONSE_OPEN):-len(TOOL_RESPONSE_CLOSE)]
            ids = [self.special_ids[TOOL_RESPONSE_OPEN], *self.encode_env(inner),
                   self.special_ids[TOOL_RESPONSE_CLOSE]]
        else:
            ids = self.encode_env(body)
        return [*self.header(message["role"]), *ids, self.im_end_id, *self.encode_env("\n")]

    def render_prompt(self, messages: list[dict]) -> list[int]:
        """Environment messages followed by the assistant header the policy continues from."""
        ids: list[int] = []
        for m in messages:
            ids.extend(self.render_message(m))
        return ids + self.header("assistant")

    def turn_overhead(self) -> int:
        """Environment tokens around one assistant turn (header, and `<|im_end|>\\n` at most)."""
        return len(self.header("assistant")) + 1 + len(self.encode_env("\n"))

    def close_assistant(self, sampled: list[int], finished_with_stop: bool) -> list[int]:
        """Environment tokens that end an assistant turn: the newline after a sampled <|im_end|>, or the
        whole `<|im_end|>\\n` when generation stopped for length (the model never closed its turn)."""
        if finished_with_stop and sampled and sampled[-1] == self.im_end_id:
            return self.encode_env("\n")
        return [self.im_end_id, *self.encode_env("\n")]
