"""IncrementalDetokenizer: UTF-8 safe deltas, special tokens, stop strings.

Most cases run on a fake byte-level tokenizer whose tokens are chosen to split characters and stop
strings at awkward places; a few repeat on the real Qwen3.6 tokenizer when it can be built here.
"""

from __future__ import annotations

import pytest

from vibeqwen.engine.detokenizer import IncrementalDetokenizer

SPECIALS = {1000: "<|endoftext|>", 1001: "<|im_start|>", 1002: "<|im_end|>"}


class ByteTokenizer:
    """Byte-level fake: ids 0-255 are single bytes, 256+ are the byte strings in `merged`, 1000+ specials."""

    def __init__(self, merged: list[bytes] = ()):
        self.vocab = {i: bytes([i]) for i in range(256)}
        self.vocab.update({256 + i: b for i, b in enumerate(merged)})
        self.special_ids = set(SPECIALS)

    def tokens(self, *pieces: bytes | str | int) -> list[int]:
        """Ids spelling `pieces`: an int is an id, str/bytes must be one vocab entry or are split into bytes."""
        ids = []
        for p in pieces:
            if isinstance(p, int):
                ids.append(p)
                continue
            b = p.encode() if isinstance(p, str) else p
            match = [i for i, v in self.vocab.items() if v == b]
            ids.extend(match[:1] or list(b))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out = b""
        for i in ids:
            if i in SPECIALS:
                out += b"" if skip_special_tokens else SPECIALS[i].encode()
            else:
                out += self.vocab[i]
        return out.decode("utf-8", errors="replace")


def run(detok: IncrementalDetokenizer, ids: list[int], flush: bool = True) -> list[str]:
    """Feed ids until the detokenizer finishes; return every delta (flush's last, if it ran)."""
    deltas = []
    for i in ids:
        deltas.append(detok.update(i))
        if detok.finished:
            return deltas
    if flush:
        deltas.append(detok.flush())
    return deltas


def test_every_byte_its_own_token():
    text = "héllo 你好 🎉 ok"
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    deltas = run(detok, list(text.encode()))
    assert "".join(deltas) == text == detok.output_text
    # Each character comes out whole on the token holding its last byte.
    expected = [d for c in text for d in [""] * (len(c.encode()) - 1) + [c]]
    assert deltas == expected + [""]


def test_token_ending_mid_character():
    # " wor", "ld\xf0\x9f" (half an emoji), "\x8e\x89!" (the rest and more).
    tok = ByteTokenizer([b" wor", b"ld\xf0\x9f", b"\x8e\x89!"])
    ids = tok.tokens("hi", b" wor", b"ld\xf0\x9f", b"\x8e\x89!")
    detok = IncrementalDetokenizer(tok)
    deltas = run(detok, ids, flush=False)
    assert deltas == ["h", "i", " wor", "", "ld🎉!"]


def test_incomplete_character_flushed_at_end():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    deltas = run(detok, tok.tokens("a", b"\xe4\xbd"))
    assert deltas == ["a", "", "", "\ufffd"]


def test_special_tokens_skipped_by_default():
    tok = ByteTokenizer()
    ids = tok.tokens(1001, "ok", 1002)
    assert "".join(run(IncrementalDetokenizer(tok), ids)) == "ok"
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(run(kept, ids)) == "<|im_start|>ok<|im_end|>"


def test_stop_string_split_across_three_tokens_never_leaks():
    tok = ByteTokenizer([b"Hello S", b"T", b"OP and more"])
    ids = tok.tokens(b"Hello S", b"T", b"OP and more", "!")
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    deltas = run(detok, ids)
    assert deltas == ["Hello ", "", ""]
    assert detok.finished and detok.stop_string == "STOP"
    assert detok.output_text == "Hello "
    # Nothing more comes out once stopped.
    assert detok.update(ord("x")) == "" and detok.flush() == ""


def test_stop_string_at_very_start():
    tok = ByteTokenizer([b"STOP"])
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    assert run(detok, tok.tokens(b"STOP", "tail")) == [""]
    assert detok.finished and detok.output_text == ""


def test_held_prefix_released_when_stop_does_not_complete():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    deltas = run(detok, tok.tokens("a ST", "AR", " x ST"))
    assert deltas == ["a", " ", "", "", "STA", "R", " ", "x", " ", "", "", "ST"]
    assert detok.output_text == "a STAR x ST" and detok.stop_string is None


def test_min_tokens_holds_stop_strings_back_as_vllm():
    """No stop string matches in the text of the first min_tokens tokens; one that completes in a later token
    matches even where it began earlier (vLLM's detokenizer: the stop check skips the first min_tokens tokens)."""
    tok = ByteTokenizer([b"ab", b"cab", b"a", b"b", b"c"])
    ids = tok.tokens(b"ab", b"cab", b"a", b"b", b"c")  # 5 tokens: "ab" "cab" "a" "b" "c"
    plain = IncrementalDetokenizer(tok, stop=["ab"])
    run(plain, ids)
    assert plain.output_text == "" and plain.stop_string == "ab"  # the first token
    late = IncrementalDetokenizer(tok, stop=["ab"], min_tokens=2)
    run(late, ids)
    # "ab" inside tokens 1 and 2 is not matched; the "a" of token 3 waits, and token 4's "b" completes a match
    assert late.output_text == "abcab" and late.stop_string == "ab"
    gone = IncrementalDetokenizer(tok, stop=["ab"], min_tokens=5)
    run(gone, ids)
    assert gone.flush() == "" and gone.output_text == "abcababc" and gone.stop_string is None


def test_earliest_of_several_stop_strings_wins():
    tok = ByteTokenizer([b"hello world"])
    detok = IncrementalDetokenizer(tok, stop=["world", "lo w", "zzz"])
    assert run(detok, tok.tokens(b"hello world")) == ["hel"]
    assert detok.stop_string == "lo w"


def test_overlapping_stop_prefixes():
    # "aab" must be found even though "aa" was held back before it completed.
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["aab"])
    assert "".join(run(detok, tok.tokens("xaaab"))) == "xa"
    assert detok.finished


def test_multibyte_stop_string_split_inside_a_character():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["🎉"])
    deltas = run(detok, list("ok 🎉 more".encode()))
    assert "".join(deltas) == "ok " and detok.stop_string == "🎉"


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    mod = pytest.importorskip("vibeqwen.tokenizer")
    path = tmp_path_factory.mktemp("tokenizer")
    try:
        mod.write_tokenizer_files(path)
        return mod.Tokenizer.from_dir(path)
    except (ImportError, AttributeError) as e:
        pytest.skip(f"real tokenizer unavailable: {e}")


@pytest.mark.parametrize("text", ["héllo 你好 🎉 done", "emoji🎉🎉 at the 👩‍👩‍👧 end"])
def test_real_tokenizer_roundtrip(qwen_tokenizer, text):
    ids = qwen_tokenizer.encode(text)
    deltas = run(IncrementalDetokenizer(qwen_tokenizer), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_real_tokenizer_stop_and_specials(qwen_tokenizer):
    tok = qwen_tokenizer
    ids = tok.encode("<|im_start|>assistant\nok\n\nThe answer is 42. END here") + list(tok.eos_token_ids[:1])
    detok = IncrementalDetokenizer(tok, stop=["is 4"])
    text = "".join(run(detok, ids))
    assert text == "assistant\nok\n\nThe answer " and detok.stop_string == "is 4"
    plain = "".join(run(IncrementalDetokenizer(tok), ids))
    assert plain == "assistant\nok\n\nThe answer is 42. END here"


def _naive_stream(pieces: list[str], stops: list[str]) -> tuple[str, str | None]:
    """The output and stop string of scanning every stop string over all text seen, one token's text (piece) at a
    time: text before the earliest occurrence (first listed on a tie) once any has completed."""
    seen = ""
    for piece in pieces:
        seen += piece
        hits = [(seen.find(s), i, s) for i, s in enumerate(stops) if s and s in seen]
        if hits:
            pos, _, s = min(hits)
            return seen[:pos], s
    return seen, None


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_match_a_naive_scan_on_random_text(seed):
    """Fresh random stop lists (repeats, prefixes of each other, lengths 1-6 over a 3-letter alphabet) and random
    token streams (tokens of 1-4 characters): the indexed check (StopStrings) stops at the same place with the same
    string as scanning every stop string over all text seen after each token, and never emits text that a stop
    string later covers."""
    import random

    rng = random.Random(seed)
    merged = sorted({"".join(rng.choice("abcd") for _ in range(rng.randint(2, 4))) for _ in range(40)})
    tok = ByteTokenizer([m.encode() for m in merged])
    vocab = list("abcd") + merged
    for _ in range(200):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 12))]
        stops += [stops[0]]  # a repeat
        pieces = [rng.choice(vocab) for _ in range(rng.randint(1, 20))]
        want, want_stop = _naive_stream(pieces, stops)
        detok = IncrementalDetokenizer(tok, stop=stops)
        emitted = ""
        for piece in pieces:
            (token,) = tok.tokens(piece)
            emitted += detok.update(token)
            assert want.startswith(emitted), (stops, pieces)
            if detok.finished:
                break
        emitted += detok.flush()
        assert (emitted, detok.stop_string) == (want, want_stop), (stops, pieces)


def test_a_hundred_thousand_stop_strings_still_stop_right():
    stops = [f"{i:07d}" for i in range(100_000)] + ["STOP"]
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=stops)
    assert "".join(run(detok, tok.tokens("abc 00012 x 0099999 tail"))) == "abc 00012 x "
    assert detok.stop_string == "0099999"
    detok = IncrementalDetokenizer(tok, stop=stops)
    assert "".join(run(detok, tok.tokens("no digits; ST"))) == "no digits; ST"
    assert detok.stop_string is None
