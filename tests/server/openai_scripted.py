"""Helpers for the OpenAI-parity tests: a live uvicorn server in a thread, SSE parsing, and a scripted
engine core that speaks with the real Qwen3.6 tokenizer (so special tokens, the chat template and the
markup-keeping detokenizer are the real ones) but replies with fixed text."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import uvicorn

from vibeqwen.engine.stats import EngineStats, FinishedRequestStats
from vibeqwen.sampling import SamplingParams


@contextmanager
def live_server(app: Any) -> Iterator[str]:
    """Serve `app` with uvicorn on a free port in a thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(5)
        sock.close()


def sse_events(text: str) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except `[DONE]`."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


@dataclass
class _Scripted:
    prompt: list[int]
    params: SamplingParams
    reply: list[int]
    arrival: float = field(default_factory=time.monotonic)
    sent: int = 0


class ScriptedEngine:
    """An `EngineCore` with the real tokenizer that replies to the last user message with scripted text.

    replies: user text -> reply text (special-token strings such as `</think>` become their ids; the
    reply ends with <|im_end|>); other users get DEFAULT. Each step emits `tokens_per_step` tokens per
    request, so a reply streams in many small deltas. A request with a constraint has every token checked
    against it (`allowed`, then `accept`), as the engine does. `gate` (cleared) blocks every step.
    Records each request's (user, SamplingParams) in `calls` and its prompt ids in `prompts`.
    """

    DEFAULT = "Hello!"

    def __init__(self, tokenizer: Any, replies: dict[str, str] | None = None, tokens_per_step: int = 1,
                 max_model_len: int = 4096, vocab_size: int = 248320) -> None:
        self.tokenizer = tokenizer
        self.replies = replies or {}
        self.tokens_per_step = tokens_per_step
        self.max_model_len = max_model_len
        self.model_name = "scripted"
        self.config = SimpleNamespace(max_num_seqs=64)
        self.model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=vocab_size))
        self.stats = EngineStats()
        self.calls: list[tuple[str, SamplingParams]] = []
        self.prompts: list[list[int]] = []
        self.requests: dict[str, _Scripted] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.eos = tokenizer.eos_token_ids[0]
        self.logprob_value = -0.5  # each sampled token's logprob (a test may make it NaN: a model gone wrong)

    def last_user(self, prompt: list[int]) -> str:
        text = self.tokenizer.decode(prompt)
        return text.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]

    def validate_request(self, prompt: list[int], params: SamplingParams) -> None:
        params.validate()
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens")

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.validate_request(prompt, params)
        user = self.last_user(prompt)
        self.calls.append((user, params))
        self.prompts.append(list(prompt))
        reply = self.tokenizer.encode(self.replies.get(user, self.DEFAULT)) + [self.eos]
        self.requests[request_id] = _Scripted(list(prompt), params, reply)

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        r = self.requests.pop(request_id, None)
        if r is not None:
            self._finished(request_id, r, reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def running_request_ids(self) -> list[str]:
        return list(self.requests)

    def _finished(self, rid: str, r: _Scripted, reason: str) -> None:
        self.stats.finished.append(FinishedRequestStats(rid, reason, len(r.prompt), r.sent, 0.01, 0.001,
                                                        time.monotonic() - r.arrival))

    def step(self) -> list[Any]:
        self.gate.wait()
        time.sleep(0.001)
        outputs = []
        for rid, r in list(self.requests.items()):
            new, reason = [], None
            for _ in range(self.tokens_per_step):
                tok = r.reply[r.sent]
                c = r.params.constraint
                if c is not None:
                    mask = c.allowed(self.model.cfg.vocab_size)
                    assert mask is None or bool(mask[tok]), f"scripted token {tok} is outside the grammar"
                    c.accept(tok)
                new.append(tok)
                r.sent += 1
                if tok == self.eos and not r.params.ignore_eos:
                    reason = "stop"
                elif r.sent == r.params.max_tokens or r.sent == len(r.reply):
                    reason = "length"
                if reason:
                    break
            logprobs = None
            k = r.params.logprobs
            if k is not None:
                # the token itself is the most likely, then k - 1 made-up alternatives
                v = self.logprob_value
                logprobs = [(v, [(t, v), *[(t + 1 + j, -1.5 - j) for j in range(k - 1)]][:k]) for t in new]
            self.stats.generation_tokens_total += len(new)
            outputs.append(SimpleNamespace(request_id=rid, new_token_ids=new, finish_reason=reason,
                                           num_output_tokens=r.sent, logprobs=logprobs, prompt_logprobs=None))
            if reason:
                del self.requests[rid]
                self._finished(rid, r, reason)
        return outputs
