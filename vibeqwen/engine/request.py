"""A request as the engine core sees it: token counts, status and timing."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from vibeqwen.sampling import SamplingParams


class ContextLengthError(ValueError):
    """A request whose prompt plus max_tokens exceeds the model's context length (the server answers 400 with
    OpenAI's code "context_length_exceeded")."""


def prompt_fills_context(n: int, limit: int) -> str:
    """The message for a prompt of `n` >= `limit` (max_model_len) tokens, which leaves no room for a completion (the
    engine's ContextLengthError and the server's early check of an encoded prompt say the same)."""
    return (f"This model's maximum context length is {limit} tokens. However, your prompt is {n} tokens long, which "
            "leaves no room for a completion. Please reduce the prompt.")


class RequestStatus(enum.Enum):
    """Where a request is: waiting (queued or preempted), running, or finished (any reason)."""
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request.

    num_computed_tokens counts the tokens whose K/V and GDN state are in the cache; the scheduler compares
    it with `num_tokens` (prompt + output) to decide what to run next, so chunked prefill, decode and
    recompute after preemption follow one rule.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None
    # speculative decoding: drafts to verify at the next step, and counters
    spec_token_ids: list[int] = field(default_factory=list)
    num_real_drafts: int = 0  # drafts at the head of spec_token_ids that a drafter proposed (the rest: padding)
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0
    # logprobs (when asked): one (logprob, top alternatives) per output token / per prompt token after the first
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    # prefix caching: prompt tokens a cached prefix served at the first admission (usage's cached_tokens), the chain
    # hashes of the full blocks of the tokens looked up so far (vibeqwen.engine.prefix_cache.chain_hashes), and the
    # positions, ascending, where the prefill stops for a snapshot of the state (a branch point, the start of a chat's
    # generation prompt)
    num_cached_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list, repr=False)
    snapshot_at: list[int] = field(default_factory=list)
    _prompt_key: int | None = field(default=None, init=False, repr=False)

    @property
    def prompt_key(self) -> int:
        """A hash of the prompt's token ids (computed once): requests with equal keys may share a prompt (compare
        `prompt_token_ids` to be sure)."""
        if self._prompt_key is None:
            self._prompt_key = hash(tuple(self.prompt_token_ids))
        return self._prompt_key

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.params.stop_token_ids) | (
            frozenset() if self.params.ignore_eos else self.eos_token_ids
        )

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens known so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list of prompt + output token ids (copies: prefer `token_slice` on hot paths)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Tokens this request may occupy in the cache at its longest."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:
        """True once the request stopped, hit a limit or was aborted."""
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> str | None:
        """Record a sampled token; return the finish reason it causes ('stop', 'length') or None."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        if self.params.constraint is not None:
            self.params.constraint.accept(token_id)
        if token_id in self.stop_ids and self.num_output_tokens >= self.params.min_tokens:
            return "stop"
        if self.num_output_tokens >= self.params.max_tokens:
            return "length"
        return None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens produced per verification step (accepted drafts + 1), the standard acceptance length."""
        if self.num_spec_steps == 0:
            return None
        return 1 + self.num_accepted_tokens / self.num_spec_steps

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (time per output token)."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)
