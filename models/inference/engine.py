"""Host-side inference engine: slot-based continuous batching over the jitted steps in `steps.py`.

A fixed number of slots share one latent cache. Queued requests are prefilled into free slots between
decode chunks; every chunk runs `chunk_steps` decode steps for all slots on device; finished sequences
(EOS id, stop string, token budget) free their slot at the next chunk boundary. New weights can be swapped
in between chunks without dropping in-flight sequences; each token carries the policy version that
sampled it. Not thread-safe: one caller drives it (the HTTP server runs it on a worker thread).
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from c2jax.models.config import ModelConfig
from c2jax.models.inference.forward import cache_slots, init_cache, init_mtp_cache, unstack
from c2jax.models.inference.sampling import SamplingParams, sample
from c2jax.models.inference.spec_policy import SpeculationPolicy
from c2jax.models.inference.speculative import (
    copy_mtp_row,
    fork_slot_spec,
    init_spec_state,
    prefill_slot_spec,
    spec_decode_chunk,
)
from c2jax.models.inference.steps import SlotState, copy_row, copy_slot, decode_chunk, prefill_slot

_sample = jax.jit(sample)


class ContextWindowExceeded(ValueError):
    """prompt + max_new_tokens does not fit the engine's cache window (the harness may summarise)."""


@dataclass(frozen=True)
class EngineConfig:
    slots: int = 8  # sequences decoded together
    max_len: int = 1024  # cache window per slot: prompt + generated tokens
    chunk_steps: int = 8  # decode steps per host call (one lax.scan)
    key_bucket: int = 64  # attention reads cache positions [0, k * key_bucket) for the smallest k that fits
    min_prompt_bucket: int = 16  # prompts are padded to a power of two >= this
    absorbed: bool = True  # absorbed-MLA decode; False: the expanded oracle
    # MTP speculative decoding (docs/inference.md): k drafts per round, 0 = off (needs MTP modules)
    speculative_k: int = 0
    speculative_rounds: int = 4  # speculative rounds per host call (each emits 1..k+1 tokens per slot)
    # speculate only while at most this many slots are live; above it a chunk is plain decoding (the verify
    # pass costs ~k+1 tokens of compute per slot, which stops paying once decoding is compute-bound)
    speculative_max_batch: int = 4
    # at or below speculative_max_batch, choose per chunk between speculative rounds and plain steps by the
    # tokens/s each measured at the current batch size (spec_policy.py); False: always speculate there
    speculative_adaptive: bool = True
    # adaptive: chunks of a batch size between tries of the slower mode (doubling up to 256 while it stays slower)
    speculative_reprobe_every: int = 16
    # prompt tokens prefilled per engine step, across requests (chunked prefill: a long prompt is prefilled in
    # pieces between decode chunks, so it does not stall the running sequences); 0 = every prompt whole
    prefill_budget: int = 0

    def __post_init__(self):
        for name in ("slots", "max_len", "chunk_steps", "key_bucket", "min_prompt_bucket", "speculative_rounds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        if self.speculative_reprobe_every < 2:
            raise ValueError(
                f"EngineConfig.speculative_reprobe_every must be >= 2, got {self.speculative_reprobe_every}")
        for name in ("speculative_k", "speculative_max_batch", "prefill_budget"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Request:
    prompt_ids: Sequence[int]
    max_new_tokens: int
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()  # checked on the detokenized completion (needs `detokenize`)
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@dataclass
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float]  # log softmax(logits / T) of each sampled token (see c2jax.models.inference.sampling)
    policy_versions: list[int]  # weight version that produced each token
    expert_ids: np.ndarray | None  # [n, L_moe, k]: experts of the forward pass that produced token j
    finish_reason: str  # "stop" | "length"
    raw_logprobs: list[float] = field(default_factory=list)  # log softmax(logits) (no temperature)
    prompt_expert_ids: np.ndarray | None = None  # [n_prompt, L_moe, k] experts of each prompt token


@dataclass
class _Live:
    request: Request
    result: GenerationResult
    experts: list = field(default_factory=list)


@dataclass
class _Prefill:
    """An admitted request whose prompt is being prefilled (chunked when prefill_budget > 0)."""
    rid: int
    request: Request
    slot: int
    prompt: list[int]
    start: int  # first position this engine prefills (after a cached prefix)
    progress: int  # prompt tokens in the cache
    experts: list = field(default_factory=list)  # prompt expert ids so far, one array per piece
    forks: list = field(default_factory=list)  # (rid, request, slot) of identical prompts admitted meanwhile


@dataclass
class _Row:
    """One prompt of a batched prefill."""
    slot: int
    tokens: list[int]  # what to run, written at positions start..
    start: int
    request: Request
    next_token: int = -1  # >= 0: the token known to follow (re-prefill after a weight swap)


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


class InferenceEngine:
    def __init__(self, cfg: ModelConfig, graphdef: nnx.GraphDef, state: nnx.State, *,
                 config: EngineConfig = EngineConfig(), version: int = 0,
                 detokenize: Callable[[list[int]], str] | None = None):
        self.cfg, self.graphdef, self.state, self.version = cfg, graphdef, state, version
        self._defs, self._weights = unstack(graphdef, state)  # per-layer weights, sliced once per version
        self.config, self.detokenize = config, detokenize
        self.cache = init_cache(cfg, config.slots, config.max_len)
        b = config.slots
        self._pending, self._lengths = np.zeros(b, np.int32), np.zeros(b, np.int32)
        self._remaining = np.zeros(b, np.int32)
        self._slots: list[_Live | None] = [None] * b
        self._live_ids: list[int | None] = [None] * b  # request id in each slot
        self._queue: collections.deque[tuple[int, Request]] = collections.deque()
        self._done: dict[int, GenerationResult] = {}
        self._ids = itertools.count()
        self._prefix: tuple[list[int], object, object, np.ndarray | None] | None = None
        self._prefilling: list[_Prefill] = []  # admitted requests whose prompt is not fully in the cache yet
        self.speculative = config.speculative_k > 0
        if self.speculative and cfg.num_nextn_predict_layers == 0:
            raise ValueError("EngineConfig.speculative_k > 0 needs MTP modules (cfg.num_nextn_predict_layers = 0)")
        # MTP cache and draft anchors; kept up to date in plain chunks too, so speculation can resume
        self.mtp_cache = init_mtp_cache(cfg, b, config.max_len) if self.speculative else None
        self.spec = init_spec_state(cfg, b) if self.speculative else None
        self.spec_stats = {"rounds": 0, "drafted": 0, "accepted": 0, "spec_chunks": 0, "plain_chunks": 0}
        self.spec_policy = SpeculationPolicy(
            config.speculative_k, config.speculative_max_batch, adaptive=config.speculative_adaptive,
            reprobe_every=config.speculative_reprobe_every) if self.speculative else None
        self._spec_shapes: set[tuple] = set()  # (k, rounds, key_len, stop width) of chunks already compiled
        self.prefill_stats = {"calls": 0, "tokens": 0, "forks": 0}  # forks: admissions that reused a prefill
        # decode chunks: wall time of the host calls that ran them, and the part spent waiting for the device
        # (wall - device_wait_s is the host's share: building inputs, dispatch, recording tokens)
        self.decode_stats = {"chunks": 0, "wall_s": 0.0, "device_wait_s": 0.0}

    @classmethod
    def from_model(cls, model: nnx.Module, **kwargs) -> InferenceEngine:
        graphdef, state = nnx.split(model)
        return cls(model.cfg, graphdef, state, **kwargs)

    # weights ----------------------------------------------------------------------------------------
    def swap_weights(self, state: nnx.State, version: int, *, recompute_cache: bool = True) -> None:
        """Use `state` from the next chunk on. In-flight sequences continue. recompute_cache=True re-prefills
        their history under the new weights, so what follows is exactly what a fresh engine on the new
        weights would sample from the same prefix; False keeps the old-weight cache (cheaper, slightly stale,
        as in PipelineRL's in-flight updates). A cached prompt prefix is recomputed either way."""
        self.state, self.version = state, version
        defs, self._weights = unstack(self.graphdef, state)
        # keep the static half's identity: the jitted steps' cache then matches it by `is`, not by comparing
        # every graphdef on every call
        self._defs = self._defs if defs == self._defs else defs
        if self.spec_policy is not None:  # the drafts' acceptance changes with the weights: re-measure it
            self.spec_policy.weights_changed()
        if self._prefix is not None:
            self.set_prefix(self._prefix[0])
        if not recompute_cache:
            return
        for entry in self._prefilling:  # partly prefilled prompts start over under the new weights
            entry.start = entry.progress = 0
            entry.experts = []
        rows = [_Row(slot, list(live.request.prompt_ids) + live.result.token_ids[:-1], 0, live.request,
                     live.result.token_ids[-1]) for slot, live in enumerate(self._slots) if live is not None]
        if rows:
            self._prefill(rows)

    # prompt caching ---------------------------------------------------------------------------------
    def set_prefix(self, prefix_ids: Sequence[int]) -> None:
        """Prefill a shared prefix (system prompt, tool specs) once; prompts starting with it reuse it."""
        prefix = [int(t) for t in prefix_ids]
        self._check_prompt(prefix, 0)
        row = init_cache(self.cfg, 1, self.config.max_len)
        mtp_row = init_mtp_cache(self.cfg, 1, self.config.max_len) if self.speculative else None
        spec_row = init_spec_state(self.cfg, 1) if self.speculative else None
        out, mtp_row, _ = self._run_prefill(row, mtp_row, spec_row, [_Row(0, prefix, 0, Request(prefix, 1))])
        experts = None if out.prompt_experts is None else np.asarray(out.prompt_experts)[0, : len(prefix)]
        self._prefix = (prefix, out.cache, mtp_row, experts)

    # requests ---------------------------------------------------------------------------------------
    def _check_prompt(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise ValueError("prompt_ids is empty")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids outside the vocabulary [0, {self.cfg.vocab_size}): {bad[:5]}")
        if len(prompt) + max_new_tokens > self.config.max_len:
            raise ContextWindowExceeded(
                f"prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens} exceeds the cache window "
                f"of {self.config.max_len} tokens")

    def submit(self, request: Request) -> int:
        if request.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {request.max_new_tokens}")
        if not 0 < request.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {request.top_p}")
        if request.top_k < 0 or request.temperature < 0:
            raise ValueError("top_k and temperature must be >= 0")
        if request.stop_strings and self.detokenize is None:
            raise ValueError("stop_strings need the engine's detokenize callback")
        self._check_prompt([int(t) for t in request.prompt_ids], request.max_new_tokens)
        rid = next(self._ids)
        self._queue.append((rid, request))
        return rid

    @property
    def has_work(self) -> bool:
        return bool(self._queue) or any(i is not None for i in self._live_ids)

    def pop_result(self, rid: int) -> GenerationResult | None:
        return self._done.pop(rid, None)

    def generate(self, requests: Sequence[Request]) -> list[GenerationResult]:
        ids = [self.submit(r) for r in requests]
        while any(i not in self._done for i in ids):
            self.step()
        return [self._done.pop(i) for i in ids]

    def generate_tokens(self, prompt_ids: list[int], *, max_new_tokens: int, stop_token_ids: list[int],
                        temperature: float = 1.0, seed: int = 0, top_p: float = 1.0,
                        top_k: int = 0) -> GenerationResult:
        return self.generate([Request(list(prompt_ids), max_new_tokens, tuple(stop_token_ids), (), temperature,
                                      top_p, top_k, seed)])[0]

    # scheduling -------------------------------------------------------------------------------------
    def _sampling(self, requests: Sequence[Request | None]) -> SamplingParams:
        reqs = [r or Request([0], 1, temperature=0.0) for r in requests]
        # NumPy arrays: the jitted step takes them as they are (jnp.asarray would be one eager dispatch each)
        return SamplingParams(np.asarray([r.temperature for r in reqs], np.float32),
                              np.asarray([r.top_p for r in reqs], np.float32),
                              np.asarray([r.top_k for r in reqs], np.int32),
                              np.asarray([r.seed % (1 << 32) for r in reqs], np.uint32))

    def _key_len(self, needed: int) -> int:
        kb = self.config.key_bucket
        return min(self.config.max_len, -(-needed // kb) * kb)

    def _run_prefill(self, cache, mtp_cache, spec, rows: list[_Row]):
        """Prefill `rows` in one call: b = a power of two >= len(rows) rows (padding rows write nothing), every
        prompt padded to one power-of-two bucket. -> (PrefillOutput, mtp_cache, spec); the MTP parts are None
        unless speculative."""
        b = _pow2_at_least(len(rows), 1)
        bucket = _pow2_at_least(max(len(r.tokens) for r in rows), self.config.min_prompt_bucket)
        tokens = np.zeros((b, bucket), np.int32)
        n_valid, start = np.ones(b, np.int32), np.zeros(b, np.int32)
        slot = np.full(b, cache_slots(cache), np.int32)  # out of range: a padding row's writes drop
        next_token = np.full(b, -1, np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r.tokens)] = r.tokens
            n_valid[i], start[i], slot[i], next_token[i] = len(r.tokens), r.start, r.slot, r.next_token
        requests = [r.request for r in rows] + [None] * (b - len(rows))
        args = (jnp.asarray(n_valid), jnp.asarray(slot), jnp.asarray(start), self._sampling(requests))
        key_len = self._key_len(int(start.max()) + bucket)
        if self.speculative:
            return prefill_slot_spec(self.cfg, self._defs, self._weights, cache, mtp_cache, spec,
                                     jnp.asarray(tokens), *args, jnp.asarray(next_token), key_len=key_len)
        out = prefill_slot(self.cfg, self._defs, self._weights, cache, jnp.asarray(tokens), *args, key_len=key_len)
        return out, None, None

    def _prefill(self, rows: list[_Row]):
        out, self.mtp_cache, self.spec = self._run_prefill(self.cache, self.mtp_cache, self.spec, rows)
        self.cache = out.cache
        self.prefill_stats["calls"] += 1
        self.prefill_stats["tokens"] += sum(len(r.tokens) for r in rows)
        return out

    def _admit(self, rid: int, request: Request, slot: int) -> None:
        """Reserve slot for the request: a prefill entry (its prompt is prefilled by `_prefill_step`), or, when
        an entry with the identical prompt is still being prefilled (the G samples of a GRPO group), a fork of
        it: no prefill of its own, its slot copies that entry's rows when they are complete."""
        prompt = [int(t) for t in request.prompt_ids]
        for entry in self._prefilling:
            if entry.prompt == prompt:
                entry.forks.append((rid, request, slot))
                return
        start, prefix_experts = 0, None
        if self._prefix is not None:
            prefix, prefix_cache, prefix_mtp, prefix_experts = self._prefix
            if len(prompt) > 1 and prompt[: len(prefix)] == prefix:
                start = min(len(prefix), len(prompt) - 1)  # at least one token left to produce logits
                if self.speculative:  # the prefix's last MTP entry needs the token after it: recompute it
                    start -= 1
                    self.mtp_cache = copy_mtp_row(self.mtp_cache, prefix_mtp, jnp.int32(slot))
                self.cache = copy_row(self.cache, prefix_cache, jnp.int32(slot))
        self._prefilling.append(_Prefill(rid, request, slot, prompt, start, start,
                                         [] if prefix_experts is None or start == 0 else [prefix_experts[:start]]))
        self._lengths[slot], self._pending[slot] = start, prompt[start]

    def _prefill_step(self) -> None:
        """One batched prefill call over the entries being prefilled, in admission order, at most
        `prefill_budget` prompt tokens in all (0: every prompt whole). An entry whose prompt completes samples
        its first token and becomes live, and its forks copy it."""
        budget = self.config.prefill_budget or sum(len(e.prompt) for e in self._prefilling)
        rows, taken = [], []
        for entry in self._prefilling:
            if budget <= 0:
                break
            take = min(len(entry.prompt) - entry.progress, budget)
            budget -= take
            end = entry.progress + take
            rows.append(_Row(entry.slot, entry.prompt[entry.progress:end], entry.progress, entry.request,
                             -1 if end == len(entry.prompt) else entry.prompt[end]))
            taken.append((entry, take))
        if not rows:
            return
        out = self._prefill(rows)
        tokens, logprobs = np.asarray(out.first.tokens), np.asarray(out.first.logprobs)
        raw = np.asarray(out.first.raw_logprobs)
        all_prompt_experts = None if out.prompt_experts is None else np.asarray(out.prompt_experts)
        first_experts = None if out.first_experts is None else np.asarray(out.first_experts)
        for i, (entry, take) in enumerate(taken):
            if all_prompt_experts is not None:
                entry.experts.append(all_prompt_experts[i, :take])
            entry.progress += take
            if entry.progress < len(entry.prompt):
                # decode chunks run idle slots too: they write this slot's caches from `lengths` on with the
                # pending token, i.e. the prompt's own next token (and the next piece overwrites them)
                self._lengths[entry.slot] = entry.progress
                self._pending[entry.slot] = entry.prompt[entry.progress]
                continue
            self._prefilling.remove(entry)
            prompt_experts = np.concatenate(entry.experts) if entry.experts else None
            experts = None if first_experts is None else first_experts[i]
            self._start(entry.rid, entry.request, entry.slot, entry.prompt, prompt_experts, int(tokens[i]),
                        float(logprobs[i]), float(raw[i]), experts)
            for rid, request, slot in entry.forks:
                self._fork(rid, request, slot, entry.prompt, entry.slot, out.last_logits[i: i + 1], prompt_experts,
                           experts)

    def _fork(self, rid: int, request: Request, slot: int, prompt: list[int], src: int, last_logits,
              prompt_experts, first_experts) -> None:
        self.cache = copy_slot(self.cache, jnp.int32(src), jnp.int32(slot))
        first = _sample(last_logits, self._sampling([request]), jnp.asarray([len(prompt)], jnp.int32))
        if self.speculative:
            self.mtp_cache, self.spec = fork_slot_spec(self.cfg, self._defs, self._weights, self.mtp_cache,
                                                       self.spec, jnp.int32(src), jnp.int32(slot),
                                                       first.tokens[0], jnp.int32(len(prompt) - 1))
        self.prefill_stats["forks"] += 1
        self._start(rid, request, slot, prompt, prompt_experts, int(first.tokens[0]), float(first.logprobs[0]),
                    float(first.raw_logprobs[0]), first_experts)

    def _start(self, rid: int, request: Request, slot: int, prompt: list[int], prompt_experts, token: int,
               logprob: float, raw: float, first_experts) -> None:
        live = _Live(request, GenerationResult([], [], [], None, "length", prompt_expert_ids=prompt_experts))
        self._slots[slot] = live
        self._lengths[slot], self._remaining[slot] = len(prompt), request.max_new_tokens
        self._record(slot, rid, token, logprob, raw, first_experts)

    def _record(self, slot: int, rid: int, token: int, logprob: float, raw: float, experts) -> None:
        """Append one sampled token to slot's sequence; finish it if a stop condition holds."""
        live = self._slots[slot]
        res, req = live.result, live.request
        res.token_ids.append(token)
        res.logprobs.append(logprob)
        res.raw_logprobs.append(raw)
        res.policy_versions.append(self.version)
        if experts is not None:
            live.experts.append(experts)
        self._pending[slot] = token
        self._remaining[slot] -= 1
        reason = None
        if token in req.stop_token_ids:
            reason = "stop"
        elif req.stop_strings and self._hit_stop_string(res.token_ids, req.stop_strings):
            reason = "stop"
        elif self._remaining[slot] <= 0:
            reason = "length"
        if reason is not None:
            res.finish_reason = reason
            res.expert_ids = np.stack(live.experts) if live.experts else None
            self._done[rid] = res
            self._slots[slot] = None
            self._live_ids[slot] = None

    def _hit_stop_string(self, tokens: list[int], stops: Sequence[str]) -> bool:
        window = max(len(s) for s in stops) + 8  # a token decodes to >= 1 character in practice
        text = self.detokenize(tokens[-window:])
        return any(s in text for s in stops)

    def step(self) -> None:
        """Admit queued requests into free slots, then run one decode chunk over all live slots."""
        for slot in range(self.config.slots):
            if self._live_ids[slot] is None and self._queue:
                rid, request = self._queue.popleft()
                self._live_ids[slot] = rid
                self._admit(rid, request, slot)
        if self._prefilling:
            self._prefill_step()
        live = [s is not None for s in self._slots]
        if not any(live):
            return
        started = time.perf_counter()  # decode_stats: the chunk's host work starts here
        requests = self._slots_requests()
        width = _pow2_at_least(max((len(r.stop_token_ids) for r in requests if r), default=1), 4)
        stop_ids = np.full((self.config.slots, width), -1, np.int32)
        for slot, r in enumerate(requests):
            if r is not None and r.stop_token_ids:
                stop_ids[slot, : len(r.stop_token_ids)] = r.stop_token_ids
        steps = self.config.chunk_steps
        state = SlotState(self._pending.copy(), self._lengths.copy(), np.asarray(live), self._remaining.copy())
        if self.speculative:
            self._spec_chunk(state, stop_ids, requests, int(sum(live)))
            self._count_chunk(started)
            return
        key_len = self._key_len(int(self._lengths[live].max()) + steps)
        self.cache, new_state, out = decode_chunk(
            self.cfg, self._defs, self._weights, self.cache, state, stop_ids,
            self._sampling(requests), steps=steps, key_len=key_len, absorbed=self.config.absorbed)
        lengths, out = self._wait((new_state.lengths, out))
        self._lengths = np.array(lengths)
        self._record_chunk(out.tokens[..., None], out.logprobs[..., None], out.raw_logprobs[..., None],
                           None if out.expert_ids is None else out.expert_ids[:, :, None], out.valid[..., None])
        self._count_chunk(started)

    def _wait(self, outputs):
        """The chunk's outputs on the host, in one transfer (then NumPy only); the wait is device time."""
        t0 = time.perf_counter()
        outputs = jax.device_get(outputs)
        self.decode_stats["device_wait_s"] += time.perf_counter() - t0
        return outputs

    def _count_chunk(self, started: float) -> None:
        self.decode_stats["chunks"] += 1
        self.decode_stats["wall_s"] += time.perf_counter() - started

    def _spec_chunk(self, state: SlotState, stop_ids: np.ndarray, requests, n_live: int) -> None:
        """One host call of speculative rounds, or plain steps that keep the MTP cache current (k = 0 rounds),
        as `spec_policy` chooses for n_live live slots; the call's tokens/s goes back to the policy."""
        cfg = self.config
        k = self.spec_policy.choose(n_live)
        rounds = cfg.speculative_rounds if k else cfg.chunk_steps
        key_len = self._key_len(int(self._lengths[np.asarray(state.active)].max()) + rounds * (k + 1) + 1)
        shape = (k, rounds, key_len, stop_ids.shape[1])
        compiled, started = shape not in self._spec_shapes, time.perf_counter()
        self._spec_shapes.add(shape)
        self.cache, self.mtp_cache, new_state, self.spec, out = spec_decode_chunk(
            self.cfg, self._defs, self._weights, self.cache, self.mtp_cache, state, self.spec,
            stop_ids, self._sampling(requests), rounds=rounds, k=k, key_len=key_len,
            absorbed=cfg.absorbed)
        lengths, out = self._wait((new_state.lengths, out))
        o = out.out
        self.spec_policy.observe(n_live, k, int(np.asarray(o.valid).sum()), time.perf_counter() - started,
                                 compiled=compiled)
        self._lengths = np.array(lengths)
        stats = self.spec_stats
        stats["spec_chunks" if k else "plain_chunks"] += 1
        if k:
            drafted = np.asarray(out.drafted)
            stats["rounds"] += int((drafted > 0).sum())
            stats["drafted"] += int(drafted.sum())
            stats["accepted"] += int(np.asarray(out.accepted).sum())
        self._record_chunk(o.tokens, o.logprobs, o.raw_logprobs, o.expert_ids, o.valid)

    def _record_chunk(self, tokens, logprobs, raw, experts, valid) -> None:
        """Record a chunk's tokens: arrays [steps, B, T] (T tokens per step and slot), in order."""
        tokens, logprobs, raw = np.asarray(tokens), np.asarray(logprobs), np.asarray(raw)
        valid = np.asarray(valid)
        experts = None if experts is None else np.asarray(experts)
        for i in range(tokens.shape[0]):
            for slot in range(self.config.slots):
                for j in range(tokens.shape[2]):
                    if valid[i, slot, j] and self._slots[slot] is not None:
                        self._record(slot, self._live_ids[slot], int(tokens[i, slot, j]),
                                     float(logprobs[i, slot, j]), float(raw[i, slot, j]),
                                     None if experts is None else experts[i, slot, j])

    @property
    def acceptance_rate(self) -> float | None:
        """Drafts kept / drafts proposed so far (None before any speculative round)."""
        drafted = self.spec_stats["drafted"]
        return self.spec_stats["accepted"] / drafted if drafted else None

    def _slots_requests(self) -> list[Request | None]:
        return [None if s is None else s.request for s in self._slots]
