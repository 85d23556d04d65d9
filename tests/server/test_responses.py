"""POST /v1/responses: the request's translation to a chat request, and the real `vibeqwen serve` process on the
tiny checkpoint driven by the unmodified `openai` SDK (whole and streamed responses, tool calls fed back, structured
output, refusals)."""

from __future__ import annotations

import json

import httpx
import pytest

from vibeqwen.server.responses_protocol import ResponsesRequest, to_chat_request
from vibeqwen.server.serving import APIError

openai = pytest.importorskip("openai")
from serve_process import start_serve, stop_serve  # noqa: E402

MODEL = "tiny-responses"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_request_becomes_the_chat_request_it_means():
    body = ResponsesRequest.model_validate({
        "model": "m", "instructions": "Be terse.", "max_output_tokens": 7, "temperature": 0.5, "top_k": 5,
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "reasoning": {"effort": "none"},
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text",
                                                                                     "text": "in Rome?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                            "text": "Call it."}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
        ]})
    chat = to_chat_request(body)
    msgs = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    assert msgs[0]["content"] == "Be terse." and msgs[1]["content"] == "Weather in Rome?"
    assistant = msgs[2]
    assert assistant["content"] == "Checking." and assistant["reasoning_content"] == "Call it."
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_1", "call_2"]
    assert msgs[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert msgs[4]["content"] == "rain"
    assert chat.max_new_tokens() == 7 and chat.temperature == 0.5 and chat.top_k == 5
    assert chat.tools[0].function.name == "get_weather" and chat.tool_choice.function.name == "get_weather"
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == {"type": "object"}
    assert chat.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("fields,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": None}]}]}, "input[0].content[0]"),
    ({"input": []}, "input"),
])
def test_what_this_server_cannot_serve_is_refused(fields, param):
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})
    with pytest.raises(APIError) as e:
        to_chat_request(body)
    assert e.value.status_code == 400 and e.value.info.param == param


def test_chat_template_kwargs_pass_through():
    """As on the chat endpoint; reasoning effort "none" still turns thinking off; OpenAI's include values pass."""
    body = ResponsesRequest.model_validate({"input": "hi", "chat_template_kwargs": {"enable_thinking": False, "x": 1},
                                            "include": ["reasoning.encrypted_content"]})
    assert to_chat_request(body).chat_template_kwargs == {"enable_thinking": False, "x": 1}
    body = ResponsesRequest.model_validate({"input": "hi", "chat_template_kwargs": {"x": 1},
                                            "reasoning": {"effort": "none"}})
    assert to_chat_request(body).chat_template_kwargs == {"x": 1, "enable_thinking": False}


def test_instructions_join_the_leading_system_messages():
    body = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "No emoji."}, {"role": "user", "content": "hi"}]})
    msgs = [m.model_dump(exclude_none=True) for m in to_chat_request(body).messages]
    assert msgs == [{"role": "system", "content": "Be brief.\n\nNo emoji."}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("fields,param", [
    ({"input": [{"type": "reasoning", "content": "abc"}]}, "input[0].content"),
    ({"input": [{"type": "reasoning", "summary": [{"text": 5}]}]}, "input[0].summary"),
    ({"text": {"format": "json_object"}}, "text.format"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_2", "output": "x"}]}, "input[1].call_id"),
    ({"input": [{"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1"}]}, "input[1].output"),
    ({"include": ["message.output_text.logprobs", "bogus"]}, "include[1]"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"input": [{"role": "user", "content": []}]}, "input[0].content"),  # as chat refuses it
])
def test_malformed_fields_are_400s(fields, param):
    body = ResponsesRequest.model_validate({"input": "hi", **fields})
    with pytest.raises(APIError) as e:
        to_chat_request(body)
    assert e.value.info.param == param


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    proc, base = start_serve(["--weights", str(tiny_checkpoint), "--served-model-name", MODEL, "--max-model-len",
                              "1024"])
    yield base
    stop_serve(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def _stream(client, **kw) -> list:
    return [e for e in client.responses.create(model=MODEL, stream=True, **kw)]


def test_whole_and_streamed_responses_agree(client):
    kw = dict(input="Count to three.", max_output_tokens=16, temperature=0)
    whole = client.responses.create(model=MODEL, **kw)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == MODEL
    # the tiny model never ends its thinking within 16 tokens: one reasoning item, cut off
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in whole.output] == ["reasoning"] and whole.output[0].content[0].text
    assert whole.usage.output_tokens == 16 and whole.usage.output_tokens_details.reasoning_tokens == 16
    assert whole.output[0].status == "incomplete"  # cut off inside it
    assert whole.usage.input_tokens > 0 and whole.usage.total_tokens == whole.usage.input_tokens + 16

    events = _stream(client, **kw)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == final.output[0].content[0].text == whole.output[0].content[0].text
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert added == [e.output_index for e in done] == [0]
    assert done[0].item.status == "incomplete" and final.usage.output_tokens == 16


def test_thinking_off_gives_a_message(client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=8, temperature=0,
                                reasoning={"effort": "none"}, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    assert [i.type for i in r.output] == ["message"]
    assert r.output_text and r.output[0].role == "assistant" and r.usage.output_tokens_details.reasoning_tokens == 0
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens == 8 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == r.output_text
    # as OpenAI's: top_logprobs alone adds none (include asks for them)
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=8, temperature=0,
                                    reasoning={"effort": "none"}, top_logprobs=2)
    assert plain.output_text == r.output_text and not plain.output[0].content[0].logprobs


def test_client_strings_are_echoed_whatever_they_hold(server):
    # a lone surrogate (valid JSON, no UTF-8) and deep nesting in fields the response echoes
    deep: list = []
    for _ in range(300):
        deep = [deep]
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "user": "\ud800", "metadata": {"k": "\udfff"},
            "text": {"format": {"type": "text"}, "junk": deep}}
    for stream in (False, True):
        r = httpx.post(server + "/v1/responses", content=json.dumps({**body, "stream": stream}),
                       headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 200, r.text[:300]
        text = r.text if not stream else [x for x in r.text.splitlines() if x.startswith("data: ")][-1][6:]
        final = json.loads(text) if not stream else json.loads(text)["response"]
        assert final["user"] == "\ud800" and final["metadata"] == {"k": "\udfff"}
    bad = httpx.post(server + "/v1/responses", json={"model": MODEL, "input": "hi", "reasoning": {"effort": "ultra"}})
    assert bad.status_code == 400, bad.text


def test_a_forced_tool_call_and_its_result_fed_back(client):
    r = client.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                                max_output_tokens=48, temperature=0, reasoning={"effort": "none"})
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_"), r.output
    if r.status == "completed":  # cut calls are closed, but only a whole one is sure to match the schema
        assert "city" in json.loads(calls[0].arguments)
    events = _stream(client, input="Weather in Rome?", tools=[WEATHER], tool_choice="required", max_output_tokens=48,
                     temperature=0, reasoning={"effort": "none"})
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and args == done[0].arguments == calls[0].arguments
    follow = client.responses.create(
        model=MODEL, tools=[WEATHER], max_output_tokens=4, temperature=0, reasoning={"effort": "none"},
        input=[{"role": "user", "content": "Weather in Rome?"}, *[i.model_dump() for i in r.output],
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_structured_output_and_errors(client, server):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = client.responses.create(model=MODEL, input="JSON", max_output_tokens=40, temperature=0,
                                reasoning={"effort": "none"},
                                text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text)["a"], int), r.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="x")
    raw = httpx.post(server + "/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 0})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "max_output_tokens", raw.text
