"""OpenAI-compatible HTTP server over an InferenceEngine (stdlib http.server; binds 127.0.0.1 by default).

Endpoints (POST, JSON):
  /v1/completions        {prompt: str | list[int], max_tokens, temperature, top_p, top_k, seed, stop, logprobs}
  /v1/chat/completions   {messages: [{role, content}], ...same sampling fields}
  /v1/generate_tokens    {prompt_ids, max_new_tokens, stop_token_ids, temperature, top_p, top_k, seed}
                          -> {token_ids, logprobs, policy_versions, expert_ids, finish_reason}
GET /v1/models lists the one served model. A worker thread owns the engine, so concurrent HTTP requests are
continuously batched together.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from c2jax.models.inference.engine import ContextWindowExceeded, InferenceEngine, Request


@dataclass(frozen=True)
class ChatTemplate:
    """message -> text as `turn.format(role=..., content=...)`; the prompt ends with `generation_prompt`."""
    turn: str = "<|im_start|>{role}\n{content}<|im_end|>\n"
    generation_prompt: str = "<|im_start|>assistant\n"
    stop: tuple[str, ...] = ("<|im_end|>",)

    def render(self, messages: list[dict]) -> str:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a 'role' and a string 'content'")
        return "".join(self.turn.format(role=m["role"], content=m["content"]) for m in messages) + \
            self.generation_prompt


class EngineWorker:
    """Runs engine.step() on its own thread; submit() returns a Future of the GenerationResult."""

    def __init__(self, engine: InferenceEngine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._futures: dict[int, Future] = {}
        self._thread = threading.Thread(target=self._loop, daemon=True, name="inference-engine")
        self._stop = threading.Event()
        self._thread.start()

    def submit(self, request: Request) -> Future:
        future: Future = Future()
        self._inbox.put((request, future))
        return future

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                block = not self.engine.has_work
                while True:
                    request, future = self._inbox.get(block=block, timeout=0.05 if block else None)
                    block = False
                    try:
                        self._futures[self.engine.submit(request)] = future
                    except Exception as e:  # bad request: reported to its caller, engine keeps going
                        future.set_exception(e)
            except queue.Empty:
                pass
            if not self.engine.has_work:
                continue
            try:
                self.engine.step()
            except Exception as e:
                for future in self._futures.values():
                    future.set_exception(e)
                self._futures.clear()
                continue
            for rid in list(self._futures):
                result = self.engine.pop_result(rid)
                if result is not None:
                    self._futures.pop(rid).set_result(result)


def _sampling_fields(body: dict) -> dict:
    return dict(temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                top_k=int(body.get("top_k", 0)), seed=int(body.get("seed", 0) or 0))


class InferenceServer:
    def __init__(self, engine: InferenceEngine, tokenizer, *, model_name: str = "c2jax",
                 template: ChatTemplate = ChatTemplate(), host: str = "127.0.0.1", port: int = 0,
                 eos_token_ids: tuple[int, ...] = ()):
        self.tokenizer, self.model_name, self.template = tokenizer, model_name, template
        self.eos_token_ids = tuple(eos_token_ids)
        if engine.detokenize is None:
            engine.detokenize = self._decode
        self.worker = EngineWorker(engine)
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> InferenceServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="inference-http")
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.worker.close()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _run(self, prompt_ids: list[int], body: dict, stop: list[str]):
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        req = Request(prompt_ids, max_tokens, self.eos_token_ids, tuple(stop), **_sampling_fields(body))
        return self.worker.submit(req).result()

    def _text(self, result, stop: list[str]) -> str:
        text = self._decode(result.token_ids)
        for s in stop:  # OpenAI semantics: the stop string itself is not returned
            if s in text:
                text = text[: text.index(s)]
        return text

    def handle(self, path: str, body: dict) -> dict:
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        now, rid = int(time.time()), uuid.uuid4().hex[:12]
        if path == "/v1/generate_tokens":
            req = Request([int(t) for t in body["prompt_ids"]], int(body.get("max_new_tokens", 16)),
                          tuple(int(t) for t in body.get("stop_token_ids", ())), (), **_sampling_fields(body))
            r = self.worker.submit(req).result()
            return {"token_ids": r.token_ids, "logprobs": r.logprobs, "raw_logprobs": r.raw_logprobs,
                    "policy_versions": r.policy_versions, "finish_reason": r.finish_reason,
                    "expert_ids": None if r.expert_ids is None else r.expert_ids.tolist()}
        if path == "/v1/completions":
            prompt = body.get("prompt", "")
            ids = [int(t) for t in prompt] if isinstance(prompt, list) else self._encode(prompt)
            r = self._run(ids, body, stop)
            choice = {"index": 0, "text": self._text(r, stop), "finish_reason": r.finish_reason,
                      "logprobs": None}
            if body.get("logprobs"):
                choice["logprobs"] = {"tokens": [self._decode([t]) for t in r.token_ids],
                                      "token_logprobs": r.logprobs, "top_logprobs": None, "text_offset": None}
            return {"id": f"cmpl-{rid}", "object": "text_completion", "created": now, "model": self.model_name,
                    "choices": [choice], "usage": _usage(len(ids), len(r.token_ids))}
        if path == "/v1/chat/completions":
            stop = stop + list(self.template.stop)
            ids = self._encode(self.template.render(body.get("messages", [])))
            r = self._run(ids, body, stop)
            choice = {"index": 0, "message": {"role": "assistant", "content": self._text(r, stop)},
                      "finish_reason": r.finish_reason, "logprobs": None}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [
                    {"token": self._decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(r.token_ids, r.logprobs, strict=True)]}
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": now,
                    "model": self.model_name, "choices": [choice], "usage": _usage(len(ids), len(r.token_ids))}
        raise KeyError(path)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _handler(server: InferenceServer):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str, kind: str) -> None:
            self._send(code, {"error": {"message": message, "type": kind, "code": code}})

        def do_GET(self):  # noqa: N802 (http.server API)
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [
                    {"id": server.model_name, "object": "model", "created": 0, "owned_by": "c2jax"}]})
            else:
                self._error(404, f"no route {self.path}", "not_found")

        def do_POST(self):  # noqa: N802
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                self._send(200, server.handle(self.path.rstrip("/"), body))
            except KeyError as e:
                self._error(404 if str(e).strip("'").startswith("/") else 400, f"missing or unknown {e}",
                            "invalid_request_error")
            except ContextWindowExceeded as e:
                self._error(400, str(e), "context_length_exceeded")
            except (ValueError, TypeError) as e:
                self._error(400, str(e), "invalid_request_error")

        def log_message(self, format, *args):  # quiet by default
            pass

    return Handler
