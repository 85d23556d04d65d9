"""vLLM's `allowed_token_ids` and `bad_words` as a `vibeqwen.sampling.TokenConstraint`."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TokenRules:
    """Restricts each sampled token of one request.

    allowed_ids: the only ids it may sample (None: any). bad_words: token id sequences it must never complete: where
    the output so far ends with all but the last id of one, that last id is masked (a one-token word is masked
    always), as vLLM's bad_words. Where every allowed id would complete a bad word, the allowed ids are kept (a
    mask must leave something to sample). Not shared between requests (it follows one output).
    """

    def __init__(self, allowed_ids: Sequence[int] | None = None, bad_words: Sequence[Sequence[int]] = ()) -> None:
        self._allowed = sorted(set(allowed_ids)) if allowed_ids is not None else None
        self._always = sorted({w[0] for w in bad_words if len(w) == 1})
        # the longer words by the length of their head (all but the last id): head -> the last ids it bans, so a
        # step looks up one key per length, however many words there are
        self._heads: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for w in bad_words:
            if len(w) > 1:
                self._heads.setdefault(len(w) - 1, {}).setdefault(tuple(w[:-1]), []).append(w[-1])
        self._keep = max(self._heads, default=0)
        self._recent: list[int] = []  # the output's last `_keep` ids
        self._base: torch.Tensor | None = None
        self._base_size = -1

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        banned = list(self._always)
        for size, heads in self._heads.items():
            if len(self._recent) >= size:
                banned += heads.get(tuple(self._recent[len(self._recent) - size :]), ())
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
        # every allowed id would complete a bad word: the allowed ids rather than none at all
        return mask if bool(mask.any()) else self._base

    def accept(self, token_id: int) -> None:
        if self._keep:
            self._recent.append(token_id)
            del self._recent[: -self._keep]

