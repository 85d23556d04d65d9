"""A drafter that knows the right answer: drafts a known continuation, right for a varying number of tokens
then wrong, so every acceptance length (0..k) and every GDN rollback position gets exercised."""

from __future__ import annotations


def oracle_drafter(prompts: list[list[int]], outputs: list[list[int]]):
    """A stand-in for `ngram_propose(tokens, k, n_min, n_max)` built from reference outputs."""
    truth = {tuple(p): p + o for p, o in zip(prompts, outputs)}
    calls = {"n": 0}

    def propose(tokens, k, n_min, n_max):
        calls["n"] += 1
        for prefix, full in truth.items():
            if tuple(tokens[: len(prefix)]) == prefix and tokens == full[: len(tokens)]:
                right = full[len(tokens) : len(tokens) + k]
                cut = calls["n"] % (k + 1)  # 0..k drafts right, then wrong ones
                return right[:cut] + [(t + 1) % 248044 for t in right[cut:]]
        return []

    return propose
