"""Lossless speculative decoding: draft proposers and the verification rule.

Drafts are deterministic (n-gram lookup, or the MTP head's argmax), i.e. the draft distribution q is a
point mass on the drafted token x. Verification with the target distribution p at each position then is
the rejection rule of Leviathan et al. 2023 / Chen et al. 2023 specialised to one-hot q: accept x with
probability p(x); on rejection sample from p with x removed (renormalised); if every draft is accepted, sample
one bonus token from p at the last position. The output distribution equals p exactly.

It is run coupled: every verified position draws its token y from p (as plain sampling would there), the draft
is accepted where y == x, and the first y that differs (or the bonus position's) is the position's token. That
accepts x with probability p(x) and, on a rejection, gives y ~ p restricted to the other ids: the same rule. A
seeded request's draws are keyed by sequence position (`sampler.position_key`), so its tokens are those of plain
seeded sampling, whatever was drafted, verified, preempted or cut by the step budget.
At temperature 0, p is a point mass on argmax, so this accepts the longest prefix equal to the target's
argmax and the result equals plain greedy decoding token for token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from vibeqwen.engine.sampler import sample, sample_rows
from vibeqwen.sampling import SamplingParams

METHODS = ("off", "mtp", "ngram", "mtp+ngram")


@dataclass(frozen=True)
class SpecConfig:
    """method: one of METHODS. num_speculative_tokens: k drafts per step. n-gram lookup tries suffixes of
    prompt_lookup_max down to prompt_lookup_min tokens. pad_drafts, adaptive: see below."""

    method: str = "off"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # pad every decoding sequence's drafts to the step's longest (filler tokens, verified like any draft: an
    # accepted filler is the target's own token), so the batch has one query length and replays a
    # verification CUDA graph; None: when the engine has verification graphs (GPU path)
    pad_drafts: bool | None = None
    # cost-aware speculation: skip a step's drafts when the verification step's measured cost outweighs the
    # tokens the drafts are expected to add (lossless either way: drafts never change the output); None:
    # when the engine has measured its CUDA graphs' step costs (GPU path)
    adaptive: bool | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative must be one of {METHODS}, got {self.method!r}")
        if self.enabled and self.num_speculative_tokens < 1:
            raise ValueError("--num-speculative-tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("n-gram lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max")

    @property
    def enabled(self) -> bool:
        """True unless method is 'off'."""
        return self.method != "off"

    @property
    def uses_mtp(self) -> bool:
        """True for 'mtp' and 'mtp+ngram' (needs the checkpoint's mtp.* weights)."""
        return "mtp" in self.method

    @property
    def uses_ngram(self) -> bool:
        """True for 'ngram' and 'mtp+ngram'."""
        return "ngram" in self.method


def ngram_propose(tokens: list[int], k: int, n_min: int = 2, n_max: int = 4) -> list[int]:
    """Prompt lookup: find the most recent earlier occurrence of the longest suffix of `tokens` (n_max down
    to n_min tokens) and propose up to k tokens that followed it. [] when nothing matches.

    Vectorised with numpy (one pass per n over the sequence, then a filter per suffix token): ~20 us for a
    1k-token sequence, where a Python scan costs ~1 ms and runs for every decoding sequence every step."""
    size = len(tokens)
    if size < 2 or k < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = arr[size - n:]
        # candidate starts 0 .. size-n-1: every match has at least one token after it
        starts = np.flatnonzero(arr[: size - n] == suffix[0])
        for t in range(1, n):
            if starts.size == 0:
                break
            starts = starts[arr[starts + t] == suffix[t]]
        if starts.size:
            start = int(starts[-1])
            return tokens[start + n : start + n + k]
    return []


def greedy_accept(drafts: list[int], argmax: list[int]) -> list[int]:
    """Temperature-0 verification on host lists: `argmax[j]` is the target's argmax at the position after
    draft j (argmax[0]: after the last accepted token), len(drafts) + 1 entries. Returns the longest prefix
    of drafts equal to the target's argmax, then the target's own token there: 1..len(drafts)+1 tokens."""
    for j, x in enumerate(drafts):
        if argmax[j] != x:
            return drafts[:j] + [argmax[j]]
    return list(drafts) + [argmax[len(drafts)]]


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator | None, position: int | None = None) -> list[int]:
    """Accepted drafts followed by one token sampled from the target: 1..len(drafts)+1 tokens (the coupled rule of
    the module docstring: row j's token drawn as `sampler.sample` draws it, the draft kept while they agree).

    logits: [len(drafts) + 1, V] float32, row j scoring the position after draft j (row 0: after the last
    accepted token); position: the sequence index of row 0's token (row j's is position + j), which keys a
    seeded request's draws (None: drawn on from the generator's state).
    """
    out: list[int] = []
    for j in range(len(drafts) + 1):
        if params.greedy:
            token = int(torch.argmax(logits[j]))
        else:
            token = sample(logits[j], params, generator, None if position is None else position + j)
        out.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return out


# verified rows drawn at once at most (a float64 uniform per vocabulary id each: 2 MB a row at Qwen3.6's 248,320 ids)
VERIFY_ROWS_AT_ONCE = 64


def verify_rows(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
                generators: list[torch.Generator | None], positions: list[int] | None = None) -> list[list[int]]:
    """`verify` for several sampling (not greedy) requests at once: `sampler.sample_rows` on every row, a call a
    `VERIFY_ROWS_AT_ONCE` rows, then one host sync.

    logits: [sum(len(d) + 1 for d in drafts), V] float32, each request's rows in turn (row j of a request scores
    the position after its draft j), no processing needed (no bias, penalties or constraint); drafts: each
    request's drafted ids (at least one); params / generators: each request's; positions: each request's sequence
    index of its row 0's token (keys a seeded request's draws; None: drawn on from each generator's state).
    Returns each request's tokens: its accepted drafts, then the first sampled token that differs from its draft
    (or the bonus position's).

    Every row draws its token with `sampler.sample_rows` (the same kernels and draws as plain sampling); a seeded
    request draws from its own generator, so its tokens do not depend on the other requests verified with it, and
    with positions they are plain seeded sampling's. One host sync.
    """
    starts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))  # each request's first row
    # requests in pieces of at most VERIFY_ROWS_AT_ONCE rows (one request's rows stay together): the uniforms of a
    # piece's rows exist at once
    pieces, piece = [], []
    for b, d in enumerate(drafts):
        if piece and starts[b + 1] - starts[piece[0]] > VERIFY_ROWS_AT_ONCE:
            pieces.append(piece)
            piece = []
        piece.append(b)
    pieces.append(piece)
    parts = []
    for piece in pieces:
        lo, hi = starts[piece[0]], starts[piece[-1] + 1]
        reps = [len(drafts[b]) + 1 for b in piece]
        parts.append(sample_rows(
            logits[lo:hi], [params[b] for b, r in zip(piece, reps) for _ in range(r)],
            [generators[b] for b, r in zip(piece, reps) for _ in range(r)],
            None if positions is None else [positions[b] + j for b, r in zip(piece, reps) for j in range(r)]))
    sampled = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
    out: list[list[int]] = []
    for b, d in enumerate(drafts):
        mine = sampled[starts[b]: starts[b + 1]]
        k = next((j for j, x in enumerate(d) if mine[j] != x), len(d))
        out.append(d[:k] + [mine[k]])
    return out
