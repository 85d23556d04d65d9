"""Bridges the synchronous engine core to asyncio.

One engine thread owns the engine and runs its step loop; HTTP handlers never touch it. A handler's
`generate` posts the request to the thread's inbox and reads its outputs from its own `asyncio.Queue`,
which the thread fills through `loop.call_soon_threadsafe`. The thread detokenizes (stop strings end a
request there) and drains the inbox between steps, so a new request or an abort takes effect at the next
step. A consumer that stops iterating (client gone, task cancelled) posts an abort: the request's blocks
and GDN slot are freed within one step.

With `warmup=True` the thread first runs one tiny greedy generation (the first forward pass compiles and
allocates); `ready` turns True after it, and the server's `/health` answers 200 only then.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from vibeqwen.engine.detokenizer import IncrementalDetokenizer
from vibeqwen.engine.stats import StatsLogger
from vibeqwen.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineCore(Protocol):
    """What `AsyncEngine` needs from the engine (`vibeqwen.engine.llm_engine.LLMEngine`)."""

    tokenizer: Any
    max_model_len: int
    model_name: str
    stats: Any

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Any: ...
    def abort_request(self, request_id: str, reason: str = "abort") -> Any: ...
    def has_unfinished_requests(self) -> bool: ...
    def running_request_ids(self) -> list[str]: ...
    def step(self) -> list[Any]: ...


class EngineOverloadedError(RuntimeError):
    """Too many requests are queued; the client should retry later (HTTP 503)."""


@dataclass
class RequestOutput:
    """What one step of a request produced.

    token_ids: tokens sampled since the previous output (empty for a final 'abort').
    text: the text those tokens completed (may be "": held back mid-character or as a possible stop string).
    num_tokens: tokens generated so far for this request (the completion token count).
    finish_reason: None while running; then 'stop' (EOS, a stop token or a stop string), 'length'
        (max_tokens) or 'abort'. stop_string names the stop string that ended the request, if one did; stop_token
        the id from the request's stop_token_ids that did (vLLM's stop_reason is one or the other; EOS is neither).
    logprobs: one (logprob, [(id, logprob), ...]) per token in token_ids, when the request asked for them.
    prompt_logprobs: on the first output, one entry per prompt token after the first, when asked for.
    num_cached_tokens: prompt tokens the prefix cache served (usage's prompt_tokens_details.cached_tokens).
    """

    request_id: str
    token_ids: list[int]
    text: str
    num_tokens: int
    finish_reason: str | None = None
    stop_string: str | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    stop_token: int | None = None
    num_cached_tokens: int = 0

    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's stop_reason: the stop string or the stop_token_ids id that ended the request, else None."""
        return self.stop_string if self.stop_string is not None else self.stop_token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _KeepSpecials:
    """A decoder that drops special tokens except `keep` (their text stays): the output parsers need the
    markup specials `<think>`, `</think>`, `<tool_call>`, `</tool_call>` but not `<|im_end|>`.

    gated, gate: specials kept only after the token `gate` (a grammar's specials: the grammar applies after the
    reasoning's `</think>`; gate None keeps them everywhere). The incremental detokenizer decodes windows of a
    reply that only move forward, so a window holding the gate keeps what follows it in the window, and once one
    has held it, a window without it lies wholly after it."""

    def __init__(self, tokenizer: Any, keep: frozenset[int], gated: frozenset[int] = frozenset(),
                 gate: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.keep, self.gated, self.gate = keep, gated, gate
        self._gate_seen = gate is None
        self._text = {t: tokenizer.decode([t], skip_special_tokens=False) for t in keep | gated}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if not skip_special_tokens:
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        after = 0 if self._gate_seen else len(ids)  # ids[after:] follow the gate
        if self.gate is not None and self.gate in ids:
            after = ids.index(self.gate) + 1
            self._gate_seen = True
        parts, run = [], []
        for i, t in enumerate(ids):
            if t in self.keep or (t in self.gated and i >= after):
                if run:
                    parts.append(self.tokenizer.decode(run, skip_special_tokens=True))
                    run = []
                parts.append(self._text[t])
            else:
                run.append(t)
        if run:
            parts.append(self.tokenizer.decode(run, skip_special_tokens=True))
        return "".join(parts)


@dataclass
class _Job:
    """A request and the channel back to the event loop that asked for it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    skip_special_tokens: bool
    keep_special_ids: frozenset[int]
    loop: asyncio.AbstractEventLoop
    on_done: Any = None
    gated_special_ids: frozenset[int] = frozenset()  # kept only after gate_token_id (`_KeepSpecials`)
    gate_token_id: int | None = None
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    detok: IncrementalDetokenizer | None = None
    num_tokens: int = 0
    released: bool = False  # the consumer is done with it (AsyncEngine._release)

    def post(self, item: RequestOutput | BaseException) -> None:
        """Hand an output (or the exception that failed the request) to the consumer's loop. A final one
        also releases the request's place in flight, even if nobody ever iterates its outputs."""
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
            if self.on_done is not None and (isinstance(item, BaseException) or item.finished):
                self.on_done()
        except RuntimeError:
            pass  # the consumer's event loop is closed: nobody is listening any more


class OutputStream:
    """The outputs of one admitted request (`AsyncEngine.generate`), as an async iterator: the last output has a
    finish_reason; a failure in the engine is raised. Closing it (`aclose`), iterated or not, aborts the request
    unless it finished: a handler that stops before reading (a client gone at once) does not leave it running."""

    def __init__(self, engine: AsyncEngine, job: _Job) -> None:
        self._engine, self._job = engine, job

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._job.released:  # finished, failed or closed
            raise StopAsyncIteration
        try:
            item = await self._job.outputs.get()
        except BaseException:  # cancelled while waiting: the request goes with it
            self._engine._release(self._job, finished=False)
            raise
        if isinstance(item, BaseException) or item.finished:
            self._engine._release(self._job, finished=True)
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        self._engine._release(self._job, finished=False)  # (a no-op once it finished: released then)

    def __del__(self) -> None:
        # dropped unread (a handler's generator closed before it first ran, which runs no `finally`): abort
        self._engine._release(self._job, finished=False)


class AsyncEngine:
    """Serves the engine core to asyncio callers with continuous batching on one engine thread.

    max_queued: sequences (engine requests: one per choice) admitted beyond those the engine is running
    (max_num_seqs); past it `generate` raises EngineOverloadedError. An exception inside a step fails the requests of that step only.
    warmup: run one tiny generation on the engine thread before serving; `ready` is False until it ran.
    """

    def __init__(self, engine: EngineCore, max_queued: int = 256, log_interval: float = 10.0,
                 warmup: bool = False) -> None:
        self.engine = engine
        self.max_queued = max_queued
        self._inbox: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._active: dict[str, _Job] = {}  # event-loop side: requests not yet finished
        self._jobs: dict[str, _Job] = {}  # engine-thread side
        self._stats_logger = StatsLogger(log_interval)
        self._ready = threading.Event()
        self.warmup_error: BaseException | None = None
        if not warmup:
            self._ready.set()
        self._thread = threading.Thread(target=self._run, args=(warmup,), name="vibeqwen-engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        """True once the engine thread serves requests (after the warm-up, if one was asked for)."""
        return self._ready.is_set() and self._thread.is_alive() and self.warmup_error is None

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout) and self.ready

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def stats(self) -> Any:
        return self.engine.stats

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request cannot be served (bad sampling values, too long for the model)."""
        self.engine.validate_request(prompt_token_ids, params)

    def check_capacity(self, n: int = 1) -> None:
        """Raise EngineOverloadedError unless `n` more sequences (choices: n x prompts) fit: at most max_num_seqs +
        max_queued in flight; ValueError when `n` alone is more than that (retrying could never help: a 400, not a
        503)."""
        max_running = getattr(getattr(self.engine, "config", None), "max_num_seqs", 0)
        if n > max_running + self.max_queued:
            raise ValueError(f"{n} choices (n x prompts) need {n} sequences, more than this server ever holds at once "
                             f"({max_running} running + {self.max_queued} queued: --max-num-seqs, --max-queue-len)")
        if len(self._active) + n > max_running + self.max_queued:
            raise EngineOverloadedError(
                f"the server is at capacity ({len(self._active)} of {max_running + self.max_queued} sequences in "
                f"flight, this request needs {n}); retry later"
            )

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        skip_special_tokens: bool = True,
        keep_special_ids: frozenset[int] = frozenset(),
        gated_special_ids: frozenset[int] = frozenset(),
        gate_token_id: int | None = None,
    ) -> OutputStream:
        """Admit a request now and return an async iterator over its outputs (the last has a finish_reason).

        skip_special_tokens leaves special tokens out of the text, except those in keep_special_ids, and those in
        gated_special_ids after the token gate_token_id (everywhere when it is None).

        Must be called on the event loop. The request counts as in flight from this call (so a capacity
        check just before it cannot race). Raises ValueError for a request `check_request` rejects or an id
        already running and EngineOverloadedError when full; iterating re-raises whatever failed this
        request in the engine. Closing or cancelling the iteration aborts the request.
        """
        self.check_request(prompt_token_ids, params)
        self.check_capacity()
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already running")
        loop = asyncio.get_running_loop()
        job = _Job(request_id, list(prompt_token_ids), params, skip_special_tokens, frozenset(keep_special_ids), loop,
                   on_done=lambda: loop.call_soon_threadsafe(self._active.pop, request_id, None),
                   gated_special_ids=frozenset(gated_special_ids), gate_token_id=gate_token_id)
        self._active[request_id] = job
        self._inbox.put(("add", job))
        return OutputStream(self, job)

    def _release(self, job: _Job, finished: bool) -> None:
        """The consumer is done with `job` (idempotent): it leaves the requests in flight, and the engine aborts it
        unless it finished."""
        if job.released:
            return
        job.released = True
        self._active.pop(job.request_id, None)
        if not finished:
            self._inbox.put(("abort", job.request_id))

    def abort(self, request_id: str) -> None:
        """Stop a queued or running request; its iterator ends with finish_reason 'abort'."""
        self._inbox.put(("abort", request_id))

    def shutdown(self, timeout: float | None = 5.0) -> None:
        """Abort every request and stop the engine thread."""
        for rid in list(self._active):
            self._inbox.put(("abort", rid))
        self._inbox.put(None)
        self._thread.join(timeout)

    # ---- engine thread ----
    def _warmup(self) -> None:
        """One short greedy generation, so the first real request does not pay for first-use costs."""
        rid = f"warmup-{uuid.uuid4().hex}"
        prompt = self.engine.tokenizer.encode("Hello") or [0]
        t0 = time.monotonic()
        try:
            self.engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=2))
            while self.engine.has_unfinished_requests():
                self.engine.step()
        except Exception as e:  # noqa: BLE001 - reported through `ready` / /health
            logger.exception("engine warm-up failed")
            self.engine.abort_request(rid)
            self.warmup_error = e
            return
        reset = getattr(self.engine.stats, "reset_counters", None)
        if reset is not None:  # /metrics counts the clients' requests, not this one
            reset()
        logger.info("engine warm-up done in %.2f s", time.monotonic() - t0)

    def _run(self, warmup: bool = False) -> None:
        if warmup:
            self._warmup()
            self._ready.set()
        while True:
            # Block for work when idle; otherwise take whatever arrived and step.
            if not self.engine.has_unfinished_requests():
                item = self._inbox.get()
                if item is None or not self._handle(item):
                    return
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is None or not self._handle(item):
                    return
            if self.engine.has_unfinished_requests():
                self._step()
            self._stats_logger.maybe_log(self.engine.stats)

    def _handle(self, item: tuple[str, Any]) -> bool:
        kind, payload = item
        if kind == "add":
            job: _Job = payload
            try:
                self.engine.add_request(job.request_id, job.prompt_token_ids, job.params)
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                job.post(e)
                return True
            decoder = self.engine.tokenizer
            if (job.keep_special_ids or job.gated_special_ids) and job.skip_special_tokens:
                decoder = _KeepSpecials(decoder, job.keep_special_ids, job.gated_special_ids - job.keep_special_ids,
                                        job.gate_token_id)
            job.detok = IncrementalDetokenizer(decoder, job.params.stop_strings, job.skip_special_tokens,
                                              job.params.include_stop_str_in_output, job.params.min_tokens)
            self._jobs[job.request_id] = job
        elif kind == "abort":
            self.engine.abort_request(payload)
            job = self._jobs.pop(payload, None)
            if job is not None:
                job.post(RequestOutput(job.request_id, [], "", job.num_tokens, "abort"))
        return True

    def _eos_ids(self, params: SamplingParams) -> frozenset[int]:
        """The EOS ids that end a request with `params` (none with ignore_eos)."""
        return frozenset(() if params.ignore_eos else getattr(self.engine.tokenizer, "eos_token_ids", ()))

    def _stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        """The ids that end a request with `params`: its stop_token_ids, and the EOS ids unless ignore_eos."""
        return frozenset(params.stop_token_ids) | self._eos_ids(params)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail what was running, keep serving
            running = self.engine.running_request_ids()
            logger.exception("engine step failed; failing its %d running request(s)", len(running))
            for rid in running:
                self.engine.abort_request(rid)
                job = self._jobs.pop(rid, None)
                if job is not None:
                    job.post(e)
            return
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                continue
            shown = out.new_token_ids
            stop_token = None
            if out.finish_reason == "stop" and shown and shown[-1] in self._stop_token_ids(job.params):
                if shown[-1] not in self._eos_ids(job.params):
                    stop_token = shown[-1]  # as vLLM: EOS ends a request with stop_reason None
                if not job.params.include_stop_str_in_output:
                    shown = shown[:-1]  # as vLLM: the token that ended the request adds no text (still counted)
            before = len(job.detok.token_ids)
            text = "".join(job.detok.update(t) for t in shown)
            reason = out.finish_reason
            new_ids, num_tokens, logprobs = list(out.new_token_ids), out.num_output_tokens, getattr(out, "logprobs",
                                                                                                      None)
            if job.detok.finished:  # a stop string: end the request in the engine too
                reason = "stop"
                # a speculative step can accept tokens past the one that completed the stop string: as plain
                # decoding would have stopped there, they are not output, counted or given logprobs
                extra = len(new_ids) - (len(job.detok.token_ids) - before)
                if extra > 0:
                    new_ids, num_tokens, stop_token = new_ids[:-extra], num_tokens - extra, None
                    logprobs = logprobs[:-extra] if logprobs else logprobs
                if out.finish_reason is None:
                    self.engine.abort_request(out.request_id, reason="stop")
            elif reason is not None:
                text += job.detok.flush()
            job.num_tokens = num_tokens
            job.post(RequestOutput(job.request_id, new_ids, text, num_tokens, reason, job.detok.stop_string, logprobs,
                                   getattr(out, "prompt_logprobs", None), stop_token,
                                   getattr(getattr(out, "request", None), "num_cached_tokens", 0)))
            if reason is not None:
                self._jobs.pop(out.request_id, None)
