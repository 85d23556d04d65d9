"""The synchronous engine of the walking skeleton: one request at a time on the reference model.

The engine-core issue replaces this with continuous batching behind the same `generate` contract.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from vibeqwen.checkpoint.loader import load_checkpoint
from vibeqwen.engine.sampler import make_generator, sample
from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM
from vibeqwen.model.state import ForwardBatch, SequenceState
from vibeqwen.model.weights import Weights
from vibeqwen.sampling import SamplingParams
from vibeqwen.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    """Owns the model and tokenizer; generates one request at a time.

    max_model_len: the longest prompt + completion accepted (tokens).
    """

    def __init__(self, model: Qwen3_5MoeForCausalLM, tokenizer: Tokenizer, model_name: str, max_model_len: int):
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        model_name: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        max_model_len: int | None = None,
    ) -> "LLMEngine":
        """Load, validate and build the engine. Raises CheckpointError / ConfigError on a bad checkpoint;
        nothing is left running when it does."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        ckpt = load_checkpoint(path)
        weights = Weights(ckpt.tensors, ckpt.precisions, DTYPES[dtype], device)
        model = Qwen3_5MoeForCausalLM.from_weights(ckpt.config, weights)
        tokenizer = Tokenizer.from_dir(path)
        limit = min(max_model_len or ckpt.config.max_position_embeddings, ckpt.config.max_position_embeddings)
        return cls(model, tokenizer, model_name or Path(path).name, limit)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> Iterator[tuple[int, str | None]]:
        """Yield (token_id, finish_reason) per generated token.

        finish_reason is None until the last token: 'stop' when the token is an EOS id (unless
        params.ignore_eos) or one of params.stop_token_ids (that token is yielded), 'length' when
        max_tokens is reached. Stop strings are the caller's job (close the generator to stop early).
        Raises ValueError if the prompt is empty, holds ids outside the vocabulary, or prompt + max_tokens
        exceeds max_model_len.
        """
        params.validate()
        vocab = self.model.cfg.vocab_size
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt holds token ids outside [0, {vocab})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{len(prompt_token_ids)} prompt + {params.max_tokens} completion tokens"
            )
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        gen = make_generator(params)
        state = SequenceState()
        tokens = list(prompt_token_ids)
        feed = tokens
        for i in range(params.max_tokens):
            ids = torch.tensor(feed, dtype=torch.long, device=self.model.device)
            positions = torch.arange(state.num_tokens, state.num_tokens + len(feed), device=self.model.device)
            hidden = self.model.forward(ids, positions, ForwardBatch([state], [len(feed)]))
            token = sample(self.model.logits(hidden[-1:])[0], params, gen)
            tokens.append(token)
            if token in stop_ids:
                yield token, "stop"
                return
            if i + 1 == params.max_tokens:
                yield token, "length"
                return
            yield token, None
            feed = [token]
