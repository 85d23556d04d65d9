"""End to end: the real `vibeqwen serve` process on a vendor-layout tiny checkpoint, driven by the
unmodified `openai` SDK, against the reference engine's own greedy output."""

from __future__ import annotations


import httpx
import pytest

openai = pytest.importorskip("openai")
from serve_process import start_serve, stop_serve  # noqa: E402

MODEL = "tiny-e2e"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count to five: 一二三 🚀"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    proc, base = start_serve(["--weights", str(tiny_checkpoint), "--served-model-name", MODEL, "--max-model-len", "512",
                              # the reply text whole in `content` (no reasoning split), to compare with the engine's
                              # own tokens
                              "--reasoning-parser", "none"])
    yield base
    stop_serve(proc)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """The reference engine's greedy tokens for MESSAGES (the same chat template, the same prompt ids)."""
    from vibeqwen.engine.llm_engine import LLMEngine
    from vibeqwen.sampling import SamplingParams

    engine = LLMEngine.from_checkpoint(tiny_checkpoint)
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    out = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24)))
    return engine.tokenizer, prompt, [t for t, _ in out], out[-1][1]


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def test_streamed_greedy_chat_equals_reference_generate(server, reference):
    tokenizer, prompt, ref_tokens, ref_finish = reference
    stream = _client(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, roles = "", None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert roles[0] == "assistant"
    assert text == tokenizer.decode(ref_tokens, skip_special_tokens=True)
    assert finish == ref_finish == "length"
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(ref_tokens) == 24


def test_non_streamed_and_stop_string(server, reference):
    tokenizer, _, ref_tokens, _ = reference
    full = tokenizer.decode(ref_tokens, skip_special_tokens=True)
    r = _client(server).chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    assert r.choices[0].message.content == full and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24
    # a stop string taken from the middle of the greedy output ends generation early, excluded from the text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    r = _client(server).chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(stop)]


def test_malformed_request_gets_400_then_server_still_serves(server):
    bad = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "messages": "not a list"}, timeout=30)
    assert bad.status_code == 400 and "error" in bad.json() and bad.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        _client(server).chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="512"):
        _client(server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100000)
    r = _client(server).chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=3)
    assert r.usage.completion_tokens == 3
    assert [m.id for m in _client(server).models.list().data] == [MODEL]


def test_include_usage_puts_null_usage_on_every_chunk_but_the_last(server):
    import json

    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    # without include_usage no chunk carries the field
    body.pop("stream_options")
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert all("usage" not in json.loads(e) for e in events[:-1])


def test_vllm_token_rules_over_http(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    r = httpx.post(server + "/v1/completions", json={**body, "allowed_token_ids": [10**6]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    (hello,) = httpx.post(server + "/tokenize", json={"model": MODEL, "prompt": "Hello"}, timeout=60).json()["tokens"]
    r = httpx.post(server + "/v1/completions", json={**body, "allowed_token_ids": [hello], "bad_words": ["Hi"]},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "Hello" * 4, r.text  # the only id allowed, four times


def test_token_ids_past_the_tokenizer_are_refused(server):
    # the logits have 248,320 rows, the tokenizer 248,077 ids: the rest are padding no text decodes to, so a
    # logit_bias, stop id or allowed id there is a 400 naming its field (not empty tokens in the reply)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    for field, value in (("logit_bias", {"248100": 100}), ("stop_token_ids", [248100]),
                         ("allowed_token_ids", [248100])):
        r = httpx.post(server + "/v1/completions", json={**body, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "[0, 248077)" in r.json()["error"]["message"], r.text
    r = httpx.post(server + "/v1/completions", json={**body, "logit_bias": {"248076": 100},
                                                     "stop_token_ids": [248076]}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_prompt_that_fills_the_context_names_no_completion_length(server):
    # 512 prompt ids fill --max-model-len 512; max_tokens unset (null): no completion length to report
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": [100] * 512, "max_tokens": None},
                   timeout=60)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "512 tokens long, which leaves no room" in msg and "for the completion" not in msg, msg


def test_token_rules_next_to_an_output_constraint_are_refused(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "guided_regex": "a+"}
    for field, value in (("allowed_token_ids", [100]), ("bad_words", ["ab"])):
        r = httpx.post(server + "/v1/completions", json={**body, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
