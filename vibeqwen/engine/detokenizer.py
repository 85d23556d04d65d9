"""Incremental detokenization with stop strings.

Token ids arrive one at a time; `IncrementalDetokenizer.update` turns each into the text it adds. Two
things make this more than `decode([token_id])`:

- A byte-level BPE token can end in the middle of a multi-byte UTF-8 character, which decodes to
  U+FFFD until the next token completes it. Text is read over a small window of recent tokens and held
  back while it ends in U+FFFD (the prefix/read offset scheme of vLLM's `detokenize_incrementally`).
- A stop string may be split across tokens. Text that could still grow into a stop string (the
  longest suffix that is a prefix of one) is held back; once a stop string appears the output is
  truncated before it and the detokenizer reports `finished`.

  emitted text          | held back          | new delta
  "... Hello wor"       | "ld! ST"           | "OP"        stop="STOP": emit "ld! ", finish
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """The part of the tokenizer the detokenizer needs."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas, one token at a time.

    tokenizer: anything with `decode(ids: list[int], skip_special_tokens: bool) -> str` that decodes
        invalid UTF-8 to U+FFFD (byte-level BPE, errors="replace").
    stop: strings that end generation (or their StopStrings index); they never appear in the output, even split
        across tokens.
    skip_special_tokens: leave special tokens (`<|im_end|>`, ...) out of the text, as OpenAI servers do.
    include_stop: end the text with the stop string that matched (vLLM's include_stop_str_in_output) instead of
        before it.
    min_tokens: no stop string ends in the text of the first min_tokens tokens (as vLLM: a stop string that
        completes in a later token's text matches, even where it began earlier; one wholly inside that text does
        not).

    Call `update(token_id)` per token; it returns the new text (possibly ""). After a stop string appears,
    `finished` is True, `stop_string` names it and further updates return "". When generation ends for
    another reason, call `flush()` to release text that was held back. `output_text` is all text emitted.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        stop: Sequence[str] | StopStrings = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self._stops = stop if isinstance(stop, StopStrings) else StopStrings(stop)
        self.stop = self._stops.strings
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.output_text = ""
        self.finished = False
        self.stop_string: str | None = None
        # Decoded text held back because it may be the start of a stop string.
        self._pending = ""
        # token_ids[prefix:read] was decoded last time; token_ids[read:] is not yet emitted as text.
        self._prefix_offset = 0
        self._read_offset = 0

    def update(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (never a split character or stop string)."""
        if self.finished:
            return ""
        self.token_ids.append(token_id)
        return self._emit(self._decode_new(final=False), len(self.token_ids) > self.min_tokens)

    def flush(self) -> str:
        """End of generation: return all text still held back (incomplete characters decode to U+FFFD)."""
        if self.finished:
            return ""
        delta = self._emit(self._decode_new(final=True), len(self.token_ids) > self.min_tokens)
        if not self.finished:
            delta += self._pending
            self.output_text += self._pending
            self._pending = ""
        self.finished = True
        return delta

    def _decode_new(self, final: bool) -> str:
        ids = self.token_ids
        if self._read_offset == len(ids):
            return ""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        new_text = decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        # An unfinished UTF-8 sequence decodes to U+FFFD: wait for the token that completes it.
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return new_text[len(prefix_text) :]

    def _emit(self, text: str, can_stop: bool = True) -> str:
        """Run new text through the stop-string check (none matches unless `can_stop`: min_tokens); return the
        part that is safe to show."""
        if not text:
            return ""
        if not self.stop:
            self.output_text += text
            return text
        # Any stop string that completes now ends inside the new text (the held-back text holds none).
        buf = self._pending + text
        hit = self._stops.earliest(buf, len(self._pending)) if can_stop else None
        if hit is not None:
            pos, stop = hit
            self.finished = True
            self.stop_string = stop
            out, self._pending = buf[: pos + len(stop) if self.include_stop else pos], ""
        else:
            keep = self._stops.partial_len(buf)
            out, self._pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.output_text += out
        return out


class StopStrings:
    """A request's stop strings, indexed so that checking a token's text costs (distinct lengths) x (new
    characters) set lookups for complete matches and (held-back characters) bisections for partial ones, not a
    scan of every string: a request may send any number of them (as vLLM allows), and the check runs on the
    engine's thread once per generated token.

    stops: the strings (empty ones ignored); when several complete at the same position, the first listed wins.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._rank: dict[str, int] = {}
        for s in stops:
            if s:
                self._rank.setdefault(s, len(self._rank))
        self._by_len: dict[int, set[str]] = {}
        for s in self._rank:
            self._by_len.setdefault(len(s), set()).add(s)
        self._lengths = sorted(self._by_len)
        self._sorted = sorted(self._rank)
        self.max_len = self._lengths[-1] if self._lengths else 0
        self.strings = list(self._rank)  # distinct, non-empty, in the order given

    def earliest(self, text: str, new_from: int = 0) -> tuple[int, str] | None:
        """The (position, string) of the stop string occurring first in `text` among those that end after
        character `new_from` (text[:new_from] must hold no complete stop string), or None."""
        best: tuple[int, int, str] | None = None  # (position, rank, string)
        n = len(text)
        for length in self._lengths:
            if length > n:
                break
            group = self._by_len[length]
            for end in range(max(length, new_from + 1), n + 1):
                start = end - length
                if best is not None and start > best[0]:
                    break  # later ends of this length start later still
                s = text[start:end]
                if s in group:
                    key = (start, self._rank[s], s)
                    if best is None or key < best:
                        best = key
                    break
        return None if best is None else (best[0], best[2])

    def partial_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string (0 if none)."""
        for n in range(min(len(text), self.max_len - 1), 0, -1):
            tail = text[-n:]
            i = bisect.bisect_left(self._sorted, tail)
            if i < len(self._sorted) and self._sorted[i].startswith(tail):
                return n
        return 0
