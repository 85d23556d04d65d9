"""Structured output: xgrammar grammars enforced through the engine's per-request `TokenConstraint`.

`GrammarBackend` (one per server, built on first use: about a second for the 248k-token vocabulary) turns
the tokenizer's vocabulary into an xgrammar `TokenizerInfo` and compiles, with a cache:

- `response_format` `json_object` (any JSON object) and `json_schema` (that schema, strictly: properties
  not in the schema are refused unless it allows them);
- `tool_choice` `required` (one or more Qwen3-Coder XML tool calls, arguments matching each tool's
  parameter schema, nothing else) and a named function (exactly one call of it);
- vLLM's `structured_outputs` / `guided_*` fields: a regex, one of several strings, or an EBNF grammar.

JSON is generated compactly (`{"a": 1, "b": [2, 3]}`, no free whitespace): weak or random models otherwise
loop on whitespace. Its numbers are finite doubles (`finite_numbers`), and schema keywords xgrammar would compile
without enforcing them are refused (`UNENFORCED_KEYWORDS`). Up to two newlines may come first (the template writes `</think>\n\n` before an answer). The special tokens other than `<tool_call>` and `</tool_call>` (which the tool-call
grammar writes as those tokens, as Qwen does) are blanked in the vocabulary, so `<|im_end|>`, `<think>` and
friends never appear inside a value; the EOS ids are allowed only once the grammar is complete.

`GrammarConstraint` holds one matcher per request (a request with n choices gets n). When the prompt opens
a think block the reply starts in free reasoning: the constraint lets everything through until the model
emits `</think>`, then enforces the grammar.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

# special tokens the grammars may produce as text
KEPT_SPECIALS = ("<tool_call>", "</tool_call>")
# what may precede the constrained part: nothing, or the template's newlines after </think>
_NEWLINES = 'root ::= "" | "\\n" | "\\n\\n"'
#: compiled grammars (and refusals) kept per server, keyed by the request's schema / tools as canonical JSON: a deep
#: schema can take seconds of CPU to compile, and xgrammar's own cache misses the grammars built here (each is
#: wrapped with the leading-newline rule first)
GRAMMAR_CACHE_SIZE = 64


class StructuredOutputError(ValueError):
    """The request asks for a grammar that cannot be built (invalid or unsupported schema)."""


class GrammarBackend:
    """Compiles grammars for one tokenizer. Thread-safe; build with `GrammarBackend.create` off the event
    loop (it reads the whole vocabulary)."""

    def __init__(self, tokenizer_info: Any, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=2, cache_enabled=True,
                                            cache_limit_bytes=COMPILER_CACHE_BYTES)
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key -> compiled grammar or StructuredOutputError
        self._cache_lock = threading.Lock()
        self._newline_ids: frozenset[int] | None = None

    def _cached(self, what: str, request: Any, build: Callable[[], Any]) -> Any:
        """build() once per `what` and request (as canonical JSON; least recently used of GRAMMAR_CACHE_SIZE
        dropped); a StructuredOutputError it raises is kept and raised again for the same key. Two threads asking
        for a new key at once may both build it; a request that cannot be written as JSON is built uncached."""
        try:
            key = what + ":" + json.dumps(request, sort_keys=True)
        except (TypeError, ValueError, RecursionError):
            grammar = build()
            self._preflight(grammar, what)
            return grammar
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            try:
                hit = build()
                self._preflight(hit, what)
            except StructuredOutputError as e:
                hit = e
            with self._cache_lock:
                self._cache[key] = hit
                self._cache.move_to_end(key)
                while len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(hit, StructuredOutputError):
            raise StructuredOutputError(str(hit))
        return hit

    @classmethod
    def create(cls, tokenizer: Any, vocab_size: int | None = None) -> GrammarBackend:
        """Raises StructuredOutputError if the tokenizer cannot describe its vocabulary."""
        import xgrammar as xgr

        if not hasattr(tokenizer, "id_to_token"):
            raise StructuredOutputError("structured output needs a tokenizer with a vocabulary")
        n = tokenizer.vocab_size
        specials = getattr(tokenizer, "special_ids", frozenset())
        vocab = []
        for i in range(n):
            token = tokenizer.id_to_token(i) or ""
            vocab.append("" if i in specials and token not in KEPT_SPECIALS else token)
        stop = list(tokenizer.eos_token_ids)
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=max(vocab_size or n, n),
                                 stop_token_ids=stop)
        return cls(info, stop)

    def json_grammar(self, schema: Mapping[str, Any] | bool | None) -> Any:
        """Compiled grammar for `schema`, or for any JSON object when schema is None. Schema `true` (or `{}`)
        accepts any JSON value; `false` accepts none: StructuredOutputError, as for any schema xgrammar refuses.
        Cached per schema (`GRAMMAR_CACHE_SIZE`), refusals too."""
        return self._cached("json", schema, lambda: self._json_grammar(schema))

    def _json_grammar(self, schema: Mapping[str, Any] | bool | None) -> Any:
        if schema is False:
            raise StructuredOutputError("invalid JSON schema: `false` accepts no JSON value")
        if schema is True:
            schema = {}  # JSON Schema's `true`: xgrammar takes only objects (or their text)
        _check_patterns(schema)
        _check_properties(_check_keywords(schema, "invalid JSON schema"), "invalid JSON schema")
        xgr = self._xgr
        try:
            if schema is None:
                body = xgr.Grammar.from_json_schema({"type": "object"}, any_whitespace=False, strict_mode=False)
            else:
                body = xgr.Grammar.from_json_schema(dict(normalized_schema(schema)), any_whitespace=False)
            body = json_string_characters(xgr, finite_numbers(xgr, body))
            return self.compiler.compile_grammar(xgr.Grammar.concat(xgr.Grammar.from_ebnf(_NEWLINES), body))
        except Exception as e:  # noqa: BLE001 - xgrammar reports bad schemas as RuntimeError / ValueError
            raise StructuredOutputError(f"invalid JSON schema: {_first_line(e)}") from None

    def _preflight(self, grammar: Any, what: str) -> None:
        """Walk a matcher of a compiled grammar through up to PREFLIGHT_STEPS random allowed tokens (a fixed seed),
        timing each token mask: the engine's thread computes one per constrained token, so a grammar whose masks
        take longer than MAX_MASK_SECONDS (xgrammar's parser slows on ambiguous nested repetition: seconds a token
        for `([\\s\\S]{1,10}){1,10}`, 60 ms for `([A-Za-z]+ ?)+`) would stall every request. Raises
        StructuredOutputError for such a grammar and for one that accepts no text at all."""
        xgr = self._xgr
        matcher = xgr.GrammarMatcher(grammar)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        gen = torch.Generator().manual_seed(0)
        label = {"json": "JSON schema", "tools": "tool parameters schema", "ebnf": "grammar",
                 "grammar": "grammar"}.get(what, what)
        for step in range(PREFLIGHT_STEPS):
            if matcher.is_terminated():
                return
            t0 = time.thread_time()  # this thread's CPU time: a loaded host does not make a grammar look slow
            matcher.fill_next_token_bitmask(bitmask)
            took = time.thread_time() - t0
            if took > MAX_MASK_SECONDS:
                raise StructuredOutputError(
                    f"{label} too complex: a token mask took {took * 1e3:.0f} ms to compute (at most "
                    f"{MAX_MASK_SECONDS * 1e3:.0f}); the usual causes are a long counted repetition of a broad class "
                    f"such as .{{0,200}} (a schema's `maxLength` bounds a string at little cost) and ambiguous nested "
                    f"repetition such as (a+)+")
            allowed = torch.nonzero(_unpack(bitmask)).view(-1)
            # a JSON grammar comes after the template's newlines (_NEWLINES), and JSON text is never empty and never
            # starts with one: newlines or the end alone at the start mean a schema without values (xgrammar makes
            # `anyOf: []` the empty text)
            if allowed.numel() == 0 or (step == 0 and what == "json" and set(allowed.tolist()) <= (
                    self._newline_token_ids() | set(self.stop_token_ids))):
                if step == 0:
                    raise StructuredOutputError(f"{label} accepts no text")
                return  # a dead end after some text: GrammarConstraint ends the reply there
            token = int(allowed[torch.randint(allowed.numel(), (1,), generator=gen)])
            if token in self.stop_token_ids or not matcher.accept_token(token):
                return

    def _newline_token_ids(self) -> frozenset[int]:
        """The ids of the tokens that are only line feeds (`\\n`, `\\n\\n`, ...)."""
        if self._newline_ids is None:
            self._newline_ids = frozenset(i for i, b in enumerate(self.info.decoded_vocab) if b and not b.strip(b"\n"))
        return self._newline_ids

    def regex_grammar(self, pattern: str, newlines: bool = False) -> Any:
        """Compiled grammar for text that matches `pattern` whole (xgrammar's regex dialect, ECMAScript-like: vLLM's
        `guided_regex`), after up to two newlines when `newlines` (the template's after `</think>`). Cached.
        Raises StructuredOutputError for a pattern xgrammar refuses or one too complex (_check_pattern)."""
        def build() -> Any:
            _check_pattern(pattern, "regex")
            return self._compile(lambda: self._xgr.Grammar.from_regex(pattern), newlines, "invalid regex")

        return self._cached("regex", [pattern, newlines], build)

    def choice_grammar(self, choices: Sequence[str], newlines: bool = False) -> Any:
        """Compiled grammar for exactly one of `choices` (vLLM's `guided_choice`), after up to two newlines when
        `newlines`. Cached. Raises StructuredOutputError for an empty list or one over MAX_CHOICE_CHARS."""
        def build() -> Any:
            if not choices:
                raise StructuredOutputError("choice needs at least one string")
            if any("\0" in c for c in choices):
                raise StructuredOutputError("choice strings must not contain null characters")
            if sum(len(c) for c in choices) > MAX_CHOICE_CHARS:
                raise StructuredOutputError(f"choice too large (at most {MAX_CHOICE_CHARS} characters in all: the "
                                            f"grammar's build time grows with the square of its size)")
            ebnf = "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)
            return self._compile(lambda: self._xgr.Grammar.from_ebnf(ebnf), newlines, "invalid choice")

        return self._cached("choice", [list(choices), newlines], build)

    def ebnf_grammar(self, grammar: str, newlines: bool = False) -> Any:
        """Compiled grammar for text that `grammar` (xgrammar's EBNF / GBNF, start rule `root`: vLLM's
        `guided_grammar`) derives, after up to two newlines when `newlines`. Cached. Raises StructuredOutputError
        for a grammar xgrammar refuses or one too complex (_check_pattern)."""
        def build() -> Any:
            _check_pattern(grammar, "grammar", ebnf=True)
            return self._compile(lambda: self._xgr.Grammar.from_ebnf(grammar), newlines, "invalid grammar")

        return self._cached("ebnf", [grammar, newlines], build)

    def _compile(self, make: Callable[[], Any], newlines: bool, what: str) -> Any:
        xgr = self._xgr
        try:
            body = make()
            if newlines:  # probe the constraint itself too: the newlines would pass "accepts no text"
                self._preflight(self.compiler.compile_grammar(body), what.split()[-1])
                body = xgr.Grammar.concat(xgr.Grammar.from_ebnf(_NEWLINES), body)
            return self.compiler.compile_grammar(body)
        except StructuredOutputError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar reports bad input as RuntimeError / ValueError
            raise StructuredOutputError(f"{what}: {_first_line(e)}") from None

    def tool_call_grammar(self, tools: Sequence[Mapping[str, Any]], name: str | None, parallel: bool) -> Any:
        """Compiled grammar for Qwen3-Coder XML tool calls: exactly one call of `name`, or (name None) one or
        more calls of any of `tools` (just one unless parallel). Cached per (tools, name, parallel)."""
        return self._cached("tools", [list(tools), name, parallel], lambda: self._tool_call_grammar(tools, name, parallel))

    def _tool_call_grammar(self, tools: Sequence[Mapping[str, Any]], name: str | None, parallel: bool) -> Any:
        from xgrammar.structural_tag import (
            JSONSchemaFormat,
            RegexFormat,
            SequenceFormat,
            StructuralTag,
            TagFormat,
            TagsWithSeparatorFormat,
        )

        def tag(fn: Mapping[str, Any]) -> Any:
            params = fn.get("parameters")
            schema = True if params is None or fn.get("strict") is False else normalized_schema(params)
            return TagFormat(
                begin=f"<tool_call>\n<function={fn['name']}>\n",
                content=JSONSchemaFormat(json_schema=schema, style="qwen_xml", max_whitespace_cnt=1),
                end="\n</function>\n</tool_call>",
            )

        functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
        checked = [f for f in functions if f.get("strict") is not False]  # strict false: any arguments (tag)
        _check_patterns([f.get("parameters") for f in checked])
        listed = sum(_check_keywords(f.get("parameters"), f"invalid tool parameters schema of {f['name']!r}")
                     for f in checked)
        _check_properties(listed, "invalid tool parameters schema")
        try:
            if name is not None:
                fmt = tag(functions[0])
            else:
                fmt = TagsWithSeparatorFormat(tags=[tag(f) for f in functions], separator="\n", at_least_one=True,
                                              stop_after_first=not parallel)
            fmt = SequenceFormat(elements=[RegexFormat(pattern=r"\n{0,2}"), fmt])
            grammar = finite_numbers(self._xgr, self._xgr.Grammar.from_structural_tag(StructuralTag(format=fmt)))
            grammar = line_feed_whitespace(self._xgr, grammar)
            return self.compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001
            raise StructuredOutputError(f"invalid tool parameters schema: {_first_line(e)}") from None

    def constraint(self, grammar: Any, gate_token_id: int | None = None) -> GrammarConstraint:
        return GrammarConstraint(self, grammar, gate_token_id)


class GrammarConstraint:
    """A `vibeqwen.sampling.TokenConstraint` over one xgrammar matcher.

    gate_token_id: when set (thinking on), tokens pass unconstrained until this token (`</think>`) is
    accepted; the grammar applies from the next token on.
    """

    def __init__(self, backend: GrammarBackend, grammar: Any, gate_token_id: int | None = None) -> None:
        xgr = backend._xgr
        self._backend = backend
        self._matcher = xgr.GrammarMatcher(grammar)
        self._bitmask = xgr.allocate_token_bitmask(1, backend.vocab_size)
        self._gate = gate_token_id
        self._broken = False
        self._dead = False  # at a dead end: only the stop tokens from here on

    @property
    def active(self) -> bool:
        return self._gate is None and not self._broken

    @property
    def gate_token_id(self) -> int | None:
        """The gate still ahead (the token after which the grammar applies), or None: none, or passed."""
        return self._gate

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        if not self.active:
            return None
        if not self._dead and not self._matcher.is_terminated():
            t0 = time.thread_time()
            self._matcher.fill_next_token_bitmask(self._bitmask)
            took = time.thread_time() - t0
            bits = _unpack(self._bitmask)
            if took <= RUNTIME_MASK_SECONDS and bool(bits.any()):
                n = bits.numel()
                return bits[:vocab_size] if vocab_size <= n else torch.cat(
                    [bits, torch.zeros(vocab_size - n, dtype=torch.bool)])
            # a mask grown slow on this reply's path (the compile-time checks are heuristics), or a dead end
            # (`(abc|x[^\s\S])` after "x"): end the reply, valid so far, rather than hold the engine's thread once
            # per token or leave the grammar
            log.warning("structured output: %s; ending the reply", f"a token mask took {took * 1e3:.0f} ms"
                        if took > RUNTIME_MASK_SECONDS else "the grammar allows no next token")
            self._dead = True
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[[t for t in self._backend.stop_token_ids if t < vocab_size]] = True
        return mask

    def accept(self, token_id: int) -> None:
        if self._gate is not None:
            if token_id == self._gate:
                self._gate = None
            return
        if self._broken or self._dead or self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(token_id):
            # Cannot happen under the mask; stop constraining rather than fail the request.
            log.warning("structured output: token %d rejected by the grammar; constraint dropped", token_id)
            self._broken = True


_SHIFTS = torch.arange(32, dtype=torch.int32)


def _unpack(bitmask: torch.Tensor) -> torch.Tensor:
    """An xgrammar token bitmask int32 [1, V/32] as bool [V]: bit j of word i allows token 32 i + j."""
    return ((bitmask.view(-1, 1) >> _SHIFTS) & 1).bool().view(-1)


_lock = threading.Lock()
_backends: dict[tuple[int, int | None], tuple[Any, GrammarBackend]] = {}


def get_backend(tokenizer: Any, vocab_size: int | None) -> GrammarBackend:
    """The backend for this tokenizer, built on first use and shared by every app in the process."""
    key = (id(tokenizer), vocab_size)
    with _lock:
        hit = _backends.get(key)
        if hit is None or hit[0] is not tokenizer:
            hit = _backends[key] = (tokenizer, GrammarBackend.create(tokenizer, vocab_size))
        return hit[1]


_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
MAX_PATTERN_REPEAT = 1000
#: the largest product of variable counted repetitions nested in one another (`(a{1,8}){1,8}`: 64)
MAX_NESTED_REPEAT = 64
#: what `*` / `+` over a variable count multiplies it by in that product (`(\d{1,3}\.)+`: 48, allowed)
LOOP_REPEAT = 16
MAX_PATTERN_CHARS = 10_000
#: a choice list's characters in all (its grammar builds in ~0.3 s at 32k on the 248k vocabulary, ~15 s at 300k)
MAX_CHOICE_CHARS = 32_768
#: the longest a grammar's token mask may take in the preflight walk (GrammarBackend._preflight), and its steps
MAX_MASK_SECONDS = 0.05
PREFLIGHT_STEPS = 16
#: a token mask slower than this while decoding ends the reply (GrammarConstraint.allowed)
RUNTIME_MASK_SECONDS = 0.25
#: xgrammar's own compiled-grammar cache (unbounded by default: ~110 MB per large choice grammar was never freed)
COMPILER_CACHE_BYTES = 256 << 20


def _check_pattern(text: str, what: str, ebnf: bool = False) -> None:
    """Refuse a regex or grammar whose automaton would take seconds to minutes to build or match: text over
    MAX_PATTERN_CHARS, a repetition count above MAX_PATTERN_REPEAT (`(a|b){1000,5000}`: ~20 s), or counted
    repetition of a variable count inside another whose counts multiply past MAX_NESTED_REPEAT
    (`([\\s\\S]{1,10}){1,10}`: seconds a token). Counts are read from the structure (_repetitions), not from
    every `{n}` in the text: escapes such as `\\x{2000}`, classes and grammar string literals hold none."""
    if len(text) > MAX_PATTERN_CHARS:
        raise StructuredOutputError(f"{what} too complex (at most {MAX_PATTERN_CHARS} characters)")
    top, nested = _repetitions(text, ebnf)
    if top > MAX_PATTERN_REPEAT:
        raise StructuredOutputError(f"{what} too complex (repetition counts up to {MAX_PATTERN_REPEAT}, got {top})")
    if nested > MAX_NESTED_REPEAT:
        raise StructuredOutputError(
            f"{what} too complex: counted repetition of a variable count nested in another ({nested} combinations; at "
            f"most {MAX_NESTED_REPEAT}) makes every token's mask take seconds")


_RULE = re.compile(r"(?m)^[ \t]*([A-Za-z_][\w.\-]*)[ \t]*::=")
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


def _repetitions(text: str, ebnf: bool) -> tuple[int, int]:
    """(largest repetition count, largest product of variable counted repetitions nested in one another) of a
    regex (ebnf False) or an EBNF grammar (string literals and comments skipped, rule references followed: a rule
    counts as the product inside it). A variable count is `{m,n}` with m < n (n, or m for `{m,}`, counts); `*` and
    `+` over something that holds a variable count multiply it by LOOP_REPEAT (`([\\s\\S]{1,10})+` is as slow as
    nested counts); over anything else they are plain loops, not counted."""
    if not ebnf:
        return _scan_full(text, False, lambda name: 1)[:2]
    heads = list(_RULE.finditer(text))
    bodies = {m.group(1): text[m.end():(heads[k + 1].start() if k + 1 < len(heads) else len(text))]
              for k, m in enumerate(heads)}
    memo: dict[str, tuple[int, int, int]] = {}
    visiting: set[str] = set()

    def rule(name: str) -> tuple[int, int, int]:
        if name in memo:
            return memo[name]
        if name in visiting or name not in bodies:
            return 0, 0, 1  # recursion is a loop; an unknown name is xgrammar's error to report
        visiting.add(name)
        memo[name] = _scan_full(bodies[name], True, lambda ref: rule(ref)[2])
        visiting.discard(name)
        return memo[name]

    largest, nested = 0, 0
    for name in bodies:
        lg, ns, _ = rule(name)
        largest, nested = max(largest, lg), max(nested, ns)
    return largest, nested


def _count(digits: str) -> int:
    return int(digits) if len(digits) <= 7 else 10**7  # int() of a 5000-digit count raises ValueError


def _scan_full(text: str, ebnf: bool, ref: Callable[[str], int]) -> tuple[int, int, int]:
    """_repetitions of one regex or rule body, and the largest product inside it (ref(name): a rule's)."""
    largest, nested = 0, 0
    stack = [1]  # per open group: the largest variable-count product inside it so far
    last = 1  # the product of the item just closed (a group's inner product, a rule's, 1 for an atom)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if ebnf and c in " \t\r\n":  # xgrammar takes `( ... ) {1,10}`: spaces do not end an item
            i += 1
            continue
        if c not in "(){*+":  # an item starts: the previous one is done
            stack[-1] = max(stack[-1], last)
            last = 1
        if c == "\\":
            i += 2
            if i <= n and text[i - 1] == "u" and i < n and text[i] == "{":
                i = text.find("}", i) + 1 or n  # \u{1F600}: a code point, no count (xgrammar reads \x{3} as x{3})
            last = 1
            continue
        if c == "[":
            j = i + 1
            if j < n and text[j] == "^":
                j += 1
            if j < n and text[j] == "]":
                j += 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i, last = j + 1, 1
            continue
        if ebnf and c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i, last = j + 1, 1
            continue
        if ebnf and c == "#":  # a comment to the end of the line
            j = text.find("\n", i)
            i, last = (n if j < 0 else j), 1
            continue
        if ebnf and (m := _NAME.match(text, i)):
            last = ref(m.group())
            i = m.end()
            continue
        if c == "(":
            stack[-1] = max(stack[-1], last)
            stack.append(1)
            last = 1
            i += 1
            continue
        if c == ")":
            stack[-1] = max(stack[-1], last)
            last = stack.pop() if len(stack) > 1 else 1
            i += 1
            continue
        if c in "*+" and last > 1:  # a loop over something that holds a variable count
            last *= LOOP_REPEAT
            nested = max(nested, last)
            i += 1
            continue
        if c == "{":
            m = _REPEAT.match(text, i)
            if m:
                lo, hi = _count(m.group(1)), m.group(2)
                count = lo if hi is None or hi == "" else _count(hi)
                largest = max(largest, lo, count)
                if hi is not None and (hi == "" or count > lo):  # a variable count
                    if last > 1:  # nested in another variable count
                        nested = max(nested, last * max(count, 1))
                    last = last * max(count, 1)
                i = m.end()
                continue
        i += 1  # a plain character (already counted as an item above)
    stack[0] = max(stack[0], last)
    return largest, nested, max(stack)


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal: quotes, backslashes and control characters as \\uXXXX escapes."""
    return '"' + "".join(f"\\u{ord(c):04x}" if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F else c
                         for c in text) + '"'


# JSON numbers as xgrammar 0.2 writes their rules, each a whole line (so no string literal of a schema can match; rule
# names take `$defs` keys' `-` and `.`): an exponent of any length, and an integer part of any length, `[1-9] [0-9]*`
# (no bounds) or `[1-9] | [1-9] digit{1, -1}` (one bound, which also limits the fraction to 6 digits, no exponent)
_RULE_NAME = r"[\w.\-]+"
_NUMBER_EXPONENT = re.compile(rf'^({_RULE_NAME}) ::= \(\"\" \| \(\[eE\] ({_RULE_NAME}) ({_RULE_NAME})\{{1, -1\}}\)\)$', re.MULTILINE)
_NUMBER_INTEGER_PART = re.compile(rf'^({_RULE_NAME}) ::= \(\("0"\) \| \(\[1-9\] \[0-9\]\*\)\)$', re.MULTILINE)
_BOUNDED_INTEGER_PART = re.compile(rf'^({_RULE_NAME}) ::= \(\(\[1-9\]\) \| \(\[1-9\] ({_RULE_NAME})\{{1, -1\}}\)\)$', re.MULTILINE)
# a JSON string with a length bound (minLength / maxLength), as xgrammar 0.2 writes its characters' rule: any
# character but `"`, `\` and line breaks, so raw control characters (a tab, U+0000-U+001F) too
_BOUNDED_STRING_CHARACTERS = re.compile(rf'^({_RULE_NAME}) ::= ' + re.escape('(([^\\"\\\\\\r\\n]))') + '$',
                                        re.MULTILINE)
#: Bounds on the JSON numbers a grammar lets the model write: at most this many integer digits and exponent digits,
#: so every number is a finite double (< 10^(200 + 99)). xgrammar's own allow any length: a model wrote `1E2432`,
#: which Python and JavaScript read as infinity and strict JSON parsers refuse.
MAX_INTEGER_DIGITS, MAX_EXPONENT_DIGITS = 200, 2


def finite_numbers(xgr: Any, grammar: Any) -> Any:
    """`grammar` (an xgrammar Grammar built from a JSON schema or a structural tag) with its JSON number rules
    bounded: at most MAX_INTEGER_DIGITS before the point (`type: integer` with a bound too, as xgrammar writes it
    with a number's rule) and MAX_EXPONENT_DIGITS in the exponent. An unbounded `type: integer` keeps any length
    (exact in Python), as do numbers with both bounds (xgrammar writes them digit by digit)."""
    text = str(grammar)
    text, n_exp = _NUMBER_EXPONENT.subn(rf'\1 ::= ("" | ([eE] \2 \3{{1, {MAX_EXPONENT_DIGITS}}}))', text)
    text, n_int = _NUMBER_INTEGER_PART.subn(rf'\1 ::= (("0") | ([1-9] [0-9]{{0, {MAX_INTEGER_DIGITS - 1}}}))', text)
    text, n_one = _BOUNDED_INTEGER_PART.subn(rf'\1 ::= (([1-9]) | ([1-9] \2{{1, {MAX_INTEGER_DIGITS - 1}}}))', text)
    return xgr.Grammar.from_ebnf(text) if n_exp or n_int or n_one else grammar


def json_string_characters(xgr: Any, grammar: Any) -> Any:
    """`grammar` (an xgrammar Grammar built from a JSON schema) with the characters of its length-bounded strings
    (`minLength` / `maxLength`) kept to those JSON takes raw: xgrammar's rule for them refuses only `"`, `\\` and line
    breaks, so a model wrote a raw tab into a `maxLength` string, which `json.loads` refuses (RFC 8259: control
    characters U+0000-U+001F must be escaped). Now none of U+0000-U+001F; escapes stay out as before (the bound counts
    characters). A grammar without such strings comes back as it is."""
    text, n = _BOUNDED_STRING_CHARACTERS.subn(r'\1 ::= (([^\\0-\\x1f\\"\\\\]))', str(grammar))
    return xgr.Grammar.from_ebnf(text) if n else grammar


def line_feed_whitespace(xgr: Any, grammar: Any) -> Any:
    """`grammar` (a structural tag's xgrammar Grammar in the `qwen_xml` style) with the free whitespace at the edges
    of each parameter value narrowed to a line feed: the rules right after a `<parameter=NAME>` opening and right
    before `</parameter>` whose whole body is one optional whitespace character (xgrammar writes
    `("" | ([ \\n\\r\\t]))` under `max_whitespace_cnt=1`). Why: the tool-call parser (`parsers.py`) takes off one
    line feed at each end of a value, which is how the chat template writes them
    (`<parameter=p>\\nVALUE\\n</parameter>`); a space, tab or carriage return there stayed in the value and broke its
    schema (a forced call gave `"p": "cb\\r"` against `^[a-c]{2}$`). Every other rule stays as it is: the values'
    own rules (a pattern's whitespace classes), the JSON whitespace inside object and array values (the parser reads
    those with json.loads, and the template writes them with spaces), the whitespace between parameters. A grammar
    without such edge rules comes back as it is."""
    text = str(grammar)
    edges = set(_VALUE_OPENING.findall(text)) | set(_VALUE_CLOSING.findall(text))
    changed = 0

    def narrow(m: re.Match) -> str:
        nonlocal changed
        if m.group(1) not in edges or "\\n" not in m.group(2):
            return m.group(0)
        changed += 1
        return f'{m.group(1)} ::= ("" | ("\\n"))'

    text = _OPTIONAL_WHITESPACE_RULE.sub(narrow, text)
    return xgr.Grammar.from_ebnf(text) if changed else grammar


# a parameter's opening (`"<parameter=p" ">"` for a schema's property, its name escaped; `"<parameter=" NAME_RULE ">"`
# for any name or a patternProperties / propertyNames key) followed by a rule, and a rule followed by the closing tag
_VALUE_OPENING = re.compile(rf'"<parameter=(?:[^"\\]|\\.)*"(?: {_RULE_NAME})? ">" ({_RULE_NAME})')
_VALUE_CLOSING = re.compile(rf'({_RULE_NAME}) "</parameter>"')
# a rule whose whole body is one optional character of a whitespace-only class (spaces and \n, \r, \t escapes)
_OPTIONAL_WHITESPACE_RULE = re.compile(rf'^({_RULE_NAME}) ::= \(""\s*\|\s*\(\[((?: |\\[nrt])+)\]\)\)$',
                                       re.MULTILINE)


#: JSON Schema keywords xgrammar 0.2 compiles but does not enforce (it would let the model write JSON that breaks
#: them): refused, as vLLM's xgrammar backend refuses what it cannot enforce. `oneOf` is served as `anyOf`, and
#: `uniqueItems` is served unenforced (pydantic writes it for `set` fields, whose duplicates collapse when parsed).
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "contains", "dependentRequired", "dependentSchemas",
                       "dependencies")
# where a schema holds other schemas: name -> schema maps, one schema, lists of schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "propertyNames", "contains", "not", "if", "then", "else",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def _unallowed_required(node: Mapping[str, Any]) -> str | None:
    """The first name in an object schema's `required` that its `properties` lack while `additionalProperties` is
    false and no `patternProperties` are given (patterns are left to the grammar engine), else None."""
    required, props = node.get("required"), node.get("properties", {})
    if (node.get("additionalProperties") is not False or node.get("patternProperties")
            or not isinstance(required, list) or not isinstance(props, Mapping)):
        return None
    return next((name for name in required if isinstance(name, str) and name not in props), None)


def _check_keywords(schema: Any, what: str) -> int:
    """Refuse (StructuredOutputError, naming the keyword and where it is) a schema that uses one of
    UNENFORCED_KEYWORDS, an `allOf` of more than one schema (xgrammar 0.2 keeps only
    one), an empty `allOf` / `anyOf` / `oneOf` / `enum`, an `enum` longer than MAX_CHOICE_CHARS as JSON (a
    `choice` list's limit), a `$ref` outside the schema (xgrammar would leave it unconstrained), an object that
    requires a property its `properties` lack while `additionalProperties` is false (no JSON value matches), a
    `type` that is neither a type name nor a non-empty list of them, a length or count bound (`maxLength`,
    `minItems`, ...) that is not a non-negative integer (xgrammar would leave either unconstrained), or an object
    listing more than MAX_OBJECT_PROPERTIES `properties`. Keyword-aware: a property named "not" is a name, not the
    keyword; a local `$ref`'s target is checked too wherever it sits (xgrammar follows any JSON pointer), each
    schema once. Returns the number of properties the schema's objects list in all (_check_properties)."""
    listed = 0
    seen: set[int] = set()  # ids of the schema nodes checked (a node reached by keyword and by `$ref` counts once)
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, Mapping) or id(node) in seen:
            continue
        seen.add(id(node))
        at = f" at {where}" if where else ""  # where the node sits, for the messages
        target = _local_ref(schema, node.get("$ref"))
        if target is not None:
            stack.append((target, node["$ref"][1:] or "/"))
        kind = node.get("type")
        if "type" in node and not (kind in JSON_TYPES or (isinstance(kind, list) and kind
                                                          and all(k in JSON_TYPES for k in kind))):
            raise StructuredOutputError(f"{what}: `type`{at} must be one of {', '.join(JSON_TYPES)} or a non-empty "
                                        f"list of them, got {json.dumps(kind)[:80]}")
        for key in _COUNT_BOUNDS:
            v = node.get(key)
            whole = (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
            if key in node and not (whole and v >= 0):
                raise StructuredOutputError(f"{what}: `{key}`{at} must be a non-negative integer, got "
                                            f"{json.dumps(v)[:80]}")
        props = node.get("properties")
        if isinstance(props, Mapping):
            if len(props) > MAX_OBJECT_PROPERTIES:
                raise StructuredOutputError(f"{what}: the object{at} lists {len(props)} properties, at most "
                                            f"{MAX_OBJECT_PROPERTIES} (the grammar's build time grows faster than "
                                            f"their number)")
            listed += len(props)
        for key in UNENFORCED_KEYWORDS:
            if key in node:
                raise StructuredOutputError(f"{what}: `{key}`{at} is not supported "
                                            f"(the grammar engine cannot enforce it)")
        for key in ("allOf", "anyOf", "oneOf", "enum"):
            if node.get(key) == []:  # JSON Schema asks for at least one (xgrammar would write an empty value)
                raise StructuredOutputError(f"{what}: `{key}`{at} is empty: no JSON "
                                            f"value can match it")
        if isinstance(node.get("enum"), list):
            size = sum(len(json.dumps(value)) for value in node["enum"])
            if size > MAX_CHOICE_CHARS:
                raise StructuredOutputError(f"{what}: `enum`{at} too large ({size} "
                                            f"characters as JSON, at most {MAX_CHOICE_CHARS}: the grammar's build "
                                            f"time grows with the square of its size)")
        integer = node.get("type") == "integer" or (isinstance(node.get("type"), list) and "integer" in node["type"])
        for key in _NUMERIC_BOUNDS:
            v = node.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not _bound_ok(v, integer):
                shown = repr(v) if len(repr(v)) <= 40 else f"a number of {len(str(abs(v)))} digits"
                raise StructuredOutputError(f"{what}: `{key}`{at} is out of the grammar "
                                            f"engine's range ({shown}): an integer's bounds must lie within int64, "
                                            f"a number's be finite")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise StructuredOutputError(f"{what}: `allOf` of several schemas{at} is not "
                                        f"supported (the grammar engine keeps only one); merge them into one schema")
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise StructuredOutputError(f"{what}: `$ref` {ref[:80]!r}{at} points outside "
                                        f"the schema; only local references (`#/...`) can be resolved")
        missing = _unallowed_required(node)
        if missing is not None:
            raise StructuredOutputError(f"{what}: required property {missing[:80]!r}{at} "
                                        f"is not in `properties` and `additionalProperties` is false: no JSON value "
                                        f"can match it")
        _map_subschemas(node, lambda sub, path, where=where: stack.append((sub, f"{where}/{path}")))
    return listed


def _map_subschemas(node: Mapping[str, Any], fn: Callable[[Any, str], Any]) -> dict[str, Any]:
    """{keyword: its value with each schema in it replaced by fn(schema, path)} for the keywords of schema `node`
    that hold schemas (_SCHEMA_MAPS: name -> schema, _SCHEMA_ONE: one schema, _SCHEMA_LISTS: lists of schemas; an
    `items` list takes the list form). path: "properties/name", "items", "anyOf/0". The one place that knows where
    schemas nest, for the walks that must tell a schema from a property name or an `enum` value."""
    out: dict[str, Any] = {}
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), Mapping):
            out[key] = {name: fn(sub, f"{key}/{name}") for name, sub in node[key].items()}
    for key in _SCHEMA_ONE:
        if key in node:
            out[key] = fn(node[key], key)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [fn(sub, f"{key}/{i}") for i, sub in enumerate(node[key])]
    return out


def _local_ref(root: Any, ref: Any) -> Any:
    """The node a local `$ref` ("#", "#/$defs/a", "#/x/0": a JSON pointer, RFC 6901, after "#") points to in
    `root`, or None (not a local ref, or nothing there: xgrammar reports that)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref[1:] else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


#: JSON Schema's type names
JSON_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")
#: bounds that must be non-negative integers (JSON Schema 2020-12, validation vocabulary)
_COUNT_BOUNDS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties")
#: the most properties one object schema may list, and a request's schemas in all (a response format's, or all its
#: tools' parameters). xgrammar's build time grows faster than an object's optional properties (on 2 CPU cores:
#: 1000 in ~0.5 s, 2000 in ~4 s, 6000 in ~2 min) and cannot be interrupted, so a larger schema would hold a core
#: long after its client left; 10 objects of 500 took ~4 s.
MAX_OBJECT_PROPERTIES = 1000
MAX_SCHEMA_PROPERTIES = 4000


def _check_properties(listed: int, what: str) -> None:
    """Refuse a request whose schemas list more than MAX_SCHEMA_PROPERTIES properties in all (_check_keywords'
    counts)."""
    if listed > MAX_SCHEMA_PROPERTIES:
        raise StructuredOutputError(f"{what}: its objects list {listed} properties in all, at most "
                                    f"{MAX_SCHEMA_PROPERTIES} (the grammar's build time grows faster than their "
                                    f"number)")


def normalized_schema(schema: Any) -> Any:
    """`schema` as xgrammar takes it, matching the same JSON values, where JSON Schema allows what xgrammar refuses:
    the fractional bounds of integer-typed nodes (`"type": "integer"`, or a list of types with "integer" and without
    "number") made whole -- `minimum` 0.5 -> 1 (ceil), `maximum` 1.5 -> 1 (floor), `exclusiveMinimum` 0.5 ->
    `minimum` 1, `exclusiveMaximum` 1.5 -> `maximum` 1 (the stricter of a bound and its exclusive form kept) -- and
    length / count bounds written as whole floats (`"maxLength": 5.0`) made ints. Returns a copy of the schema nodes
    (`enum` / `const` values shared); the caller's schema is never modified.

    Raises:
        RecursionError: a schema nested deeper than Python's recursion limit (the grammar builders, which call this
            inside their try, report it as an invalid schema).
    """
    def integer_only(node: Mapping[str, Any]) -> bool:
        kind = node.get("type")
        return kind == "integer" or (isinstance(kind, list) and "integer" in kind and "number" not in kind)

    def fractional(v: Any) -> bool:
        return isinstance(v, float) and v == v and v not in (float("inf"), float("-inf")) and not v.is_integer()

    def fix(node: Any) -> Any:  # keyword-aware: schemas only, never `enum` / `const` values or property names
        if not isinstance(node, Mapping):
            return node
        items = {**node, **_map_subschemas(node, lambda sub, path: fix(sub))}
        for key in _COUNT_BOUNDS:
            if isinstance(node.get(key), float) and node[key].is_integer():
                items[key] = int(node[key])
        numbers = all(isinstance(node[k], (int, float)) and not isinstance(node[k], bool)
                      for k in _NUMERIC_BOUNDS if k in node)  # else xgrammar refuses the node, as it is
        if integer_only(node) and numbers and any(fractional(node.get(k)) for k in _NUMERIC_BOUNDS):
            for keys, whole, pick in ((("minimum", "exclusiveMinimum"), math.ceil, max),
                                      (("maximum", "exclusiveMaximum"), math.floor, min)):
                made = [whole(items.pop(k)) for k in keys if fractional(items.get(k))]
                if made:  # the inclusive bound that admits the same integers, the stricter of any two
                    have = items.get(keys[0])
                    if isinstance(have, (int, float)) and not isinstance(have, bool):
                        made.append(have)
                    items[keys[0]] = pick(made)
        return items

    return fix(schema)


#: the numeric bounds of a schema node (xgrammar fails on an integer's outside int64 and on a number's past float64)
_NUMERIC_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _bound_ok(v: int | float, integer: bool) -> bool:
    """Whether xgrammar can take bound `v`: finite as a float64, and an integer's within int64 (a float one strictly
    inside +-2^63: xgrammar refuses both ends as doubles). Whole-number and empty-range checks are xgrammar's own
    (its messages say so)."""
    try:
        f = float(v)
    except OverflowError:
        return False
    if f != f or f in (float("inf"), float("-inf")):
        return False
    if not integer:
        return True
    return -(2**63) <= v <= 2**63 - 1 if isinstance(v, int) else -(2.0**63) < v < 2.0**63


def _check_patterns(schema: Any) -> None:
    """Refuse a schema whose regex `pattern`s _check_pattern refuses."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                _check_pattern(pattern, "invalid JSON schema: pattern")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _first_line(e: Exception) -> str:
    """The first line of a grammar builder's error, as a client may read it (a schema too deep for the schema walks
    or the builders: in words instead of Python's or pydantic's)."""
    # pydantic's "Maximum serialization depth exceeded" comes from xgrammar's structural tags (tool schemas)
    if isinstance(e, RecursionError) or "Maximum serialization depth exceeded" in str(e):
        return "nested too deeply to compile"
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    # xgrammar prefixes "[time] /path/file.cc:line: "
    if "] " in text and ".cc:" in text:
        text = text.split(": ", 1)[-1]
    return text[:500]
