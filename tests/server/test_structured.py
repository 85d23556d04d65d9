"""`vibeqwen.server.structured.GrammarBackend`'s grammar cache: a schema (or tool set) is compiled once per server,
its refusal kept too, the least recently used entry dropped past GRAMMAR_CACHE_SIZE. Built on a small byte-level
vocabulary (the real 248k-token one takes a second)."""

from __future__ import annotations

import pytest

xgr = pytest.importorskip("xgrammar")

from vibeqwen.server import structured as S  # noqa: E402


@pytest.fixture()
def backend(monkeypatch):
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "<eos>"]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[len(vocab) - 1])
    b = S.GrammarBackend(info, [len(vocab) - 1])
    builds = []
    json_build, tools_build = b._json_grammar, b._tool_call_grammar
    monkeypatch.setattr(b, "_json_grammar", lambda schema: builds.append(schema) or json_build(schema))
    monkeypatch.setattr(b, "_tool_call_grammar", lambda *a: builds.append(a) or tools_build(*a))
    b.builds = builds
    return b


def test_a_schema_compiles_once(backend):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    g1 = backend.json_grammar(schema)
    g2 = backend.json_grammar({"properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"})
    assert g1 is g2 and len(backend.builds) == 1  # key order does not matter
    assert backend.json_grammar(None) is backend.json_grammar(None) and len(backend.builds) == 2
    assert backend.json_grammar(True) is not backend.json_grammar(None) and len(backend.builds) == 3


def test_a_refused_schema_is_refused_again_without_compiling(backend):
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    for _ in range(3):
        with pytest.raises(S.StructuredOutputError, match="invalid JSON schema"):
            backend.json_grammar(bad)
    assert len(backend.builds) == 1
    with pytest.raises(S.StructuredOutputError, match="accepts no JSON value"):
        backend.json_grammar(False)


def test_least_recently_used_is_dropped(backend, monkeypatch):
    monkeypatch.setattr(S, "GRAMMAR_CACHE_SIZE", 2)
    schemas = [{"type": "object", "properties": {f"p{i}": {"type": "integer"}}} for i in range(3)]
    backend.json_grammar(schemas[0])
    backend.json_grammar(schemas[1])
    backend.json_grammar(schemas[0])  # most recent now: schemas[1] goes first
    backend.json_grammar(schemas[2])
    assert len(backend.builds) == 3
    backend.json_grammar(schemas[0])
    assert len(backend.builds) == 3
    backend.json_grammar(schemas[1])
    assert len(backend.builds) == 4


def test_tool_grammars_are_cached_per_tools_name_and_parallel(backend):
    tools = [{"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    g = backend.tool_call_grammar(tools, "get", False)
    assert backend.tool_call_grammar(tools, "get", False) is g and len(backend.builds) == 1
    backend.tool_call_grammar(tools, None, True)
    assert len(backend.builds) == 2
