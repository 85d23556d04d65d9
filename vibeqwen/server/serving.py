"""What chat and legacy completions share: errors, server settings, sampling defaults, starting n engine
requests, merging their outputs, and logprob formatting."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from vibeqwen import __version__
from vibeqwen.engine.request import ContextLengthError, prompt_fills_context
from vibeqwen.sampling import SamplingParams
from vibeqwen.server.async_engine import AsyncEngine, EngineOverloadedError, RequestOutput
from vibeqwen.server.parsers import markup_token_ids
from vibeqwen.server.protocol import ErrorInfo, ErrorResponse, SamplingFields, TopLogprob
from vibeqwen.server.shutdown import STREAM_BACKSTOP_S, ShutdownGrace
from vibeqwen.server.structured import (KEPT_SPECIALS, GrammarBackend, GrammarConstraint, StructuredOutputError,
                                        get_backend)
from vibeqwen.server.token_rules import TokenRules

logger = logging.getLogger("vibeqwen.server")

# The id of the HTTP request being served (X-Request-Id), for log lines.
request_id_var: ContextVar[str] = ContextVar("request_id", default="-")


def log_text(text: str) -> str:
    """`text` as a log line may carry it: unchanged where every character is printable, else with control and other
    unprintable characters escaped (a client's field name or path cannot add lines, NULs or terminal codes to the
    server's log)."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


# generation_config.json keys that set sampling defaults (vLLM reads the same), with our field names.
GENERATION_KEYS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens",
}
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                   "presence_penalty": 0.0, "frequency_penalty": 0.0}
LOGPROB_FLOOR = -9999.0  # stands in for -inf, which JSON cannot carry


def json_logprob(value: float) -> float:
    """A log-probability as a response carries it: LOGPROB_FLOOR for -inf, anything below it, or NaN (a model whose
    logits are NaN: the OpenAI schema's logprob is a number, never null), else the value."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR  # (NaN compares false)
# vLLM request fields whose behaviour this server lacks -> the values that ask for nothing (accepted, no effect)
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "use_beam_search": (False, None), "prompt_logprobs": (None,), "return_tokens_as_token_ids": (False, None),
    "logits_processors": (None, []), "chat_template": (None,),
}
# OpenAI request fields about the hosted service (storage, billing, caching hints, moderation ids) or other
# modalities' defaults: accepted without effect and without a log line (clients send them on every call)
SERVICE_FIELDS = frozenset({"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                            "verbosity", "modalities", "prediction", "max_tool_calls", "stream_options"})


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP layer serves the engine (the `vibeqwen serve` flags).

    api_key: required as `Authorization: Bearer KEY` on every route but /health (None: no auth).
    max_body_bytes: larger request bodies get HTTP 413.
    reasoning: split `<think>...</think>` into `reasoning_content` when the prompt opens a think block.
    generation_defaults: sampling fields used when a request leaves them unset (see
        `load_generation_defaults`); OpenAI's defaults fill the rest.
    shutdown_grace_s: seconds a reply may go on being generated once the server is told to stop (SIGTERM,
        Ctrl-C); one still running then ends with the error `server_shutting_down`: a stream with an error event and
        `[DONE]`, so the client can tell it was cut short, a plain reply as HTTP 503 (see `shutdown.ShutdownGrace`).
    allowed_origins, allowed_methods, allowed_headers, allow_credentials: the CORS policy browsers are told (as
        vLLM's flags of the same names; "*" is any): by default any origin may call the API, without credentials.
    """

    api_key: str | None = None
    max_body_bytes: int = 16 << 20
    reasoning: bool = False
    generation_defaults: Mapping[str, Any] = field(default_factory=dict)
    version: str = __version__
    shutdown_grace_s: float = 10.0
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def load_generation_defaults(checkpoint: str | Path, strict: bool = False) -> dict[str, Any]:
    """Sampling defaults from the checkpoint's `generation_config.json` ({} if it has none).

    Reads temperature, top_p, top_k, min_p, repetition/presence/frequency penalties and max_new_tokens
    (as max_tokens); values of the wrong type or out of a request's range (SamplingParams' checks, e.g. a
    negative temperature) are skipped with a warning naming the file and the field, so that no request is
    refused for a value it did not send. A file that cannot be read, is not JSON or is not a JSON object is
    skipped with a warning too, unless `strict` (the user named its folder: `--generation-config DIR`).

    Raises:
        ValueError: with `strict`, the file cannot be read, is not JSON, or is not a JSON object (the file named).
    """
    path = Path(checkpoint) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")  # noqa: TRY004, TRY301
    except (OSError, ValueError, RecursionError) as e:
        if strict:
            raise ValueError(f"--generation-config: {path}: {e}") from None
        logger.warning("ignoring %s: %s", path, e)
        return {}
    defaults: dict[str, Any] = {}
    for key, name in GENERATION_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        # (an int is finite, and math.isfinite overflows on one of 400 digits)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and not math.isfinite(value)):
            logger.warning("ignoring %s in %s: %r is not a number", key, path, value)
            continue
        try:
            value = int(value) if name in ("top_k", "max_tokens") else float(value)
            SamplingParams(**{name: value}).validate()
        except (ValueError, OverflowError) as e:
            logger.warning("ignoring %s in %s: %s", key, path, e)
            continue
        defaults[name] = value
    return defaults


class APIError(Exception):
    """An error to answer with an OpenAI error body."""

    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        # a client's text quoted in the message may hold a lone surrogate (JSON "\ud800"), which has no UTF-8:
        # escape it, or the error reply itself fails to encode (a 500 in place of this error)
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status_code,
                            headers=self.headers or None)


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar")


def output_constraint(body: SamplingFields) -> tuple[str, str, Any] | None:
    """(param, kind, value) of the request's output constraint, or None: `response_format` json_object /
    json_schema, vLLM's `structured_outputs` or a `guided_*` field (kind "json" with a schema, or None for any JSON
    object; "regex", "choice" or "grammar" with its text or strings).

    Raises:
        APIError (400): more than one of them, a json_schema format without its `json_schema`, or a JSON schema
            given as text that is not JSON."""
    specs: list[tuple[str, str, Any]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema" and fmt.json_schema is None:
            raise APIError("response_format json_schema needs a `json_schema` object", param="response_format")
        if fmt.type == "json_object":
            specs.append(("response_format", "json", None))
        else:
            specs.append(("response_format.json_schema.schema", "json", fmt.json_schema.schema_))
    so = body.structured_outputs
    if so is not None and so.structural_tag is not None:
        raise APIError("structured_outputs.structural_tag is not supported (use json, json_object, regex, choice or "
                       "grammar)", param="structured_outputs.structural_tag")
    if so is not None:
        if so.json_object:
            specs.append(("structured_outputs.json_object", "json", None))
        for kind, value in zip(_CONSTRAINT_KINDS, (so.json_, so.regex, so.choice, so.grammar)):
            if value is not None:
                specs.append((f"structured_outputs.{kind}", kind, value))
    for kind in _CONSTRAINT_KINDS:
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            specs.append((f"guided_{kind}", kind, value))
    if not specs:
        return None
    if len(specs) > 1:
        raise APIError("at most one output constraint (response_format, structured_outputs, guided_json / "
                       f"_regex / _choice / _grammar) per request; got {', '.join(p for p, _, _ in specs)}",
                       param=specs[1][0])
    param, kind, value = specs[0]
    if kind == "json" and isinstance(value, str):  # vLLM takes a schema as its JSON text too
        try:
            value = json.loads(value)
        except ValueError as e:
            raise APIError(f"{param} is not a JSON schema: {e}", param=param, code="invalid_schema") from None
        except RecursionError:
            raise APIError(f"{param} is nested too deeply to be read as a JSON schema", param=param,
                           code="invalid_schema") from None
        if not isinstance(value, (dict, bool)):
            raise APIError(f"{param} must be a JSON schema (an object or a boolean)", param=param,
                           code="invalid_schema")
    return param, kind, value


def engine_error(e: BaseException) -> APIError:
    """The error a failed generation is reported as."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineOverloadedError):
        # the queue drains as requests finish: a client's retry policy may come back soon
        return APIError(str(e), 503, type="service_unavailable", code="overloaded", headers={"Retry-After": "1"})
    if isinstance(e, ContextLengthError):  # OpenAI's code for it, which clients branch on
        return APIError(str(e), code="context_length_exceeded")
    if isinstance(e, ValueError):
        return APIError(str(e))
    logger.error("[%s] request failed: %r", request_id_var.get(), e)
    return APIError(f"internal error: {e}", 500, type="server_error")


class Serving:
    """The engine, the model's name and the server settings, with the steps every endpoint shares."""

    def __init__(self, engine: AsyncEngine, model_name: str, config: ServerConfig) -> None:
        self.engine = engine
        self.model_name = model_name
        self.config = config
        self.defaults = {**OPENAI_DEFAULTS, **config.generation_defaults}
        self.markup = markup_token_ids(engine.tokenizer)
        # the special token opening a chat turn (where a chat prompt's generation prompt starts), if the tokenizer has it
        ids = engine.tokenizer.encode("<|im_start|>")
        self.turn_start = ids[0] if len(ids) == 1 and ids[0] in getattr(engine.tokenizer, "special_ids", ()) else None
        self.token_text = TokenText(engine.tokenizer)
        # the server's stop signal: `vibeqwen serve` (shutdown.serve) begins it when a signal stops uvicorn
        self.shutdown = ShutdownGrace(config.shutdown_grace_s)
        self._grammars: GrammarBackend | None = None

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary (logits width), or the tokenizer's, or None when neither is known."""
        size = getattr(self.engine.engine, "vocab_size", None) or getattr(self.engine.tokenizer, "vocab_size", None)
        return size if isinstance(size, int) else None

    @property
    def token_vocab_size(self) -> int | None:
        """The ids a client can name: the tokenizer's (248,077 with its special tokens) where it has no more than the
        model's logits (248,320 rows: the rest are padding that no text decodes to), else the smaller of the two
        known sizes, or None."""
        known = getattr(self.engine.tokenizer, "vocab_size", None)
        model = getattr(self.engine.engine, "vocab_size", None)
        sizes = [v for v in (known, model) if isinstance(v, int)]
        return min(sizes) if sizes else None

    def encode_prompt(self, text: str, param: str, check_length: bool = True, scoring: bool = False) -> list[int]:
        """Token ids of a prompt's text; blocking (seconds for megabytes of text): call it off the event loop.

        Raises APIError (400, code context_length_exceeded, naming `param`) unless check_length is false (/tokenize
        counts any text): without encoding when the text cannot fit the context whatever it holds
        (`Tokenizer.min_num_tokens`, its UTF-8 bytes over the longest token's, already reaches max_model_len), and
        as soon as it is encoded when its tokens leave no room for a completion (`prompt_too_long`; scoring: for the
        scoring pass's one position), so that a list of prompts stops at the first such one instead of encoding the
        rest; APIError (400) when the tokenizer refuses the text.
        """
        tokenizer = self.engine.tokenizer
        bound, limit = getattr(tokenizer, "min_num_tokens", None), getattr(self.engine, "max_model_len", None)
        if check_length and bound is not None and isinstance(limit, int):
            n = bound(text)
            if n >= limit:
                raise APIError(f"This model's maximum context length is {limit} tokens. However, your prompt is at "
                               f"least {n} tokens long ({len(text)} characters). Please reduce the prompt.",
                               param=param, code="context_length_exceeded")
        try:
            ids = tokenizer.encode(text)
        except Exception as e:  # noqa: BLE001 - what the tokenizer refuses; a lone surrogate named
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as u:  # a lone surrogate (JSON "\ud800"): no UTF-8, so no tokens
                raise APIError(f"the prompt is not valid Unicode text: {u.object[u.start:u.end]!a} at character "
                               f"{u.start} is a lone surrogate", param=param) from None
            raise APIError(f"cannot encode the prompt: {e}", param=param) from None
        if check_length and isinstance(limit, int) and len(ids) >= limit:
            raise self.prompt_too_long(len(ids), param, scoring)
        return ids

    def prompt_too_long(self, n: int, param: str, scoring: bool = False, hint: str = "") -> APIError:
        """The 400 (code context_length_exceeded, naming `param`) for a prompt of `n` >= max_model_len tokens: no
        room for a completion (the engine's message), or with `scoring` (max_tokens 0 with echo) for the one next-token
        position the scoring pass reads; `hint` is appended to the message (`truncation_hint`)."""
        limit = self.engine.max_model_len
        if scoring:
            message = (f"This model's maximum context length is {limit} tokens; scoring a prompt (max_tokens 0 with "
                       f"echo) takes up to {limit - 1} tokens, and this prompt has {n}. Please reduce the prompt.")
        else:
            message = prompt_fills_context(n, limit)
        return APIError(message + hint, param=param, code="context_length_exceeded")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")

    # ---- sampling ----
    def sampling_params(self, body: SamplingFields, prompt_len: int, max_tokens: int | None,
                        logprobs: int | None = None, prompt_logprobs: int | None = None,
                        default_max_tokens: int | None = None) -> SamplingParams:
        """The request's SamplingParams: its fields, else the checkpoint's defaults, else OpenAI's. An
        unset max_tokens fills the room the prompt leaves in the context, at most `default_max_tokens` (an
        endpoint's own default: /v1/completions' 16) and at most the checkpoint's default (as vLLM caps them)."""
        d = self.defaults

        def pick(name: str) -> Any:
            value = getattr(body, name)
            return d[name] if value is None else value

        if max_tokens is None:
            room = max(self.engine.max_model_len - prompt_len, 1)
            caps = [c for c in (default_max_tokens, d.get("max_tokens")) if c is not None]
            max_tokens = min([room, *caps])
        if body.min_tokens > max_tokens:
            raise APIError(f"min_tokens ({body.min_tokens}) is more than this request may generate: {max_tokens} "
                           "tokens (its max_tokens / max_completion_tokens, or the room its prompt leaves in the "
                           "context)", param="min_tokens")
        return SamplingParams(
            temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"), min_p=pick("min_p"),
            presence_penalty=pick("presence_penalty"), frequency_penalty=pick("frequency_penalty"),
            repetition_penalty=pick("repetition_penalty"), logit_bias=self._logit_bias(body.logit_bias),
            max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop_strings(),
            stop_token_ids=self._stop_token_ids(body.stop_token_ids), seed=body.seed, ignore_eos=body.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )

    def _stop_token_ids(self, ids: list[int] | None) -> list[int]:
        """stop_token_ids as given; an id outside the tokenizer's vocabulary (`token_vocab_size`) is a 400, as for
        logit_bias and allowed_token_ids."""
        vocab = self.token_vocab_size
        for token in ids or []:
            if vocab is not None and token >= vocab:
                raise APIError(f"stop_token_ids: token id {token} is outside the vocabulary [0, {vocab})",
                               param="stop_token_ids")
        return list(ids or [])

    def _logit_bias(self, bias: Mapping[str, float] | None) -> dict[int, float]:
        """logit_bias as {token id: bias}; a key that is not a decimal id, or an id outside the tokenizer's
        vocabulary (`token_vocab_size`: a bias on the logits' padding rows would make the model emit ids that no
        text decodes to), is a 400."""
        out: dict[int, float] = {}
        vocab = self.token_vocab_size
        for key, value in (bias or {}).items():
            # a token id in decimal ASCII digits: int() alone would also take " 12 ", "1_0" and other scripts' digits
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
            # more digits than any id has: out of range without int(), which refuses keys of 4300+ digits
            if len(key) > 12 or (vocab is not None and int(key) >= vocab):
                shown = key if len(key) <= 40 else f"{key[:20]}... ({len(key)} digits)"
                raise APIError(f"logit_bias token id {shown} is outside the vocabulary [0, {vocab})",
                               param="logit_bias")
            out[int(key)] = value
        return out

    async def index_params(self, params: Sequence[SamplingParams]) -> None:
        """Build the stop-string and logit_bias indexes of a request's params off the event loop (seconds for a
        million stop strings), once: params equal in those fields (a request's prompts) share them."""
        built: list[SamplingParams] = []
        for p in params:
            for b in built:
                p.share_indexes(b)
            if "stop_strings" not in p.__dict__ or "logit_bias_tensors" not in p.__dict__:
                await asyncio.to_thread(p.build_indexes)
                built.append(p)

    def truncate_prompt(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` ids (-1: as many as max_model_len; None: all).

        Raises APIError (400) for a `keep` above max_model_len."""
        if keep is None:
            return prompt_ids
        if keep > self.engine.max_model_len:
            raise APIError(f"truncate_prompt_tokens ({keep}) is more than the context holds, {self.engine.max_model_len} "
                           "tokens; keep at most that less the tokens to generate", param="truncate_prompt_tokens")
        keep = self.engine.max_model_len if keep == -1 else keep
        return prompt_ids[len(prompt_ids) - keep :] if 0 < keep < len(prompt_ids) else prompt_ids

    def check_request(self, prompt_ids: list[int], params: SamplingParams, param: str = "prompt",
                      truncated: bool = False) -> None:
        """The engine's checks of a request before it is admitted; a prompt the engine refuses (empty, too long
        for the context, ids outside the model's) is an APIError naming `param` ("prompt" or "messages").
        `truncated`: truncate_prompt_tokens cut the prompt to prompt_ids (a context-length error then says what the
        truncation kept and the largest value that leaves room, `truncation_hint`)."""
        try:
            self.engine.check_request(prompt_ids, params)
        except ValueError as e:
            error = engine_error(e)
            if error.info.param is None and (isinstance(e, ContextLengthError) or str(e).startswith("the prompt")):
                error.info.param = param
            if isinstance(e, ContextLengthError) and truncated:
                error.info.message += self.truncation_hint(len(prompt_ids), params.max_tokens)
                error.args = (error.info.message,)
            raise error from None

    def truncation_hint(self, kept: int, new_tokens: int) -> str:
        """What a context-length error adds when truncate_prompt_tokens cut the prompt to `kept` tokens and
        `new_tokens` more are asked for: the largest truncate_prompt_tokens that leaves them room, where one does."""
        asked = max(new_tokens, 1)
        room = self.engine.max_model_len - asked
        return (f" (truncate_prompt_tokens kept the prompt's last {kept} tokens"
                + (f"; {room} or fewer leave room for {asked} more)" if room >= 1 else ")"))

    # ---- structured output ----
    async def grammar_backend(self, param: str = "response_format") -> GrammarBackend:
        """The server's GrammarBackend, built on first use (off the event loop); APIError naming `param` (the field
        that asked for a grammar) when the tokenizer cannot back one."""
        if self._grammars is None:
            try:
                self._grammars = await asyncio.to_thread(get_backend, self.engine.tokenizer, self.vocab_size)
            except StructuredOutputError as e:
                raise APIError(str(e), param=param) from None
        return self._grammars

    async def output_grammar(self, spec: tuple[str, str, Any] | None, gated: bool = False) -> Any:
        """The compiled grammar of an output constraint (output_constraint's (param, kind, value)), or None for
        None (free text). gated: the constraint starts after `</think>` (thinking on), so regex, choice and grammar
        constraints allow the template's newlines first (JSON always does).

        Raises:
            APIError (400, naming the field): a constraint the backend refuses (invalid, accepting no text, too
                complex)."""
        if spec is None:
            return None
        param, kind, value = spec
        backend = await self.grammar_backend(param.split(".")[0])
        build = {
            "json": lambda: backend.json_grammar(value),
            "regex": lambda: backend.regex_grammar(value, gated),
            "choice": lambda: backend.choice_grammar(value, gated),
            "grammar": lambda: backend.ebnf_grammar(value, gated),
        }[kind]
        try:
            return await asyncio.to_thread(build)
        except StructuredOutputError as e:
            raise APIError(str(e), param=param, code="invalid_schema" if kind == "json" else None) from None

    def choice_params(self, params: SamplingParams, n: int, grammar: Any = None, gate_token_id: int | None = None,
                      rules: tuple[list[int] | None, list[list[int]]] | None = None) -> list[SamplingParams]:
        """n copies of `params` (sharing the indexes `index_params` built): with a seed, choice i uses seed + i;
        with a grammar, each gets its own matcher (unconstrained until `gate_token_id` when thinking); with `rules`
        (`token_rules`), its own `TokenRules`."""
        out = []
        for i in range(n):
            p = params.clone()
            if params.seed is not None and i:
                seed = params.seed + i
                p.seed = seed - 2**64 if seed >= 2**64 else seed
            if grammar is not None:
                assert self._grammars is not None  # built when the grammar was compiled
                p.constraint = self._grammars.constraint(grammar, gate_token_id)
            elif rules is not None:
                p.constraint = TokenRules(*rules)
            out.append(p)
        return out

    async def token_rules(self, body: SamplingFields, grammar: Any = None
                          ) -> tuple[list[int] | None, list[list[int]]] | None:
        """(allowed ids, bad words' id sequences) of vLLM's `allowed_token_ids` and `bad_words`, or None without
        them; the words are tokenized off the event loop. A bad word counts as tokenized alone and after a space
        (both forms are banned), as in vLLM.

        Raises APIError (400): an allowed id outside the tokenizer's vocabulary; either field next to an output
        constraint (`grammar`: a JSON schema, regex, choice, grammar or forced tool call), whose masks they could
        leave empty."""
        if body.allowed_token_ids is None and not body.bad_words:
            return None
        param = "allowed_token_ids" if body.allowed_token_ids is not None else "bad_words"
        if grammar is not None:
            raise APIError(f"{param} cannot be combined with an output constraint (response_format, structured "
                           "outputs, guided_*, a forced tool call)", param=param)
        vocab = self.token_vocab_size
        for token in body.allowed_token_ids or ():
            if vocab is not None and token >= vocab:
                raise APIError(f"allowed_token_ids: token id {token} is outside the vocabulary [0, {vocab})",
                               param="allowed_token_ids")

        def encode() -> list[list[int]]:
            forms = {f for word in body.bad_words or () for f in (word.strip(), " " + word.strip()) if f.strip()}
            return [list(ids) for ids in {tuple(self.engine.tokenizer.encode(f)) for f in sorted(forms)} if ids]

        words = await asyncio.to_thread(encode) if body.bad_words else []
        return (list(body.allowed_token_ids) if body.allowed_token_ids is not None else None), words

    def check_fields(self, body: Any, unsupported: Mapping[str, tuple] = {}, served: frozenset[str] = frozenset()
                     ) -> None:
        """Refuse the request's unknown fields named in `unsupported` or UNSUPPORTED_FIELDS (name -> the values that
        ask for nothing) when they ask for something this server lacks, with a 400 naming the field; log the names
        of the other unknown fields, which are ignored (as vLLM does), except those in `served` (read elsewhere)."""
        extra = body.model_extra or {}
        for name, off in {**UNSUPPORTED_FIELDS, **unsupported}.items():
            if name in extra and extra[name] not in off:
                raise APIError(f"{name} is not supported by this server", param=name)
        ignored = sorted(k for k in extra if k not in UNSUPPORTED_FIELDS and k not in unsupported and k not in served
                         and k not in SERVICE_FIELDS)
        if ignored:
            logger.warning("[%s] the request's fields %s are not known here and were ignored", request_id_var.get(),
                           ", ".join(log_text(k) for k in ignored))

    # ---- running ----
    def start(self, request_id: str, requests: Sequence[tuple[list[int], SamplingParams]],
              skip_special_tokens: bool, keep_special_ids: frozenset[int] = frozenset()
              ) -> list[AsyncIterator[RequestOutput]]:
        """Admit every request now (all or none): one engine request per choice, ids `request_id` (one
        choice) or `request_id-i`. Raises APIError 503 when they do not fit, 400 when the engine refuses.

        Nothing awaits between the capacity check and the admissions, so concurrent handlers cannot both
        take the last places. A request under a grammar keeps the text of the specials a grammar writes as tokens
        (`structured.KEPT_SPECIALS`: `<tool_call>`, `</tool_call>`) where the grammar applies (after its gate, the
        reasoning's `</think>`, if it has one): they are part of the text the grammar accepted, so dropping them
        would break the constraint (a choice `<tool_call>x` returned as `x`).
        """
        gated, gate = frozenset(), None
        grammars = [p.constraint for _, p in requests if isinstance(p.constraint, GrammarConstraint)]
        if skip_special_tokens and grammars:
            gated = frozenset(self.markup[t] for t in KEPT_SPECIALS if t in self.markup)
            gate = grammars[0].gate_token_id  # the choices of one request share their grammar and gate
        try:
            self.engine.check_capacity(len(requests))
        except (ValueError, EngineOverloadedError) as e:
            raise engine_error(e) from None
        started: list[str] = []
        streams = []
        try:
            for i, (prompt, params) in enumerate(requests):
                rid = request_id if len(requests) == 1 else f"{request_id}-{i}"
                streams.append(self.engine.generate(rid, prompt, params, skip_special_tokens, keep_special_ids,
                                                    gated, gate))
                started.append(rid)
        except (ValueError, EngineOverloadedError) as e:
            for rid in started:
                self.engine.abort(rid)
            raise engine_error(e) from None
        return streams


def shutting_down() -> APIError:
    """What a reply still being generated at the end of the shutdown grace period (ServerConfig.shutdown_grace_s)
    ends with: in-band for a stream, HTTP 503 for a plain reply."""
    return APIError("the server is shutting down: this response was ended before it finished", 503,
                    type="service_unavailable", code="server_shutting_down")


def sse_response(events: AsyncIterator[dict], shutdown: ShutdownGrace) -> EventSourceResponse:
    """An SSE response of `events`, which end by themselves when the server shuts down (they pass
    `shutdown.wait` to `merge`); sse-starlette cancels them only a few seconds after that, had they not ended."""
    return EventSourceResponse(events, sep="\n", shutdown_grace_period=shutdown.grace_s + STREAM_BACKSTOP_S)


async def merge(streams: list[AsyncIterator[RequestOutput]],
                stop: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several requests, as they arrive. Closing it aborts every request.

    stop: returns when the outputs must end (`Serving.shutdown.wait`: the server is shutting down): every request
    is aborted and `shutting_down()` raised.
    """
    if len(streams) == 1 and stop is None:
        async with aclosing(streams[0]) as it:
            async for out in it:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    stopped = object()

    async def watch() -> None:
        await stop()
        queue.put_nowait((-1, stopped))

    async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(it):
                async for out in it:
                    queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    if stop is not None:
        tasks.append(asyncio.create_task(watch()))
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif item is stopped:
                raise shutting_down()
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(request: Request, work: Any) -> Any:
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


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet: vocab character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class TokenText:
    """A token's text (as decoded alone; a partial UTF-8 character shows as U+FFFD) and its exact bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._bytes_of = _byte_decoder()
        self._specials = getattr(tokenizer, "special_ids", frozenset())

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            spelled = getattr(self.tokenizer, "id_to_token", lambda _: None)(token_id)
            if spelled is not None and token_id not in self._specials and all(c in self._bytes_of for c in spelled):
                raw = [self._bytes_of[c] for c in spelled]
            else:
                raw = list(text.encode("utf-8"))
            hit = self._cache[token_id] = (text, raw)
            if len(self._cache) > 65536:
                self._cache.clear()
        return hit

    def top(self, alternatives: Sequence[tuple[int, float]]) -> list[TopLogprob]:
        out = []
        for tok, lp in alternatives:
            text, raw = self(tok)
            out.append(TopLogprob(token=text, logprob=json_logprob(lp), bytes=raw))
        return out
