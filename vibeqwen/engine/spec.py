"""Lossless speculative decoding: draft proposers and the verification rule.

Drafts are deterministic (n-gram lookup, or the MTP head's argmax), i.e. the draft distribution q is a
point mass on the drafted token x. Verification with the target distribution p at each position then is
the rejection rule of Leviathan et al. 2023 / Chen et al. 2023 specialised to one-hot q:
accept x with probability p(x); on rejection sample from p with x removed (renormalised); if every draft is
accepted, sample one bonus token from p at the last position. The output distribution equals p exactly.
At temperature 0, p is a point mass on argmax, so this accepts the longest prefix equal to the target's
argmax and the result equals plain greedy decoding token for token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from vibeqwen.engine.sampler import candidate_probs, draw_uniforms, race, target_probs, to_device
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
           generator: torch.Generator | None) -> list[int]:
    """Accepted drafts followed by one token sampled from the target: 1..len(drafts)+1 tokens.

    logits: [len(drafts) + 1, V] float32, row j scoring the position after draft j (row 0: after the last
    accepted token).
    """
    out: list[int] = []
    for j, x in enumerate(drafts):
        if params.greedy:
            best = int(torch.argmax(logits[j]))
            if best != x:
                return out + [best]
        else:
            p = target_probs(logits[j], params)
            u = torch.rand((), generator=generator, device=p.device)
            if u >= p[x]:
                residual = p.clone()
                residual[x] = 0.0
                return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))]
        out.append(x)
    last = logits[len(drafts)]
    if params.greedy:
        return out + [int(torch.argmax(last))]
    return out + [int(torch.multinomial(target_probs(last, params), 1, generator=generator))]


def verify_rows(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[list[int]]:
    """`verify` for several sampling (not greedy) requests at once, in a few launches and one host sync.

    logits: [sum(len(d) + 1 for d in drafts), V] float32, each request's rows in turn (row j of a request scores
    the position after its draft j), no processing needed (no bias, penalties or constraint); drafts: each
    request's drafted ids (at least one); params / generators: each request's. Returns each request's tokens:
    its accepted drafts, then one token sampled from the target (the residual after a rejection, else the bonus
    position's distribution).

    The rule is `verify`'s (accept draft x with probability p(x); Leviathan et al. 2023 with one-hot q), with the
    draws made up front: one uniform per draft, then the exponential race of `sampler.sample_rows` at the position
    where the request stops (x's probability zeroed after a rejection). A seeded request draws them all from its own
    generator, so its tokens do not depend on the other requests verified with it.
    """
    vocab = logits.shape[-1]
    starts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))  # each request's first row
    cut = [0 < p.top_k < vocab or p.top_p < 1.0 for p in params]
    if any(cut) and not all(cut):
        # requests that keep every id apart from those that select theirs (see sampler.sample_rows)
        out: list[list[int] | None] = [None] * len(drafts)
        for keep in (True, False):
            group = [b for b in range(len(drafts)) if cut[b] == keep]
            rows = [r for b in group for r in range(starts[b], starts[b + 1])]
            for b, tokens in zip(group, verify_rows(logits[rows], [drafts[b] for b in group],
                                                    [params[b] for b in group], [generators[b] for b in group])):
                out[b] = tokens
        return out
    dev = logits.device
    n, width = len(drafts), max(len(d) for d in drafts) + 1
    rows = [p for p, d in zip(params, drafts) for _ in range(len(d) + 1)]
    probs, ids = candidate_probs(logits, rows)
    # each request's rows padded to `width`: [n, width, K]; a padded position is never reached
    index = [[s + min(i, len(d)) for i in range(width)] for s, d in zip(starts, drafts)]
    index_t = to_device(index, torch.long, dev)
    probs = probs[index_t]
    ids = None if ids is None else ids[index_t]
    # the probability each position gives its draft (0 where it has none: the request stops there at the latest)
    drafted = to_device([d + [-1] * (width - len(d)) for d in drafts], torch.long, dev)
    if ids is None:
        p_draft = probs.gather(2, drafted.clamp_min(0)[:, :, None])[:, :, 0]
    else:
        p_draft = (probs * (ids == drafted[:, :, None])).sum(-1)
    p_draft = p_draft.masked_fill(drafted < 0, 0.0)
    seeded = [g if p.seed is not None else None for p, g in zip(params, generators)]
    uniform = torch.rand(n, width, device=dev, dtype=torch.float64)
    for b, (g, d) in enumerate(zip(seeded, drafts)):
        if g is not None:  # as many draws as its own drafts need, whatever the others'
            uniform[b, : len(d)].uniform_(generator=g)
    noise = draw_uniforms(n, logits.shape[-1], dev, seeded)
    # the first position that does not accept its draft (a position without a draft never does)
    stop = (uniform >= p_draft).int().argmax(-1)
    at = probs[torch.arange(n, device=dev), stop]  # [n, K]
    at_ids = None if ids is None else ids[torch.arange(n, device=dev), stop]
    rejected = drafted.gather(1, stop[:, None])  # the draft refused there, or -1 at the bonus position
    columns = torch.arange(at.shape[-1], device=dev)[None, :] if at_ids is None else at_ids
    residual = at.masked_fill(columns == rejected, 0.0)
    # a residual with no mass left (a draft with all the mass, refused by float rounding): the target itself
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, at)
    choice = race(residual, noise if at_ids is None else noise.gather(1, at_ids))
    token = choice if at_ids is None else at_ids.gather(1, choice[:, None])[:, 0]
    stops, tokens = torch.stack([stop, token]).tolist()
    return [d[:k] + [t] for d, k, t in zip(drafts, stops, tokens)]

