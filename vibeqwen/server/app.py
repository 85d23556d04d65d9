"""The OpenAI-compatible HTTP API.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses`, `GET /v1/models[/{model}]`,
`POST /tokenize`, `POST /detokenize`, `GET /health`
(503 until the engine is warm), `GET /metrics` (Prometheus), `GET /version`, and FastAPI's `/openapi.json`.

Every error leaves as HTTP 4xx/5xx with an OpenAI error body, including FastAPI's request validation
errors (400 here, not 422), a missing or wrong API key (401) and an oversized body (413). A streamed reply
that fails after its headers were sent ends with an error event and `data: [DONE]`. A client that goes away
aborts its request: for streams sse-starlette cancels the body iterator, for plain replies a watcher on the
ASGI receive channel cancels the collection. Every response carries `X-Request-Id` (the client's, if it
sent a usable one), which also tags the server's log lines for that request.
"""

from __future__ import annotations

import hmac
import logging
import re
import sys
import time
import uuid
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import Field, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vibeqwen.server import metrics
from vibeqwen.server.async_engine import AsyncEngine
from vibeqwen.server.chat import create_chat_completion, message_token_bound
from vibeqwen.server.completions import create_completion
from vibeqwen.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionInfo,
)
from vibeqwen.server.responses import create_response
from vibeqwen.server.responses_protocol import ResponsesRequest
from vibeqwen.server.serving import (
    APIError, ServerConfig, Serving, load_generation_defaults, log_text, request_id_var)
from vibeqwen.server.tokenize import detokenize, tokenize
from vibeqwen.server.validation import describe_validation_errors

__all__ = ["APIError", "ServerConfig", "create_app", "load_generation_defaults"]

logger = logging.getLogger("vibeqwen.server")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in [(400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Unknown model"),
                       (413, "Request body too large"), (500, "Engine failure"), (503, "Server at capacity")]
}
_STREAM = {"text/event-stream": {"schema": {"type": "string"}, "example": "data: {...}\n\ndata: [DONE]\n\n"}}


def create_app(async_engine: AsyncEngine, served_model_name: str, config: ServerConfig | None = None) -> FastAPI:
    """Build the FastAPI app serving `async_engine` under the model name `served_model_name`."""
    config = config or ServerConfig()
    serving = Serving(async_engine, served_model_name, config)
    registry = metrics.make_registry(async_engine.stats, served_model_name)
    # one schema per model (the response models' None-dropping serializers would hide their fields)
    # redirect_slashes off: `POST /v1/chat/completions/` gets the OpenAI-style 404 body, not an empty 307
    app = FastAPI(title="VibeQwen", version=config.version, separate_input_output_schemas=False,
                  description="OpenAI-compatible API for Qwen3.6-35B-A3B (NVFP4).", redirect_slashes=False)
    app.state.engine = async_engine
    app.state.served_model_name = served_model_name
    app.state.serving = serving
    _install_error_handlers(app)
    app.add_middleware(_RequestContextMiddleware, api_key=config.api_key, max_body_bytes=config.max_body_bytes)
    # outermost: a browser's preflight (OPTIONS) is answered before the API key is asked for, as in vLLM
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials, expose_headers=["x-request-id"])

    @app.head("/health", include_in_schema=False)  # load balancers probe with HEAD
    @app.get("/health", responses={503: {"model": ErrorResponse, "description": "Engine not ready"}})
    async def health() -> Response:
        """200 once the engine thread runs (after its warm-up); 503 before, or if it died."""
        if async_engine.ready:
            return Response(status_code=200)
        reason = "the engine failed to start" if async_engine.warmup_error else "the engine is warming up"
        raise APIError(reason, 503, type="service_unavailable", code="not_ready")

    @app.get("/version")
    async def version() -> VersionInfo:
        return VersionInfo(version=config.version)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(registry), media_type=metrics.CONTENT_TYPE)

    def card() -> ModelCard:
        return ModelCard(id=served_model_name, max_model_len=async_engine.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model:path}", responses={404: _ERRORS[404]})
    async def model(model: str) -> ModelCard | ModelList:
        if not model:  # `/v1/models/`: the list (redirect_slashes is off, see above)
            return ModelList(data=[card()])
        serving.check_model(model)
        return card()

    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(serving, body, request)

    chat_completions.__annotations__["body"] = chat_request_model(async_engine)
    app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses={200: {"content": _STREAM}, **_ERRORS})(chat_completions)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={200: {"content": _STREAM}, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await create_completion(serving, body, request)

    @app.post("/v1/responses", responses={200: {"content": _STREAM}, **_ERRORS})
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        return await create_response(serving, body, request)

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(serving, body)

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize(serving, body)

    return app


def chat_request_model(async_engine: Any) -> type[ChatCompletionRequest]:
    """The chat request body this server validates: ChatCompletionRequest with `messages` capped at the most
    messages a prompt shorter than max_model_len can hold, (max_model_len - 1) // `Tokenizer.min_message_tokens`
    (1023 for the demo's 4096 tokens, 65535 for 262144). pydantic checks a list's length before its items, so a body of
    400,000 tiny messages is refused in milliseconds; validating them took ~1.5 s of the event loop, during which no
    other request was served (four such bodies at once held `/health` for 7 s). The base model when the engine's
    tokenizer gives no bound (test stand-ins, a template that refuses the probes)."""
    tokenizer = getattr(getattr(async_engine, "engine", None), "tokenizer", None)
    limit = getattr(async_engine, "max_model_len", None)
    per_message = message_token_bound(tokenizer)
    if not isinstance(limit, int) or not isinstance(per_message, int) or per_message <= 0:
        return ChatCompletionRequest
    cap = max(1, (limit - 1) // per_message)
    return create_model(ChatCompletionRequest.__name__, __base__=ChatCompletionRequest,
                        __module__=ChatCompletionRequest.__module__,
                        messages=(Annotated[list[ChatMessage], Field(min_length=1, max_length=cap)], ...))


_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


class _RequestContextMiddleware:
    """Pure ASGI (streams and disconnect detection pass through untouched): the request id, API-key
    check, body size limit and one access-log line per request."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        incoming = headers.get("x-request-id", "")
        rid = incoming if _REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex
        token = request_id_var.set(rid)
        status = 0
        t0 = time.monotonic()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            error = self._refuse(scope["path"], headers)
            if error is not None:
                await error.response()(scope, receive, send_with_id)
                return
            try:
                await self.app(scope, self._limited(receive), send_with_id)
            except Exception as e:  # a bug in a handler: answer 500, keep serving
                logger.exception("[%s] unexpected error", rid)
                if status:
                    raise  # the response has started: nothing more can be said
                await APIError(f"internal error: {e}", 500, type="server_error").response()(scope, receive,
                                                                                           send_with_id)
        finally:
            logger.info("[%s] %s %s %d %.3fs", rid, log_text(scope.get("method", "")), log_text(scope["path"]),
                        status, time.monotonic() - t0)
            request_id_var.reset(token)

    def _refuse(self, path: str, headers: dict[str, str]) -> APIError | None:
        if self.api_key is not None and path != "/health":
            auth = headers.get("authorization", "")
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
                what = "Incorrect API key provided" if auth.strip() else "Missing API key"
                return APIError(f"{what}. Send it as `Authorization: Bearer KEY`.", 401, code="invalid_api_key")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return _too_large(self.max_body_bytes)
        return None

    def _limited(self, receive: Receive) -> Receive:
        """`receive` that fails with 413 once a body without Content-Length grows past the limit."""
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    err = _too_large(self.max_body_bytes)
                    raise StarletteHTTPException(err.status_code, err.info.message)
            return message

        return wrapped


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than {limit} bytes", 413, code="request_too_large")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        cap = [e for e in errors if e.get("type") == "too_long" and tuple(e.get("loc", ())) == ("body", "messages")]
        if cap:  # chat_request_model's cap: more messages than the context can hold
            errors = [e for e in errors if e not in cap]
            if not errors:  # else the other fields' errors first, then a wrong model, as without the cap
                body = exc.body if isinstance(exc.body, dict) else {}
                if isinstance(body.get("model"), str):
                    try:
                        request.app.state.serving.check_model(body["model"])
                    except APIError as e:
                        return e.response()
                limit = getattr(request.app.state.engine, "max_model_len", None)
                ctx = cap[0].get("ctx", {})
                return APIError(f"This model's maximum context length is {limit} tokens, which holds at most "
                                f"{ctx.get('max_length')} messages. However, your request has "
                                f"{ctx.get('actual_length')} messages. Please reduce the prompt.",
                                param="messages", code="context_length_exceeded").response()
        message, param = describe_validation_errors(errors)
        content_type = request.headers.get("content-type", "")
        if param is None and "json" not in content_type.lower():
            # FastAPI parses the body as JSON only under a JSON content type (`curl -d` sends form encoding):
            # say so instead of "Input should be a valid dictionary"
            got = f"got {content_type!r}" if content_type else "the request has no Content-Type"
            message = f"the request body must be a JSON object sent with 'Content-Type: application/json' ({got}): {message}"
        return APIError(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "request_too_large" if exc.status_code == 413 else None
        message = str(exc.detail)
        # the router's bare phrases name the request instead (OpenAI: "Invalid URL (GET /v1/...)")
        if exc.status_code == 404 and message == "Not Found":
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405 and message == "Method Not Allowed":
            allow = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
            message = f"{request.method} is not allowed on {request.url.path}" + (f" (use {allow})" if allow else "")
        elif exc.status_code == 400 and message == "There was an error parsing the body":
            # FastAPI's phrase for a body its JSON decoder raised on other than with a syntax error
            encoding = request.headers.get("content-encoding")
            message = ("the request body could not be read as JSON: it must be UTF-8 text, uncompressed"
                       + (f" (got Content-Encoding {encoding!r})" if encoding else "")
                       + f", hold no integer of more than {sys.get_int_max_str_digits()} digits, and be nested less "
                       "deeply than Python's recursion limit")
        reply = APIError(message, exc.status_code, type=kind, code=code).response()
        for name, value in (exc.headers or {}).items():
            reply.headers[name] = value
        return reply
