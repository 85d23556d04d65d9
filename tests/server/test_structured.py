"""`vibeqwen.server.structured.GrammarBackend`'s grammar cache: a schema (or tool set) is compiled once per server,
its refusal kept too, the least recently used entry dropped past GRAMMAR_CACHE_SIZE. Built on a small byte-level
vocabulary (the real 248k-token one takes a second)."""

from __future__ import annotations

import json
import re

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


# ---- what a constraint may cost: the static check, the preflight walk, dead ends ----


@pytest.mark.parametrize("text, ebnf, counts", [
    (r"([\s\S]{1,10}){1,10}", False, (10, 100)),
    (r"(\d{1,3}\.){3}\d{1,3}", False, (3, 0)),  # a fixed outer count multiplies nothing
    (r"(a|b){1000,5000}", False, (5000, 0)),
    (r"\u{2028}[{2000}]", False, (0, 0)),  # a code point escape and a class hold no count (false refusals)
    (r"\x{2000}", False, (2000, 0)),  # but xgrammar reads \x{2000} as x{2000}
    ("a{" + "9" * 5000 + "}", False, (10**7, 0)),  # past int()'s digit limit: refused, not a 500
    (r"(\d{1,3}\.)+", False, (3, 48)),  # a loop over a variable count multiplies it (LOOP_REPEAT)
    ("The quick\\. " * 3 + r"([\s\S]{1,10})+", False, (10, 160)),  # a literal prefix the probe walk never passes
    ("root ::= q{1,10}\nq ::= s{1,10}\ns ::= [^\\n]{1,10}", True, (10, 1000)),  # rule references followed
    ("root ::= ([^\\n]{1,10}) {1,10}", True, (10, 100)),  # a space before the count
    ('root ::= "a" | b\nb ::= "x" b | "y"', True, (0, 0)),  # recursion is a loop
    ('root ::= "{2000}" # {3000}', True, (0, 0)),  # nor a grammar's string literals and comments
    ('root ::= ([^\\n]{1,40}){1,40}', True, (40, 1600)),
    (r"((a{1,4}){1,4}){1,4}", False, (4, 64)),
    (r"(x{2,}){1,20}", False, (20, 40)),
    (r"([A-Za-z]+ ?)+", False, (0, 0)),  # loops are not counted (the preflight walk times these)
])
def test_repetition_counts_come_from_the_structure(text, ebnf, counts):
    assert S._repetitions(text, ebnf) == counts


@pytest.mark.parametrize("build, arg", [
    ("regex_grammar", r"([\s\S]{1,97}){1,100}"),  # the break-it review's: 33 s a token for every request
    ("ebnf_grammar", "root ::= ([^\\n]{1,40}){1,40}"),
    ("json_grammar", {"type": "string", "pattern": "^([\\s\\S]{1,96}){1,100}$"}),
])
def test_nested_counted_repetition_is_refused(backend, build, arg):
    with pytest.raises(S.StructuredOutputError, match="too complex"):
        getattr(backend, build)(arg)


def test_grammars_that_accept_nothing_are_refused(backend):
    for build, arg in [("regex_grammar", r"[^\s\S]"), ("ebnf_grammar", "root ::= root")]:
        with pytest.raises(S.StructuredOutputError, match="accepts no text"):
            getattr(backend, build)(arg)
    with pytest.raises(S.StructuredOutputError, match="null"):
        backend.choice_grammar(["a\0b"])


def test_slow_masks_are_refused_by_the_preflight_walk(backend, monkeypatch):
    monkeypatch.setattr(S, "MAX_MASK_SECONDS", 0.0)  # every mask is too slow
    with pytest.raises(S.StructuredOutputError, match="a token mask took") as e:
        backend.regex_grammar(r"[a-c]{2}")
    assert "maxLength" in str(e.value) and ".{0,200}" in str(e.value)  # names the likely causes and a way out
    with pytest.raises(S.StructuredOutputError, match="a token mask took"):  # refused from the cache too
        backend.regex_grammar(r"[a-c]{2}")
    monkeypatch.setattr(S, "MAX_MASK_SECONDS", 10.0)
    backend.regex_grammar(r"[a-d]{2}")


def test_a_dead_end_ends_the_reply_with_the_stop_tokens(backend):
    """`(abc|x[^\\s\\S])` after "x" allows no next token: only the stop tokens from there on (the constraint used to
    drop itself and let free text through)."""
    eos = backend.stop_token_ids[0]
    c = backend.constraint(backend.regex_grammar(r"(abc|x[^\s\S])"))
    first = c.allowed(backend.vocab_size)
    x = ord("x") - 32
    assert first[x] and first[ord("a") - 32] and not first[eos]
    c.accept(x)
    for _ in range(2):
        mask = c.allowed(backend.vocab_size)
        assert mask.nonzero().view(-1).tolist() == [eos]
        c.accept(ord("b") - 32)  # whatever comes is not fed to the grammar


def test_the_probe_walk_sees_past_the_template_newlines(backend):
    """With thinking on the grammar allows newlines first, which "accepts no text" must not count."""
    with pytest.raises(S.StructuredOutputError, match="accepts no text"):
        backend.regex_grammar(r"[^\s\S]", True)
    backend.regex_grammar(r"[ab]", True)


def test_a_slow_mask_mid_reply_ends_the_reply(backend, monkeypatch):
    eos = backend.stop_token_ids[0]
    c = backend.constraint(backend.regex_grammar(r"[a-c]{3}"))
    assert c.allowed(backend.vocab_size)[ord("a") - 32]
    monkeypatch.setattr(S, "RUNTIME_MASK_SECONDS", -1.0)  # every mask from here is too slow
    c.accept(ord("a") - 32)
    assert c.allowed(backend.vocab_size).nonzero().view(-1).tolist() == [eos]
    monkeypatch.setattr(S, "RUNTIME_MASK_SECONDS", 10.0)
    assert c.allowed(backend.vocab_size).nonzero().view(-1).tolist() == [eos]  # and it stays ended


def _accepts(grammar, text: str) -> bool:
    return xgr.GrammarMatcher(grammar).accept_string(text)


def test_numbers_are_finite_doubles(backend):
    """xgrammar's number rules take any exponent: a model wrote `1E2432` (infinity to Python and JavaScript). The
    grammars bound the exponent and the integer digits; integers stay unbounded (exact in Python)."""
    g = backend.json_grammar({"type": "object", "properties": {"x": {"type": "number"}, "n": {"type": "integer"}}})
    for text in ['{"x": 1E2432', '{"x": 1e100', '{"x": ' + "9" * (S.MAX_INTEGER_DIGITS + 1)]:
        assert not _accepts(g, text), text
    for text in ['{"x": -1.5e10, "n": ' + "9" * 400 + "}", '{"x": 1e99', '{"x": 0.5e-99', '{"x": 123.456}']:
        assert _accepts(g, text), text
    assert not _accepts(backend.json_grammar(None), '{"a": [1e999')  # json_object's numbers too
    # one bound (pydantic's Field(ge=0) on a float), and a $defs name with `-` and `.` (in xgrammar's rule names)
    for schema in ({"type": "number", "minimum": 0}, {"type": "number", "exclusiveMinimum": 0.5},
                   {"$defs": {"my-num.v1": {"type": "number"}}, "$ref": "#/$defs/my-num.v1"}):
        g = backend.json_grammar(schema)
        assert _accepts(g, "1" + "0" * (S.MAX_INTEGER_DIGITS - 1)) and not _accepts(g, "1" + "0" * S.MAX_INTEGER_DIGITS)
    assert not _accepts(g, "1e100")
    # a string that reads like a number rule is text, left as it is
    text = 'n ::= ("" | ([eE] a b{1, -1}))'
    g = backend.json_grammar({"type": "object", "properties": {"c": {"const": text}, "x": {"type": "number"}}})
    assert _accepts(g, '{"c": ' + json.dumps(text) + ', "x": 1e5}') and not _accepts(g, '{"c": ' + json.dumps(text)
                                                                                        + ', "x": 1e500')
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}}}]
    call = "<tool_call>\n<function=add>\n<parameter=a>\n"
    g = backend.tool_call_grammar(tools, "add", False)
    assert _accepts(g, call + "2.5e3\n</parameter>") and not _accepts(g, call + "1E243")
    for value in ("-1.5", "1e99", "9" * S.MAX_INTEGER_DIGITS):  # every number the grammar takes is finite
        assert _accepts(g, call + value) and float(value) != float("inf")


def test_length_bounded_strings_take_no_raw_control_characters(backend):
    """xgrammar's rule for a string with minLength / maxLength let raw control characters in: a model wrote a tab
    into a `maxLength: 6` name, and json.loads refused the reply. Now only what JSON takes raw."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "code": {"type": "string", "minLength": 2}},
              "required": ["name", "code"], "additionalProperties": False}
    g = backend.json_grammar(schema)
    for bad in ("\t", "\x00", "\x1f", "\r", "\n"):
        assert not _accepts(g, '{"name": "a' + bad), repr(bad)
        assert not _accepts(g, '{"name": "ab", "code": "x' + bad), repr(bad)
    text = '{"name": "a b~é", "code": "x\x7fz"}'
    assert _accepts(g, text) and json.loads(text)["name"] == "a b~é"
    assert not _accepts(g, '{"name": "abcdefg"')  # the bound still holds
    assert _accepts(backend.json_grammar({"type": "string"}), '"a\\tb"')  # unbounded: escapes, as before


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "integer", "not": {"type": "integer"}}, "`not`"),
    ({"type": "object", "properties": {"a": {"type": "array", "if": {}}}}, "`if` at /properties/a"),
    ({"anyOf": [{"type": "string"}, {"type": "object", "if": {}, "then": {}}]}, "`if` at /anyOf/1"),
    ({"$defs": {"x": {"type": "array", "contains": {"const": 5}}}, "$ref": "#/$defs/x"}, "`contains` at /$defs/x"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "`dependentRequired`"),
    ({"allOf": [{"type": "object"}, {"required": ["b"]}]}, "`allOf` of several schemas"),
    ({"type": "array", "items": {"enum": [f"v{i:05d}" for i in range(5000)]}}, "`enum` at /items too large (40000"),
])
def test_keywords_the_grammar_cannot_enforce_are_refused(backend, schema, keyword):
    with pytest.raises(S.StructuredOutputError, match=re.escape(keyword)):
        backend.json_grammar(schema)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                          "properties": {"p": schema}}}}]
    with pytest.raises(S.StructuredOutputError, match="tool parameters schema of 'f'"):
        backend.tool_call_grammar(tools, None, False)


def test_numeric_bounds_out_of_the_grammar_engines_range_are_named(backend):
    """Bounds xgrammar cannot take (an integer's outside int64, a number's past float64) are refused naming the
    keyword and where it is, not with xgrammar's internal check text; bounds at the ends of the range compile."""
    for schema, where in (({"type": "integer", "minimum": 10**400}, "`minimum` is out of"),
                          ({"type": "integer", "minimum": -1e300}, "`minimum` is out of"),
                          ({"type": "number", "maximum": 10**400}, "`maximum` is out of"),
                          ({"type": "object", "properties": {"a": {"type": ["integer", "null"], "maximum": 2**63}}},
                           "`maximum` at /properties/a is out of")):
        with pytest.raises(S.StructuredOutputError, match=re.escape(where)) as e:
            backend.json_grammar(schema)
        assert "Check failed" not in str(e.value) and "RuntimeError" not in str(e.value)
    g = backend.json_grammar({"type": "object", "properties": {"a": {"type": "integer", "minimum": -(2**63),
                                                                      "maximum": 2**63 - 1},
                                                                "b": {"type": "number", "minimum": -1e300}}})
    assert _accepts(g, '{"a": -5, "b": 1.5}')


def test_keyword_names_as_property_names_are_served(backend):
    """A property named `not` is a name, not the keyword; a one-schema `allOf` asks for nothing the grammar cannot
    do; `uniqueItems` (pydantic's `set` fields) is served unenforced."""
    g = backend.json_grammar({"type": "object", "properties": {"not": {"type": "integer"}, "if": {
        "type": "array", "uniqueItems": True}}, "allOf": [{"required": ["not"]}]})
    assert _accepts(g, '{"not": 1, "if": [1, 1]}')


def test_a_required_property_no_key_allows_and_an_outside_ref_are_refused(backend):
    """An object requiring a name that neither `properties` nor `additionalProperties` allows matches nothing; a
    `$ref` outside the schema would go unconstrained. Both refused; patterns and local refs are left to xgrammar."""
    closed = {"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False}
    with pytest.raises(S.StructuredOutputError, match="required property 'a' is not in `properties`"):
        backend.json_grammar(closed)
    with pytest.raises(S.StructuredOutputError, match=re.escape("required property 'a' at /properties/x")):
        backend.json_grammar({"type": "object", "properties": {"x": closed}})
    with pytest.raises(S.StructuredOutputError, match="points outside the schema"):
        backend.json_grammar({"$ref": "http://example.com/schema.json"})
    assert _accepts(backend.json_grammar({**closed, "properties": {"a": {"type": "integer"}}}), '{"a": 1}')
    assert _accepts(backend.json_grammar({"$defs": {"n": {"type": "integer"}}, "type": "object",
                                          "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"]}), '{"a": 2}')


def test_a_schema_without_values_is_refused(backend, monkeypatch):
    """`anyOf: []` accepts no JSON value (xgrammar writes the empty text): refused as it is read, and by the probe
    walk (the grammar allows only the template's newlines or the end) where the schema check does not see it."""
    with pytest.raises(S.StructuredOutputError, match=re.escape("`anyOf` is empty")):
        backend.json_grammar({"anyOf": []})
    monkeypatch.setattr(S, "_check_keywords", lambda *a: 0)
    with pytest.raises(S.StructuredOutputError, match="accepts no text"):
        backend.json_grammar({"anyOf": [], "title": "not the cached refusal's key"})
    monkeypatch.undo()
    with pytest.raises(S.StructuredOutputError, match=re.escape("`anyOf` at /properties/a is empty")):
        backend.json_grammar({"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]})


def test_tool_call_value_edges_are_line_feeds_only(backend):
    """xgrammar's qwen_xml style lets one whitespace character of any kind around a parameter value; the parser takes
    off one line feed at each end (as the template writes values), so a space, tab or carriage return there stayed in
    the value and broke its schema (a forced call gave `"p": "cb\\r"` against `^[a-c]{2}$`). Only line feeds now, at
    the edges only: a pattern's own whitespace and the JSON inside object values (the template writes `{"x": 1}`)
    keep theirs."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 3},
                                         "p": {"type": "string", "pattern": "^[a-c]{2}$"},
                                         "o": {"type": "object", "properties": {"x": {"type": "integer"}}},
                                         "w": {"type": "string", "pattern": "^a[ \\t\\n]b$"}},
        "required": ["s", "p"]}}}]
    head = "<tool_call>\n<function=f>\n<parameter=s>\nab\n</parameter>\n<parameter=p>"
    tail = "</parameter>\n</function>\n</tool_call>"
    for name, parallel in (("f", False), (None, False), (None, True)):
        g = backend.tool_call_grammar(tools, name, parallel)
        for value in ("\ncb\n", "cb", "\ncb", "cb\n"):
            assert _accepts(g, head + value + tail), repr(value)
        for value in ("cb\r", "\tcb", " cb", "cb ", "\ncb \n", "\r\ncb\n"):
            assert not _accepts(g, head + value + tail), repr(value)
        obj = head + "\ncb\n</parameter>\n<parameter=o>\n"
        for value in ('{"x":1}', '{"x": 1}', '{ "x":1}'):  # JSON keeps its whitespace
            assert _accepts(g, obj + value + "\n</parameter>\n</function>\n</tool_call>"), value
        assert not _accepts(g, obj[:-1] + ' {"x": 1}')
        pattern = head + "\ncb\n</parameter>\n<parameter=o>\n{}\n</parameter>\n<parameter=w>\n"
        for value in ("a b", "a\tb", "a\nb"):  # the pattern's class is the value's: untouched
            assert _accepts(g, pattern + value + "\n</parameter>\n</function>\n</tool_call>"), repr(value)
    # names that are rules of their own (patternProperties, propertyNames) or escaped (a quote): the same edges
    for params, name in (({"type": "object", "patternProperties": {"^x_[0-9]$": {"type": "string",
                                                                                 "pattern": "^[a-c]{2}$"}}}, "x_1"),
                         ({"type": "object", "propertyNames": {"pattern": "^y[0-9]$"},
                           "additionalProperties": {"type": "string", "pattern": "^[a-c]{2}$"}}, "y1"),
                         ({"type": "object", "properties": {'a"b': {"type": "string", "pattern": "^[a-c]{2}$"}},
                           "required": ['a"b']}, 'a"b')):
        g = backend.tool_call_grammar([{"type": "function", "function": {"name": "f", "parameters": params}}], "f",
                                      False)
        call = f"<tool_call>\n<function=f>\n<parameter={name}>"
        assert _accepts(g, call + "\ncb\n</parameter>"), params
        assert not _accepts(g, call + " cb") and not _accepts(g, call + "cb\r"), params
    # a schema without properties (any names): its values are any text, edges included (nothing to break)
    g = backend.tool_call_grammar([{"type": "function", "function": {"name": "any"}}], "any", False)
    assert _accepts(g, "<tool_call>\n<function=any>\n<parameter=k>\nv\n</parameter>")


def test_line_feed_whitespace_narrows_only_the_value_edges(backend):
    text = "\n".join([
        'root ::= (("<parameter=a" ">" e1 v e3 "</parameter>" w "<parameter=" xml_variable_name ">" e2 v e4 '
        '"</parameter>"))',
        'e1 ::= ("" | ([ \\n\\r\\t]))', 'e2 ::= ("" | ([ \\n\\r\\t]))', 'e3 ::= ("" | ([ \\t\\n]))',
        'e4 ::= ("" | ([ \\t]))', 'w ::= ("" | ([ \\n\\r\\t]))', 'v ::= (("a" [ \\n\\r\\t] "b"))',
        'xml_variable_name ::= (([a-z]+))'])
    g = S.line_feed_whitespace(xgr, xgr.Grammar.from_ebnf(text))
    printed = str(g)
    for rule in ("e1", "e2", "e3"):
        assert f'{rule} ::= (("" | ("\\n")))' in printed or f'{rule} ::= ("" | ("\\n"))' in printed, printed
    assert "e4 ::= ((\"\" | ([ \\t])))" in printed or 'e4 ::= ("" | ([ \\t]))' in printed  # no line feed: stays
    compiled = backend.compiler.compile_grammar(g)
    assert _accepts(compiled, '<parameter=a>\na\rb\n</parameter> <parameter=k>a b\t</parameter>')  # w, v, e4 kept
    assert not _accepts(compiled, '<parameter=a> a')
    plain = xgr.Grammar.from_ebnf('root ::= "a" [ \\n]')
    assert S.line_feed_whitespace(xgr, plain) is plain


def test_bounds_xgrammar_refuses_are_normalized(backend):
    """JSON Schema lets an integer's bounds be fractional; xgrammar refuses them, so they are rounded inward to the
    bounds that admit the same integers (in a response format and in tool parameters alike). `enum` values and the
    caller's schema are left as they are."""
    schema = {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0.5, "maximum": 2.5},
        "b": {"type": ["integer", "null"], "exclusiveMinimum": 0.5, "exclusiveMaximum": 3.0, "minimum": 2},
        "c": {"type": "number", "minimum": 0.5}}, "required": ["a", "b", "c"]}
    before = json.dumps(schema)
    g = backend.json_grammar(schema)
    assert json.dumps(schema) == before
    assert _accepts(g, '{"a": 1, "b": 2, "c": 0.75}') and _accepts(g, '{"a": 2, "b": null, "c": 1}')
    for bad in ('{"a": 0, "b": 2, "c": 1}', '{"a": 3, "b": 2, "c": 1}', '{"a": 1, "b": 1, "c": 1}',
                '{"a": 1, "b": 3, "c": 1}'):
        assert not _accepts(g, bad), bad
    value = {"type": "integer", "minimum": 0.5}
    made = S.normalized_schema({"enum": [value], "anyOf": [value, {"type": ["integer", "number"], "maximum": 1.5}]})
    assert made == {"enum": [value], "anyOf": [{"type": "integer", "minimum": 1},
                                               {"type": ["integer", "number"], "maximum": 1.5}]}
    assert value == {"type": "integer", "minimum": 0.5}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "exclusiveMaximum": 9.5}}, "required": ["n"]}}}]
    backend.tool_call_grammar(tools, "f", False)  # compiles
    # length bounds written as whole floats (JSON Schema's integers) serve as ints
    g = backend.json_grammar({"type": "string", "maxLength": 2.0})
    assert _accepts(g, '"ab"') and not _accepts(g, '"abc"')
    # exclusive bounds become the inclusive ones that admit the same integers, negative ones too
    g = backend.json_grammar({"type": "integer", "exclusiveMaximum": 9.5, "minimum": -1.5})
    assert _accepts(g, "9") and _accepts(g, "-1") and not _accepts(g, "10") and not _accepts(g, "-2")
    g = backend.json_grammar({"type": "integer", "maximum": -0.5, "exclusiveMinimum": -3.5})
    assert _accepts(g, "-1") and _accepts(g, "-3") and not _accepts(g, "0") and not _accepts(g, "-4")
    # a sibling bound that is not a number leaves the node as it is: xgrammar refuses it, as without the rounding
    with pytest.raises(S.StructuredOutputError):
        backend.json_grammar({"type": "integer", "exclusiveMinimum": 0.5, "minimum": "7"})


@pytest.mark.parametrize("node,key", [({"type": []}, "type"), ({"type": "any"}, "type"),
                                      ({"type": ["string", "text"]}, "type"), ({"type": "string", "maxLength": -1},
                                                                               "maxLength"),
                                      ({"type": "array", "maxItems": 1.5}, "maxItems"),
                                      ({"type": "string", "minLength": True}, "minLength"),
                                      ({"type": "object", "maxProperties": "2"}, "maxProperties")])
def test_types_and_length_bounds_are_checked(backend, node, key):
    """A `type` that is no type name (or an empty list) and a length / count bound that is not a non-negative
    integer: xgrammar would leave them unconstrained, so they are refused, naming the keyword and where it is."""
    with pytest.raises(S.StructuredOutputError, match=re.escape(f"`{key}` at /properties/p")):
        backend.json_grammar({"type": "object", "properties": {"p": node}})
    # as property names they are names
    g = backend.json_grammar({"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]})
    assert _accepts(g, json.dumps({key: 1}))


def test_property_counts_are_capped(backend, monkeypatch):
    """An object listing more than MAX_OBJECT_PROPERTIES properties, or a request whose schemas list more than
    MAX_SCHEMA_PROPERTIES in all (its tools' parameters together), is refused before xgrammar builds it: that build
    grows faster than the count and cannot be stopped once begun."""
    monkeypatch.setattr(S, "MAX_OBJECT_PROPERTIES", 3)
    monkeypatch.setattr(S, "MAX_SCHEMA_PROPERTIES", 5)

    def obj(prefix, n):
        return {"type": "object", "properties": {f"{prefix}{i}": {"type": "integer"} for i in range(n)}}

    with pytest.raises(S.StructuredOutputError, match=re.escape("object at /properties/x lists 4 properties")):
        backend.json_grammar({"type": "object", "properties": {"x": obj("a", 4)}})
    with pytest.raises(S.StructuredOutputError, match="6 properties in all, at most 5"):
        backend.json_grammar({"type": "object", "properties": {"x": obj("b", 2), "y": obj("c", 2)}})
    backend.json_grammar({"type": "object", "properties": {"x": obj("d", 2), "y": obj("e", 1)}})  # 5: served
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": obj(f"g{i}", 3)}} for i in range(2)]
    with pytest.raises(S.StructuredOutputError, match="6 properties in all"):
        backend.tool_call_grammar(tools, None, False)
    backend.tool_call_grammar(tools, "f0", False)  # one tool's 3: served


def test_ref_targets_are_checked_wherever_they_sit(backend, monkeypatch):
    """xgrammar follows any local JSON pointer, so a `$ref`'s target is checked (keywords, bounds, property counts)
    even outside `$defs`; a target reached both by keyword and by `$ref` counts once."""
    monkeypatch.setattr(S, "MAX_OBJECT_PROPERTIES", 3)
    monkeypatch.setattr(S, "MAX_SCHEMA_PROPERTIES", 5)
    big = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(4)}}
    with pytest.raises(S.StructuredOutputError, match=re.escape("object at /x lists 4 properties")):
        backend.json_grammar({"type": "object", "properties": {"a": {"$ref": "#/x"}}, "x": big})
    with pytest.raises(S.StructuredOutputError, match=re.escape("`maxLength` at /x/y")):
        backend.json_grammar({"$ref": "#/x/y", "x": {"y": {"type": "string", "maxLength": -1}}})
    with pytest.raises(S.StructuredOutputError, match=re.escape("`not` at /a~1b")):
        backend.json_grammar({"$ref": "#/a~1b", "a/b": {"not": {"type": "string"}}})
    three = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3)}}
    g = backend.json_grammar({"$defs": {"t": three}, "type": "object", "required": ["a", "b"],
                              "properties": {"a": {"$ref": "#/$defs/t"}, "b": {"$ref": "#/$defs/t"}}})
    assert _accepts(g, '{"a": {"p0": 1}, "b": {}}')  # 3 + 2 named properties: within 5, the target counted once
    backend.json_grammar({"type": "object", "properties": {"r": {"$ref": "#"}}})  # recursion terminates


def test_tools_with_strict_false_are_not_checked(backend, monkeypatch):
    """A tool with `strict: false` takes any arguments (its schema is not compiled), so its parameters are neither
    checked nor counted: loose schemas (MCP servers' often are) stay usable."""
    monkeypatch.setattr(S, "MAX_SCHEMA_PROPERTIES", 2)
    loose = {"type": "object", "properties": {"p": {"type": "any", "maxLength": -1}, "q": {}, "r": {}}}
    tools = [{"type": "function", "function": {"name": "f", "strict": False, "parameters": loose}}]
    backend.tool_call_grammar(tools, None, False)
    with pytest.raises(S.StructuredOutputError, match="`type` at /properties/p"):
        backend.tool_call_grammar([{"type": "function", "function": {"name": "g", "parameters": loose}}], None, False)



def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("kind, depth", [("json", 400), ("tools", 200), ("tools", 400)])
def test_a_schema_nested_too_deeply_says_so(backend, kind, depth):
    """A schema deeper than the grammar builders walk is refused in words, not with Python's RecursionError text or
    pydantic's serialization error (a review found both: the latter from the tool-call grammar's structural tags,
    which give up at a smaller depth than the JSON schema builder)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": _nested(depth)}}]
    with pytest.raises(S.StructuredOutputError) as e:
        backend.json_grammar(_nested(depth)) if kind == "json" else backend.tool_call_grammar(tools, None, True)
    assert str(e.value).endswith(": nested too deeply to compile"), str(e.value)
