"""POST /v1/chat/completions: chat template, reasoning and tool-call parsing, structured output, n choices.

A request runs as n engine requests (one per choice). Each choice's text goes through an `OutputParser`:
the reasoning split when the server splits reasoning and the prompt opens a think block, then tool-call
parsing when the request has tools (and tool_choice is not "none"). Streamed and whole replies run the
same parsers, so a stream's deltas add up to the whole reply.

tool_choice: "auto" (default with tools) lets the model choose and parses what it writes; "none" leaves
the tools out of the prompt and parses nothing; "required" and a named function are enforced during
decoding with an xgrammar constraint (one or more calls of the listed tools / exactly one call of that
function, arguments matching the parameter schemas). With thinking on, constraints start after `</think>`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from vibeqwen.server.async_engine import RequestOutput
from vibeqwen.server.parsers import (
    OutputParser,
    ParsedReply,
    Text,
    ToolCallArguments,
    ToolCallStart,
    coalesce,
    prompt_opens_reasoning,
)
from vibeqwen.server.protocol import (
    with_null_usage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorResponse,
    FunctionCall,
    NamedToolChoice,
    TokenizeRequest,
    TokenLogprob,
    ToolCall,
    PromptTokensDetails,
    UsageInfo,
    now,
    random_id,
)
from vibeqwen.server.serving import (
    APIError,
    Serving,
    engine_error,
    json_logprob,
    merge,
    output_constraint,
    sse_response,
    unless_disconnected,
)
from vibeqwen.server.structured import StructuredOutputError

THINK_TAGS = ("<think>", "</think>")
TOOL_TAGS = ("<tool_call>", "</tool_call>")


async def create_chat_completion(serving: Serving, body: ChatCompletionRequest, request: Request) -> Any:
    serving.check_model(body.model)
    serving.check_fields(body, {"echo": (False, None)})
    reply, streams = await start_chat(serving, body, random_id("chatcmpl"))
    if body.stream:
        opts = body.stream_options
        return sse_response(reply.stream(streams, bool(opts and opts.include_usage), serving.shutdown.wait,
                                         bool(opts and opts.continuous_usage_stats)), serving.shutdown)
    return await unless_disconnected(request, reply.collect(streams, serving.shutdown.wait))


async def start_chat(serving: Serving, body: ChatCompletionRequest, request_id: str
                     ) -> tuple[ChatReply, list[AsyncIterator[RequestOutput]]]:
    """Render, check and admit a chat request (its n choices as engine requests `request_id[-i]`): the reply that
    parses its choices' outputs, and their output streams. Raises APIError for what the request cannot have."""
    constraint = _validate(body)
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    tools = offered_tools(body)  # none under tool_choice "none": not offered, not parsed
    rendered = await render_prompt(serving, body, tools, check_length=body.truncate_prompt_tokens is None)
    prompt_ids = serving.truncate_prompt(rendered, body.truncate_prompt_tokens)

    markup = serving.markup
    thinking = prompt_opens_reasoning(prompt_ids, markup.get("<think>"), markup.get("</think>"))
    split_reasoning = serving.config.reasoning and thinking
    keep = {markup[t] for t in THINK_TAGS if split_reasoning and t in markup}
    keep |= {markup[t] for t in TOOL_TAGS if tools and t in markup}

    top = body.top_logprobs or 0
    params = serving.sampling_params(body, len(prompt_ids), body.max_new_tokens(),
                                     logprobs=top if body.logprobs else None)
    params.prefix_cache_point = _generation_prompt_start(serving, prompt_ids)
    await serving.index_params([params])
    serving.check_request(prompt_ids, params, "messages", truncated=len(prompt_ids) < len(rendered))
    grammar = await _grammar(serving, body, tools, choice, constraint, thinking)
    if grammar is not None and params.min_tokens:
        raise APIError("min_tokens cannot be combined with an output constraint (response_format, "
                       "structured_outputs, guided_*) or a forced tool call", param="min_tokens")
    gate = markup.get("</think>") if thinking else None
    choices = serving.choice_params(params, body.n, grammar, gate, await serving.token_rules(body, grammar))

    streams = serving.start(request_id, [(prompt_ids, p) for p in choices], body.skip_special_tokens,
                            frozenset(keep))
    parallel = body.parallel_tool_calls is not False
    forced = _forces_calls(choice)  # _grammar's constraint: calls only
    reply = ChatReply(serving, request_id, len(prompt_ids), body.n,
                      lambda: OutputParser(split_reasoning, tools, parallel, forced_tool_calls=forced),
                      bool(body.logprobs), named_tool=isinstance(choice, NamedToolChoice))
    return reply, streams


def _generation_prompt_start(serving: Serving, prompt_ids: list[int]) -> int | None:
    """Where the prompt's last turn opens (its last <|im_start|>): the conversation up to there is what the next
    turn's prompt repeats (the template renders this reply, as history, unlike the generation prompt that opens it
    here), so the engine keeps a prefix-cache snapshot there. None without such a token."""
    start = serving.turn_start
    if start is None:
        return None
    for i in range(len(prompt_ids) - 1, 0, -1):
        if prompt_ids[i] == start:
            return i
    return None


def _forces_calls(choice: Any) -> bool:
    """Whether a `tool_choice` (None, a string or a NamedToolChoice) forces tool calls: "required" or a named
    function, which `_grammar` enforces while decoding."""
    return isinstance(choice, NamedToolChoice) or choice == "required"


def _validate(body: ChatCompletionRequest) -> tuple[str, str, Any] | None:
    """Checks across fields; returns the request's output constraint (serving.output_constraint)."""
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
    if body.top_logprobs and not body.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    choice = body.tool_choice
    names = [t.function.name for t in body.tools or ()]
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                           param="tool_choice")
    elif choice == "required" and not names:
        raise APIError("tool_choice 'required' needs tools", param="tool_choice")
    constraint = output_constraint(body)
    if _forces_calls(choice) and constraint is not None:
        raise APIError(f"{constraint[0].split('.')[0]} cannot be combined with a forced tool call",
                       param=constraint[0].split(".")[0])
    return constraint


def offered_tools(body: ChatCompletionRequest | TokenizeRequest) -> list[dict] | None:
    """The tools the chat template shows the model, as plain dicts: `body.tools`, unless `tool_choice` is "none"."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def message_token_bound(tokenizer: Any) -> int:
    """`Tokenizer.min_message_tokens` (tokens each chat message adds at least; measured once, ~30 ms, by
    `create_app`'s `chat_request_model` before serving), or 0 (no bound) for a tokenizer without it."""
    return tokenizer.min_message_tokens if hasattr(type(tokenizer), "min_message_tokens") else 0


async def render_prompt(serving: Serving, body: ChatCompletionRequest | TokenizeRequest, tools: list[dict] | None,
                        check_length: bool = True) -> list[int]:
    """The prompt ids the chat template renders for `body`'s messages (its add_generation_prompt,
    continue_final_message and chat_template_kwargs), off the event loop. Raises APIError (400) for what the
    template or the tokenizer refuses, and for a prompt that cannot fit the context unless check_length is false."""
    tokenizer = serving.engine.tokenizer
    limit = getattr(serving.engine, "max_model_len", None)
    if check_length and isinstance(limit, int):
        # each message adds at least this many tokens: refuse far too many messages before rendering them
        n = len(body.messages) * message_token_bound(tokenizer)
        if n >= limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, your prompt is at "
                           f"least {n} tokens long ({len(body.messages)} messages). Please reduce the prompt.",
                           param="messages", code="context_length_exceeded")
    kwargs: dict[str, Any] = {"tools": tools, "add_generation_prompt": body.add_generation_prompt,
                              "continue_final_message": body.continue_final_message}
    if getattr(body, "reasoning_effort", None) == "none":
        kwargs["enable_thinking"] = False
    extra = body.chat_template_kwargs or {}
    for name in ("messages", "tools"):  # the request's own fields, not template variables a request may set
        if name in extra:
            raise APIError(f"chat_template_kwargs may not set {name} (send them as the request's {name})",
                           param=f"chat_template_kwargs.{name}")
    kwargs.update(extra)
    defaults = {"add_generation_prompt": body.add_generation_prompt,
                "continue_final_message": body.continue_final_message, "enable_thinking": True}
    for flag, default in defaults.items():
        if kwargs.get(flag, default) is None:  # null: the default
            kwargs[flag] = default
        if flag in kwargs and not isinstance(kwargs[flag], bool):
            raise APIError(f"chat_template_kwargs.{flag} must be true or false, got {kwargs[flag]!r}",
                           param=f"chat_template_kwargs.{flag}")
    if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
        raise APIError("continue_final_message needs add_generation_prompt: false (the reply continues the last "
                       "assistant message instead of opening a new one)", param="continue_final_message")

    def messages_for_template() -> list[dict[str, Any]]:
        try:
            return [m.for_template() for m in body.messages]
        except ValueError as e:
            raise APIError(str(e), param="messages") from None

    def render() -> str:
        return tokenizer.apply_chat_template(messages_for_template(), **kwargs)

    try:
        # Off the event loop: a long conversation takes milliseconds to render and encode (100,000 messages:
        # seconds, which the event loop would spend away from every other request).
        text = await asyncio.to_thread(render)
    except APIError:
        raise
    except RecursionError:
        raise APIError("cannot apply the chat template: the messages or tools are nested too deeply",
                       param="tools" if tools else "messages") from None
    except Exception as e:  # noqa: BLE001 - the template rejects malformed conversations in its own ways
        raise APIError(f"cannot apply the chat template to these messages: {e}", param="messages") from None
    return await asyncio.to_thread(serving.encode_prompt, text, "messages", check_length)


async def _grammar(serving: Serving, body: ChatCompletionRequest, tools: list[dict] | None, choice: Any,
                   constraint: tuple[str, str, Any] | None, gated: bool) -> Any:
    if _forces_calls(choice):
        backend = await serving.grammar_backend("tool_choice")
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        try:
            return await asyncio.to_thread(backend.tool_call_grammar, tools, name,
                                           body.parallel_tool_calls is not False)
        except StructuredOutputError as e:
            raise APIError(str(e), param="tools", code="invalid_schema") from None
    return await serving.output_grammar(constraint, gated)


class ChatReply:
    """Formats the outputs of a request's choices as a chat completion, whole or as a stream of chunks."""

    def __init__(self, serving: Serving, request_id: str, prompt_tokens: int, n: int,
                 make_parser: Callable[[], OutputParser], logprobs: bool, named_tool: bool = False) -> None:
        self.serving = serving
        self.named_tool = named_tool
        self.id = request_id
        self.model = serving.model_name
        self.created = now()
        self.prompt_tokens = prompt_tokens
        self.parsers = [make_parser() for _ in range(n)]
        self.logprobs = logprobs
        self.include_usage = False  # set by stream(): then every chunk carries `usage` (null until the last)
        self.continuous_usage = False  # set by stream(): every chunk carries the usage so far
        self.tokens = [0] * n  # tokens each choice has generated so far
        self.cached_tokens = 0  # prompt tokens the prefix cache served (the most any choice had)

    def usage(self, completion_tokens: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=self.prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens))

    def saw(self, out: RequestOutput) -> None:
        """Note what every output says about the request as a whole (cached prompt tokens)."""
        self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)

    def finish_reason(self, i: int, reason: str | None) -> str | None:
        """"tool_calls" for a reply that ended after calling tools, except under a named tool_choice: the OpenAI
        API (and vLLM) then report "stop" although the reply is the forced call."""
        if reason == "stop" and self.parsers[i].tool_calls_made and not self.named_tool:
            return "tool_calls"
        return reason

    def token_logprobs(self, out: RequestOutput) -> list[TokenLogprob]:
        if not self.logprobs or not out.logprobs:
            return []
        entries = []
        for tok, (lp, alts) in zip(out.token_ids, out.logprobs):
            text, raw = self.serving.token_text(tok)
            entries.append(TokenLogprob(token=text, logprob=json_logprob(lp), bytes=raw,
                                        top_logprobs=self.serving.token_text.top(alts)))
        return entries

    async def collect(self, streams: list[AsyncIterator[RequestOutput]],
                      stop: Callable[[], Awaitable[None]] | None = None) -> ChatCompletionResponse | JSONResponse:
        n = len(self.parsers)
        replies = [ParsedReply() for _ in range(n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        stops: list[int | str | None] = [None] * n
        tokens = [0] * n
        try:
            async for i, out in merge(streams, stop):
                parser = self.parsers[i]
                self.saw(out)
                replies[i].add(parser.feed(out.text))
                logprobs[i] += self.token_logprobs(out)
                tokens[i] = out.num_tokens
                if out.finished:
                    replies[i].add(parser.finish())
                    reasons[i], stops[i] = out.finish_reason, out.stop_reason
        except Exception as e:  # noqa: BLE001 - an engine failure fails this request only
            return engine_error(e).response()
        choices = [
            ChatCompletionChoice(
                index=i,
                message=_message(replies[i]),
                logprobs=ChoiceLogprobs(content=logprobs[i]) if self.logprobs else None,
                finish_reason=self.finish_reason(i, reasons[i]),
                stop_reason=stops[i],
            )
            for i in range(n)
        ]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage(sum(tokens)))

    def chunk(self, i: int, delta: DeltaMessage, finish_reason: str | None = None,
              logprobs: list[TokenLogprob] | None = None, stop_reason: int | str | None = None) -> dict[str, str]:
        lp = ChoiceLogprobs(content=logprobs) if logprobs is not None else None
        choice = ChatCompletionChunkChoice(index=i, delta=delta, logprobs=lp, finish_reason=finish_reason,
                                           stop_reason=stop_reason)
        c = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
        if self.continuous_usage:  # as vLLM: the prompt and this choice's tokens so far
            c.usage = self.usage(self.tokens[i])
            return {"data": c.model_dump_json()}
        return {"data": with_null_usage(c) if self.include_usage else c.model_dump_json()}

    async def stream(self, streams: list[AsyncIterator[RequestOutput]], include_usage: bool,
                     stop: Callable[[], Awaitable[None]] | None = None,
                     continuous_usage: bool = False) -> AsyncIterator[dict]:
        """SSE events: a role chunk per choice, delta chunks (reasoning, content, tool-call parts) as the
        choices progress, a finish chunk per choice, an optional usage chunk, `[DONE]`. continuous_usage (with
        include_usage): every chunk carries the usage so far."""
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage
        n = len(self.parsers)
        for i in range(n):
            yield self.chunk(i, DeltaMessage(role="assistant", content=""))
        pending: list[list[TokenLogprob]] = [[] for _ in range(n)]  # logprobs not yet sent with a chunk
        tokens = self.tokens
        try:
            async for i, out in merge(streams, stop):
                parser = self.parsers[i]
                self.saw(out)
                events = parser.feed(out.text)
                if out.finished:
                    events += parser.finish()
                pending[i] += self.token_logprobs(out)
                tokens[i] = out.num_tokens
                for e in coalesce(events):
                    lp, pending[i] = (pending[i] or None), []
                    yield self.chunk(i, _delta(e), logprobs=lp if self.logprobs else None)
                if out.finished:
                    lp, pending[i] = pending[i], []
                    yield self.chunk(i, DeltaMessage(), self.finish_reason(i, out.finish_reason),
                                     logprobs=lp if self.logprobs and lp else None, stop_reason=out.stop_reason)
            if include_usage:
                usage = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                            usage=self.usage(sum(tokens)))
                yield {"data": usage.model_dump_json()}
        except Exception as e:  # noqa: BLE001 - an engine failure fails this request only
            # Headers are gone already: report the failure in-band, as OpenAI does.
            yield {"data": ErrorResponse(error=engine_error(e).info).model_dump_json()}
        yield {"data": "[DONE]"}


def _message(reply: ParsedReply) -> ChatCompletionMessage:
    other = bool(reply.reasoning or reply.tool_calls)
    return ChatCompletionMessage(
        content=reply.content if reply.content or not other else None,
        reasoning_content=reply.reasoning or None,
        reasoning=reply.reasoning or None,
        tool_calls=[ToolCall(id=c["id"], function=FunctionCall(name=c["name"], arguments=c["arguments"]))
                    for c in reply.tool_calls] or None,
    )


def _delta(e: Any) -> DeltaMessage:
    if isinstance(e, Text):
        if e.kind == "reasoning":
            return DeltaMessage(reasoning_content=e.text, reasoning=e.text)
        return DeltaMessage(content=e.text)
    if isinstance(e, ToolCallStart):
        fn = DeltaFunctionCall(name=e.name, arguments="")
        return DeltaMessage(tool_calls=[DeltaToolCall(index=e.index, id=e.id, type="function", function=fn)])
    assert isinstance(e, ToolCallArguments)
    return DeltaMessage(tool_calls=[DeltaToolCall(index=e.index, function=DeltaFunctionCall(arguments=e.text))])
