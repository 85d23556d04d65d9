"""POST /v1/completions (legacy): raw prompts, no chat template, no reasoning or tool parsing.

The prompt is a string, a list of strings, a token id list or a list of those; each prompt gets n choices,
indexed prompt * n + j. `echo` puts the prompt text before the completion, and with `logprobs` the prompt
tokens' logprobs before the completion's (the first prompt token has none); `max_tokens: 0` with echo
scores a prompt without generating. Logprobs use the legacy format: parallel lists of tokens, their
logprobs, the top alternatives (a {token: logprob} map that always holds the chosen token) and text offsets.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from vibeqwen.server.async_engine import RequestOutput
from vibeqwen.server.protocol import (
    with_null_usage,
    COMPLETION_DEFAULT_MAX_TOKENS,
    MAX_PROMPTS,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    PromptTokensDetails,
    UsageInfo,
    now,
    random_id,
)
from vibeqwen.server.serving import (
    LOGPROB_FLOOR,
    APIError,
    Serving,
    engine_error,
    json_logprob,
    merge,
    output_constraint,
    sse_response,
    unless_disconnected,
)


async def create_completion(serving: Serving, body: CompletionRequest, request: Request) -> Any:
    serving.check_model(body.model)
    serving.check_fields(body)
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
    if body.suffix:
        raise APIError("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError("best_of must equal n (candidates are not ranked)", param="best_of")
    score_only = body.max_tokens == 0
    if score_only and not body.echo:
        raise APIError("max_tokens must be at least 1 (0 is allowed only with echo)", param="max_tokens")
    prompts, texts, cut = await _prompts(serving, body.prompt, body.truncate_prompt_tokens, score_only)
    if len(prompts) * body.n > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} completions (prompts x n) per request", param="prompt")

    grammar = await serving.output_grammar(output_constraint(body))
    if grammar is not None and body.min_tokens:
        raise APIError("min_tokens cannot be combined with an output constraint (response_format, structured_outputs, "
                       "guided_*)", param="min_tokens")
    echo_logprobs = body.logprobs if body.echo else None
    # max_tokens unset: OpenAI's 16; an explicit null: no cap of the endpoint's (vLLM's reading); either way at most
    # the room the prompt leaves and the checkpoint's default (Serving.sampling_params)
    default_max = None if "max_tokens" in body.model_fields_set else COMPLETION_DEFAULT_MAX_TOKENS
    # (its errors are about request fields, never one prompt: not named by _naming_prompt)
    per_prompt = [serving.sampling_params(body, len(ids), 1 if score_only else body.max_tokens,
                                          logprobs=body.logprobs, prompt_logprobs=echo_logprobs,
                                          default_max_tokens=default_max) for ids in prompts]
    await serving.index_params(per_prompt)  # once for all prompts, off the event loop
    rules = await serving.token_rules(body, grammar)
    requests, echoes = [], []
    limit = serving.engine.max_model_len
    for i, (ids, text, params) in enumerate(zip(prompts, texts, per_prompt)):
        with _naming_prompt(i, len(prompts)):
            if score_only and len(ids) >= limit:
                # the scoring pass reads one next token as a completion would: it needs one free position
                raise serving.prompt_too_long(len(ids), "prompt", scoring=True,
                                              hint=serving.truncation_hint(len(ids), 1) if cut[i] else "")
            serving.check_request(ids, params, truncated=cut[i])
        requests += [(ids, p) for p in serving.choice_params(params, body.n, grammar, rules=rules)]
        echoes += [text] * body.n

    request_id = random_id("cmpl")
    streams = serving.start(request_id, requests, body.skip_special_tokens)
    reply = _CompletionReply(serving, request_id, [ids for ids, _ in requests], echoes, sum(map(len, prompts)),
                             body, score_only)
    if body.stream:
        opts = body.stream_options
        return sse_response(reply.stream(streams, bool(opts and opts.include_usage), serving.shutdown.wait,
                                         bool(opts and opts.continuous_usage_stats)), serving.shutdown)
    return await unless_disconnected(request, reply.collect(streams, serving.shutdown.wait))


@contextlib.contextmanager
def _naming_prompt(i: int, n: int) -> Iterator[None]:
    """An APIError about the prompt (param "prompt") raised inside names prompt `i` (0-based) of a request's `n` when
    there are several; request-level errors (logit_bias, stop_token_ids, ...) pass unchanged."""
    try:
        yield
    except APIError as e:
        if n > 1 and e.info.param == "prompt":
            e.info.message = f"prompt {i} (of {n}): {e.info.message}"
            e.args = (e.info.message,)
        raise


async def _prompts(serving: Serving, prompt: Any, truncate: int | None = None, scoring: bool = False
                   ) -> tuple[list[list[int]], list[str | None], list[bool]]:
    """Token ids of each prompt, its text when it came as text (and was not truncated: see
    `Serving.truncate_prompt`), and whether truncation cut it. Text prompts are encoded in order, and without
    truncation the first that cannot fit the context stops the rest (`Serving.encode_prompt`; scoring: max_tokens 0
    with echo, whose message differs)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError("prompt must not be empty", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    check = truncate is None  # a prompt to truncate may be longer than the context

    def encode(i: int, text: str) -> list[int]:
        with _naming_prompt(i, len(items)):
            return serving.encode_prompt(text, "prompt", check, scoring)

    encoded = iter(await asyncio.to_thread(lambda: [encode(i, p) for i, p in enumerate(items) if isinstance(p, str)])
                   if any(isinstance(p, str) for p in items) else [])
    ids = [next(encoded) if isinstance(p, str) else list(p) for p in items]
    # as vLLM: a token id prompt must hold ids the tokenizer knows (the embedding has padding rows past them,
    # whose "text" is empty)
    known = getattr(serving.engine.tokenizer, "vocab_size", None)
    limit = serving.engine.max_model_len
    for i, p in enumerate(items):
        if isinstance(p, str):
            continue
        with _naming_prompt(i, len(items)):
            if isinstance(known, int) and p and max(p) >= known:
                raise APIError(f"Token id {max(p)} is out of vocabulary (the tokenizer has ids 0-{known - 1})",
                               param="prompt")
            if check and len(p) >= limit:  # as the text prompts' check (encode_prompt): the same order of errors
                raise serving.prompt_too_long(len(p), "prompt", scoring)
    kept = [serving.truncate_prompt(x, truncate) for x in ids]
    cut = [len(k) < len(x) for k, x in zip(kept, ids)]
    return kept, [p if isinstance(p, str) and not c else None for p, c in zip(items, cut)], cut


@dataclass
class _Choice:
    """One choice as it is built: text, legacy logprob lists, token count."""

    text: str = ""
    logprobs: CompletionLogprobs | None = None
    tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False
    # text_offset bookkeeping: characters the logprob tokens' bytes have completed so far (a token that starts
    # inside a multi-byte character is at that character's offset)
    chars: int = 0
    utf8: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


class _CompletionReply:
    def __init__(self, serving: Serving, request_id: str, prompts: list[list[int]], echoes: list[str | None],
                 prompt_tokens: int, body: CompletionRequest, score_only: bool) -> None:
        self.serving = serving
        self.id = request_id
        self.model = serving.model_name
        self.created = now()
        self.prompts = prompts  # per choice
        self.echoes = echoes  # per choice: the prompt as sent, when it was text
        self.prompt_tokens = prompt_tokens  # each prompt once, as OpenAI counts them
        self.echo = body.echo
        self.want_logprobs = body.logprobs is not None
        self.score_only = score_only
        self.choices = [_Choice(logprobs=CompletionLogprobs() if self.want_logprobs else None) for _ in prompts]
        self.n = body.n
        self.cached: dict[int, int] = {}  # prompt index -> prompt tokens the prefix cache served (most of its choices)

    def _add_tokens(self, c: _Choice, entries: list[tuple[int, tuple[float, list] | None]]) -> None:
        """Append (token, (logprob, alternatives) or None) entries to the choice's legacy logprobs."""
        lp = c.logprobs
        assert lp is not None
        for tok, scored in entries:
            text, raw = self.serving.token_text(tok)
            lp.text_offset.append(c.chars)  # where the token's text starts in the choice's text
            c.chars += len(c.utf8.decode(bytes(raw)))
            lp.tokens.append(text)
            if scored is None:
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            value, alts = scored
            top: dict[str, float] = {}
            for alt, alt_lp in alts:
                name = self.serving.token_text(alt)[0]
                top[name] = max(top.get(name, LOGPROB_FLOOR), json_logprob(alt_lp))
            top.setdefault(text, json_logprob(value))
            lp.token_logprobs.append(json_logprob(value))
            lp.top_logprobs.append(top)

    def update(self, i: int, out: RequestOutput) -> tuple[str, int]:
        """Fold one output into choice i; returns (the text it adds, logprob entries it adds)."""
        c = self.choices[i]
        self.cached[i // self.n] = max(self.cached.get(i // self.n, 0), out.num_cached_tokens)
        text, before = "", len(c.logprobs.tokens) if c.logprobs else 0
        if not c.started:
            c.started = True
            if self.echo:
                prompt = self.prompts[i]
                echo = self.echoes[i]
                text += echo if echo is not None else self.serving.engine.tokenizer.decode(prompt)
                if c.logprobs is not None:
                    scored = [None, *(out.prompt_logprobs or [None] * (len(prompt) - 1))]
                    self._add_tokens(c, list(zip(prompt, scored)))
        if not self.score_only:
            text += out.text
            if c.logprobs is not None and out.logprobs:
                self._add_tokens(c, list(zip(out.token_ids, out.logprobs)))
            c.tokens = out.num_tokens
        c.text += text
        if out.finished:
            c.finish_reason = "length" if self.score_only else out.finish_reason
            c.stop_reason = None if self.score_only else out.stop_reason
        return text, (len(c.logprobs.tokens) - before if c.logprobs else 0)

    def usage(self) -> UsageInfo:
        completion = sum(c.tokens for c in self.choices)
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                         total_tokens=self.prompt_tokens + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached.values())))

    async def collect(self, streams: list[AsyncIterator[RequestOutput]],
                      stop: Callable[[], Awaitable[None]] | None = None) -> CompletionResponse | JSONResponse:
        try:
            async for i, out in merge(streams, stop):
                self.update(i, out)
        except Exception as e:  # noqa: BLE001 - an engine failure fails this request only
            return engine_error(e).response()
        choices = [CompletionChoice(index=i, text=c.text, logprobs=c.logprobs, finish_reason=c.finish_reason,
                                    stop_reason=c.stop_reason) for i, c in enumerate(self.choices)]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=self.usage())

    async def stream(self, streams: list[AsyncIterator[RequestOutput]], include_usage: bool,
                     stop: Callable[[], Awaitable[None]] | None = None,
                     continuous_usage: bool = False) -> AsyncIterator[dict]:
        """SSE events: a chunk per piece of text (with its logprobs), an optional usage chunk, `[DONE]`.
        continuous_usage (with include_usage): every chunk carries the usage so far."""
        try:
            async for i, out in merge(streams, stop):
                text, added = self.update(i, out)
                c = self.choices[i]
                if not text and not added and not out.finished:
                    continue
                logprobs = None
                if c.logprobs is not None:
                    lp = c.logprobs
                    logprobs = CompletionLogprobs(
                        tokens=lp.tokens[len(lp.tokens) - added :],
                        token_logprobs=lp.token_logprobs[len(lp.tokens) - added :],
                        top_logprobs=lp.top_logprobs[len(lp.tokens) - added :],
                        text_offset=lp.text_offset[len(lp.tokens) - added :],
                    )
                choice = CompletionChoice(index=i, text=text, logprobs=logprobs,
                                          finish_reason=c.finish_reason if out.finished else None,
                                          stop_reason=c.stop_reason if out.finished else None)
                chunk = CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice])
                if include_usage and continuous_usage:  # as vLLM: the prompt and this choice's tokens so far
                    prompt = len(self.prompts[i])
                    chunk.usage = UsageInfo(prompt_tokens=prompt, completion_tokens=c.tokens,
                                            total_tokens=prompt + c.tokens)
                    yield {"data": chunk.model_dump_json()}
                else:
                    yield {"data": with_null_usage(chunk) if include_usage else chunk.model_dump_json()}
            if include_usage:
                chunk = CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                           usage=self.usage())
                yield {"data": chunk.model_dump_json()}
        except Exception as e:  # noqa: BLE001
            yield {"data": ErrorResponse(error=engine_error(e).info).model_dump_json()}
        yield {"data": "[DONE]"}

