"""vLLM's `allowed_token_ids` and `bad_words` as a `vibeqwen.sampling.TokenConstraint`, and the conjunction of
several constraints (these rules next to a structured-output grammar)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TokenRules:
    """Restricts each sampled token of one request.

    allowed_ids: the only ids it may sample (None: any). bad_words: token id sequences it must never complete: where
    the output so far ends with all but the last id of one, that last id is masked (a one-token word is masked
    always), as vLLM's bad_words. A position where every id is masked samples from the unmasked logits' fallback
    (the engine's rule for a row with no mass left). Not shared between requests (it follows one output).
    """

    def __init__(self, allowed_ids: Sequence[int] | None = None, bad_words: Sequence[Sequence[int]] = ()) -> None:
        self._allowed = sorted(set(allowed_ids)) if allowed_ids is not None else None
        self._always = sorted({w[0] for w in bad_words if len(w) == 1})
        self._longer = [tuple(w) for w in bad_words if len(w) > 1]
        self._keep = max((len(w) - 1 for w in self._longer), default=0)
        self._recent: list[int] = []  # the output's last `_keep` ids
        self._base: torch.Tensor | None = None
        self._base_size = -1

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        banned = list(self._always)
        for word in self._longer:
            head = word[:-1]
            if len(self._recent) >= len(head) and tuple(self._recent[len(self._recent) - len(head) :]) == head:
                banned.append(word[-1])
        if self._allowed is None and not banned:
            return None
        if self._base_size != vocab_size:
            self._base = torch.ones(vocab_size, dtype=torch.bool)
            if self._allowed is not None:
                self._base.zero_()
                self._base[[i for i in self._allowed if i < vocab_size]] = True
            self._base_size = vocab_size
        if not banned:
            return self._base
        mask = self._base.clone()
        mask[[i for i in banned if i < vocab_size]] = False
        return mask

    def accept(self, token_id: int) -> None:
        if self._keep:
            self._recent.append(token_id)
            del self._recent[: -self._keep]


class AllConstraints:
    """Several TokenConstraints at once: a token must pass every one (the masks' AND); each sees every token."""

    def __init__(self, constraints: Sequence) -> None:
        self._parts = list(constraints)

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        mask = None
        for part in self._parts:
            m = part.allowed(vocab_size)
            if m is not None:
                mask = m if mask is None else mask & m
        return mask

    def accept(self, token_id: int) -> None:
        for part in self._parts:
            part.accept(token_id)
