"""Structured output: xgrammar grammars enforced through the engine's per-request `TokenConstraint`.

`GrammarBackend` (one per server, built on first use: about a second for the 248k-token vocabulary) turns
the tokenizer's vocabulary into an xgrammar `TokenizerInfo` and compiles, with a cache:

- `response_format` `json_object` (any JSON object) and `json_schema` (that schema, strictly: properties
  not in the schema are refused unless it allows them);
- `tool_choice` `required` (one or more Qwen3-Coder XML tool calls, arguments matching each tool's
  parameter schema, nothing else) and a named function (exactly one call of it);
- vLLM's `structured_outputs` / `guided_*` fields: a regex, one of several strings, or an EBNF grammar.

JSON is generated compactly (`{"a": 1, "b": [2, 3]}`, no free whitespace): weak or random models otherwise
loop on whitespace. Up to two newlines may come first (the template writes `</think>\n\n` before an answer). The special tokens other than `<tool_call>` and `</tool_call>` (which the tool-call
grammar writes as those tokens, as Qwen does) are blanked in the vocabulary, so `<|im_end|>`, `<think>` and
friends never appear inside a value; the EOS ids are allowed only once the grammar is complete.

`GrammarConstraint` holds one matcher per request (a request with n choices gets n). When the prompt opens
a think block the reply starts in free reasoning: the constraint lets everything through until the model
emits `</think>`, then enforces the grammar.
"""

from __future__ import annotations

import json
import logging
import re
import threading
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
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=2, cache_enabled=True)
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key -> compiled grammar or StructuredOutputError
        self._cache_lock = threading.Lock()

    def _cached(self, what: str, request: Any, build: Callable[[], Any]) -> Any:
        """build() once per `what` and request (as canonical JSON; least recently used of GRAMMAR_CACHE_SIZE
        dropped); a StructuredOutputError it raises is kept and raised again for the same key. Two threads asking
        for a new key at once may both build it; a request that cannot be written as JSON is built uncached."""
        try:
            key = what + ":" + json.dumps(request, sort_keys=True)
        except (TypeError, ValueError, RecursionError):
            return build()
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            try:
                hit = build()
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
        xgr = self._xgr
        try:
            if schema is None:
                body = xgr.Grammar.from_json_schema({"type": "object"}, any_whitespace=False, strict_mode=False)
            else:
                body = xgr.Grammar.from_json_schema(dict(schema), any_whitespace=False)
            return self.compiler.compile_grammar(xgr.Grammar.concat(xgr.Grammar.from_ebnf(_NEWLINES), body))
        except Exception as e:  # noqa: BLE001 - xgrammar reports bad schemas as RuntimeError / ValueError
            raise StructuredOutputError(f"invalid JSON schema: {_first_line(e)}") from None

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
            _check_pattern(grammar, "grammar")
            return self._compile(lambda: self._xgr.Grammar.from_ebnf(grammar), newlines, "invalid grammar")

        return self._cached("ebnf", [grammar, newlines], build)

    def _compile(self, make: Callable[[], Any], newlines: bool, what: str) -> Any:
        xgr = self._xgr
        try:
            body = make()
            if newlines:
                body = xgr.Grammar.concat(xgr.Grammar.from_ebnf(_NEWLINES), body)
            return self.compiler.compile_grammar(body)
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
            schema = True if params is None or fn.get("strict") is False else params
            return TagFormat(
                begin=f"<tool_call>\n<function={fn['name']}>\n",
                content=JSONSchemaFormat(json_schema=schema, style="qwen_xml", max_whitespace_cnt=1),
                end="\n</function>\n</tool_call>",
            )

        functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
        _check_patterns([f.get("parameters") for f in functions])
        try:
            if name is not None:
                fmt = tag(functions[0])
            else:
                fmt = TagsWithSeparatorFormat(tags=[tag(f) for f in functions], separator="\n", at_least_one=True,
                                              stop_after_first=not parallel)
            fmt = SequenceFormat(elements=[RegexFormat(pattern=r"\n{0,2}"), fmt])
            return self.compiler.compile_structural_tag(StructuralTag(format=fmt))
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
        self._shifts = torch.arange(32, dtype=torch.int32)

    @property
    def active(self) -> bool:
        return self._gate is None and not self._broken

    def allowed(self, vocab_size: int) -> torch.Tensor | None:
        if not self.active:
            return None
        if self._matcher.is_terminated():
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[[t for t in self._backend.stop_token_ids if t < vocab_size]] = True
            return mask
        self._matcher.fill_next_token_bitmask(self._bitmask)
        # [1, V/32] int32 -> [V] bool: bit j of word i allows token 32 i + j
        bits = ((self._bitmask.view(-1, 1) >> self._shifts) & 1).bool().view(-1)
        n = bits.numel()
        if vocab_size <= n:
            return bits[:vocab_size]
        return torch.cat([bits, torch.zeros(vocab_size - n, dtype=torch.bool)])

    def accept(self, token_id: int) -> None:
        if self._gate is not None:
            if token_id == self._gate:
                self._gate = None
            return
        if self._broken or self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(token_id):
            # Cannot happen under the mask; stop constraining rather than fail the request.
            log.warning("structured output: token %d rejected by the grammar; constraint dropped", token_id)
            self._broken = True


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
MAX_PATTERN_CHARS = 10_000
#: a choice list's characters in all (its grammar builds in ~0.3 s at 32k on the 248k vocabulary, ~15 s at 300k)
MAX_CHOICE_CHARS = 32_768


def _check_pattern(text: str, what: str) -> None:
    """Refuse a regex or grammar whose automaton would take seconds to minutes to build: bounded repetition above
    MAX_PATTERN_REPEAT, or text over MAX_PATTERN_CHARS (as _check_patterns does for a schema's patterns)."""
    bounds = [int(b) for m in _REPEAT.finditer(text) for b in m.groups() if b]
    if len(text) > MAX_PATTERN_CHARS or any(b > MAX_PATTERN_REPEAT for b in bounds):
        raise StructuredOutputError(f"{what} too complex (at most {MAX_PATTERN_CHARS} characters and repetition "
                                    f"counts up to {MAX_PATTERN_REPEAT})")


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal: quotes, backslashes and control characters as \\uXXXX escapes."""
    return '"' + "".join(f"\\u{ord(c):04x}" if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F else c
                         for c in text) + '"'


def _check_patterns(schema: Any) -> None:
    """Refuse regex `pattern`s whose automaton would take seconds to minutes to build (`(a|b){1000,5000}`
    takes ~20 s): bounded repetition above MAX_PATTERN_REPEAT, or a pattern over MAX_PATTERN_CHARS."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                bounds = [int(b) for m in _REPEAT.finditer(pattern) for b in m.groups() if b]
                if len(pattern) > MAX_PATTERN_CHARS or any(b > MAX_PATTERN_REPEAT for b in bounds):
                    raise StructuredOutputError(
                        f"invalid JSON schema: pattern too complex (at most {MAX_PATTERN_CHARS} characters and "
                        f"repetition counts up to {MAX_PATTERN_REPEAT})")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _first_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    # xgrammar prefixes "[time] /path/file.cc:line: "
    if "] " in text and ".cc:" in text:
        text = text.split(": ", 1)[-1]
    return text[:500]
