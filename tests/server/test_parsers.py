"""Reasoning and Qwen3-Coder XML tool-call parsing: the parsers fed known model text in pieces of every
size (the stream must add up to the whole), malformed output, and the exact OpenAI objects a live server
sends for scripted replies (real tokenizer: `<think>` / `<tool_call>` are special tokens there)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai_scripted import ScriptedEngine, live_server, sse_events

from vibeqwen.server.app import ServerConfig, create_app
from vibeqwen.server.async_engine import AsyncEngine
from vibeqwen.server.parsers import (
    OutputParser,
    ParsedReply,
    Text,
    ToolCallArguments,
    ToolCallStart,
    coalesce,
    convert_parameter,
    markup_token_ids,
    prompt_opens_reasoning,
)

# one client for the module: a fresh httpx client per call costs tens of milliseconds
HTTP = httpx.Client(timeout=60)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "scale": {"type": "number"},
                "opts": {"type": "object"},
                "tags": {"type": "array"},
                "unit": {"type": "string", "enum": ["C", "F"]},
                "note": {"type": ["string", "null"]},
            },
            "required": ["city"],
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NOOP]

CALLS = (
    "Checking.\n\n<tool_call>\n<function=get_weather>\n"
    '<parameter=city>\nParis "Île"\nde France\n</parameter>\n'
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
    "<parameter=scale>\n1.5\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n"
    "<parameter=tags>\n['x', 'y']\n</parameter>\n<parameter=unit>\n C \n</parameter>\n"
    "<parameter=note>\nnull\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=noop>\n</function>\n</tool_call>"
)
CALLS_ARGS = [
    {"city": 'Paris "Île"\nde France', "days": 3, "metric": True, "scale": 1.5, "opts": {"a": [1, 2]},
     "tags": ["x", "y"], "unit": "C", "note": None},
    {},
]


def feed(text: str, size: int, reasoning: bool = False, tools=TOOLS, parallel: bool = True, forced: bool = False):
    """(raw events, assembled reply) after feeding `text` in pieces of `size` characters."""
    parser = OutputParser(reasoning, tools, parallel, new_id=lambda: "call_x", forced_tool_calls=forced)
    events = []
    for i in range(0, len(text), size):
        events += parser.feed(text[i : i + size])
    events += parser.finish()
    reply = ParsedReply()
    reply.add(events)
    return events, reply


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 10_000])
def test_tool_calls_in_any_pieces_add_up_to_the_whole(size):
    events, reply = feed(CALLS, size)
    assert reply.content == "Checking." and reply.reasoning == ""
    assert [c["name"] for c in reply.tool_calls] == ["get_weather", "noop"]
    # the arguments are exactly the JSON text of the typed values
    assert [c["arguments"] for c in reply.tool_calls] == [json.dumps(a, ensure_ascii=False) for a in CALLS_ARGS]
    assert [json.loads(c["arguments"]) for c in reply.tool_calls] == CALLS_ARGS
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(s.index, s.name, s.id) for s in starts] == [(0, "get_weather", "call_x"), (1, "noop", "call_x")]


def test_tool_call_events_stream_header_then_argument_fragments():
    events = coalesce(feed(CALLS, 1)[0])
    assert events == [
        Text("content", "Checking."),
        ToolCallStart(0, "call_x", "get_weather"),
        ToolCallArguments(0, json.dumps(CALLS_ARGS[0], ensure_ascii=False)),
        ToolCallStart(1, "call_x", "noop"),
        ToolCallArguments(1, "{}"),
    ]
    raw = feed(CALLS, 1)[0]
    args = [e.text for e in raw if isinstance(e, ToolCallArguments) and e.index == 0]
    # the string value streams as it arrives (many fragments before its parameter closes); typed values whole
    assert args[0] == '{"city": "'
    city = args[1 : args.index(', "days": ') - 1]
    assert len(city) > 5 and "".join(city) == json.dumps('Paris "Île"\nde France', ensure_ascii=False)[1:-1]
    assert args[args.index(', "days": ') :] == [', "days": ', "3", ', "metric": ', "true", ', "scale": ', "1.5",
                                                ', "opts": ', '{"a": [1, 2]}', ', "tags": ', '["x", "y"]',
                                                ', "unit": ', '"C"', ', "note": ', "null", "}"]


@pytest.mark.parametrize("size", [1, 4, 10_000])
def test_reasoning_split(size):
    text = "Let me think.\nStep 2.\n\n</think>\n\nThe answer."
    _, reply = feed(text, size, reasoning=True, tools=None)
    assert (reply.reasoning, reply.content) == ("Let me think.\nStep 2.", "The answer.")
    events = feed(text, size, reasoning=True, tools=None)[0]
    kinds = [e.kind for e in events]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # content never before reasoning ends


@pytest.mark.parametrize("text, reasoning", [("Still thinking\n", "Still thinking\n"), ("abc</thi", "abc</thi")])
def test_reasoning_cut_off_stays_reasoning(text, reasoning):
    for size in (1, 100):
        _, reply = feed(text, size, reasoning=True, tools=None)
        assert (reply.reasoning, reply.content, reply.tool_calls) == (reasoning, "", [])


def test_tool_call_inside_reasoning_is_not_a_call():
    inner = "I could call <tool_call>\n<function=noop>\n</function>\n</tool_call> but no."
    for size in (1, 7, 1000):
        _, reply = feed(inner + "\n</think>\n\nDone.", size, reasoning=True)
        assert (reply.reasoning, reply.content, reply.tool_calls) == (inner, "Done.", [])


def test_tool_call_after_reasoning():
    for size in (1, 1000):
        _, reply = feed("Plan.\n</think>\n\n" + CALLS.split("Checking.\n\n")[1], size, reasoning=True)
        assert (reply.reasoning, reply.content) == ("Plan.", "")
        assert [json.loads(c["arguments"]) for c in reply.tool_calls] == CALLS_ARGS


def call(body: str) -> str:
    return f"<tool_call>\n<function=get_weather>\n{body}</function>\n</tool_call>"


DEEP_CALL = '<tool_call>\n{"name": "noop", "arguments": {"k": ' + "[" * 3000 + "]" * 3000 + "}}\n</tool_call>"
MALFORMED = {
    # (text, content, [(name, arguments)])
    "tag_then_text": ("<tool_call> just text", "<tool_call> just text", []),
    "bad_function_name": ("a <tool_call>\n<function=bad name\n> x", "a <tool_call>\n<function=bad name\n> x", []),
    "cut_in_string_value": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", "",
                            [("get_weather", '{"city": "Par"}')]),
    "cut_in_typed_value": ("<tool_call>\n<function=get_weather>\n<parameter=days>\n1", "",
                           [("get_weather", '{"days": 1}')]),
    "cut_after_name": ("<tool_call>\n<function=noop>\n", "", [("noop", "{}")]),
    # cut off (max_tokens) before the name was complete: neither a call nor markup in the content
    "cut_in_name": ("\n\n<tool_call>\n<function=g", "", []),
    "cut_in_function_tag": ("<tool_call>\n<func", "", []),
    "cut_after_tag": ("Checking.\n<tool_call>", "Checking.", []),
    "missing_parameter_close": (call("<parameter=city>\nRome\n<parameter=days>\n2\n</parameter>\n"), "",
                                [("get_weather", '{"city": "Rome", "days": 2}')]),
    "missing_function_close": ("<tool_call>\n<function=noop>\n</tool_call>after", "after", [("noop", "{}")]),
    "missing_tool_call_close": ("<tool_call>\n<function=noop>\n</function>\nafter", "after", [("noop", "{}")]),
    "stray_text_in_function": (call("blah <b> blah\n<parameter=days>\n4\n</parameter>\n"), "",
                               [("get_weather", '{"days": 4}')]),
    "untyped_value_stays_string": (call("<parameter=days>\nthree\n</parameter>\n"), "",
                                   [("get_weather", '{"days": "three"}')]),
    "unknown_parameter_is_string": (call("<parameter=extra>\n42\n</parameter>\n"), "",
                                    [("get_weather", '{"extra": "42"}')]),
    # a parameter given twice keeps its first value: no repeated key in the JSON (a stream cannot take it back)
    "repeated_parameter": (call("<parameter=days>\n1\n</parameter>\n<parameter=city>\nA\n</parameter>\n"
                                "<parameter=days>\n2\n</parameter>\n<parameter=city>\nBB\n</parameter>\n"), "",
                           [("get_weather", '{"days": 1, "city": "A"}')]),
    "unknown_function": ("<tool_call>\n<function=other>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
                         "", [("other", '{"x": "1"}')]),
    "hermes_json_body": ('<tool_call>\n{"name": "noop", "arguments": {"k": [1]}}\n</tool_call>', "",
                         [("noop", '{"k": [1]}')]),
    "hermes_repeated_key": ('<tool_call>\n{"name": "noop", "arguments": {"k": 1, "j": 2, "k": 3}}\n</tool_call>', "",
                            [("noop", '{"k": 1, "j": 2}')]),
    "bad_json_body": ('<tool_call>\n{"name": 5}\n</tool_call>', '<tool_call>\n{"name": 5}\n</tool_call>', []),
    # nested past the JSON parser's recursion limit: kept as text, as any body that does not parse (not a 500)
    "json_body_too_deep": (DEEP_CALL, DEEP_CALL, []),
    "text_after_calls": ("Hi.\n\n" + call("") + "\n\nBye.", "Hi.Bye.", [("get_weather", "{}")]),
}


@pytest.mark.parametrize("case", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_tool_calls(case):
    text, content, calls = case
    for size in (1, 3, 10_000):
        _, reply = feed(text, size)
        assert reply.content == content, size
        assert [(c["name"], c["arguments"]) for c in reply.tool_calls] == calls, size
        for c in reply.tool_calls:
            assert isinstance(json.loads(c["arguments"]), dict)


@pytest.mark.parametrize("size", [1, 4, 10_000])
def test_a_reply_cut_anywhere_leaves_json_arguments_and_no_markup(size):
    # max_tokens may end the reply at any character: inside a tag, a value or between calls
    tag = "<tool_call>"
    opens = [i for i in range(len(CALLS)) if CALLS.startswith(tag, i)]
    for cut in range(len(CALLS) + 1):
        _, reply = feed(CALLS[:cut], size)
        # a cut inside a <tool_call> tag leaves its start as text (a "<" may be text: the real model writes the
        # tag as one special token); otherwise the content is what precedes the calls
        inside = [CALLS[i:cut] for i in opens if i < cut < i + len(tag)]
        want = CALLS[:cut].rstrip() if cut < opens[0] + len(tag) else "Checking." + (inside[0] if inside else "")
        assert reply.content.rstrip() == want, (cut, reply.content)
        for c, whole in zip(reply.tool_calls, CALLS_ARGS):
            args = json.loads(c["arguments"])
            assert isinstance(args, dict) and "<" not in c["arguments"], (cut, c["arguments"])
            for name, value in args.items():  # a value whose closing tag arrived is whole and typed
                close = CALLS.index("</parameter>", CALLS.index(f"<parameter={name}>")) + len("</parameter>")
                assert cut < close or value == whole[name], (cut, name, value)


@pytest.mark.parametrize("size", [1, 3, 10_000])
def test_a_forced_call_cut_inside_its_opening_tag_leaves_no_markup(size):
    """Under a forced tool_choice the grammar lets the model spell <tool_call> as text pieces, so max_tokens can
    end the reply inside the tag: that is a call cut off before its name (no call, no markup in the content, the
    whitespace before it dropped). Without the constraint the unfinished tag stays text, and a whole call parses
    either way."""
    tag = "<tool_call>"
    for lead in ("", "\n\n", "Checking. "):
        for cut in range(1, len(tag)):
            text = lead + tag[:cut]
            _, forced = feed(text, size, forced=True)
            assert (forced.content, forced.tool_calls) == (lead.strip(), []), (text, forced)
            _, free = feed(text, size)
            assert free.content.strip() == text.strip() and free.tool_calls == [], (text, free)
    _, whole = feed(CALLS, size, forced=True)
    assert [c["name"] for c in whole.tool_calls] == ["get_weather", "noop"]
    assert ParsedReply.parse("a < b", tools=TOOLS, forced_tool_calls=True).content == "a < b"  # not a tag's start


def test_parallel_false_reports_the_first_call_only():
    _, reply = feed(CALLS, 2, parallel=False)
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"]
    assert json.loads(reply.tool_calls[0]["arguments"]) == CALLS_ARGS[0]


def test_without_tools_or_reasoning_text_passes_through():
    text = "a <tool_call> b </think> c  "
    assert ParsedReply.parse(text).content == text


@pytest.mark.parametrize("raw, schema, value", [
    ("\n 42 ", {"type": "integer"}, 42),
    ("4.0", {"type": "integer"}, 4),
    ("x", {"type": "integer"}, "x"),
    ("-1.5e3", {"type": "number"}, -1500.0),
    ("FALSE", {"type": "boolean"}, False),
    ("None", {"type": "null"}, None),
    ("{'a': (1)}", {"type": "object"}, {"a": 1}),
    ("[1, 'b']", {"type": "array"}, [1, "b"]),
    ("[1", {"type": "array"}, "[1"),
    ("7", {"type": ["integer", "string"]}, 7),
    ("seven", {"type": ["integer", "string"]}, "seven"),
    ("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 7),
    (" F ", {"type": "string", "enum": ["C", "F"]}, "F"),
    ("2", {"enum": [1, 2]}, 2),
    ("  keep  spaces ", {"type": "string"}, "  keep  spaces "),
    ("3", None, "3"),
])
def test_convert_parameter(raw, schema, value):
    assert convert_parameter(raw, schema) == value
    assert type(convert_parameter(raw, schema)) is type(value)


@pytest.mark.parametrize("raw, schema", [
    ("[3907E3211 ]", {"type": "array", "items": {"type": "number"}}),  # the break-it review's forced call: [Infinity]
    ("NaN", {"type": "number"}),
    ("-Infinity", {"type": "number"}),
    ("1e999", {"type": ["number", "string"]}),
    ("1" * 5000, {"type": "integer"}),  # past int()'s digit limit
    ("[{1, 2}]", {"type": "array"}),  # a set (ast.literal_eval)
    ("{(1, 2): 3}", {"type": "object"}),  # a tuple key
    ("[1j]", {"type": "array"}),
    ("[b'x']", {"type": "array"}),
    ("[" * 5000 + "]" * 5000, {"type": "array"}),
    ("[" * 5000 + "]" * 5000, {"type": "number"}),
    ("[" * 5000 + "]" * 5000, {"type": "integer"}),
    ('{"a": [1, NaN]}', {"type": "object"}),
])
def test_values_strict_json_cannot_hold_stay_text(raw, schema):
    """Arguments are strict JSON (clients parse them with JSON.parse): a value that parses only to NaN, an
    infinity, a set, bytes or a complex number, or that is too long or deep to check, stays the text written."""
    value = convert_parameter(raw, schema)
    assert value == raw.strip()
    json.dumps({"x": value}, allow_nan=False)


# ---- through a live server: scripted replies, the real tokenizer ----

REPLIES = {
    "think": "Let me think.\n</think>\n\nThe answer is 4.",
    "plain": "Plain <think>x</think> answer.",
    "tool": "Plan.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
}
TOOL_ARGS = '{"city": "Paris", "days": 3}'


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from vibeqwen.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_checkpoint)


@pytest.fixture(scope="module")
def scripted(tokenizer):
    engine = ScriptedEngine(tokenizer, REPLIES)
    async_engine = AsyncEngine(engine)
    with live_server(create_app(async_engine, "scripted", ServerConfig(reasoning=True))) as url:
        yield url, engine
    async_engine.shutdown()


def user(text: str, **kw) -> dict:
    return {"model": "scripted", "messages": [{"role": "user", "content": text}], **kw}


def post_stream(url: str, body: dict) -> list:
    r = HTTP.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_markup_ids_and_thinking_prompt(tokenizer):
    ids = markup_token_ids(tokenizer)
    assert ids == {"<think>": 248068, "</think>": 248069, "<tool_call>": 248058, "</tool_call>": 248059}
    msgs = [{"role": "user", "content": "hi"}]
    on = tokenizer.encode(tokenizer.apply_chat_template(msgs))
    off = tokenizer.encode(tokenizer.apply_chat_template(msgs, enable_thinking=False))
    assert prompt_opens_reasoning(on, 248068, 248069) and not prompt_opens_reasoning(off, 248068, 248069)
    assert not prompt_opens_reasoning(on, None, None)


def test_reasoning_whole_and_streamed(scripted):
    url, _ = scripted
    r = HTTP.post(url + "/v1/chat/completions", json=user("think"), timeout=30).json()
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "The answer is 4.",
                                          "reasoning_content": "Let me think.", "reasoning": "Let me think."}
    assert r["choices"][0]["finish_reason"] == "stop"
    chunks = post_stream(url, user("think"))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    body = deltas[1:-1]
    assert len(body) > 4 and deltas[-1] == {}
    reasoning = [d for d in body if "reasoning_content" in d]
    content = [d for d in body if "content" in d]
    assert all(d.keys() == {"reasoning_content", "reasoning"} and d["reasoning"] == d["reasoning_content"]
               for d in reasoning)
    assert all(d.keys() == {"content"} for d in content) and len(reasoning) + len(content) == len(body)
    assert body.index(content[0]) > body.index(reasoning[-1])
    assert "".join(d["reasoning_content"] for d in reasoning) == "Let me think."
    assert "".join(d["content"] for d in content) == "The answer is 4."


def test_thinking_off_never_fills_reasoning(scripted):
    url, _ = scripted
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    r = HTTP.post(url + "/v1/chat/completions", json=user("plain", **kw), timeout=30).json()
    # no think block open: no split, and the stray tags are dropped as the special tokens they are
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "Plain x answer."}
    chunks = post_stream(url, user("plain", **kw))
    assert all("reasoning_content" not in c["choices"][0]["delta"] for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Plain x answer."


def test_tool_call_stream_is_openai_shaped(scripted):
    url, engine = scripted
    chunks = post_stream(url, user("tool", tools=[WEATHER]))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    tool_deltas = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert all(d.keys() == {"tool_calls"} for d in deltas if "tool_calls" in d)
    first, rest = tool_deltas[0], tool_deltas[1:]
    assert first == [{"index": 0, "id": first[0]["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": ""}}]
    assert first[0]["id"].startswith("call_")
    assert len(rest) > 3 and all(t == [{"index": 0, "function": {"arguments": t[0]["function"]["arguments"]}}]
                                 for t in rest)
    assert "".join(t[0]["function"]["arguments"] for t in rest) == TOOL_ARGS
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Plan."
    assert "".join(d.get("content", "") for d in deltas) == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the tools reached the prompt through the chat template
    assert "<tools>" in engine.tokenizer.decode(engine.prompts[-1]) and "get_weather" in engine.tokenizer.decode(
        engine.prompts[-1])


def test_tool_call_with_the_openai_sdk(scripted):
    url, _ = scripted
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    r = sdk.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "tool"}], tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tc,) = choice.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_")
    assert (tc.function.name, tc.function.arguments) == ("get_weather", TOOL_ARGS)
    # streamed: accumulate the deltas as OpenAI clients do
    calls: dict[int, dict] = {}
    for chunk in sdk.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "tool"}],
                                             tools=[WEATHER], stream=True):
        for d in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
    assert list(calls.values()) == [{"id": calls[0]["id"], "name": "get_weather", "arguments": TOOL_ARGS}]


def test_tool_choice_none_neither_offers_nor_parses(scripted):
    url, engine = scripted
    r = HTTP.post(url + "/v1/chat/completions", json=user("tool", tools=[WEATHER], tool_choice="none"),
                   timeout=30).json()
    msg = r["choices"][0]["message"]
    assert "tool_calls" not in msg and r["choices"][0]["finish_reason"] == "stop"
    assert "<function=get_weather>" in msg["content"]
    assert "<tools>" not in engine.tokenizer.decode(engine.prompts[-1])


def test_forced_tool_call_constraint_accepts_the_model_format(scripted):
    # The scripted engine checks every token against the request's grammar (unconstrained until </think>).
    url, _ = scripted
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = HTTP.post(url + "/v1/chat/completions", json=user("tool", tools=[WEATHER, NOOP], tool_choice=choice),
                       timeout=30).json()
        assert r["choices"][0]["finish_reason"] == ("tool_calls" if choice == "required" else "stop"), r
        assert r["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == TOOL_ARGS


def test_tool_results_in_later_turns_reach_the_template(scripted):
    url, engine = scripted
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": TOOL_ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = HTTP.post(url + "/v1/chat/completions", json={"model": "scripted", "messages": messages, "tools": [WEATHER]},
                   timeout=30)
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(engine.prompts[-1])
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt


def test_nan_logprobs_are_numbers_in_both_apis(scripted):
    """A model whose logits are NaN (a broken checkpoint) gives NaN logprobs: chat and completions both carry them as
    -9999.0, the stand-in for -inf (the OpenAI schema's logprob is a number, never null), in every place the same."""
    url, engine = scripted
    engine.logprob_value = float("nan")
    try:
        r = HTTP.post(url + "/v1/chat/completions", json=user("think", logprobs=True, top_logprobs=2), timeout=30)
        assert r.status_code == 200, r.text
        for e in r.json()["choices"][0]["logprobs"]["content"]:
            assert e["logprob"] == -9999.0 and e["top_logprobs"][0]["logprob"] == -9999.0, e
        r = HTTP.post(url + "/v1/completions", json={"model": "scripted", "prompt": "think", "logprobs": 2,
                                                      "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"] and all(v == -9999.0 for v in lp["token_logprobs"]), lp
        for token, top in zip(lp["tokens"], lp["top_logprobs"]):
            assert top[token] == -9999.0, (token, top)
    finally:
        engine.logprob_value = -0.5


def test_logprobs_follow_the_deltas(scripted):
    url, _ = scripted
    r = HTTP.post(url + "/v1/chat/completions", json=user("think", logprobs=True, top_logprobs=2), timeout=30).json()
    entries = r["choices"][0]["logprobs"]["content"]
    assert r["usage"]["completion_tokens"] == len(entries)
    assert all(e.keys() == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2
               for e in entries)
    text = bytes(b for e in entries for b in e["bytes"]).decode()
    assert text == REPLIES["think"] + "<|im_end|>"
    chunks = post_stream(url, user("think", logprobs=True, top_logprobs=2))
    streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == entries
