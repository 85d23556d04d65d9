"""The OpenAI Responses API's request (`POST /v1/responses`) and its translation to a chat completion request.

A Responses request is a chat request in other words: `instructions` is the system message, `input` the
conversation (text, messages with `input_text` / `output_text` parts, earlier `function_call` items and their
`function_call_output` results, earlier `reasoning` items), `tools` flat function definitions, `text.format` the
output format, `max_output_tokens` the completion budget. `to_chat_request` builds the `ChatCompletionRequest` the
chat path serves; the reply is then formatted as a response (`responses.py`).

Not served (HTTP 400 naming the field): `previous_response_id`, `conversation` and `prompt` (this server keeps no
responses, conversations or prompt templates: send the whole conversation in `input`), `background`,
`truncation: "auto"`, non-function tools (web search, file search, ...), and input other than text (images, files,
audio). `store` is accepted and reported false. Token logprobs come with the message text when `include` names
"message.output_text.logprobs" (`top_logprobs` alternatives each, 0 by default), as OpenAI's; OpenAI's other
`include` values are accepted and add nothing, unknown ones get 400. `chat_template_kwargs` (a vLLM extension) passes
to the chat template as on the chat endpoint.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationError

from vibeqwen.server.protocol import MAX_TOP_LOGPROBS, ChatCompletionRequest, JsonInt, SamplingFields, _Request
from vibeqwen.server.serving import APIError
from vibeqwen.server.validation import describe_validation_errors

# Sampling fields a Responses request may carry as vLLM extensions (its own are temperature and top_p), and the
# unknown fields `to_chat_request` reads
_SAMPLING_EXTRAS = frozenset(SamplingFields.model_fields) - {"model", "stream", "stream_options", "n",
                                                             "response_format", "user", "temperature", "top_p"}
SERVED_EXTRAS = _SAMPLING_EXTRAS | {"conversation", "prompt", "chat_template_kwargs"}


class Reasoning(_Request):
    """`reasoning`: Qwen's thinking has no levels, so effort "none" turns it off and any other effort leaves it on;
    `summary` is accepted (no summaries are written)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None


class ResponsesRequest(_Request):
    """POST /v1/responses (the fields this server reads; see the module docstring for the rest)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: JsonInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    top_logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None


LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: OpenAI's `include` values; only LOGPROBS_INCLUDE adds something here (no tools or stored items have outputs to add)
INCLUDE_VALUES = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content", "file_search_call.results",
                            "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                            "computer_call_output.output.image_url", "code_interpreter_call.outputs"})


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the response carries its message's token logprobs: `include` names LOGPROBS_INCLUDE."""
    return LOGPROBS_INCLUDE in (body.include or ())


def _refuse(message: str, param: str) -> APIError:
    return APIError(message, param=param)


def _text_parts(content: Any, param: str, what: str = "a message's content") -> str:
    """A Responses message's content (or `what`) as text: a string, or `input_text` / `output_text` / `text` /
    `refusal` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(f"{what} must be text or a list of text parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            key = "refusal" if kind == "refusal" else "text"
            if not isinstance(part.get(key), str):
                raise _refuse(f"a content part of type {kind!r} needs its `{key}` (text)", f"{param}.content[{j}]")
            texts.append(part[key])
        else:
            raise _refuse(f"content parts of type {kind!r} are not supported; send input_text parts "
                          "(this server has no vision or audio tower)", f"{param}.content[{j}]")
    return "".join(texts)


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of `instructions` and `input`."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return _with_instructions(messages, body.instructions)
    reasoning: str | None = None  # an earlier reasoning item, for the assistant turn after it
    call_ids: set[str] = set()  # the function_call items so far: an output answers one of them
    for i, item in enumerate(body.input):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _refuse(f"unknown message role {role!r}", f"{param}.role")
            if role == "user" and item.get("content") == []:  # as the chat endpoint's ChatMessage check
                raise _refuse("a user message's `content` list needs at least one part", f"{param}.content")
            msg: dict[str, Any] = {"role": role, "content": _text_parts(item.get("content"), param)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            messages.append(msg)
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise _refuse("a function_call item needs its call_id, name and arguments (text)", param)
            if call_id in call_ids:
                raise _refuse(f"two function_call items have the call_id {call_id!r}; an output could answer either",
                              f"{param}.call_id")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            call_ids.add(call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # the reply's text and calls (parallel ones too) are one assistant turn
                last.setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                messages.append(msg)
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(call_id, str):
                raise _refuse("a function_call_output item needs its call_id", param)
            if output is None:
                raise _refuse("a function_call_output item needs its output (text, or a list of input_text parts)",
                              f"{param}.output")
            if call_id not in call_ids:  # no stored responses here: the call must be in this input, before it
                raise _refuse(f"no function_call item before this output has the call_id {call_id!r}",
                              f"{param}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text_parts(output, f"{param}.output", "a function_call_output's output")})
        elif kind == "reasoning":
            texts = []
            for key in ("content", "summary"):
                parts = item.get(key) or []
                if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                          for p in parts):
                    raise _refuse(f"a reasoning item's {key} must be a list of parts with their text",
                                  f"{param}.{key}")
                texts += [p["text"] for p in parts]
            reasoning = "".join(texts) or None
        else:
            raise _refuse(f"input items of type {kind!r} are not supported (message, function_call, "
                          "function_call_output and reasoning are)", f"{param}.type")
    return _with_instructions(messages, body.instructions)


def _with_instructions(messages: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """`instructions` and the conversation's leading system / developer messages as its one system message (the
    chat template takes a single system message, first)."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] in ("system", "developer"):
        lead += 1
    texts = ([instructions] if instructions else []) + [m["content"] for m in messages[:lead]]
    if not texts:
        return messages
    return [{"role": "system", "content": "\n\n".join(texts)}] + messages[lead:]


def _tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    tools = []
    for i, tool in enumerate(body.tools or ()):
        if tool.get("type") != "function":
            raise _refuse(f"tools of type {tool.get('type')!r} are not supported (function tools are)",
                          f"tools[{i}].type")
        if not isinstance(tool.get("name"), str):
            raise _refuse("a function tool needs its `name` (Responses tools are flat: {\"type\": \"function\", "
                          "\"name\": ..., \"parameters\": {...}})", f"tools[{i}].name")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        tools.append({"type": "function", "function": fn})
    return tools or None


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _refuse("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                          "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise _refuse('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                      '"name": ..., "schema": {...}}', "text.format")
    if kind == "text":
        return None
    if kind == "json_schema":
        if "schema" not in fmt:  # required by OpenAI's Responses API (chat's json_schema.schema may be left out)
            raise _refuse('text.format of type "json_schema" needs its `schema` ({"type": "json_schema", "name": '
                          '..., "schema": {...}})', "text.format.schema")
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": kind}


def to_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves `body`. Raises APIError (400) for what it cannot have."""
    extra = body.model_extra or {}
    for param, asked, why in (
            ("previous_response_id", body.previous_response_id, "this server keeps no responses; send the whole "
                                                                 "conversation in `input`"),
            ("conversation", extra.get("conversation"), "this server keeps no conversations; send the whole "
                                                        "conversation in `input`"),
            ("prompt", extra.get("prompt"), "this server keeps no prompt templates; send the prompt in `input`"),
            ("background", body.background, "responses run in the foreground here"),
            ("truncation", body.truncation == "auto", "a conversation longer than the context is refused "
                                                      "(truncation \"disabled\")")):
        if asked:
            raise _refuse(f"{param} is not supported: {why}", param)
    for i, value in enumerate(body.include or ()):
        if value not in INCLUDE_VALUES:
            raise _refuse(f"unknown include value {value!r} (OpenAI's are {', '.join(sorted(INCLUDE_VALUES))})",
                          f"include[{i}]")
    kwargs = extra.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _refuse("chat_template_kwargs must be an object", "chat_template_kwargs")
    effort = body.reasoning.effort if body.reasoning is not None else None
    chat: dict[str, Any] = {
        "model": body.model, "messages": _messages(body), "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "tools": _tools(body),
        "tool_choice": _tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text), "user": body.user,
        "logprobs": wants_logprobs(body), "top_logprobs": (body.top_logprobs or 0) if wants_logprobs(body) else None,
        # reasoning effort "none" turns Qwen's thinking off; any other effort leaves it on (it has no levels)
        "chat_template_kwargs": {**(kwargs or {}), "enable_thinking": False} if effort == "none" else kwargs,
    }
    chat.update({k: v for k, v in (body.model_extra or {}).items() if k in _SAMPLING_EXTRAS})
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as e:
        message, param = describe_validation_errors(e.errors(), rename=responses_param)
        raise _refuse(message, param) from None


# chat request fields -> the Responses fields they come from (for error params), first match wins
_PARAMS = (("messages", "input"), ("response_format.json_schema", "text.format"),
           ("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
           ("max_tokens", "max_output_tokens"))
_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.function(?=$|[.\[])")


def responses_param(param: str | None) -> str | None:
    """The Responses field an error about chat request field `param` is about: `messages...` -> `input`,
    `response_format.json_schema.strict` -> `text.format.strict`, `tools[0].function.name` -> `tools[0].name` (a
    Responses tool is flat)."""
    if param is None:
        return None
    tool = _TOOL_FIELD.match(param)
    if tool is not None:
        return f"tools[{tool.group(1)}]" + param[tool.end():]
    for chat_name, name in _PARAMS:
        if param == chat_name or param.startswith((chat_name + ".", chat_name + "[")):
            # the messages' indexes are not the input items' (instructions, calls joined into one turn)
            return name if chat_name == "messages" else name + param[len(chat_name):]
    return param

