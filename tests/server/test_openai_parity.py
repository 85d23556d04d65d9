"""OpenAI API parity against the real engine on the tiny checkpoint (random weights, real tokenizer), served
by uvicorn in a thread and driven by the `openai` SDK: every endpoint, the sampling and output options,
n > 1, logprobs, reasoning, structured output, tool choice, metrics, errors, auth, request ids, limits."""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from openai_scripted import ScriptedEngine, live_server, wait_for

from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
from vibeqwen.engine.stats import EngineStats, FinishedRequestStats
from vibeqwen.server.app import ServerConfig, create_app, load_generation_defaults
from vibeqwen.server.async_engine import AsyncEngine
from vibeqwen.server.metrics import make_registry, render

# one client for the module: a fresh httpx client per call costs tens of milliseconds
HTTP = httpx.Client(timeout=60)

MODEL = "tiny-parity"
KEY = "sk-parity"
MAX_MODEL_LEN = 512
MAX_BODY = 64 << 10
THINK_END = 248069
EOS = 248046
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
HI = [{"role": "user", "content": "Hi there"}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "member", "color"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7},
                           "metric": {"type": "boolean"}},
            "required": ["city", "days", "metric"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    engine = LLMEngine.from_checkpoint(tiny_checkpoint, model_name=MODEL, config=EngineConfig(
        max_model_len=MAX_MODEL_LEN, max_num_seqs=16, cache_memory_bytes=16 << 20))
    async_engine = AsyncEngine(engine, warmup=True)
    config = ServerConfig(api_key=KEY, max_body_bytes=MAX_BODY, reasoning=True,
                          generation_defaults=load_generation_defaults(tiny_checkpoint))
    with live_server(create_app(async_engine, MODEL, config)) as url:
        wait_for(lambda: HTTP.get(url + "/health").status_code == 200, timeout=60)
        yield url, engine
    async_engine.shutdown()


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def sdk(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


AUTH = {"Authorization": f"Bearer {KEY}"}


def chat(sdk, **kw):
    kw.setdefault("messages", HI)
    kw.setdefault("max_tokens", 6)
    return sdk.chat.completions.create(model=MODEL, **kw)


# ---- endpoints ----


def test_models_version_openapi(url, sdk):
    assert [m.id for m in sdk.models.list()] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("gpt-4")
    assert HTTP.get(url + "/version", headers=AUTH).json()["version"]
    spec = HTTP.get(url + "/openapi.json", headers=AUTH).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/version"} <= set(
        spec["paths"])
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("ChatCompletionRequest")


def test_health_needs_no_key_and_everything_else_does(url):
    assert HTTP.get(url + "/health").status_code == 200
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/version"),
                         ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/openapi.json")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = HTTP.request(method, url + path, headers=headers, json={})
            assert r.status_code == 401, (path, headers)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
            assert err["message"].startswith("Missing API key" if not headers else "Incorrect API key"), err
    bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_request_id_header_and_log_line(url, caplog):
    with caplog.at_level(logging.INFO, logger="vibeqwen.server"):
        r = HTTP.get(url + "/v1/models", headers={**AUTH, "X-Request-Id": "trace-123"})
        assert r.headers["x-request-id"] == "trace-123"
        generated = HTTP.get(url + "/v1/models", headers=AUTH).headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", generated)
        # errors carry it too, and an unusable incoming id is replaced
        r = HTTP.get(url + "/v1/models", headers={"X-Request-Id": "x" * 500})
        assert r.status_code == 401 and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
        wait_for(lambda: any("trace-123" in rec.getMessage() for rec in caplog.records))
    line = next(rec.getMessage() for rec in caplog.records if "trace-123" in rec.getMessage())
    assert "GET /v1/models 200" in line


def test_body_size_limit_is_413(url):
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    r = HTTP.post(url + "/v1/chat/completions", json=big, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies while the body streams in
        yield b'{"model": "tiny-parity", "messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY // 4096 + 1):
            yield b"y" * 4096
        yield b'"}]}'

    r = HTTP.post(url + "/v1/chat/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


# ---- completions ----


def _assert_offsets_point_into(text: str, lp) -> None:
    """text_offset[i] is where token i's text starts in the choice's text (OpenAI's legacy logprobs); a token
    holding part of a multi-byte character (shown as U+FFFD) sits at that character."""
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    for token, off in zip(lp.tokens, lp.text_offset):
        if "\ufffd" not in token:
            assert text[off : off + len(token)] == token, (token, off, text)


def test_completions_text_offset_with_multibyte_characters(sdk):
    r = sdk.completions.create(model=MODEL, prompt="h\u00e9llo \U0001f30d emoji \u4f60\u597d", max_tokens=4,
                               temperature=0, echo=True, logprobs=0)
    lp = r.choices[0].logprobs
    assert any("\ufffd" in t for t in lp.tokens)  # the emoji spans several tokens
    _assert_offsets_point_into(r.choices[0].text, lp)
    assert lp.text_offset[lp.tokens.index(" emoji")] == r.choices[0].text.index(" emoji")


def test_completions_prompt_forms_echo_and_logprobs(sdk, served):
    _, engine = served
    text = sdk.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0)
    assert text.object == "text_completion" and text.id.startswith("cmpl-")
    ids = engine.tokenizer.encode("Hello world")
    by_ids = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text
    assert text.usage.prompt_tokens == len(ids) and text.usage.completion_tokens == 5
    assert text.choices[0].finish_reason == "length"

    echo = sdk.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0, echo=True,
                                  logprobs=2)
    c = echo.choices[0]
    assert c.text == "Hello world" + text.choices[0].text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 5 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 2 <= len(top) <= 3 and top[token] == value  # the chosen token is always listed
    _assert_offsets_point_into(c.text, lp)
    # greedy: the chosen token is the most likely one
    assert all(v == max(top.values()) for v, top in zip(lp.token_logprobs[len(ids):], lp.top_logprobs[len(ids):]))

    # scoring only: echo with max_tokens 0
    score = sdk.completions.create(model=MODEL, prompt="Hello world", max_tokens=0, echo=True, logprobs=0)
    assert score.choices[0].text == "Hello world" and score.usage.completion_tokens == 0
    assert score.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(ids)], abs=1e-4)
    # the scoring pass needs one free position: max_model_len - 1 prompt tokens score, max_model_len get a 400
    # that says so (not "no room for a completion", which was not asked for)
    longest = sdk.completions.create(model=MODEL, prompt=[7] * (MAX_MODEL_LEN - 1), max_tokens=0, echo=True,
                                     logprobs=0)
    assert len(longest.choices[0].logprobs.token_logprobs) == MAX_MODEL_LEN - 1
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model=MODEL, prompt=[7] * MAX_MODEL_LEN, max_tokens=0, echo=True, logprobs=0)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert f"scoring a prompt (max_tokens 0 with echo) takes up to {MAX_MODEL_LEN - 1} tokens" in err["message"]


def test_more_messages_than_the_context_holds_are_refused_by_count(sdk):
    """A new user's report: a body of 460,000 tiny messages took ~10 s to refuse and held every other request for
    seconds (validation, then rendering). Messages are now counted first: each adds at least 4 tokens
    (`Tokenizer.min_message_tokens`), so at most (max_model_len - 1) // 4 can fit."""
    cap = (MAX_MODEL_LEN - 1) // 4
    many = [{"role": "user", "content": ""}] * (cap + 1)
    with pytest.raises(openai.BadRequestError) as e:
        chat(sdk, messages=many)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages", err
    assert f"holds at most {cap} messages" in err["message"] and f"has {cap + 1} messages" in err["message"]
    # what was reported before the cap still comes first: a wrong model (404), another field's error
    with pytest.raises(openai.NotFoundError) as e:
        sdk.chat.completions.create(model="gpt-4", messages=many, max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        chat(sdk, messages=many, temperature="hot")
    assert e.value.body["param"] == "temperature", e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # both wrong: the field's error, as with one message
        sdk.chat.completions.create(model="gpt-4", messages=many, max_tokens=2, temperature="hot")
    assert e.value.body["param"] == "temperature", e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # cap messages pass the count, not the tokens (5 each)
        chat(sdk, messages=many[:cap])
    assert e.value.body["code"] == "context_length_exceeded" and "tokens long" in e.value.body["message"]
    fits = [{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}] * 20 + HI
    assert chat(sdk, messages=fits, max_tokens=2).usage.prompt_tokens > 20 * 4
    # the Responses API's input items become chat messages after validation: counted before rendering
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model=MODEL, input=[{"role": "user", "content": "x"}] * (cap + 1), max_output_tokens=2)
    err = e.value.body["error"] if "error" in e.value.body else e.value.body
    assert err["code"] == "context_length_exceeded" and f"({cap + 1} messages)" in err["message"], err


def test_completions_batch_n_and_stream(sdk):
    r = sdk.completions.create(model=MODEL, prompt=["One", "Two two"], max_tokens=3, temperature=0.8, seed=5, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 1 + 2
    whole = sdk.completions.create(model=MODEL, prompt="Stream me", max_tokens=6, temperature=0, logprobs=1)
    chunks = list(sdk.completions.create(model=MODEL, prompt="Stream me", max_tokens=6, temperature=0, logprobs=1,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == \
        whole.choices[0].logprobs.tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_stop_string_never_leaks(sdk):
    full = sdk.completions.create(model=MODEL, prompt="Count", max_tokens=12, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    r = sdk.completions.create(model=MODEL, prompt="Count", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        model=MODEL, prompt="Count", max_tokens=12, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == r.choices[0].text


# ---- chat: n, seeds, streaming, logprobs, sampling fields ----


def test_n_choices_use_seed_plus_index(sdk):
    kw = dict(max_tokens=5, temperature=1.0, top_p=0.9, extra_body=NO_THINK)
    r = chat(sdk, n=3, seed=11, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    singles = [chat(sdk, n=1, seed=11 + i, **kw).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in r.choices] == singles
    assert len(set(singles)) > 1


def test_n_streams_interleave_by_index(sdk):
    kw = dict(max_tokens=6, temperature=0.9, seed=3, extra_body=NO_THINK)
    whole = chat(sdk, n=2, **kw)
    chunks = list(chat(sdk, n=2, stream=True, stream_options={"include_usage": True}, **kw))
    order = [c.choices[0].index for c in chunks if c.choices]
    texts, roles, finishes = {0: "", 1: ""}, {0: 0, 1: 0}, {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            roles[ch.index] += ch.delta.role == "assistant"
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert texts == {i: c.message.content for i, c in enumerate(whole.choices)}
    assert roles == {0: 1, 1: 1} and finishes == {0: "length", 1: "length"}
    assert order[:2] == [0, 1] and any(a != b for a, b in itertools.pairwise(order[2:]))  # interleaved
    assert chunks[-1].usage.completion_tokens == 12


def test_n_is_capped(url, sdk):
    with pytest.raises(openai.BadRequestError) as e:
        chat(sdk, n=17)
    assert e.value.body["param"] == "n"


def test_chat_logprobs(sdk):
    r = chat(sdk, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_THINK)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 5
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.token == e.top_logprobs[0].token and e.logprob <= 0
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace") == r.choices[0].message.content
    streamed = [e for c in chat(sdk, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, stream=True,
                                extra_body=NO_THINK) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    with pytest.raises(openai.BadRequestError):
        chat(sdk, logprobs=True, top_logprobs=21)


def test_logit_bias_stop_token_ids_min_tokens_ignore_eos(sdk, served):
    _, engine = served
    forced = engine.tokenizer.encode(" banana")[0]
    word = engine.tokenizer.decode([forced])
    r = chat(sdk, max_tokens=4, temperature=0, logit_bias={str(forced): 100}, extra_body=NO_THINK)
    assert r.choices[0].message.content == word * 4
    # a stop token id ends the reply (its text is not shown); min_tokens masks it for the first tokens
    r = chat(sdk, max_tokens=8, temperature=0, logit_bias={str(forced): 100}, extra_body={**NO_THINK,
             "stop_token_ids": [forced]})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 1)
    assert not r.choices[0].message.content
    body = dict(max_tokens=8, temperature=0, logit_bias={str(forced): 100}, extra_body={**NO_THINK,
                "stop_token_ids": [forced], "min_tokens": 3})
    r = chat(sdk, **body)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 4)
    content = r.choices[0].message.content  # the 3 tokens sampled while the stop token was masked
    assert content and word not in content
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(sdk, stream=True, **body) if c.choices)
    assert streamed == content
    # a stop string in the first min_tokens tokens' text does not match (vLLM): the word every token spells
    # stops the reply at the first token, or at token 4 with min_tokens 3
    body = dict(max_tokens=8, temperature=0, logit_bias={str(forced): 100}, stop=[word.strip()], extra_body=NO_THINK)
    r = chat(sdk, **body)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens, r.choices[0].message.content) == ("stop", 1, " ")
    body["extra_body"] = {**NO_THINK, "min_tokens": 3}
    r = chat(sdk, **body)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 4)
    assert r.choices[0].message.content == word * 3 + " "
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(sdk, stream=True, **body) if c.choices)
    assert streamed == word * 3 + " "
    # EOS forced: stops at once, unless ignore_eos
    eos = {str(EOS): 100}
    assert chat(sdk, max_tokens=5, temperature=0, logit_bias=eos).usage.completion_tokens == 1
    r = chat(sdk, max_tokens=5, temperature=0, logit_bias=eos, extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 5)


def test_sampling_fields_and_max_completion_tokens(sdk):
    r = chat(sdk, max_tokens=9, max_completion_tokens=3, temperature=0.7, top_p=0.8, presence_penalty=0.5,
             frequency_penalty=0.5, seed=1, extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3})
    assert r.usage.completion_tokens == 3
    for bad in ({"presence_penalty": 3}, {"temperature": -1}, {"extra_body": {"min_p": 2}},
                {"extra_body": {"repetition_penalty": 0}}, {"logit_bias": {"x": 1}},
                {"logit_bias": {"999999999": 1}}, {"logit_bias": {"5": 101}}, {"seed": 2**64},
                {"extra_body": {"stop_token_ids": [10**12]}}):
        with pytest.raises(openai.BadRequestError):
            chat(sdk, **bad)


def test_extreme_valid_sampling_values_neither_fail_nor_spoil_other_requests(sdk):
    greedy = chat(sdk, max_tokens=4, temperature=0, extra_body=NO_THINK).choices[0].message.content
    with ThreadPoolExecutor(4) as pool:
        bystander = pool.submit(lambda: list(chat(sdk, max_tokens=12, temperature=0, stream=True)))
        extreme = [pool.submit(chat, sdk, max_tokens=4, **{"extra_body": NO_THINK, **kw}) for kw in (
            {"temperature": 1e-38}, {"temperature": 5e-324}, {"top_p": 1e-300},
            {"temperature": 0.8, "extra_body": {**NO_THINK, "repetition_penalty": 1e-300}})]
        replies = [f.result().choices[0] for f in extreme]
        chunks = bystander.result()
    assert replies[0].message.content == replies[1].message.content == greedy  # below 1e-5: greedy
    assert all(r.finish_reason in ("length", "stop") for r in replies)  # the penalty may pick the prompt's EOS
    assert chunks[-1].choices[0].finish_reason == "length"


def test_generation_config_defaults_fill_unset_fields(tiny_checkpoint, tokenizer_engine):
    defaults = load_generation_defaults(tiny_checkpoint)
    assert defaults == {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
    engine = tokenizer_engine
    app = create_app(AsyncEngine(engine), "s", ServerConfig(generation_defaults={**defaults, "min_p": 0.1}))
    with live_server(app) as url:
        HTTP.post(url + "/v1/chat/completions", json={"messages": HI}, timeout=30)
        p = engine.calls[-1][1]
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 0.95, 20, 0.1, 1.0)
        HTTP.post(url + "/v1/chat/completions", json={"messages": HI, "top_p": 0.5, "top_k": -1, "min_p": 0,
                                                       "presence_penalty": 1, "frequency_penalty": -1,
                                                       "repetition_penalty": 1.1, "seed": 4, "logit_bias": {"7": -5},
                                                       "stop_token_ids": [9], "min_tokens": 1, "ignore_eos": True},
                   timeout=30)
        p = engine.calls[-1][1]
        assert (p.top_p, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.seed,
                p.logit_bias, p.stop_token_ids, p.min_tokens, p.ignore_eos) == (
            0.5, -1, 0, 1, -1, 1.1, 4, {7: -5.0}, [9], 1, True)


def test_a_checkpoint_max_tokens_caps_completions_unset_and_null(tokenizer_engine):
    """/v1/completions: unset max_tokens is min(16, the room left, the checkpoint's default), an explicit null
    min(the room left, the checkpoint's default), as vLLM caps them (the review: unset took 16 over a lower
    checkpoint default); chat's unset takes the checkpoint's default."""
    engine = tokenizer_engine
    for ckpt_max, unset, null in ((5, 5, 5), (100, 16, 100), (None, 16, engine.max_model_len - 3)):
        defaults = {} if ckpt_max is None else {"max_tokens": ckpt_max}
        app = create_app(AsyncEngine(engine), "s", ServerConfig(generation_defaults=defaults))
        with live_server(app) as url:
            for body, want in (({}, unset), ({"max_tokens": None}, null), ({"max_tokens": 3}, 3)):
                r = HTTP.post(url + "/v1/completions", json={"prompt": [5, 6, 7], **body}, timeout=30)
                assert r.status_code == 200, r.text
                assert engine.calls[-1][1].max_tokens == want, (ckpt_max, body)
            HTTP.post(url + "/v1/chat/completions", json={"messages": HI}, timeout=30)
            chat_max = engine.calls[-1][1].max_tokens
            assert chat_max == ckpt_max if ckpt_max else chat_max > 100, (ckpt_max, chat_max)


@pytest.fixture
def tokenizer_engine(served):
    """A scripted engine (fixed replies) with the real tokenizer."""
    return ScriptedEngine(served[1].tokenizer)


def test_health_is_503_until_the_engine_is_warm(tokenizer_engine):
    engine = tokenizer_engine
    engine.gate.clear()  # the warm-up step blocks
    async_engine = AsyncEngine(engine, warmup=True)
    with live_server(create_app(async_engine, "s")) as url:
        r = HTTP.get(url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        engine.gate.set()
        wait_for(lambda: HTTP.get(url + "/health").status_code == 200)
    async_engine.shutdown()


# ---- reasoning ----


def test_reasoning_split_by_default_and_off_with_enable_thinking_false(sdk):
    r = chat(sdk, max_tokens=6, temperature=0)
    msg = r.choices[0].message
    # the random model never closes its think block: all reasoning
    assert msg.content is None and msg.reasoning_content and msg.reasoning == msg.reasoning_content
    streamed = list(chat(sdk, max_tokens=6, temperature=0, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in streamed if c.choices)
    assert reasoning == msg.reasoning_content
    assert all(not c.choices[0].delta.content for c in streamed if c.choices)
    off = chat(sdk, max_tokens=6, temperature=0, extra_body=NO_THINK)
    assert off.choices[0].message.content and getattr(off.choices[0].message, "reasoning_content", None) is None
    for c in chat(sdk, max_tokens=6, temperature=0, stream=True, extra_body=NO_THINK):
        if c.choices:
            assert getattr(c.choices[0].delta, "reasoning_content", None) is None


# ---- structured output ----


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_schema_output_validates(sdk, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    outs = []
    runs = [{"temperature": 1.0, "seed": 8}] if stream else [{"temperature": 0}, {"temperature": 1.0, "seed": 7, "n": 2}]
    for kw in runs:
        r = chat(sdk, max_tokens=60, response_format=fmt, stream=stream, extra_body=NO_THINK, **kw)
        if stream:
            texts: dict[int, str] = {}
            for c in r:
                for ch in c.choices:
                    texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            outs += texts.values()
        else:
            assert {c.finish_reason for c in r.choices} == {"stop"}
            outs += [c.message.content for c in r.choices]
    assert len(outs) == (1 if stream else 3)
    for text in outs:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_schema_after_thinking(sdk):
    # thinking on: free until </think> (forced here with a bias), then the schema applies
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = chat(sdk, max_tokens=60, temperature=0, response_format=fmt, logit_bias={str(THINK_END): 100})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"


def test_json_object_and_completions_schema(sdk):
    r = chat(sdk, max_tokens=30, temperature=0, response_format={"type": "json_object"}, extra_body=NO_THINK)
    text = r.choices[0].message.content.lstrip("\n")
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    c = sdk.completions.create(model=MODEL, prompt="JSON:", max_tokens=60, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    jsonschema.validate(json.loads(c.choices[0].text), PERSON)


@pytest.mark.parametrize("spec", [{"name": "any", "schema": True}, {"name": "any"}], ids=["true", "missing"])
def test_schema_true_or_missing_allows_any_json(sdk, spec):
    # OpenAI's `schema` is optional; JSON Schema's `true` (like `{}`) accepts every JSON value
    r = chat(sdk, max_tokens=40, temperature=0, response_format={"type": "json_schema", "json_schema": spec},
             extra_body=NO_THINK)
    text = r.choices[0].message.content.strip()
    assert text
    if r.choices[0].finish_reason == "stop":
        json.loads(text)


@pytest.mark.parametrize("schema", [{"type": "objekt"}, {"type": "integer", "minimum": "x"},
                                    {"type": "string", "pattern": "(("}, {"$ref": "#/nope"},
                                    {"type": "string", "pattern": "(a|b){1000,5000}"}, False,
                                    {"$ref": "http://example.com/schema.json"},
                                    {"type": "object", "properties": {}, "required": ["a"],
                                     "additionalProperties": False}])
def test_invalid_schema_is_400(sdk, schema):
    with pytest.raises(openai.BadRequestError) as e:
        chat(sdk, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert e.value.body["code"] == "invalid_schema"


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("field, value", [
    ("guided_json", "[" * 1200 + "]" * 1200),  # schema text past the JSON parser's recursion limit
    ("guided_json", _nested_schema(300)),  # a schema the grammar builders cannot walk
], ids=["text", "object"])
def test_a_schema_nested_too_deeply_is_400(sdk, field, value):
    """Found by a break-it trial: the text form was a 500 (RecursionError), the object form a 400 quoting Python's
    "maximum recursion depth exceeded" (a tool schema that deep: test_structured.py)."""
    with pytest.raises(openai.BadRequestError) as e:
        chat(sdk, max_tokens=2, extra_body={field: value})
    assert "nested too deeply" in e.value.body["message"] and "recursion" not in e.value.body["message"]


@pytest.mark.parametrize("field, value, check", [
    ("guided_regex", r"[a-c]{2}-\d{3}", lambda t: re.fullmatch(r"[a-c]{2}-\d{3}", t)),
    ("guided_choice", ["yes", "no", 'say "maybe"\n'], lambda t: t in ("yes", "no", 'say "maybe"\n')),
    ("guided_grammar", 'root ::= "x" [0-9] [0-9] ("!" | "?")', lambda t: re.fullmatch(r"x\d\d[!?]", t)),
    ("guided_json", PERSON, lambda t: jsonschema.validate(json.loads(t), PERSON) or True),
    ("guided_json", json.dumps(PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON) or True),
    ("structured_outputs", {"regex": r"(ab|cd){1,3};"}, lambda t: re.fullmatch(r"(ab|cd){1,3};", t)),
    ("structured_outputs", {"choice": ["Paris", "Rome"]}, lambda t: t in ("Paris", "Rome")),
    ("structured_outputs", {"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ("structured_outputs", {"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) or True),
], ids=["regex", "choice", "grammar", "json", "json-text", "so-regex", "so-choice", "so-json-object", "so-json"])
def test_vllm_output_constraints(sdk, field, value, check):
    """vLLM's guided_* and structured_outputs fields are enforced (the break-it review found them accepted and
    ignored): the whole reply, in chat (thinking off) and completions, streamed chat too, matches."""
    kinds = ("regex", "choice", "grammar")
    free_text = field in [f"guided_{k}" for k in kinds] or (field == "structured_outputs" and set(value) <= set(kinds))
    replies = []  # (text, finish_reason)
    for stream in (False, True):
        r = chat(sdk, max_tokens=80, temperature=1.0, seed=5, stream=stream, extra_body={field: value, **NO_THINK})
        if stream:
            chunks = [c.choices[0] for c in r if c.choices]
            replies.append(("".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason))
        else:
            replies.append((r.choices[0].message.content, r.choices[0].finish_reason))
    c = sdk.completions.create(model=MODEL, prompt="Answer:", max_tokens=80, temperature=0, extra_body={field: value})
    replies.append((c.choices[0].text, c.choices[0].finish_reason))
    for text, finish in replies:
        if finish == "length" and value == {"json_object": True}:  # any object: a random model may never close it
            assert text.strip().startswith("{")
            continue
        assert finish == "stop" and check(text if free_text else text.strip()), text


TOOL_CALL = 248058  # <tool_call>, a special token the tool-call grammar writes as itself


def test_a_grammar_keeps_the_text_of_the_specials_it_writes(sdk):
    """A grammar may write `<tool_call>` as that special token (the grammars' vocabulary keeps it for the tool-call
    grammar); a reply under a grammar keeps its text, which is part of what the grammar accepted (a break-it trial
    got `x` for the choice `<tool_call>x`, and a schema enum `<tool_call>` as ""). Without a grammar the special is
    dropped as before."""
    bias = {str(TOOL_CALL): 100}  # the special token itself, not its spelling in text pieces
    so = {"structured_outputs": {"choice": ["<tool_call>x"]}}
    c = sdk.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0, logprobs=0, logit_bias=bias,
                               extra_body=so)
    assert c.choices[0].logprobs.tokens[0] == "<tool_call>" and c.choices[0].text == "<tool_call>x"
    for stream in (False, True):
        r = chat(sdk, max_tokens=8, temperature=0, logit_bias=bias, stream=stream, extra_body={**so, **NO_THINK})
        text = ("".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) if stream
                else r.choices[0].message.content)
        assert text == "<tool_call>x"
    free = sdk.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0, logprobs=0, logit_bias=bias)
    assert free.choices[0].logprobs.tokens[0] == "<tool_call>" and "<tool_call>" not in free.choices[0].text


def test_a_grammar_after_thinking_keeps_its_specials_only_where_it_applies(sdk):
    """With thinking on the grammar applies after `</think>`: a `<tool_call>` token in the free reasoning before
    it is dropped as without a grammar (a review found it kept), one the grammar writes after it is kept."""
    so = {"structured_outputs": {"choice": ["<tool_call>x"]}}
    before = chat(sdk, max_tokens=4, temperature=0, logit_bias={str(TOOL_CALL): 100}, extra_body=so)
    msg = before.choices[0].message
    assert "<tool_call>" not in (getattr(msg, "reasoning_content", None) or "") + (msg.content or "")
    assert before.choices[0].finish_reason == "length"
    after = chat(sdk, max_tokens=8, temperature=0, logit_bias={str(THINK_END): 100, str(TOOL_CALL): 50},
                 extra_body=so)
    assert after.choices[0].message.content == "<tool_call>x" and after.choices[0].finish_reason == "stop"


def test_vllm_output_constraints_after_thinking(sdk):
    r = chat(sdk, max_tokens=60, temperature=0, logit_bias={str(THINK_END): 100},
             extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].message.content in ("alpha", "beta") and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_regex": "(a|b){1000,5000}"}, "guided_regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1]"}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_choice": ["a"], "min_tokens": 1}, "min_tokens"),
    ({"guided_choice": [f"{i:031d}" for i in range(1100)]}, "guided_choice"),  # over MAX_CHOICE_CHARS
    ({"structured_outputs": {"structural_tag": {"type": "structural_tag"}}}, "structured_outputs.structural_tag"),
])
def test_vllm_output_constraint_errors(url, extra, param):
    for path, body in (("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "hi"})):
        r = HTTP.post(url + path, headers=AUTH, json={"model": MODEL, "max_tokens": 4, **body, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()


def test_forced_tool_call_with_a_vllm_constraint_is_400(sdk):
    with pytest.raises(openai.BadRequestError) as e:
        chat(sdk, tools=[WEATHER], tool_choice="required", extra_body={"guided_regex": "a+"})
    assert e.value.body["param"] == "guided_regex"


def test_prompt_errors_name_the_prompt(url, tiny_checkpoint):
    """Token ids past the tokenizer's (the embedding's padding rows, whose text is empty) are refused as vLLM does;
    the engine's prompt checks name `prompt` / `messages` (param was null); an error about one prompt of a list says
    which, an error about the whole request does not."""
    from vibeqwen.tokenizer import Tokenizer

    known = Tokenizer.from_dir(tiny_checkpoint).vocab_size
    cases = [("/v1/completions", {"prompt": [1, known]}, "prompt", "out of vocabulary"),
             ("/v1/completions", {"prompt": [1, known - 1]}, None, None),
             ("/v1/completions", {"prompt": [[5], [known + 7]]}, "prompt", "prompt 1 (of 2): Token id"),
             ("/v1/completions", {"prompt": "hi " * 400, "max_tokens": 200}, "prompt", "maximum context length"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 400}], "max_tokens": 200},
              "messages", "maximum context length")]
    for path, body, param, message in cases:
        r = HTTP.post(url + path, headers=AUTH, json={"model": MODEL, "max_tokens": 1, **body})
        if param is None:
            assert r.status_code == 200, r.text
            continue
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], err
    # an error about the request, not one of its prompts: not named (a review found logit_bias named "prompt 0")
    for extra in ({"logit_bias": {"999999999": 1}}, {"stop_token_ids": [999999999]}):
        r = HTTP.post(url + "/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": ["a", "b"], **extra})
        assert r.status_code == 400 and not r.json()["error"]["message"].startswith("prompt "), r.text


def test_include_stop_str_in_output(sdk, served):
    engine = served[1]
    plain = sdk.completions.create(model=MODEL, prompt="Count:", max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
    stop = plain[3:5]
    assert stop.strip()  # some text to stop at
    for include in (False, True):
        c = sdk.completions.create(model=MODEL, prompt="Count:", max_tokens=12, temperature=0, stop=[stop],
                                   extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        cut = plain.find(stop)
        assert c.choices[0].text == plain[: cut + (len(stop) if include else 0)]
        assert c.choices[0].finish_reason == "stop" and c.choices[0].stop_reason == stop
    # a stop token's text too (vLLM): a token forced by logit_bias and listed in stop_token_ids
    forced = engine.tokenizer.encode(" banana")[0]
    for include in (False, True):
        c = sdk.completions.create(model=MODEL, prompt="Count:", max_tokens=5, temperature=0,
                                   logit_bias={str(forced): 100}, extra_body={
                                       "stop_token_ids": [forced], "include_stop_str_in_output": include})
        assert c.choices[0].finish_reason == "stop" and c.usage.completion_tokens == 1
        assert c.choices[0].text == (engine.tokenizer.decode([forced]) if include else "")
        assert c.choices[0].stop_reason == forced
    # chat, streamed: the finish chunk carries it
    chunks = [ch.choices[0] for ch in chat(sdk, max_tokens=5, temperature=0, logit_bias={str(forced): 100},
                                           stream=True, extra_body={"stop_token_ids": [forced], **NO_THINK})
              if ch.choices]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == forced
    # EOS listed in stop_token_ids still reports null, as vLLM
    c = sdk.completions.create(model=MODEL, prompt="Count:", max_tokens=5, temperature=0, logit_bias={str(EOS): 100},
                               extra_body={"stop_token_ids": [EOS]})
    assert c.choices[0].finish_reason == "stop" and c.choices[0].stop_reason is None


def test_continue_final_message(sdk):
    """vLLM's top-level continue_final_message / add_generation_prompt: the prompt ends with the assistant's text
    (no new turn opened); chat_template_kwargs can say the same; asking it with a generation prompt is a 400."""
    msgs = [*HI, {"role": "assistant", "content": "Sure, the answer is"}]
    opened = chat(sdk, messages=msgs, max_tokens=1, extra_body=NO_THINK).usage.prompt_tokens
    closed = chat(sdk, messages=msgs, max_tokens=1, extra_body={  # the last turn rendered whole, none opened
        "add_generation_prompt": False, **NO_THINK}).usage.prompt_tokens
    cont = chat(sdk, messages=msgs, max_tokens=1, extra_body={
        "continue_final_message": True, "add_generation_prompt": False, **NO_THINK})
    kw = chat(sdk, messages=msgs, max_tokens=1, extra_body={"chat_template_kwargs": {
        "continue_final_message": True, "add_generation_prompt": False, "enable_thinking": False}})
    # continuing drops the last turn's closing "<|im_end|>" and "\n" (2 tokens)
    assert cont.usage.prompt_tokens == kw.usage.prompt_tokens == closed - 2 < opened
    with pytest.raises(openai.BadRequestError) as e:
        chat(sdk, messages=msgs, extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"
    for flag, value in (("continue_final_message", [1]), ("add_generation_prompt", "false")):  # not taken as true
        with pytest.raises(openai.BadRequestError) as e:
            chat(sdk, messages=msgs, extra_body={"chat_template_kwargs": {flag: value}})
        assert e.value.body["param"] == f"chat_template_kwargs.{flag}"


# ---- tools ----


def test_named_tool_choice_is_enforced(sdk):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(sdk, max_tokens=150, temperature=0, tools=[WEATHER, CLOCK], tool_choice=choice, extra_body=NO_THINK)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None  # OpenAI's (and vLLM's) reason for a named call
    (tc,) = c.message.tool_calls
    assert tc.function.name == "get_weather" and tc.id.startswith("call_")
    jsonschema.validate(json.loads(tc.function.arguments), WEATHER["function"]["parameters"])
    # streamed: the header delta, then argument fragments adding up to the same arguments
    deltas = [d for chunk in chat(sdk, max_tokens=150, temperature=0, tools=[WEATHER, CLOCK], tool_choice=choice,
                                  stream=True, extra_body=NO_THINK) if chunk.choices
              for d in chunk.choices[0].delta.tool_calls or ()]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert deltas[0].function.arguments == "" and all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas[1:]) == tc.function.arguments


def test_forced_tool_call_strings_keep_to_their_pattern_and_length(sdk):
    """A new user's report: with a forced call the grammar let one space, tab or carriage return of any kind around a
    parameter value, and the parser kept it (`"p": "cb\\r"` against `^[a-c]{2}$`, 12 seeds of 12)."""
    params = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3},
                                               "p": {"type": "string", "pattern": "^[a-c]{2}$"}},
              "required": ["s", "p"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    for stream in (False, True):
        kw = dict(max_tokens=200, temperature=1.0, seed=3, n=6, tools=[tool], extra_body=NO_THINK,
                  tool_choice={"type": "function", "function": {"name": "f"}})
        if stream:
            args = ["", "", "", "", "", ""]
            for chunk in chat(sdk, stream=True, **kw):
                for c in chunk.choices:
                    for d in c.delta.tool_calls or ():
                        args[c.index] += d.function.arguments or ""
        else:
            args = [c.message.tool_calls[0].function.arguments for c in chat(sdk, **kw).choices]
        for a in args:
            jsonschema.validate(json.loads(a), params)


def test_required_tool_choice_after_thinking(sdk):
    r = chat(sdk, max_tokens=80, temperature=0.8, seed=2, tools=[WEATHER, CLOCK], tool_choice="required",
             logit_bias={str(THINK_END): 100}, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[calls[0].function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)


def test_tool_choice_none_and_tool_errors(sdk):
    with_tools = chat(sdk, max_tokens=2, tools=[WEATHER], extra_body=NO_THINK)
    without = chat(sdk, max_tokens=2, tools=[WEATHER], tool_choice="none", extra_body=NO_THINK)
    assert without.usage.prompt_tokens < with_tools.usage.prompt_tokens  # not offered in the prompt
    assert without.choices[0].message.tool_calls is None
    bad = [
        dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tool_choice="required"),
        dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]),
        dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
        dict(tools=[WEATHER], tool_choice="required", extra_body={"min_tokens": 2}),
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a>b": {"type": "number"}}}}}]),  # no XML for that name
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x</parameter>y": {"type": "string"}}}}}], tool_choice="required"),
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
             tool_choice="required"),  # arguments are an object: OpenAI refuses other parameter types
    ]
    for kw in bad:
        with pytest.raises(openai.BadRequestError):
            chat(sdk, **kw)


# ---- errors ----


def test_errors_are_openai_shaped(url, sdk):
    cases = [
        ({"model": "gpt-4", "messages": HI}, 404),
        ({"model": MODEL, "messages": HI, "max_tokens": "many"}, 400),
        ({"model": MODEL, "messages": HI, "max_tokens": MAX_MODEL_LEN}, 400),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 700}]}, 400),
        ({"model": MODEL, "messages": HI, "temperature": float("nan")}, 400),
        ({"model": MODEL, "messages": HI, "stream_options": {"include_usage": True}}, 400),
    ]
    for body, status in cases:
        r = HTTP.post(url + "/v1/chat/completions", content=json.dumps(body), headers={
            **AUTH, "content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = HTTP.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": MAX_MODEL_LEN},
                   headers=AUTH)
    assert str(MAX_MODEL_LEN) in r.json()["error"]["message"]
    for body in ({"model": MODEL, "prompt": []}, {"model": MODEL, "prompt": "x", "max_tokens": 0},
                 {"model": MODEL, "prompt": "x", "suffix": "y"}, {"model": MODEL, "prompt": "x", "best_of": 3},
                 {"model": MODEL, "prompt": [-1]}, {"model": MODEL, "prompt": [[1]] * 65}):
        r = HTTP.post(url + "/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 400, (body, r.text)
    assert chat(sdk, max_tokens=2).usage.completion_tokens == 2  # still serving


# ---- prefix caching ----


def _chat_ids(engine, messages) -> list[int]:
    """The prompt ids the server renders for `messages` with thinking off."""
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, enable_thinking=False))


def test_prefix_cache_hits_show_in_usage_and_metrics(url, sdk, served):
    ids = list(range(1000, 1040))
    first = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    longer = sdk.completions.create(model=MODEL, prompt=ids + [7, 8, 9], max_tokens=2, temperature=0)
    assert longer.usage.prompt_tokens_details.cached_tokens == 40  # the first prompt's end was snapshotted
    # a system prompt shared by several users: the second request leaves a snapshot where the prompts branch, the
    # third starts there (streamed: the usage chunk carries it)
    system = {"role": "system", "content": "You are a careful assistant. " * 6}
    cached = []
    for who in ("Ann", "Bob", "Cy"):
        stream = chat(sdk, messages=[system, {"role": "user", "content": f"I am {who}."}], stream=True,
                      stream_options={"include_usage": True}, extra_body=NO_THINK)
        usage = [c.usage for c in stream if c.usage is not None][-1]
        cached.append(usage.prompt_tokens_details.cached_tokens)
    assert cached[:2] == [0, 0] and 16 <= cached[2] < usage.prompt_tokens
    # a conversation: the next turn starts where the last turn's generation prompt began (the template renders
    # the reply, as history, unlike the generation prompt)
    history = [system, {"role": "user", "content": "Tell me a story."}]
    previous = None
    for turn in range(3):
        reply = chat(sdk, messages=history, max_tokens=5, temperature=0, extra_body=NO_THINK)
        details = reply.usage.prompt_tokens_details
        if previous is not None:
            assert details.cached_tokens == previous  # everything up to the last turn's generation prompt
        start = served[1].tokenizer.encode("<|im_start|>")[0]
        ids = _chat_ids(served[1], history)
        previous = max(i for i, t in enumerate(ids) if t == start)
        history = history + [{"role": "assistant", "content": reply.choices[0].message.content or "ok"},
                             {"role": "user", "content": f"And then {turn}?"}]
    text = HTTP.get(url + "/metrics", headers=AUTH).text
    hits = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vibeqwen:prefix_cache_hits_total"))
    assert hits >= 40 + cached[2] and "vibeqwen:prefix_cache_queries_total" in text


# ---- metrics ----


def test_metrics_follow_the_engine(url, sdk):
    chat(sdk, max_tokens=3)
    text = HTTP.get(url + "/metrics", headers=AUTH).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)

    def get(metric: str) -> float:
        return sum(v for k, v in values.items() if k.split("{")[0] == metric)

    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gdn_slot_usage_perc"):
        assert f"vibeqwen:{gauge}" in text
    assert get("vibeqwen:prompt_tokens_total") > 0 and get("vibeqwen:generation_tokens_total") >= 3
    finished = get("vibeqwen:request_success_total")
    assert finished >= 1
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert get(f"vibeqwen:{hist}_count") >= 1 and f'vibeqwen:{hist}_bucket{{le="+Inf"' in text
    assert get("vibeqwen:e2e_request_latency_seconds_count") == finished  # the warm-up is left out
    for spec in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_mean_acceptance_length"):
        assert f"vibeqwen:{spec}" in text


def test_metrics_collector_reads_speculative_and_latency_stats():
    stats = EngineStats(num_running=2, num_waiting=1, kv_usage=0.5, spec_steps_total=4, spec_drafted_total=12,
                        spec_accepted_total=6, spec_skipped_steps_total=3, async_steps_total=5)
    for pos, accepted in [(0, True), (0, True), (1, False)]:
        stats.record_position(pos, accepted)
    registry = make_registry(stats, "m")
    stats.finished.append(FinishedRequestStats("warmup-1", "length", 1, 2, 0.5, 0.1, 1.0))
    stats.finished.append(FinishedRequestStats("a", "stop", 10, 5, 0.03, 0.002, 0.2))
    text = render(registry).decode()
    assert 'vibeqwen:spec_decode_mean_acceptance_length{model_name="m"} 2.5' in text
    assert 'vibeqwen:spec_decode_num_accepted_tokens_total{model_name="m"} 6.0' in text
    assert 'vibeqwen:spec_decode_num_skipped_steps_total{model_name="m"} 3.0' in text
    assert 'vibeqwen:async_scheduled_steps_total{model_name="m"} 5.0' in text
    assert 'vibeqwen:spec_decode_acceptance_rate_per_position{model_name="m",position="1"} 0.0' in text
    assert 'vibeqwen:time_to_first_token_seconds_bucket{le="0.04",model_name="m"} 1.0' in text
    assert 'vibeqwen:num_requests_waiting{model_name="m"} 1.0' in text
    stats.finished.append(FinishedRequestStats("b", "length", 10, 5, 0.3, 0.002, 0.5))
    text = render(registry).decode()  # only the new record is folded in
    assert 'vibeqwen:e2e_request_latency_seconds_count{model_name="m"} 2.0' in text
    assert 'vibeqwen:request_success_total{finished_reason="length",model_name="m"} 1.0' in text


def test_concurrent_mixed_requests(sdk):
    results = {}

    def one(i):
        if i % 2:
            results[i] = chat(sdk, max_tokens=4, temperature=0, extra_body=NO_THINK).choices[0].message.content
        else:
            results[i] = "".join(c.choices[0].text for c in sdk.completions.create(
                model=MODEL, prompt="Hi", max_tokens=4, temperature=0, stream=True) if c.choices)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 6 and len({results[i] for i in (1, 3, 5)}) == 1 and len({results[i] for i in (0, 2, 4)}) == 1




def test_unexpected_handler_error_is_a_500_with_request_id(tokenizer_engine, monkeypatch):
    def explode(*_):
        raise RuntimeError("handler bug")

    monkeypatch.setattr(tokenizer_engine, "validate_request", explode)
    async_engine = AsyncEngine(tokenizer_engine)
    with live_server(create_app(async_engine, "s")) as url:
        r = HTTP.post(url + "/v1/chat/completions", json={"messages": HI}, headers={"X-Request-Id": "rid-500"})
        assert r.status_code == 500 and r.headers["x-request-id"] == "rid-500"
        assert r.json()["error"]["type"] == "server_error" and "handler bug" in r.json()["error"]["message"]
        assert HTTP.get(url + "/health").status_code == 200
    async_engine.shutdown()


def test_serve_flags_build_the_server_config(tiny_checkpoint, monkeypatch, tmp_path, caplog):
    from vibeqwen.cli import _parser, _server_config

    def config(*flags):
        return _server_config(_parser().parse_args(["serve", "--weights", str(tiny_checkpoint), *flags]),
                              tiny_checkpoint)

    monkeypatch.delenv("VIBEQWEN_API_KEY", raising=False)
    c = config()
    assert (c.api_key, c.reasoning, c.max_body_bytes) == (None, True, 16 << 20)
    assert c.generation_defaults == {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
    monkeypatch.setenv("VIBEQWEN_API_KEY", "from-env")
    assert config().api_key == "from-env" and config("--api-key", "flag").api_key == "flag"
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_k": "x", "repetition_penalty": 1.05, '
                                                     '"top_p": 7, "min_p": -1, "max_new_tokens": 0, "presence_penalty": '
                                                     + "9" * 400 + "}")
    with caplog.at_level("WARNING"):
        c = config("--reasoning-parser", "none", "--generation-config", str(tmp_path), "--max-request-bytes", "10")
    assert (c.reasoning, c.max_body_bytes) == (False, 10)
    # a wrong type or a value a request could not send is skipped, with a warning naming it
    assert c.generation_defaults == {"temperature": 0.6, "repetition_penalty": 1.05}
    assert "ignoring top_p in" in caplog.text and "top_p must be in (0, 1], got 7.0" in caplog.text
    assert "ignoring min_p" in caplog.text and "ignoring max_new_tokens" in caplog.text
    assert "ignoring presence_penalty" in caplog.text  # a 400-digit integer: no OverflowError at start-up
    assert config("--generation-config", "none").generation_defaults == {}
    # CORS: any origin by default, as vLLM; the flags' JSON lists and the credentials switch reach the config
    assert (c.allowed_origins, c.allowed_methods, c.allowed_headers, c.allow_credentials) == (("*",),) * 3 + (False,)
    c = config("--allowed-origins", '["https://a.example"]', "--allowed-methods", '["GET", "POST"]',
               "--allowed-headers", '["authorization"]', "--allow-credentials")
    assert (c.allowed_origins, c.allowed_methods, c.allowed_headers, c.allow_credentials) == (
        ("https://a.example",), ("GET", "POST"), ("authorization",), True)


def test_warm_up_leaves_the_counters_at_zero(tiny_checkpoint):
    """/metrics counts the clients' requests: the server's warm-up generation is not in the counters."""
    engine = LLMEngine.from_checkpoint(tiny_checkpoint, model_name=MODEL, config=EngineConfig(
        max_model_len=MAX_MODEL_LEN, max_num_seqs=4, cache_memory_bytes=16 << 20))
    async_engine = AsyncEngine(engine, warmup=True)
    try:
        assert async_engine.wait_ready(60)
        s = engine.stats
        assert (s.prompt_tokens_total, s.generation_tokens_total, s.steps_total, len(s.finished)) == (0, 0, 0, 0)
    finally:
        async_engine.shutdown()
