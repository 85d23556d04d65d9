"""The OpenAI-compatible HTTP API: `/v1/chat/completions`, `/v1/models`, `/health`.

Every error leaves as HTTP 4xx/5xx with an OpenAI error body, including FastAPI's request validation
errors (400 here, not 422). A streamed reply that fails after its headers were sent ends with an error
event and `data: [DONE]`. A client that goes away aborts its request: for streams sse-starlette cancels
the body iterator, for plain replies a watcher on the ASGI receive channel cancels the collection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vibeqwen.sampling import SamplingParams
from vibeqwen.server.async_engine import AsyncEngine, EngineOverloadedError, RequestOutput
from vibeqwen.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageInfo,
    now,
    random_id,
)

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error to answer with an OpenAI error body."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status_code)


def create_app(async_engine: AsyncEngine, served_model_name: str) -> FastAPI:
    """Build the FastAPI app serving `async_engine` under the model name `served_model_name`."""
    app = FastAPI(title="VibeQwen", version="0.1.0")
    app.state.engine = async_engine
    app.state.served_model_name = served_model_name
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=async_engine.max_model_len)])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        if body.model is not None and body.model != served_model_name:
            raise APIError(
                f"The model `{body.model}` does not exist.", 404, param="model", code="model_not_found"
            )
        prompt_ids, params = await _prepare(async_engine, body)
        try:
            async_engine.check_capacity()
        except EngineOverloadedError as e:
            raise APIError(str(e), 503, type="service_unavailable", code="overloaded") from None
        request_id = random_id("chatcmpl")
        outputs = async_engine.generate(request_id, prompt_ids, params, body.skip_special_tokens)
        reply = _Reply(request_id, served_model_name, len(prompt_ids))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return EventSourceResponse(reply.stream(outputs, include_usage), sep="\n")
        return await _unless_disconnected(request, reply.collect(outputs))

    return app


async def _prepare(engine: AsyncEngine, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
    """Render and tokenize the prompt and build the sampling params; raise APIError for bad input."""
    if body.n != 1:
        raise APIError("only n=1 is supported", param="n")
    if body.logprobs:
        raise APIError("logprobs are not supported", param="logprobs")
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
    try:
        messages = [m.for_template() for m in body.messages]
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
    kwargs: dict[str, Any] = {"tools": body.tools, "add_generation_prompt": True}
    kwargs.update(body.chat_template_kwargs or {})
    tokenizer = engine.tokenizer

    def tokenize() -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(messages, **kwargs))

    try:
        # Off the event loop: a long prompt takes milliseconds to encode.
        prompt_ids = await asyncio.to_thread(tokenize)
    except Exception as e:  # noqa: BLE001 - the template rejects malformed conversations in its own ways
        raise APIError(f"cannot apply the chat template to these messages: {e}", param="messages") from None
    max_tokens = body.max_new_tokens()
    params = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        max_tokens=max_tokens if max_tokens is not None else max(engine.max_model_len - len(prompt_ids), 1),
        stop=body.stop_strings(),
        stop_token_ids=list(body.stop_token_ids or []),
        seed=body.seed,
        ignore_eos=body.ignore_eos,
    )
    try:
        engine.check_request(prompt_ids, params)
    except ValueError as e:
        raise APIError(str(e)) from None
    return prompt_ids, params


class _Reply:
    """Formats one request's outputs as a chat completion, whole or as a stream of chunks."""

    def __init__(self, request_id: str, model: str, prompt_tokens: int) -> None:
        self.id = request_id
        self.model = model
        self.created = now()
        self.prompt_tokens = prompt_tokens

    def usage(self, completion_tokens: int) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.prompt_tokens + completion_tokens,
        )

    async def collect(self, outputs: AsyncIterator[RequestOutput]) -> ChatCompletionResponse | JSONResponse:
        text, last = [], None
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    text.append(out.text)
                    last = out
        except Exception as e:  # noqa: BLE001 - an engine failure fails this request only
            return _engine_error(e).response()
        assert last is not None
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[
                ChatCompletionChoice(
                    message=ChatCompletionMessage(content="".join(text)), finish_reason=last.finish_reason
                )
            ],
            usage=self.usage(last.num_tokens),
        )

    def chunk(self, delta: DeltaMessage | None, finish_reason: str | None = None) -> dict[str, str]:
        choices = (
            [] if delta is None else [ChatCompletionChunkChoice(delta=delta, finish_reason=finish_reason)]
        )
        c = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices)
        return {"data": c.model_dump_json()}

    async def stream(self, outputs: AsyncIterator[RequestOutput], include_usage: bool) -> AsyncIterator[dict]:
        """SSE events: role chunk, content chunks, finish chunk, optional usage chunk, `[DONE]`."""
        yield self.chunk(DeltaMessage(role="assistant", content=""))
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    if out.text:
                        yield self.chunk(DeltaMessage(content=out.text))
                    if out.finished:
                        yield self.chunk(DeltaMessage(), out.finish_reason)
                        if include_usage:
                            usage = ChatCompletionChunk(
                                id=self.id,
                                created=self.created,
                                model=self.model,
                                choices=[],
                                usage=self.usage(out.num_tokens),
                            )
                            yield {"data": usage.model_dump_json()}
        except Exception as e:  # noqa: BLE001 - an engine failure fails this request only
            # Headers are gone already: report the failure in-band, as OpenAI does.
            yield {"data": ErrorResponse(error=_engine_error(e).info).model_dump_json()}
        yield {"data": "[DONE]"}


def _engine_error(e: Exception) -> APIError:
    if isinstance(e, ValueError):
        return APIError(str(e))
    logger.error("request failed: %r", e)
    return APIError(f"internal error: {e}", 500, type="server_error")


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await `work`, but cancel it (aborting the request) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        # Nobody is left to read this; the status is for the access log.
        return Response(status_code=499)
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body was read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc.errors())
        return APIError(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(str(exc.detail), exc.status_code, type=kind).response()


def _describe_validation(errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message, param) for FastAPI validation errors; param is the path all errors share, e.g. `messages[0].role`."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return (
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'decode error')}",
            None,
        )
    locs = [[p for p in e.get("loc", ()) if p != "body"] for e in errors]
    if locs == [[]] and first.get("type") == "missing":
        return "the request body is missing", None
    shared = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(shared), len(loc)) and shared[n] == loc[n]:
            n += 1
        shared = shared[:n]
    message = "; ".join(
        f"{_param(loc)}: {e.get('msg')}" if loc else str(e.get("msg")) for loc, e in zip(locs, errors)
    )
    return message, _param(shared)


def _param(loc: Sequence[Any]) -> str | None:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
