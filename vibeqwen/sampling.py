"""Per-request sampling parameters."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from vibeqwen.engine.detokenizer import StopStrings

MAX_LOGPROBS = 20
#: temperatures below this sample greedily (vLLM's _SAMPLING_EPS): logits / 1e-38 overflow float32
SAMPLING_EPS = 1e-5


class TokenConstraint(Protocol):
    """Restricts which tokens a request may sample next (structured output, e.g. an xgrammar matcher).

    The engine calls `allowed(vocab_size)` before sampling each token of the request (a bool tensor [V],
    True = allowed, or None for no restriction at this position) and `accept(token_id)` after each token it
    appends. Requests with a constraint are not speculated.
    """

    def allowed(self, vocab_size: int) -> Any: ...

    def accept(self, token_id: int) -> None: ...


#: SamplingParams fields -> the cached indexes built from each (dropped when the field is assigned)
_DERIVED = {"stop": ("stop_strings",), "logit_bias": ("logit_bias_tensors", "_logit_bias_device")}


@dataclass
class SamplingParams:
    """How one request is decoded (the OpenAI / vLLM sampling fields).

    temperature: below SAMPLING_EPS (1e-5, vLLM's threshold) means greedy (argmax of the processed logits); a
    smaller positive temperature would only overflow the scaled logits. top_p in (0, 1]; top_k 0 or -1 disables
    top-k; min_p in [0, 1] drops tokens below min_p * the top probability.
    presence_penalty, frequency_penalty in [-2, 2]: subtracted from logits of tokens already generated
    (once / per occurrence), as OpenAI defines them. repetition_penalty > 0: logits of tokens seen in the
    prompt or output are divided by it when positive, multiplied when negative (CTRL, Keskar et al. 2019).
    logit_bias: token id -> bias added to its logit (-100..100).
    max_tokens: cap on generated tokens; min_tokens: EOS and stop ids are masked until this many.
    stop: strings that end generation (not in the output unless include_stop_str_in_output: then the text ends with
    the one matched, as vLLM). stop_token_ids: extra ids that end
    generation, besides the model's EOS ids unless ignore_eos (the server leaves the stopping token's text out).
    seed: makes sampling reproducible for this request whatever else runs.
    logprobs: None, or how many top alternatives (0..20) to return with each sampled token's logprob.
    prompt_logprobs: None, or the same for every prompt token (the first has none).
    constraint: a per-request `TokenConstraint` (structured output); not shared between requests.
    Logprobs are those of the model's raw distribution (log_softmax of the logits), as vLLM returns them.
    Raises ValueError from `validate()` on out-of-range values.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: TokenConstraint | None = field(default=None, compare=False, repr=False)
    include_stop_str_in_output: bool = False
    # prefix caching: a prompt position to keep a snapshot at (the server sets it where a chat's generation prompt
    # starts: the next turn repeats the conversation up to there, then renders the reply differently)
    prefix_cache_point: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range (NaN and infinities included)."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        for tok, bias in self.logit_bias.items():
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias for token {tok} must be a finite number, got {bias}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for tok, bias in self.logit_bias.items():
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias for token {tok} must be in [-100, 100], got {bias}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @functools.cached_property
    def logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (token ids int64 [n], biases float32 [n]) on the CPU, built once per request: a step adds
        them with one index_add_ whatever n is (a whole-vocabulary bias is 248k entries). Assigning `logit_bias`
        drops it; changing the dict in place is not seen."""
        ids = torch.tensor(list(self.logit_bias), dtype=torch.long)
        return ids, torch.tensor(list(self.logit_bias.values()), dtype=torch.float32)

    def logit_bias_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias_tensors on `device`, copied there once (each sampled row of each step adds them: a per-row
        copy of a whole-vocabulary bias would move 2 MB to the GPU every time)."""
        cached = self.__dict__.get("_logit_bias_device")
        if cached is None or cached[0] != device:
            ids, bias = self.logit_bias_tensors
            cached = self.__dict__["_logit_bias_device"] = (device, ids.to(device), bias.to(device))
        return cached[1], cached[2]

    @functools.cached_property
    def stop_strings(self) -> StopStrings:
        """`stop` indexed for the per-token check (engine/detokenizer.py), built once per request (seconds for a
        million strings: the server builds it before the request reaches the engine's thread). Assigning `stop`
        drops it; changing the list in place is not seen."""
        from vibeqwen.engine.detokenizer import StopStrings

        return StopStrings(self.stop)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        for derived in _DERIVED.get(name, ()):
            self.__dict__.pop(derived, None)  # assigning stop / logit_bias drops the indexes built from the old value

    def build_indexes(self) -> None:
        """Build the `stop_strings` and `logit_bias_tensors` indexes now (seconds for a million stop strings: the
        server calls this off its event loop, before the request reaches the engine's thread)."""
        _ = self.stop_strings, self.logit_bias_tensors

    def share_indexes(self, other: SamplingParams) -> None:
        """Take the indexes `other` has built for a `stop` / `logit_bias` equal to this one's (a request's prompts)."""
        for field_name, names in _DERIVED.items():
            if getattr(self, field_name) == getattr(other, field_name):
                for name in names:
                    if name in other.__dict__ and name not in self.__dict__:
                        self.__dict__[name] = other.__dict__[name]

    def clone(self) -> SamplingParams:
        """A copy (dataclasses.replace: fields shared, not deep-copied) that also shares the indexes already built
        from `logit_bias` and `stop`, so that n choices of one request build them once."""
        new = dataclasses.replace(self)
        for names in _DERIVED.values():
            for name in names:
                if name in self.__dict__:
                    new.__dict__[name] = self.__dict__[name]
        return new

    @property
    def greedy(self) -> bool:
        """True below SAMPLING_EPS (argmax sampling)."""
        return self.temperature < SAMPLING_EPS

    @property
    def needs_history(self) -> bool:
        """True when the logits depend on the tokens so far (penalties, min_tokens)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.min_tokens > 0)
