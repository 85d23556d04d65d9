"""POST /v1/responses: the OpenAI Responses API over the chat path.

The request becomes a chat completion request (`responses_protocol.to_chat_request`) and runs as one; its parsed
reply (`parsers.OutputParser` events: reasoning text, content text, tool calls) becomes the response's output
items, in order: a `reasoning` item (Qwen's thinking, as `reasoning_text` content), a `message` item (the answer,
as `output_text`), and a `function_call` item per tool call. A reply cut off by `max_output_tokens` is a response
with status `incomplete` (`incomplete_details.reason: "max_output_tokens"`).

Streamed (`stream: true`), the events are OpenAI's: `response.created`, `response.in_progress`, then for each item
`response.output_item.added`, its content part's `response.content_part.added`, the text deltas
(`response.reasoning_text.delta`, `response.output_text.delta`, `response.function_call_arguments.delta`), their
`.done` events, `response.output_item.done`, and last `response.completed` (or `response.incomplete`, or
`response.failed` with the error), every event numbered by `sequence_number`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vibeqwen.server.async_engine import RequestOutput
from vibeqwen.server.chat import ChatReply, start_chat
from vibeqwen.server.parsers import Text, ToolCallArguments, ToolCallStart, coalesce
from vibeqwen.server.protocol import now
from vibeqwen.server.responses_protocol import (SERVED_EXTRAS, ResponsesRequest, responses_param, to_chat_request,
                                               wants_logprobs)
from vibeqwen.server.serving import APIError, Serving, engine_error, merge, sse_response, unless_disconnected


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def create_response(serving: Serving, body: ResponsesRequest, request: Request) -> Any:
    """Serve one Responses request: the response object as JSON, or its SSE events when `body.stream`.

    Raises APIError: 400 for what the request cannot have (naming the Responses field), 404 for another model,
    503 when the server is full."""
    serving.check_model(body.model)
    serving.check_fields(body, served=SERVED_EXTRAS)
    chat = to_chat_request(body)
    response_id = _item_id("resp")
    try:
        reply, streams = await start_chat(serving, chat, response_id)
    except APIError as e:  # name the Responses field, not the chat request's
        e.info.param = responses_param(e.info.param)
        raise
    run = _Response(serving, body, chat.temperature, chat.top_p, reply, response_id)
    if body.stream:
        return sse_response(run.stream(streams, serving.shutdown.wait), serving.shutdown)
    return await unless_disconnected(request, run.collect(streams, serving.shutdown.wait))


def _dumps(data: Any) -> str:
    """JSON text of `data`; non-ASCII text as is, unless a client's string holds a lone surrogate (which has no
    UTF-8): then all of it as ASCII escapes."""
    text = json.dumps(data, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(data)
    return text


class _Response:
    """One response as it is built from its reply's parser events: output items, and the stream events that add
    them."""

    def __init__(self, serving: Serving, body: ResponsesRequest, temperature: float | None, top_p: float | None,
                 reply: ChatReply, response_id: str) -> None:
        self.serving, self.body, self.reply = serving, body, reply
        self.id = response_id
        self.created = now()
        d = serving.defaults
        self.temperature = d["temperature"] if temperature is None else temperature
        self.top_p = d["top_p"] if top_p is None else top_p
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written (the last of `items`)
        self.seq = 0
        self.output_tokens = 0
        self.reasoning_tokens = 0  # the reply's tokens up to its </think> (all of them while thinking)
        self.thinking = reply.parsers[0].reasoning is not None
        self.think_end = serving.markup.get("</think>")
        self.logprobs = wants_logprobs(body)
        self.pending: list[dict[str, Any]] = []  # logprobs of tokens whose message text has not come out yet

    # ---- the response object ----
    def response(self, status: str, error: dict | None = None, incomplete: str | None = None) -> dict[str, Any]:
        body = self.body
        usage = None
        if status != "in_progress":
            u = self.reply.usage(self.output_tokens)
            usage = {"input_tokens": u.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": self.reply.cached_tokens},
                     "output_tokens": u.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                     "total_tokens": u.total_tokens}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.serving.model_name, "output": [dict(i) for i in self.items],
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "store": False,
            "temperature": self.temperature, "text": {"format": {"type": "text"}, **(body.text or {})},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto", "tools": body.tools or [],
            "top_logprobs": body.top_logprobs, "top_p": self.top_p, "truncation": body.truncation or "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {},
        }

    def _finish(self, out: RequestOutput | None, error: Exception | None) -> tuple[str, dict | None, str | None]:
        """(status, error, incomplete reason) of the finished response."""
        if error is not None:
            info = engine_error(error).info
            return "failed", {"code": info.code or info.type, "message": info.message}, None
        if out is not None and out.finish_reason == "length":
            return "incomplete", None, "max_output_tokens"
        return "completed", None, None

    # ---- events ----
    def _event(self, kind: str, **fields: Any) -> dict[str, str]:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return {"event": kind, "data": _dumps(data)}

    def _open(self, item: dict[str, Any]) -> list[dict[str, str]]:
        events = self._close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index,
                                  item={**item, "content": []} if "content" in item else dict(item)))
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        elif item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            return events
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
        return events

    def _close(self, status: str = "completed") -> list[dict[str, str]]:
        """Events that end the open item, with `status` ("incomplete" when the reply was cut off in it)."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index = len(self.items) - 1
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            events.append(self._event(kind, item_id=item["id"], output_index=index, content_index=0,
                                      text=part["text"], **extra))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def feed(self, out: RequestOutput) -> list[dict[str, str]]:
        """The stream events of one engine output (its tokens parsed into items)."""
        parser = self.reply.parsers[0]
        self.reply.saw(out)
        self.output_tokens = out.num_tokens
        scored = self.reply.token_logprobs(out) if self.logprobs else []
        for k, token in enumerate(out.token_ids):
            if self.thinking:
                self.reasoning_tokens += 1
                self.thinking = token != self.think_end
            elif scored:  # the message's tokens: those after </think>
                self.pending.append(scored[k].model_dump())
        events_in = parser.feed(out.text)
        if out.finished:
            events_in += parser.finish()
        events: list[dict[str, str]] = []
        for e in coalesce(events_in):
            if isinstance(e, Text):
                kind = "reasoning" if e.kind == "reasoning" else "message"
                if self.open is None or self.open["type"] != kind:
                    if kind == "reasoning":
                        item = {"id": _item_id("rs"), "type": "reasoning", "summary": [],
                                "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
                    else:
                        item = {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
                    events += self._open(item)
                part = self.open["content"][0]
                part["text"] += e.text
                index = len(self.items) - 1
                if kind == "reasoning":
                    events.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                              output_index=index, content_index=0, delta=e.text))
                else:
                    logprobs, self.pending = self.pending, []
                    part["logprobs"] += logprobs
                    events.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                              output_index=index, content_index=0, delta=e.text, logprobs=logprobs))
            elif isinstance(e, ToolCallStart):
                self.pending = []  # a call's tokens: not the message's
                events += self._open({"id": _item_id("fc"), "type": "function_call", "call_id": e.id, "name": e.name,
                                      "arguments": "", "status": "in_progress"})
            elif isinstance(e, ToolCallArguments) and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += e.text
                events.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                          output_index=len(self.items) - 1, delta=e.text))
        return events

    # ---- whole and streamed ----
    async def collect(self, streams: list[AsyncIterator[RequestOutput]],
                      stop: Callable[[], Awaitable[None]] | None = None) -> Response:
        last = None
        try:
            async for _, out in merge(streams, stop):
                self.feed(out)
                last = out
        except Exception as e:  # noqa: BLE001 - an engine failure fails this request only
            return engine_error(e).response()
        status, error, incomplete = self._finish(last, None)
        self._close("completed" if status == "completed" else "incomplete")
        # serialised here: the echoed fields are the client's (any nesting, any text)
        return Response(_dumps(self.response(status, error, incomplete)), media_type="application/json")

    async def stream(self, streams: list[AsyncIterator[RequestOutput]],
                     stop: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[dict[str, str]]:
        try:
            yield self._event("response.created", response=self.response("in_progress"))
            yield self._event("response.in_progress", response=self.response("in_progress"))
            last, error = None, None
            try:
                async for _, out in merge(streams, stop):
                    for event in self.feed(out):
                        yield event
                    last = out
            except Exception as e:  # noqa: BLE001 - reported in-band: the headers are gone
                error = e
            status, err, incomplete = self._finish(last, error)
            for event in self._close("completed" if status == "completed" else "incomplete"):
                yield event
            kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                    "failed": "response.failed"}[status]
            yield self._event(kind, response=self.response(status, err, incomplete))
        finally:  # closed before the engine's outputs were read (a client gone at once): abort them
            for s in streams:
                await s.aclose()
