"""The OpenAI-compatible API over a fake step-based engine core: TestClient for the routes, the AsyncEngine
directly, and a live uvicorn server for the `openai` SDK, batching, overload and client disconnects."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai_scripted import live_server, sse_events, wait_for

from vibeqwen.engine.request import ContextLengthError
from vibeqwen.engine.stats import EngineStats
from vibeqwen.sampling import SamplingParams
from vibeqwen.server.app import ServerConfig, create_app
from vibeqwen.server.async_engine import AsyncEngine, EngineOverloadedError

MODEL = "vibeqwen-test"
SPECIALS = {"<|endoftext|>": 1000, "<|im_start|>": 1001, "<|im_end|>": 1002}
SPECIAL_TEXT = {v: k for k, v in SPECIALS.items()}
DEFAULT_REPLY = "Hello, world! 你好 🎉"
BURST_REPLY = "tock " * 10


class FakeTokenizer:
    """Byte-level: one token per UTF-8 byte (so characters split across tokens), specials at 1000+."""

    eos_token_ids = (1002, 1000)
    special_ids = frozenset(SPECIAL_TEXT)

    def __init__(self):
        self.template_calls: list[dict] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in re.split("(" + "|".join(map(re.escape, SPECIALS)) + ")", text):
            ids.extend([SPECIALS[piece]] if piece in SPECIALS else piece.encode())
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out = b""
        for i in ids:
            if i in SPECIAL_TEXT:
                out += b"" if skip_special_tokens else SPECIAL_TEXT[i].encode()
            else:
                out += bytes([i])
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages, tools=None, add_generation_prompt=True, enable_thinking=True, **kw
    ):
        self.template_calls.append(
            {"messages": messages, "tools": tools, "enable_thinking": enable_thinking, "kwargs": kw}
        )
        if not any(m["role"] == "user" for m in messages):
            raise ValueError("chat template: no user query found in messages")
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n" + ("" if enable_thinking else "<think>\n\n</think>\n\n")
        return text


@dataclass
class FakeRequest:
    user: str
    params: SamplingParams
    reply_ids: list[int]  # the scripted reply, ending in <|im_end|>
    sent: int = 0
    per_step: int = 1  # tokens a step emits ("multi": 4, as a speculative step that accepted 3 drafts)


@dataclass
class FakeStepOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_output_tokens: int
    logprobs: list | None = None  # one (logprob, top alternatives) per new token, when the request asked


class FakeEngine:
    """A step-based engine core (the `EngineCore` protocol) that replies to the last user message.

    Each `step()` admits waiting requests up to max_num_seqs (FCFS), then emits one byte-token per running
    request; replies end with <|im_end|>. Every step takes `step_delay` seconds (10 ms while a "slow"
    request runs), so concurrent requests visibly share steps.
    "say X": reply X; "multi X": the same, 4 tokens a step. "slow": 200 tokens. "burst": 50 tokens. "fail": the
    step that would give its third
    token raises RuntimeError. "bad": add_request raises ValueError; "invalid": validate_request does.
    Anything else: DEFAULT_REPLY.
    Records add_request calls (user, params), the requests aborted while held (`aborted`, request ids),
    the users that ever ran, finished normally, and the peak number running at once.
    """

    def __init__(self, max_model_len: int = 4096, max_num_seqs: int = 64, step_delay: float = 0.001):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.model_name = "fake"
        self.config = SimpleNamespace(max_num_seqs=max_num_seqs)
        self.stats = EngineStats()
        self.step_delay = step_delay
        self.calls: list[tuple[str, SamplingParams]] = []
        self.users: dict[str, str] = {}
        self.aborted: list[str] = []
        self.started: list[str] = []
        self.completed: list[str] = []
        self.waiting: dict[str, FakeRequest] = {}
        self.running: dict[str, FakeRequest] = {}
        self.peak_running = 0
        # step() waits while this is clear: a test can queue several requests before any step runs.
        self.gate = threading.Event()
        self.gate.set()

    def last_user(self, prompt_ids: list[int]) -> str:
        text = self.tokenizer.decode(prompt_ids)
        return text.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]

    def aborted_users(self) -> list[str]:
        return [self.users[rid] for rid in self.aborted]

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def validate_request(self, prompt_token_ids, params) -> None:
        params.validate()
        n = len(prompt_token_ids)
        if n + params.max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"{n} + {params.max_tokens} requested"
            )
        user = self.last_user(prompt_token_ids)
        if user == "invalid":
            raise ValueError("the engine cannot serve this prompt")

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        self.validate_request(prompt_token_ids, params)
        user = self.last_user(prompt_token_ids)
        self.calls.append((user, params))
        if user == "bad":
            raise ValueError("the engine rejects this prompt")
        reply, per_step = DEFAULT_REPLY, 1
        if user.startswith("say "):
            reply = user[4:]
        elif user.startswith("multi "):
            reply, per_step = user[6:], 4
        elif user == "slow":
            reply = "tick " * 40
        elif user == "burst":
            reply = BURST_REPLY
        self.users[request_id] = user
        self.waiting[request_id] = FakeRequest(user, params, list(reply.encode()) + [1002], per_step=per_step)

    def abort_request(self, request_id, reason="abort") -> None:
        held = self.running.pop(request_id, None) or self.waiting.pop(request_id, None)
        if held is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def running_request_ids(self) -> list[str]:
        return list(self.running)

    def step(self) -> list[FakeStepOutput]:
        assert self.gate.wait(5), "the gate was never opened"
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            rid = next(iter(self.waiting))
            self.running[rid] = self.waiting.pop(rid)
            self.started.append(self.running[rid].user)
        self.peak_running = max(self.peak_running, len(self.running))
        time.sleep(0.01 if any(r.user == "slow" for r in self.running.values()) else self.step_delay)
        if any(r.user == "fail" and r.sent == 2 for r in self.running.values()):
            raise RuntimeError("engine exploded")
        outputs = []
        for rid, r in list(self.running.items()):
            new, reason = [], None
            while len(new) < r.per_step and reason is None:
                new.append(r.reply_ids[r.sent])
                r.sent += 1
                if r.sent == len(r.reply_ids):
                    reason = "stop"
                elif r.sent == r.params.max_tokens:
                    reason = "length"
            if reason is not None:
                del self.running[rid]
                self.completed.append(r.user)
            lps = None if r.params.logprobs is None else [(-0.5 - 0.01 * t, []) for t in new]
            outputs.append(FakeStepOutput(rid, new, reason, r.sent, lps))
        return outputs


@pytest.fixture
def limits() -> dict:
    """Engine limits: max_num_seqs for the fake engine, max_queued for the AsyncEngine (parametrize to set)."""
    return {}


@pytest.fixture
def engine(limits):
    return FakeEngine(max_num_seqs=limits.get("max_num_seqs", 64))


@pytest.fixture
def async_engine(engine, limits):
    ae = AsyncEngine(engine, max_queued=limits.get("max_queued", 256))
    yield ae
    ae.shutdown()


@pytest.fixture
def client(async_engine):
    with TestClient(create_app(async_engine, MODEL)) as c:
        yield c


@pytest.fixture
def server(async_engine):
    """A live uvicorn server on a free port, in a thread; yields its base URL."""
    with live_server(create_app(async_engine, MODEL)) as url:
        yield url


@pytest.fixture
def sdk(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=10)


def chat(content: str = "hi", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


# ---- routes over TestClient ----


def test_health_and_models(client):
    assert client.get("/health").status_code == 200
    assert client.head("/health").status_code == 200  # load balancers probe with HEAD
    assert list(client.get("/openapi.json").json()["paths"]["/health"]) == ["get"]  # one operation id
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in body["data"]] == [(MODEL, "model", "vibeqwen")]
    assert client.get("/v1/models/").json() == body  # with a trailing slash too (it read as a model named "")
    assert client.get(f"/v1/models/{MODEL}").json() == body["data"][0]


def test_chat_non_streamed(client, engine):
    r = client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text
    body = r.json()
    assert re.fullmatch(r"chatcmpl-[0-9a-f]+", body["id"])
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert abs(body["created"] - time.time()) < 60
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": DEFAULT_REPLY},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,  # EOS (vLLM's: a stop string or stop_token_ids id)
        }
    ]
    prompt_len = len(engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"))
    completion = len(DEFAULT_REPLY.encode()) + 1
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # Unset sampling fields take the OpenAI defaults; max_tokens fills the context.
    params = engine.calls[-1][1]
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    assert params.max_tokens == engine.max_model_len - prompt_len


def test_sampling_fields_reach_the_engine(client, engine):
    req = chat(temperature=0.3, top_p=0.9, top_k=20, seed=7, max_completion_tokens=50, stop=["x", "yz"])
    assert client.post("/v1/chat/completions", json=req).status_code == 200
    p = engine.calls[-1][1]
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens, p.stop) == (
        0.3,
        0.9,
        20,
        7,
        50,
        ["x", "yz"],
    )
    # integers written as numbers without a fraction (Python's json.dumps(1e3) writes 1000.0), as JSON Schema takes
    # them; an integer temperature is a number
    req = chat(temperature=1, top_k=20.0, seed=1e3, max_tokens=5.0)
    assert client.post("/v1/chat/completions", json=req).status_code == 200
    p = engine.calls[-1][1]
    assert (p.temperature, p.top_k, p.seed, p.max_tokens) == (1.0, 20, 1000, 5)
    assert all(type(v) is int for v in (p.top_k, p.seed, p.max_tokens))


def test_messages_roles_parts_tools_and_template_kwargs(client, engine):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "say "}, {"type": "text", "text": "ok"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "user", "content": "say done"},
    ]
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": messages,
            "tools": tools,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "done"
    call = engine.tokenizer.template_calls[-1]
    assert call["tools"] == tools and call["enable_thinking"] is False
    assert [m["role"] for m in call["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assert call["messages"][1]["content"] == "say ok"
    assert call["messages"][2]["tool_calls"][0]["function"]["name"] == "f"
    assert call["messages"][3]["tool_call_id"] == "c1"


def test_max_tokens_gives_length(client):
    body = client.post("/v1/chat/completions", json=chat(max_tokens=5)).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == "Hello"
    assert body["usage"]["completion_tokens"] == 5


def test_stop_string_non_streamed(client):
    body = client.post("/v1/chat/completions", json=chat("say alpha STOP beta", stop="STOP")).json()
    assert body["choices"][0]["message"]["content"] == "alpha "
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_a_multi_token_step_accepts_past_a_stop_string_are_not_output(client, stream):
    # a speculative step can accept tokens after the one that completes a stop string; plain decoding would have
    # stopped there, so they are neither counted nor given logprobs ("multi": 4 byte-tokens a step; "abcSTOPxyz" gives
    # "abcS" then "TOPx": the stop string completes at the step's 3rd token, so 7 tokens, "x" dropped)
    req = chat("multi abcSTOPxyz", stop=["STOP"], logprobs=True, stream=stream,
               **({"stream_options": {"include_usage": True}} if stream else {}))
    r = client.post("/v1/chat/completions", json=req)
    assert r.status_code == 200
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        usage = chunks[-1]["usage"]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        content = "".join(c["delta"].get("content") or "" for c in choices)
        entries = [e for c in choices if c.get("logprobs") for e in c["logprobs"]["content"]]
        finish = [c["finish_reason"] for c in choices if c["finish_reason"]]
    else:
        body = r.json()
        usage, choice = body["usage"], body["choices"][0]
        content, entries, finish = choice["message"]["content"], choice["logprobs"]["content"], [choice["finish_reason"]]
    assert content == "abc"
    assert finish == ["stop"]
    assert usage["completion_tokens"] == 7
    assert [e["token"] for e in entries] == list("abcSTOP")


def test_chat_streamed(client):
    req = chat("say héllo 🎉 STOP no", stream=True, stop=["STOP"], stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=req) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert "".join(content) == "héllo 🎉 "
    assert not any("\ufffd" in s for s in content)
    finish = chunks[-2]["choices"][0]
    assert finish["finish_reason"] == "stop" and finish["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len("héllo 🎉 STOP".encode())
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI: usage null until the last chunk


def test_stream_without_usage(client):
    with client.stream("POST", "/v1/chat/completions", json=chat("say ab", stream=True)) as r:
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(e["choices"] for e in events[:-1])


BAD_REQUESTS = {
    "bad_json": b'{"model": "vibeqwen-test", "messages": [',
    "not_an_object": b"[1, 2]",
    "no_messages": {"model": MODEL},
    "empty_messages": {"model": MODEL, "messages": []},
    "messages_wrong_type": {"model": MODEL, "messages": "hi"},
    "unknown_role": {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
    "negative_temperature": chat(temperature=-0.5),
    "zero_max_tokens": chat(max_tokens=0),
    "top_p_above_one": chat(top_p=1.5),
    "max_tokens_not_int": chat(max_tokens="many"),
    "n_17": chat(n=17),
    "too_long": chat(max_tokens=10_000),
    "image_part": {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    "text_part_without_text": {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
    "stream_options_without_stream": chat(stream_options={"include_usage": True}),
    "template_rejects": {"model": MODEL, "messages": [{"role": "system", "content": "no user"}]},
    "stop_wrong_type": chat(stop=5),
    "logit_bias_key_with_spaces": chat(logit_bias={" 12 ": 1}),
    "logit_bias_key_with_underscore": chat(logit_bias={"1_0": 1}),
    "logit_bias_key_in_other_digits": chat(logit_bias={"\u0661\u0662": 1}),
    "logit_bias_negative_key": chat(logit_bias={"-3": 1}),
    "template_kwargs_set_messages": chat(chat_template_kwargs={"messages": 5}),
    "logit_bias_key_of_5000_digits": chat(logit_bias={"9" * 5000: 1}),  # past int()'s 4300-digit limit
    "max_tokens_of_5000_digits": b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": %s}'
    % (MODEL.encode(), b"9" * 5000),
    "temperature_nan_as_string": chat(temperature="nan"),
    "lone_surrogate": json.dumps(chat("say \ud800 fine")).encode(),  # ASCII JSON: the \ud800 escape
}


@pytest.mark.parametrize("body", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_request_is_400_and_server_keeps_serving(client, body):
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = client.post("/v1/chat/completions", **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    ok = client.post("/v1/chat/completions", json=chat("say fine"))
    assert ok.json()["choices"][0]["message"]["content"] == "fine"


def test_lone_surrogate_is_named(client):
    headers = {"content-type": "application/json"}
    body = json.dumps(chat("say \ud800 fine")).encode()  # ASCII JSON: the \ud800 escape (httpx would not encode it)
    r = client.post("/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text
    body = json.dumps({"model": MODEL, "prompt": "ab\udfff", "max_tokens": 2}).encode()
    r = client.post("/v1/completions", content=body, headers=headers)
    assert r.status_code == 400 and "'\\udfff' at character 2" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("case", ["bad-utf8", "gzip", "deep", "long-integer"])
def test_an_unreadable_json_body_says_why(client, case):
    """Bodies FastAPI cannot decode as JSON for other reasons than a syntax error (not UTF-8, compressed, nested past
    the recursion limit, an integer longer than Python converts) get a 400 that says what the body must be, and
    the server goes on serving."""
    import gzip

    headers = {"content-type": "application/json"}
    body = json.dumps(chat("say fine")).encode()
    if case == "bad-utf8":
        body = body.replace(b"say fine", b"say \xff\xfe fine")
    elif case == "gzip":
        body, headers = gzip.compress(body), {**headers, "content-encoding": "gzip"}
    elif case == "deep":
        body = b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    else:
        body = body[:-1] + b', "seed": 1' + b"0" * 5000 + b"}"
    r = client.post("/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "JSON" in message and message != "There was an error parsing the body", message
    if case == "gzip":
        assert "'gzip'" in message
    if case == "long-integer":
        assert f"no integer of more than {sys.get_int_max_str_digits()} digits" in message, message
    ok = client.post("/v1/chat/completions", json=chat("say fine"))
    assert ok.json()["choices"][0]["message"]["content"] == "fine"


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_body_without_json_content_type_says_so(client, content_type):
    """A JSON body sent without a JSON content type (curl -d sends form encoding) gets a 400 that names the
    header to set; with the header the same bytes are served."""
    body = json.dumps(chat("say fine")).encode()
    headers = {"content-type": content_type} if content_type else {}
    r = client.post("/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "Content-Type: application/json" in message
    assert (content_type or "no Content-Type") in message
    ok = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert ok.json()["choices"][0]["message"]["content"] == "fine"


def test_too_long_names_the_limit(client, engine):
    r = client.post("/v1/chat/completions", json=chat(max_tokens=10_000))
    err = r.json()["error"]
    assert r.status_code == 400 and str(engine.max_model_len) in err["message"]
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
    err = client.post("/v1/chat/completions", json=chat("x" * 5000)).json()["error"]
    assert str(engine.max_model_len) in err["message"] and err["code"] == "context_length_exceeded"


def test_a_refused_prompt_of_several_is_named(client, engine):
    """/v1/completions with a list of prompts: the error says which one (0-based), from each check that refuses
    one (its text's length, its length in tokens)."""
    limit = engine.max_model_len
    cases = [(["fine", "x" * (limit * 40)], 1, "context_length_exceeded"),
             ([[5], [5], [7] * limit], 2, "context_length_exceeded")]  # ids past the vocabulary: test_openai_parity
    for prompt, bad, code in cases:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == code, err
        assert err["message"].startswith(f"prompt {bad} (of {len(prompt)}): "), err
    # one prompt: the message as before
    err = client.post("/v1/completions", json={"model": MODEL, "prompt": [7] * limit}).json()["error"]
    assert err["message"].startswith("This model's maximum context length"), err
    # an error about the request, not one of its prompts: not named (found by a review: logit_bias was)
    # (logit_bias and stop_token_ids past the vocabulary: test_openai_parity, whose engine checks them)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("min_tokens (5)"), r.text


def test_far_too_long_prompt_is_refused_before_encoding(client, engine, monkeypatch):
    encoded = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "min_num_tokens", lambda text: len(text.encode()), raising=False)
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text: encoded.append(len(text)) or encode(text))
    big = "x" * (engine.max_model_len + 10)
    for path, body in [("/v1/chat/completions", chat(big)), ("/v1/completions", {"model": MODEL, "prompt": big})]:
        r = client.post(path, json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded", err
        assert str(engine.max_model_len) in err["message"] and err["param"] in ("messages", "prompt")
    assert all(n < engine.max_model_len for n in encoded)  # the big texts were never encoded
    assert client.post("/v1/chat/completions", json=chat()).json()["choices"][0]["message"]["content"]


def test_a_list_of_prompts_stops_encoding_at_the_first_that_cannot_fit(client, engine, monkeypatch):
    """A break-it trial's finding: /v1/completions encoded every text prompt of a list before refusing the first
    too long one (64 prompts of 100k tokens: 8 s). Each text is now refused as soon as it is encoded; without
    truncate_prompt_tokens, the prompts after it are never encoded. The message is the engine's (and the scoring
    pass's own for max_tokens 0 with echo)."""
    limit = engine.max_model_len
    encoded = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text: encoded.append(text) or encode(text))
    ids = encode("hello world ")
    long_text = "hello world " * (limit // len(ids) + 1)  # fits min_num_tokens' bound, not the context
    assert len(encode(long_text)) >= limit
    for extra, expect in [({"max_tokens": 2}, "which leaves no room for a completion"),
                          ({"max_tokens": 0, "echo": True}, f"takes up to {limit - 1} tokens")]:
        encoded.clear()
        prompts = ["fine", long_text, "later one", "and another"]
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompts, **extra})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
        assert err["message"].startswith("prompt 1 (of 4): ") and expect in err["message"], err
        assert encoded == prompts[:2]  # the two after it were never encoded
    # token-id prompts are checked at the same point: the same error as text for the same request (a review found a
    # min_tokens error for ids where text got the context one)
    for prompt in ([7] * limit, long_text):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "min_tokens": 20})
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    # with truncate_prompt_tokens the long text is kept (its last tokens) and every prompt is encoded
    encoded.clear()
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["fine", long_text], "max_tokens": 1,
                                             "truncate_prompt_tokens": 8})
    assert r.status_code == 200 and len(encoded) == 2, r.text


def test_validation_error_names_the_param(client):
    err = client.post("/v1/chat/completions", json=chat(temperature=-1)).json()["error"]
    assert err["param"] == "temperature"
    # a field of several accepted forms (a union): the error of the form the value came closest to, not one line
    # per form
    for path, body, param, message in [
        ("/v1/completions", {"model": MODEL, "prompt": [-1]}, "prompt[0]",
         "prompt[0]: Input should be greater than or equal to 0"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["", None]}, "stop[1]",
         "stop[1]: Input should be a valid string"),
        ("/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, "prompt",
         "prompt: Input should be a valid string or a valid list"),
        ("/v1/chat/completions", chat(stop=5), "stop", "stop: Input should be a valid string or a valid list"),
        ("/v1/responses", {"model": MODEL, "input": 5}, "input", "input: Input should be a valid string or a valid list"),
        # the member with the fewest errors: a list of strings with one non-string, not a list of token ids
        ("/v1/completions", {"model": MODEL, "prompt": ["hello", "world", 5]}, "prompt[2]",
         "prompt[2]: Input should be a valid string"),
        # the member the value reaches deepest into: the object form of tool_choice, without its class name
        ("/v1/chat/completions", {**chat(), "tool_choice": {"type": "function", "function": {"name": 5}}},
         "tool_choice.function.name", "tool_choice.function.name: Input should be a valid string"),
        ("/v1/chat/completions", {**chat(), "tool_choice": {"type": "function"}}, "tool_choice.function",
         "tool_choice.function: Field required"),
        # an earlier reply's reasoning is text (a new user's report: a number or an object was silently dropped)
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {
            "role": "assistant", "content": "a", "reasoning_content": 5}]}, "messages[1].reasoning_content",
         "messages[1].reasoning_content: Input should be a valid string"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {
            "role": "assistant", "content": "a", "reasoning": [1, 2]}]}, "messages[1].reasoning",
         "messages[1].reasoning: Input should be a valid string"),
        ("/v1/chat/completions", {**chat(), "guided_json": 5}, "guided_json",
         "guided_json: Input should be a valid dictionary or a valid string or a valid boolean"),
        # JSON types as they are, as OpenAI takes them (pydantic's lax mode would take true as 1, "yes" as true)
        ("/v1/chat/completions", chat(max_tokens=True), "max_tokens", "max_tokens: Input should be a valid integer"),
        ("/v1/chat/completions", chat(stream="yes"), "stream", "stream: Input should be a valid boolean"),
        ("/v1/chat/completions", chat(temperature="0.5"), "temperature",
         "temperature: Input should be a valid number"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": 1}, "echo", "echo: Input should be a valid boolean"),
        ("/v1/chat/completions", chat(stream=True, stream_options={"include_usage": "true"}),
         "stream_options.include_usage", "stream_options.include_usage: Input should be a valid boolean"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": None}]}, "messages[0]",
         "messages[0]: a user message needs its `content` (text, or a list of text parts)"),
        ("/v1/chat/completions", {**chat(), "tools": [{"type": "function", "function": {"name": "f"}}] * 2},
         "tools", "tools: two tools are named 'f'; tool names must be unique"),
        ("/v1/chat/completions", chat(max_tokens=5.5), "max_tokens",
         "max_tokens: Input should be a valid integer"),
        ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": True}, "max_output_tokens",
         "max_output_tokens: Input should be a valid integer"),
        # the Responses API's own field names, and the validators' messages without pydantic's "Value error, "
        ("/v1/responses", {"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "f"}] * 2}, "tools",
         "tools: two tools are named 'f'; tool names must be unique"),
        ("/v1/responses", {"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "f", "strict": "yes"}]},
         "tools[0].strict", "tools[0].strict: Input should be a valid boolean"),
        ("/v1/responses", {"model": MODEL, "input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                           "schema": {}, "strict": "true"}}},
         "text.format.strict", "text.format.strict: Input should be a valid boolean"),
        ("/v1/responses", {"model": MODEL, "input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
         "text.format.schema", 'text.format of type "json_schema" needs its `schema` ({"type": "json_schema", '
                               '"name": ..., "schema": {...}})'),
        ("/v1/responses", {"model": MODEL, "input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c1", "name": "g", "arguments": "{}"}]}, "input[1].call_id",
         "two function_call items have the call_id 'c1'; an output could answer either"),
        ("/v1/responses", {"model": MODEL, "input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": {"temp": 20}}]}, "input[1].output",
         "a function_call_output's output must be text or a list of text parts"),
        # a typo in structured_outputs would leave the reply unconstrained
        ("/v1/chat/completions", chat(structured_outputs={"jsn": {"type": "object"}}), "structured_outputs.jsn",
         "structured_outputs.jsn: Extra inputs are not permitted"),
        ("/v1/chat/completions", chat(chat_template_kwargs={"tools": 5}), "chat_template_kwargs.tools",
         "chat_template_kwargs may not set tools (send them as the request's tools)"),
        # dict keys the client chose are never taken for union members
        ("/v1/chat/completions", chat(logit_bias={"-1": 500}), "logit_bias.-1",
         "logit_bias.-1: Input should be less than or equal to 100"),
    ]:
        r = client.post(path, json=body)
        assert r.status_code == 400 and (r.json()["error"]["param"], r.json()["error"]["message"]) == (param, message)
    # errors of other fields are kept next to a union's
    err = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b", 5], "max_tokens": -1}).json()
    assert err["error"]["message"] == ("prompt[2]: Input should be a valid string; max_tokens: Input should be "
                                       "greater than or equal to 0"), err
    # at most 5 errors in the message
    bad = {"model": MODEL, "prompt": "hi", "temperature": "x", "top_p": "x", "top_k": "x", "min_p": "x", "seed": "x",
           "presence_penalty": "x", "frequency_penalty": "x"}
    msg = client.post("/v1/completions", json=bad).json()["error"]["message"]
    assert msg.count("Input should be") == 5 and msg.endswith("; and 2 more errors"), msg
    err = client.post("/v1/chat/completions", json=chat(min_tokens=10, max_tokens=2)).json()["error"]
    assert err["param"] == "min_tokens" and "may generate: 2 tokens" in err["message"]
    body = {**chat(), "response_format": {"type": "json_object"}, "guided_choice": ["a"]}
    err = client.post("/v1/chat/completions", json=body).json()["error"]
    assert "got response_format, guided_choice" in err["message"] and err["param"] == "guided_choice"


def test_tokenize_and_detokenize(client, engine, monkeypatch):
    """vLLM's /tokenize (a prompt, or messages as /v1/chat/completions renders them) and /detokenize."""
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "hé", "return_token_strs": True})
    assert r.status_code == 200 and r.json() == {"count": 3, "max_model_len": engine.max_model_len,
                                                 "tokens": list("hé".encode()), "token_strs": ["h", "\ufffd", "\ufffd"]}
    seen = []
    add = engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda rid, ids, params: seen.append(list(ids)) or add(rid, ids, params))
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hi"}]}
    client.post("/v1/chat/completions", json={**chat(), **body})
    r = client.post("/tokenize", json=body).json()
    assert r["tokens"] == seen[0] and r["count"] == len(seen[0]) and r["token_strs"] is None
    # tools as the chat endpoint offers them: not under tool_choice "none"
    tool = {"type": "function", "function": {"name": "f"}}
    for choice, offered in (("auto", True), ("none", False)):
        client.post("/tokenize", json={**body, "tools": [tool], "tool_choice": choice})
        assert (engine.tokenizer.template_calls[-1]["tools"] is not None) == offered, choice
    # not limited to the context: a client counts to check
    assert client.post("/tokenize", json={"prompt": "x" * (engine.max_model_len + 5)}).json()["count"] > \
        engine.max_model_len
    r = client.post("/detokenize", json={"model": MODEL, "tokens": list("dé".encode()) + [SPECIALS["<|im_end|>"]]})
    assert r.json() == {"prompt": "dé<|im_end|>"}
    for path, bad, param in [("/tokenize", {"prompt": "x", "messages": body["messages"]}, None),
                             ("/tokenize", {}, None), ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
                             ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                              "messages")]:
        r = client.post(path, json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.post("/tokenize", json={"model": "gpt-4", "prompt": "x"}).status_code == 404


def test_unknown_model_is_404(client):
    r = client.post("/v1/chat/completions", json={**chat(), "model": "gpt-4"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and "gpt-4" in r.json()["error"]["message"]


def test_a_lone_surrogate_quoted_in_an_error_is_escaped(client):
    """The break-it review: the 404 for model "\\ud800" (valid JSON, no UTF-8) failed to encode, so a 500."""
    body = '{"prompt": "hi", "max_tokens": 2, "model": "x\\ud800y"}'
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and "x\\ud800y" in r.json()["error"]["message"]


def test_unknown_route_is_openai_shaped_404(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"] == "Invalid URL (GET /v1/nothing)"


def test_a_trailing_slash_is_an_openai_shaped_404_not_a_redirect(client):
    """The new-user trial: `POST /v1/chat/completions/` got an empty 307 (FastAPI's slash redirect)."""
    r = client.post("/v1/chat/completions/", json=chat(), follow_redirects=False)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_completions_without_max_tokens_take_16_or_the_room_left_and_null_the_room_left(client, engine):
    """Unset max_tokens on /v1/completions: OpenAI's 16, or the room the prompt leaves where that is less (the
    new-user trial: a prompt 4 tokens short of the context was refused for asking 16 tokens it never asked for);
    an explicit null is the room left, as vLLM reads it; an explicit value that does not fit is still refused."""
    room = 4
    prompt = [5] * (engine.max_model_len - room)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text
    assert engine.calls[-1][1].max_tokens == room
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7]})
    assert r.status_code == 200 and engine.calls[-1][1].max_tokens == 16
    # an explicit null is the room left, as in vLLM (the new-user trial: it was 16, as if unset)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": None})
    assert r.status_code == 200 and engine.calls[-1][1].max_tokens == engine.max_model_len - 3, r.text
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": room + 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_wrong_method_names_the_allowed_one(client):
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"] == "GET is not allowed on /v1/chat/completions (use POST)"
    assert r.headers["allow"] == "POST"


def test_engine_failure_fails_only_that_request(client, engine):
    r = client.post("/v1/chat/completions", json=chat("fail"))
    assert r.status_code == 500 and "engine exploded" in r.json()["error"]["message"]
    # The request that raised in step() was aborted in the engine, so the engine is idle again.
    assert engine.aborted_users() == ["fail"] and engine.num_requests == 0
    r = client.post("/v1/chat/completions", json=chat("bad"))
    assert r.status_code == 400 and "rejects" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json=chat("invalid"))
    assert r.status_code == 400 and "cannot serve" in r.json()["error"]["message"]
    assert (
        client.post("/v1/chat/completions", json=chat("say ok")).json()["choices"][0]["message"]["content"]
        == "ok"
    )


def test_engine_failure_mid_stream_reports_error_event(client):
    with client.stream("POST", "/v1/chat/completions", json=chat("fail", stream=True)) as r:
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    assert "engine exploded" in events[-2]["error"]["message"]


# ---- AsyncEngine directly ----


def prompt(engine: FakeEngine, user: str) -> list[int]:
    return engine.tokenizer.encode(f"<|im_start|>user\n{user}<|im_end|>\n")


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)


def tokens_sent(engine: FakeEngine, request_id: str) -> int:
    r = engine.running.get(request_id)
    return 0 if r is None else r.sent


async def collect(async_engine: AsyncEngine, rid: str, ids: list[int], max_tokens: int = 1000) -> list:
    return [o async for o in async_engine.generate(rid, ids, SamplingParams(max_tokens=max_tokens))]


def test_async_engine_batches_concurrent_requests(engine, async_engine):
    async def one(i: int) -> str:
        text = []
        params = SamplingParams(max_tokens=100)
        async for out in async_engine.generate(f"r{i}", prompt(engine, f"say reply {i}"), params):
            text.append(out.text)
        assert out.finish_reason == "stop" and out.num_tokens == len(f"reply {i}") + 1
        return "".join(text)

    async def main():
        return await asyncio.gather(*(one(i) for i in range(6)))

    assert asyncio.run(main()) == [f"reply {i}" for i in range(6)]
    assert engine.peak_running > 1
    assert sorted(engine.completed) == sorted(f"say reply {i}" for i in range(6))


def test_async_engine_consumer_break_aborts(engine, async_engine):
    async def main():
        async for out in async_engine.generate("r", prompt(engine, "slow"), SamplingParams(max_tokens=1000)):
            if out.num_tokens == 3:
                break

    asyncio.run(main())
    wait_for(lambda: engine.aborted == ["r"])
    assert engine.completed == [] and engine.num_requests == 0


@pytest.mark.parametrize("how", ["closed", "dropped"])
def test_async_engine_stream_never_read_aborts(engine, async_engine, how):
    # a handler that stops before reading its outputs (a client gone at once): the request must not run on
    async def main():
        stream = async_engine.generate("r", prompt(engine, "slow"), SamplingParams(max_tokens=1000))
        if how == "closed":
            await stream.aclose()
        del stream

    asyncio.run(main())
    wait_for(lambda: engine.aborted == ["r"])
    assert engine.completed == [] and not async_engine._active  # its place in flight is free again


@pytest.mark.parametrize("limits", [{"max_num_seqs": 1}], ids=["one_running"])
def test_async_engine_abort_queued_and_running(engine, async_engine):
    async def main():
        running = asyncio.create_task(collect(async_engine, "slow", prompt(engine, "slow")))
        queued = asyncio.create_task(collect(async_engine, "queued", prompt(engine, "say hi")))
        await until(lambda: engine.num_requests == 2 and tokens_sent(engine, "slow") >= 3)
        async_engine.abort("queued")
        async_engine.abort("slow")
        return await running, await queued

    running, queued = asyncio.run(main())
    assert running[-1].finish_reason == "abort" and 0 < len(running) - 1 < 200
    assert all(o.finish_reason is None for o in running[:-1])
    assert [o.finish_reason for o in queued] == ["abort"]
    # Both reached the engine, only the first ever ran; both were aborted there.
    assert [c[0] for c in engine.calls] == ["slow", "say hi"] and engine.started == ["slow"]
    assert sorted(engine.aborted) == ["queued", "slow"] and engine.num_requests == 0
    assert engine.completed == []


def test_async_engine_abort_output_counts_tokens_so_far(engine, async_engine):
    async def main():
        task = asyncio.create_task(collect(async_engine, "slow", prompt(engine, "slow")))
        await until(lambda: tokens_sent(engine, "slow") >= 3)
        async_engine.abort("slow")
        return await task

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "abort" and len(outs) > 1
    assert outs[-1].num_tokens == outs[-2].num_tokens == len(outs) - 1


@pytest.mark.parametrize("limits", [{"max_num_seqs": 1}], ids=["one_running"])
def test_async_engine_step_failure_spares_queued_requests(engine, async_engine):
    async def main():
        engine.gate.clear()
        failing = asyncio.create_task(collect(async_engine, "fail", prompt(engine, "fail")))
        queued = asyncio.create_task(collect(async_engine, "queued", prompt(engine, "say ok")))
        # Both tasks post their request on their first turn; only then may the engine step.
        await asyncio.sleep(0.01)
        engine.gate.set()
        with pytest.raises(RuntimeError, match="engine exploded"):
            await failing
        return await queued

    outs = asyncio.run(main())
    assert engine.started == ["fail", "say ok"]
    assert "".join(o.text for o in outs) == "ok" and outs[-1].finish_reason == "stop"


def test_async_engine_rejects_over_long_requests(async_engine):
    # check_request is the engine's validate_request: the limit is named in the message.
    with pytest.raises(ValueError, match="4096"):
        async_engine.check_request([1] * 4000, SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="4096"):
        async_engine.check_request([1] * 4096, SamplingParams(max_tokens=1))
    async_engine.check_request([1] * 4000, SamplingParams(max_tokens=96))


@pytest.mark.parametrize("limits", [{"max_num_seqs": 1, "max_queued": 1}], ids=["1+1"])
def test_async_engine_over_capacity_raises(engine, async_engine):
    async def main():
        rids = ["running", "queued"]
        tasks = [asyncio.create_task(collect(async_engine, rid, prompt(engine, "slow"))) for rid in rids]
        await until(lambda: engine.num_requests == 2)
        with pytest.raises(EngineOverloadedError, match="capacity"):
            await collect(async_engine, "third", prompt(engine, "say no"))
        for rid in rids:
            async_engine.abort(rid)
        return [await t for t in tasks]

    outs = asyncio.run(main())
    assert [o[-1].finish_reason for o in outs] == ["abort", "abort"]
    assert "say no" not in [c[0] for c in engine.calls]


# ---- a live server: the openai SDK, concurrency, disconnects ----


def test_openai_sdk_chat(sdk):
    r = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == DEFAULT_REPLY and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(DEFAULT_REPLY.encode()) + 1
    assert r.id.startswith("chatcmpl-") and r.model == MODEL


def test_openai_sdk_stream_with_stop_and_usage(sdk):
    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "say one two END three"}],
        stop=["END"],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len("one two END")


def test_openai_sdk_errors_then_serves(sdk):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=MODEL, messages=[], max_tokens=5)
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.APIError, match="engine exploded"):
        list(
            sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "fail"}], stream=True
            )
        )
    r = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "say still here"}])
    assert r.choices[0].message.content == "still here"
    assert [m.id for m in sdk.models.list()] == [MODEL]


def test_concurrent_requests_batch_and_all_complete(sdk, engine):
    results: dict[int, str] = {}
    # Long enough replies (about 50 steps of 1 ms) that the requests overlap in the engine.
    replies = {i: f"answer {i} " + "." * 40 for i in range(8)}

    def one(i: int) -> None:
        msgs = [{"role": "user", "content": f"say {replies[i]}"}]
        if i % 2:
            stream = sdk.chat.completions.create(model=MODEL, messages=msgs, stream=True)
            results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        else:
            results[i] = sdk.chat.completions.create(model=MODEL, messages=msgs).choices[0].message.content

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == replies
    assert engine.peak_running > 1
    assert len(engine.completed) == 8 and engine.aborted == []


def test_client_disconnect_mid_stream_aborts(server, engine):
    with (
        httpx.Client(base_url=server, timeout=10) as http,
        http.stream("POST", "/v1/chat/completions", json=chat("slow", stream=True)) as r,
    ):
        # Read a few content chunks, then hang up mid-stream.
        contents = (line for line in r.iter_lines() if '"content":"' in line)
        assert [next(contents) for _ in range(3)]
    wait_for(lambda: engine.aborted_users() == ["slow"])
    assert engine.completed == [] and engine.num_requests == 0
    with httpx.Client(base_url=server, timeout=10) as http:
        r = http.post("/v1/chat/completions", json=chat("say next"))
    assert r.json()["choices"][0]["message"]["content"] == "next"


def test_client_disconnect_non_streamed_aborts(server, engine):
    with httpx.Client(base_url=server, timeout=0.2) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=chat("slow"))
    wait_for(lambda: engine.aborted_users() == ["slow"])
    assert engine.completed == [] and engine.num_requests == 0
    with httpx.Client(base_url=server, timeout=10) as http:
        r = http.post("/v1/chat/completions", json=chat("say next"))
    assert r.json()["choices"][0]["message"]["content"] == "next"


@pytest.mark.parametrize("limits", [{"max_num_seqs": 1, "max_queued": 1}], ids=["1+1"])
def test_overload_is_503_then_serves_again(server, sdk, engine):
    with httpx.Client(base_url=server, timeout=10) as http, ExitStack() as streams:
        req = chat("slow", stream=True)
        responses = [
            streams.enter_context(http.stream("POST", "/v1/chat/completions", json=req)) for _ in "ab"
        ]
        # One running, one queued: capacity (max_num_seqs + max_queued) is reached.
        wait_for(lambda: engine.num_requests == 2)
        assert [r.status_code for r in responses] == [200, 200]
        r = http.post("/v1/chat/completions", json=chat("say no"))
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["code"]) == ("service_unavailable", "overloaded")
        assert "capacity" in err["message"] and r.headers.get("retry-after") == "1"
        assert "(2 of 2 sequences in flight, this request needs 1)" in err["message"]  # n x prompts, not requests
        with pytest.raises(openai.InternalServerError) as e:
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "say no"}])
        assert e.value.status_code == 503 and e.value.body["code"] == "overloaded"
        # more choices than the server ever holds: a 400 (retrying cannot help), not a 503
        r = http.post("/v1/chat/completions", json=chat("say no", n=3))
        assert r.status_code == 400 and "retry-after" not in r.headers, r.text
        assert "--max-num-seqs" in r.json()["error"]["message"]
    # Closing both streams aborted them; the refused requests never reached the engine.
    wait_for(lambda: engine.aborted_users() == ["slow", "slow"] and engine.num_requests == 0)
    assert "say no" not in [c[0] for c in engine.calls]
    r = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "say back"}])
    assert r.choices[0].message.content == "back"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("limits", [{"max_num_seqs": 1, "max_queued": 1}], ids=["1+1"])
def test_simultaneous_burst_over_capacity_gets_503(async_engine, engine, monkeypatch, stream):
    # In-process ASGI and inline tokenization make the handlers' interleaving deterministic: three requests
    # for two places take turns at each await, so all reach the capacity check before any reply starts.
    async def inline(func, *args, **kwargs):
        await asyncio.sleep(0)
        return func(*args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", inline)

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(async_engine, MODEL))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as http:
            req = chat("burst", stream=stream)
            return await asyncio.gather(*(http.post("/v1/chat/completions", json=req) for _ in range(3)))

    replies = asyncio.run(main())
    assert sorted(r.status_code for r in replies) == [200, 200, 503]
    for r in replies:
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "overloaded"
        elif stream:
            chunks = sse_events(r.text)[:-1]
            assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == BURST_REPLY
        else:
            assert r.json()["choices"][0]["message"]["content"] == BURST_REPLY
    assert sorted(engine.completed) == ["burst", "burst"]


def test_a_requests_prompts_build_their_indexes_once_off_the_event_loop(monkeypatch):
    """The review: a completions request of 16 prompts with 800k stop strings built the index 16 times on the event
    loop (12 s during which every stream stalled). Equal stop / logit_bias lists now share one build, made in a
    worker thread."""
    from vibeqwen.server.serving import Serving

    threads = []
    build = SamplingParams.build_indexes
    monkeypatch.setattr(SamplingParams, "build_indexes",
                        lambda self: threads.append(threading.current_thread()) or build(self))
    stop = [f"s{i}" for i in range(1000)]
    same = [SamplingParams(stop=list(stop), logit_bias={1: 2.0}, max_tokens=m) for m in (1, 2, 3)]
    other = SamplingParams(stop=["x"], logit_bias={1: 2.0})
    asyncio.run(Serving.index_params(None, [*same, other]))
    assert len(threads) == 2 and threading.main_thread() not in threads
    assert all(p.stop_strings is same[0].stop_strings for p in same)
    assert other.stop_strings.strings == ["x"] and other.logit_bias_tensors is same[0].logit_bias_tensors


# ---- nullable fields, unknown and unsupported fields, vLLM's request extensions ----


def test_null_means_the_default(client):
    r = client.post("/v1/chat/completions", json=chat(n=None, stream=None, ignore_eos=None, min_tokens=None))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "echo": None, "n": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field,value", [("use_beam_search", True), ("prompt_logprobs", 2),
                                         ("return_tokens_as_token_ids", True), ("echo", True)])
def test_vllm_fields_this_server_lacks_are_refused(client, field, value):
    r = client.post("/v1/chat/completions", json=chat(**{field: value}))
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    # asking for nothing is fine
    off = {"use_beam_search": False, "prompt_logprobs": None, "return_tokens_as_token_ids": False, "echo": False}
    assert client.post("/v1/chat/completions", json=chat(**{field: off[field]})).status_code == 200


def test_unknown_fields_are_logged_as_ignored(client, caplog):
    with caplog.at_level("WARNING", logger="vibeqwen.server"):
        r = client.post("/v1/chat/completions", json=chat(max_token=5, frobnicate={"a": 1}))
    assert r.status_code == 200, r.text
    assert any("frobnicate, max_token" in rec.getMessage() and "ignored" in rec.getMessage()
               for rec in caplog.records), [rec.getMessage() for rec in caplog.records]


def test_cors_preflight_and_headers(client, async_engine):
    """As vLLM by default: any origin may call the API (a browser's preflight answered, the reply's CORS header set);
    a policy of named origins refuses others, and the preflight needs no API key."""
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = client.options("/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*", (r.status_code, r.headers)
    r = client.post("/v1/chat/completions", json=chat(max_tokens=1), headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    config = ServerConfig(api_key="k", allowed_origins=("https://app.example",))
    with TestClient(create_app(async_engine, MODEL, config)) as strict:
        r = strict.options("/v1/chat/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = strict.options("/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        assert strict.get("/v1/models").status_code == 401  # the API itself still asks for the key


def test_client_text_cannot_forge_log_lines(client, caplog):
    """A field name or path with a newline, NUL or terminal escape is logged escaped: one line, printable."""
    forged = "evil\nINFO vibeqwen.server: FAKE LINE\u0000\u001b[31mRED"
    with caplog.at_level("INFO", logger="vibeqwen.server"):
        r = client.post("/v1/chat/completions", json=chat(max_tokens=1, **{forged: 1}))
        assert r.status_code == 200, r.text
        assert client.get("/v1/models/%00%0aFAKE").status_code == 404
    lines = [rec.getMessage() for rec in caplog.records]
    assert any("evil\\nINFO" in m and "ignored" in m for m in lines), lines
    assert any("/v1/models/\\x00\\nFAKE" in m for m in lines), lines
    assert all(m.isprintable() for m in lines), lines


@pytest.mark.parametrize("stop", ["", ["x", ""], "\ud83d", ["ok", "a\udc00"]])
def test_an_empty_stop_string_is_refused(client, stop):
    """An empty stop string, and one with a lone surrogate (sent as JSON's \\ud83d escape: no UTF-8 holds it)."""
    r = client.post("/v1/chat/completions", content=json.dumps(chat(stop=stop)),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, engine):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "0123456789say ok", "max_tokens": 5,
                                              "truncate_prompt_tokens": 6})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "ok" and r.json()["usage"]["prompt_tokens"] == 6
    # longer than the context before truncation: served from its end
    long = "x" * 5000 + "say ok"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": long, "max_tokens": 5,
                                              "truncate_prompt_tokens": 100})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100, r.text
    # the rendered prompt's last 20 tokens: "say yes" and the template after it
    r = client.post("/v1/chat/completions", json=chat("say yes", truncate_prompt_tokens=20))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 20, r.text
    assert r.json()["choices"][0]["message"]["content"] == "yes"
    # more than the context holds: a 400 that says what fits (not -1, which keeps the whole context and leaves no
    # room for a completion)
    too_many = engine.max_model_len + 1
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": long, "max_tokens": 5,
                                              "truncate_prompt_tokens": too_many})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    message = r.json()["error"]["message"]
    assert f"more than the context holds, {engine.max_model_len} tokens" in message and "-1" not in message
    # -1 (the whole context) or a count that leaves too little room: the context error says what truncation kept
    # and the largest value that fits
    limit = engine.max_model_len
    cases = [("/v1/completions", {"model": MODEL, "prompt": long, "truncate_prompt_tokens": -1, "max_tokens": 1},
              f"kept the prompt's last {limit} tokens; {limit - 1} or fewer leave room for 1 more)"),
             ("/v1/chat/completions", chat(long, truncate_prompt_tokens=limit - 2, max_tokens=5),
              f"kept the prompt's last {limit - 2} tokens; {limit - 5} or fewer leave room for 5 more)"),
             ("/v1/completions", {"model": MODEL, "prompt": long, "truncate_prompt_tokens": -1, "max_tokens": 0,
                                  "echo": True},  # scoring: one free position
              f"kept the prompt's last {limit} tokens; {limit - 1} or fewer leave room for 1 more)"),
             ("/v1/completions", {"model": MODEL, "prompt": long, "truncate_prompt_tokens": 10, "max_tokens": limit},
              "kept the prompt's last 10 tokens)")]  # no value leaves room for max_tokens: none named
    for path, body, hint in cases:
        err = client.post(path, json=body).json()["error"]
        assert err["code"] == "context_length_exceeded", err
        assert err["message"].endswith(f" (truncate_prompt_tokens {hint}"), err
    # a prompt the truncation did not cut (shorter than, or as long as, what it keeps): the plain error
    ids = client.post("/tokenize", json={"model": MODEL, "prompt": "say ok"}).json()["tokens"]
    for keep in (50, len(ids)):
        err = client.post("/v1/completions", json={"model": MODEL, "prompt": "say ok", "truncate_prompt_tokens": keep,
                                                   "max_tokens": limit}).json()["error"]
        assert err["code"] == "context_length_exceeded" and "truncate_prompt_tokens" not in err["message"], err


def test_allowed_token_ids_and_bad_words_reach_the_engine(client, engine):
    r = client.post("/v1/chat/completions", json=chat(allowed_token_ids=[104, 105], bad_words=["ab"], n=2))
    assert r.status_code == 200, r.text
    constraints = [p.constraint for _, p in engine.calls[-2:]]
    assert constraints[0] is not None and constraints[0] is not constraints[1]  # one per choice
    mask = constraints[0].allowed(2000)
    assert mask.sum() == 2 and mask[104] and mask[105]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats(client, route):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    if route == "chat":
        url, body = "/v1/chat/completions", chat("say abc", stream=True, stream_options=opts)
    else:
        url, body = "/v1/completions", {"model": MODEL, "prompt": "say abc", "max_tokens": 8, "stream": True,
                                        "stream_options": opts}
    with client.stream("POST", url, json=body) as r:
        events = sse_events(r.read().decode())
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks and all(e["usage"] is not None for e in chunks), events
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(counts) and events[-2]["usage"]["completion_tokens"] >= counts[-1]


def test_history_refusal_parts_and_tool_call_shape(client, engine):
    history = [{"role": "user", "content": "a"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
               {"role": "user", "content": "b"}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": history})
    assert r.status_code == 200, r.text
    assert engine.tokenizer.template_calls[-1]["messages"][1]["content"] == "I can't."
    bad = [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"foo": 1}]},
           {"role": "user", "content": "b"}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": bad})
    assert r.status_code == 400 and "tool call" in r.json()["error"]["message"], r.text
    # as OpenAI's API: a call's id and type "function", a tool message's tool_call_id, a user content list's parts
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    answer = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    for messages, want in (
        ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [call]}, answer], 200),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{k: v for k, v in call.items()
                                                                                 if k != "type"}]}, answer], 200),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [dict(call, type="bogus")]}], 400),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{k: v for k, v in call.items()
                                                                                 if k != "id"}]}], 400),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [call]},
          {"role": "tool", "content": "42"}], 400),
        ([{"role": "user", "content": []}], 400),
    ):
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
        assert r.status_code == want, (messages, r.text)
        if want == 400:
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and any(
                k in err["message"] for k in ("tool_call_id", "type", "`id`", "at least one part")), err



def test_truncate_prompt_tokens_zero_is_refused(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_reasoning_effort_none_turns_thinking_off(client, engine):
    assert client.post("/v1/chat/completions", json=chat(reasoning_effort="none")).status_code == 200
    assert engine.tokenizer.template_calls[-1]["enable_thinking"] is False
    assert client.post("/v1/chat/completions", json=chat(reasoning_effort="high")).status_code == 200
    assert engine.tokenizer.template_calls[-1]["enable_thinking"] is True
    r = client.post("/v1/chat/completions", json=chat(reasoning_effort="bogus"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text


def test_service_fields_are_accepted_quietly_and_a_request_template_refused(client, caplog):
    with caplog.at_level("WARNING", logger="vibeqwen.server"):
        r = client.post("/v1/chat/completions", json=chat(store=False, metadata={"a": "b"}, service_tier="auto",
                                                             prompt_cache_key="k", safety_identifier="u"))
    assert r.status_code == 200 and not [x for x in caplog.records if "ignored" in x.getMessage()]
    r = client.post("/v1/chat/completions", json=chat(chat_template="{{ 1/0 }}"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text


def test_truncate_beyond_the_context_is_refused(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "truncate_prompt_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_continuous_usage_counts_each_choice(client):
    body = chat("say abcdef", stream=True, n=2, stream_options={"include_usage": True, "continuous_usage_stats": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r.read().decode())
    seen = {0: 0, 1: 0}
    for e in events[:-2]:
        if e.get("choices") and e["choices"][0]["delta"].get("content"):
            i = e["choices"][0]["index"]
            seen[i] += 1
            assert e["usage"]["completion_tokens"] >= seen[i] and e["usage"]["completion_tokens"] <= 7
    assert events[-2]["usage"]["completion_tokens"] == 14  # the last chunk: both choices


def test_tools_nested_too_deeply_for_the_template_are_named(client, engine, monkeypatch):
    """A conversation or tool schema nested past Python's recursion limit in the chat template (the real template
    at ~300 levels of tool parameters) is a 400 naming the tools, not the template's "maximum recursion depth
    exceeded"."""
    def deep(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded in comparison")

    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", deep)
    body = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    for req, param in ((body, "tools"), (chat(), "messages")):
        r = client.post("/v1/chat/completions", json=req)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"] == ("cannot apply the chat template: the messages or tools are nested too "
                                                "deeply"), r.text
    monkeypatch.undo()
    assert client.post("/v1/chat/completions", json=chat()).status_code == 200


@pytest.mark.parametrize("seed,ok", [(2**64, False), (-(2**63) - 1, False), (2**64 - 1, True), (-(2**63), True)])
def test_seed_bounds_are_named_as_integers(client, seed, ok):
    """A seed outside torch.Generator's range gets a 400 naming the bounds as integers (pydantic's `le` message
    printed 2**64 - 1 as 18446744073709552000); the bounds themselves are accepted."""
    r = client.post("/v1/chat/completions", json=chat("say fine", seed=seed))
    if ok:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "seed" and "from -9223372036854775808 to 18446744073709551615" in err["message"], err


def test_keep_specials_gated_by_windows_that_move_forward():
    """`_KeepSpecials` with a gate: specials of `gated` are kept only after the gate token, also when the
    incremental detokenizer decodes windows of the reply that no longer hold the gate."""
    from vibeqwen.server.async_engine import _KeepSpecials

    names = {1: "a", 2: "<g>", 3: "<s>", 4: "<k>", 5: "b"}  # 2: the gate, 3: a gated special, 4: always kept
    specials = {2, 3, 4}

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(names[i] for i in ids if not (skip_special_tokens and i in specials))

    d = _KeepSpecials(Tok(), frozenset({4}), frozenset({3}), gate=2)
    assert d.decode([1, 3, 4, 5], skip_special_tokens=True) == "a<k>b"  # before the gate: <s> dropped
    assert d.decode([3, 2, 3, 1], skip_special_tokens=True) == "<s>a"  # the gate's window: <s> kept after it only
    assert d.decode([3, 5], skip_special_tokens=True) == "<s>b"  # a later window, wholly after the gate
    assert d.decode([3, 2], skip_special_tokens=False) == "<s><g>"
    ungated = _KeepSpecials(Tok(), frozenset(), frozenset({3}), gate=None)
    assert ungated.decode([3, 1, 3], skip_special_tokens=True) == "<s>a<s>"
