"""Parsers for Qwen3.6 output text: reasoning (`<think>...</think>`) and Qwen3-Coder XML tool calls.

Both read text fed in arbitrary pieces (one engine step's worth, or a whole reply at once) and give back
events; streamed and whole replies run the same code, so a stream's pieces always add up to the whole reply.

The tokenizer marks `<think>`, `</think>`, `<tool_call>` and `</tool_call>` as special tokens, so decoding
with skip_special_tokens=True would drop exactly the markup these parsers look for. The server therefore
decodes a parsed request with those four specials kept as text and every other special (`<|im_end|>`, ...)
dropped (`markup_token_ids` names them; `AsyncEngine.generate(keep_special_ids=...)` decodes so). A plain
request (no reasoning split, no tools) is decoded as before, markup dropped, except `<tool_call>` / `</tool_call>`
where a grammar applies (`Serving.start`: a grammar may write them as those tokens).

    reasoning:  <prompt ends in "<think>\n"> REASONING \n</think>\n\n CONTENT
    tool call:  <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
MARKUP = (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END)


class Text(NamedTuple):
    """Reply text of one kind: "reasoning" or "content"."""

    kind: str
    text: str


class ToolCallStart(NamedTuple):
    """A tool call begins: OpenAI's first tool-call delta (id, type "function", name, arguments "")."""

    index: int
    id: str
    name: str


class ToolCallArguments(NamedTuple):
    """The next fragment of tool call `index`'s arguments (JSON object text)."""

    index: int
    text: str


Event = Text | ToolCallStart | ToolCallArguments


def _first_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members with a repeated key keeping its first value (`json.loads`' object_pairs_hook; its own
    default keeps the last): as a repeated XML parameter keeps its first (`ToolCallParser`)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        out.setdefault(k, v)
    return out


def markup_token_ids(tokenizer: Any) -> dict[str, int]:
    """The ids of the markup specials (`<think>`, `</think>`, `<tool_call>`, `</tool_call>`) this tokenizer
    has as single special tokens; tokenizers without them (test doubles) give {}."""
    specials = getattr(tokenizer, "special_ids", frozenset())
    found = {}
    for tag in MARKUP:
        ids = tokenizer.encode(tag)
        if len(ids) == 1 and ids[0] in specials:
            found[tag] = ids[0]
    return found


def prompt_opens_reasoning(prompt_ids: Sequence[int], think_start: int | None, think_end: int | None) -> bool:
    """True if the prompt ends inside a `<think>` block (thinking on: the reply starts in its reasoning).

    With enable_thinking=false the template closes the block (`<think>\\n\\n</think>\\n\\n`), so False.
    """
    if think_start is None:
        return False
    for t in reversed(prompt_ids):
        if t == think_start:
            return True
        if t == think_end:
            return False
    return False


def _partial_suffix(text: str, tags: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (held back: the
    next piece may complete the tag)."""
    best = 0
    for tag in tags:
        for n in range(min(len(text), len(tag) - 1), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def _earliest(text: str, tags: Iterable[str]) -> tuple[int, str] | None:
    best = None
    for tag in tags:
        i = text.find(tag)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, tag)
    return best


class ReasoningParser:
    """Splits a reply that starts inside its reasoning at the first `</think>`.

    Reasoning loses the newlines before `</think>`, content the whitespace after it (the template writes
    `\\n</think>\\n\\n`); both are held back while streaming until it is clear whether more text follows.
    A reply cut off before `</think>` is all reasoning.
    """

    def __init__(self) -> None:
        self.in_reasoning = True
        self._buf = ""
        self._content_started = False

    def feed(self, text: str) -> list[Text]:
        out: list[Text] = []
        if self.in_reasoning:
            self._buf += text
            end = self._buf.find(THINK_END)
            if end < 0:
                keep = _partial_suffix(self._buf, (THINK_END,))
                body = self._buf[: len(self._buf) - keep].rstrip("\n")
                if body:
                    out.append(Text("reasoning", body))
                self._buf = self._buf[len(body) :]
                return out
            reasoning = self._buf[:end].rstrip("\n")
            if reasoning:
                out.append(Text("reasoning", reasoning))
            text = self._buf[end + len(THINK_END) :]
            self._buf = ""
            self.in_reasoning = False
        if not self._content_started:
            text = text.lstrip()
            self._content_started = bool(text)
        if text:
            out.append(Text("content", text))
        return out

    def finish(self) -> list[Text]:
        if self.in_reasoning and self._buf:
            buf, self._buf = self._buf, ""
            return [Text("reasoning", buf)]
        return []


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows, or [] when it says nothing usable."""
    if not isinstance(schema, Mapping):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    types: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types += [x for x in _schema_types(sub) if x not in types]
    if types:
        return types
    if "enum" in schema or "const" in schema:
        return ["json"]
    if "properties" in schema:
        return ["object"]
    if "items" in schema:
        return ["array"]
    return []


_FAIL = object()
_INT = re.compile(r"[-+]?\d+")


def _json_value(v: Any) -> bool:
    """Whether a parsed value is strict JSON: strings, booleans, None, finite numbers, lists (or tuples) and dicts of
    them with scalar keys. json.loads reads NaN, Infinity and 1e999, which strict parsers of the client's
    `arguments` reject; ast.literal_eval reads sets, bytes and complex numbers, which json.dumps cannot write."""
    try:
        return _strict(v)
    except RecursionError:  # nested deeper than this check can walk
        return False


def _strict(v: Any) -> bool:
    if v is None or isinstance(v, (str, bool, int)):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, (list, tuple)):
        return all(_strict(x) for x in v)
    if isinstance(v, dict):
        return all((k is None or isinstance(k, (str, int, float))) and _strict(k) and _strict(x) for k, x in v.items())
    return False


def _as_type(text: str, kind: str) -> Any:
    """`text` as a strict JSON value (_json_value) of JSON type `kind`, or _FAIL."""
    low = text.lower()
    if kind == "integer":
        if _INT.fullmatch(text):
            try:
                return int(text)
            except ValueError:  # past Python's 4300-digit limit for int(str)
                return _FAIL
        v = _as_type(text, "number")
        return int(v) if isinstance(v, float) and v.is_integer() else _FAIL
    if kind == "number":
        try:
            v = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: an array nested past the parser's limit
            return _FAIL
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) and _json_value(v) else _FAIL
    if kind == "boolean":
        return {"true": True, "false": False}.get(low, _FAIL)
    if kind == "null":
        return None if low in ("null", "none") else _FAIL
    if kind in ("object", "array", "json"):
        want = {"object": dict, "array": list, "json": object}[kind]
        for parse in (json.loads, ast.literal_eval):
            try:
                v = parse(text)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if isinstance(v, want) and not isinstance(v, tuple) and _json_value(v):
                return v
        return _FAIL
    return _FAIL


def convert_parameter(raw: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema asks for: integer, number, boolean, null, object or
    array are parsed (surrounding whitespace ignored); strings, unknown parameters and values that parse
    as none of the allowed types stay the text as written."""
    types = _schema_types(schema)
    text = raw.strip()
    choices = _choices(schema)
    if choices:
        # An enum member written with stray whitespace around it (grammars allow some) is that member.
        for value in (raw, text):
            if value in choices:
                return value
    for kind in types:
        if kind == "string":
            continue
        v = _as_type(text, kind)
        if v is not _FAIL:
            return v
    return raw


def _choices(schema: Any) -> list[Any]:
    if not isinstance(schema, Mapping):
        return []
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return list(enum) if isinstance(enum, list) else []


def _is_string_parameter(schema: Any) -> bool:
    """Values streamed as they arrive: parameters typed only "string" (not an enum), or not typed at all."""
    types = _schema_types(schema)
    return (not types or types == ["string"]) and not _choices(schema)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Turns Qwen3-Coder XML tool calls in content text into OpenAI tool-call events.

    Arguments stream as the JSON object text they add up to: `{"ARG": ` when a parameter opens, a string
    value fragment by fragment as it arrives (JSON-escaped), any other value whole when its parameter
    closes (typed by the tool's JSON schema, see `convert_parameter`), `}` when the function closes.
    Text outside calls is content; whitespace just before a call, between calls and after the last one is
    dropped. A Hermes-style JSON body (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`) is
    accepted too.

    Malformed output: a `<tool_call>` followed by neither `<function=NAME>` nor a JSON body stays content
    text; stray text inside a function block is skipped; a parameter repeated in one call keeps its first
    value (no repeated key in the arguments); a call cut short (max_tokens, or the reply's end) is closed, so its
    arguments are still a JSON object, and one cut off before its name was complete is dropped (neither a
    call nor content). With parallel=False only the first call is reported. With forced=True (a grammar
    forces calls: `tool_choice` "required" or a named function) a reply that ends inside a `<tool_call>` tag
    spelled as text (the grammar allows its bytes in pieces) is such a cut-off call too; otherwise that
    unfinished tag stays text (a "<" may be text: the model writes the tag as one special token).
    """

    _CONTENT, _HEAD, _JSON, _PARAMS, _VALUE, _TAIL = range(6)
    _VALUE_ENDS = (PARAMETER_END, PARAMETER_START, FUNCTION_END, TOOL_CALL_END)
    _PARAMS_TAGS = (PARAMETER_START, FUNCTION_END, TOOL_CALL_END, TOOL_CALL_START)

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None, parallel: bool = True,
                 new_id: Callable[[], str] = new_tool_call_id, forced: bool = False) -> None:
        self._schemas: dict[str, Mapping[str, Any]] = {}
        self._forced = forced
        for tool in tools or ():
            fn = tool.get("function", tool)
            params = fn.get("parameters") if isinstance(fn, Mapping) else None
            props = params.get("properties") if isinstance(params, Mapping) else None
            self._schemas[fn["name"]] = props if isinstance(props, Mapping) else {}
        self._parallel = parallel
        self._new_id = new_id
        self._state = self._CONTENT
        self._buf = ""
        self._ws = ""  # trailing content whitespace, held back: dropped if a call follows
        self._after_call = False
        self._cut = False  # a call head cut off by the end of the reply was dropped
        self.num_calls = 0  # calls started (reported or not)
        self._props: Mapping[str, Any] = {}
        self._num_params = 0
        self._param_names: set[str] = set()  # the current call's parameters so far
        self._repeated = False  # the open parameter repeats one of them: its value is dropped
        self._string_value = False
        self._value_started = False
        self._param_schema: Any = None

    @property
    def tool_calls_made(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        """End of the reply: release held text and close an unfinished call."""
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        if self._state in (self._PARAMS, self._TAIL):
            if self._state == self._PARAMS:
                self._close_arguments(out)
            self._end_call()
        if self._ws and not self.num_calls and not self._cut:
            out.append(Text("content", self._ws))
        self._ws = ""
        return out

    # ---- states ----
    def _step(self, out: list[Event], final: bool) -> bool:
        """Consume what the buffer allows in the current state; True if it should be called again."""
        state = self._state
        if state == self._CONTENT:
            return self._step_content(out, final)
        if state == self._HEAD:
            return self._step_head(out, final)
        if state == self._JSON:
            return self._step_json(out, final)
        if state == self._PARAMS:
            return self._step_params(out, final)
        if state == self._VALUE:
            return self._step_value(out, final)
        return self._step_tail(out, final)

    def _step_content(self, out: list[Event], final: bool) -> bool:
        buf = self._buf
        i = buf.find(TOOL_CALL_START)
        if i >= 0:
            self._content(buf[:i], out)
            self._buf = buf[i + len(TOOL_CALL_START) :]
            self._state = self._HEAD
            return True
        keep = _partial_suffix(buf, (TOOL_CALL_START,))
        if final and keep and self._forced:  # a forced call cut off inside its opening tag: no call, no markup
            self._content(buf[: len(buf) - keep], out)
            self._buf, self._cut = "", True
            return False
        keep = 0 if final else keep
        self._content(buf[: len(buf) - keep], out)
        self._buf = buf[len(buf) - keep :]
        return False

    def _step_head(self, out: list[Event], final: bool) -> bool:
        s = self._buf.lstrip()
        if s.startswith(FUNCTION_START):
            j = s.find(">")
            name = s[len(FUNCTION_START) : j] if j >= 0 else s[len(FUNCTION_START) :]
            if j < 0 and not final and "\n" not in name and "<" not in name and len(name) <= 256:
                return False  # the name is still arriving
            if j >= 0 and name and "\n" not in name and "<" not in name:
                self._start_call(name, out)
                self._buf = s[j + 1 :]
                self._state = self._PARAMS
                return True
        elif s.startswith("{"):
            self._state = self._JSON
            return True
        elif not final and FUNCTION_START.startswith(s):
            return False
        if final and self._cut_head(s):  # cut off (max_tokens) before its name was complete: no call, no markup
            self._buf, self._state, self._cut = "", self._CONTENT, True
            return False
        # not a call after all: the tag was text
        self._content(TOOL_CALL_START, out)
        self._state = self._CONTENT
        return True

    @staticmethod
    def _cut_head(s: str) -> bool:
        """Whether `s`, what followed `<tool_call>` when the reply ended, is the start of a call's head."""
        if FUNCTION_START.startswith(s):
            return True
        name = s[len(FUNCTION_START) :]
        return s.startswith(FUNCTION_START) and ">" not in name and "\n" not in name and "<" not in name

    def _step_json(self, out: list[Event], final: bool) -> bool:
        end = self._buf.find(TOOL_CALL_END)
        if end < 0 and not final:
            return False
        body = self._buf if end < 0 else self._buf[:end]
        rest = "" if end < 0 else self._buf[end + len(TOOL_CALL_END) :]
        try:
            call = json.loads(body, object_pairs_hook=_first_wins)
            name, args = call["name"], call.get("arguments", call.get("parameters", {}))
            if isinstance(args, str):
                args = json.loads(args, object_pairs_hook=_first_wins)
            ok = isinstance(name, str) and bool(name) and isinstance(args, dict)
            text = json.dumps(args, ensure_ascii=False) if ok else ""
        except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested past the parser's limit
            ok = False
        if ok:
            self._start_call(name, out)
            self._emit(out, ToolCallArguments(self.num_calls - 1, text))
            self._end_call()
            self._buf = rest
        else:
            self._content(TOOL_CALL_START, out)
        self._state = self._CONTENT
        return True

    def _step_params(self, out: list[Event], final: bool) -> bool:
        s = self._buf.lstrip()
        if s.startswith(PARAMETER_START):
            j = s.find(">")
            name = s[len(PARAMETER_START) : j] if j >= 0 else ""
            if j < 0 or "\n" in name or "<" in name:
                if j < 0 and not final and "\n" not in s and "<" not in s[1:] and len(s) <= 256:
                    self._buf = s
                    return False  # the name is still arriving
                return self._skip(s)
            self._open_parameter(name, out)
            self._buf = s[j + 1 :]
            return True
        if s.startswith(FUNCTION_END):
            self._close_arguments(out)
            self._buf = s[len(FUNCTION_END) :]
            self._state = self._TAIL
            return True
        if s.startswith((TOOL_CALL_END, TOOL_CALL_START)):
            # </function> is missing: close the call here
            self._close_arguments(out)
            self._end_call()
            self._buf = s.removeprefix(TOOL_CALL_END)
            self._state = self._CONTENT
            return True
        if not s or (not final and any(tag.startswith(s) for tag in self._PARAMS_TAGS)):
            self._buf = s
            return False
        return self._skip(s)

    def _skip(self, s: str) -> bool:
        """Drop stray text inside a function block, up to the next tag."""
        k = s.find("<", 1)
        self._buf = s[k:] if k >= 0 else ""
        return k >= 0

    def _step_value(self, out: list[Event], final: bool) -> bool:
        buf = self._buf
        if not self._value_started:
            if not buf and not final:
                return False
            buf = buf.removeprefix("\n")  # the template writes <parameter=ARG>\nVALUE\n</parameter>
            self._value_started = True
        hit = _earliest(buf, self._VALUE_ENDS)
        if hit is not None or final:
            # cut off (max_tokens) inside a closing tag: the tag's start is not part of the value
            end = hit[0] if hit is not None else len(buf) - _partial_suffix(buf, self._VALUE_ENDS)
            self._close_value(buf[:end].removesuffix("\n"), out)
            if hit is None:
                self._buf = ""
            else:
                tag = hit[1]
                self._buf = buf[end + len(tag) :] if tag == PARAMETER_END else buf[end:]
            self._state = self._PARAMS
            return True
        if self._string_value:
            # Stream what cannot be the start of a closing tag (or the newline before one).
            keep = _partial_suffix(buf, self._VALUE_ENDS)
            ready = buf[: len(buf) - keep]
            ready = ready.removesuffix("\n")
            if ready and not self._repeated:
                self._arguments(out, json.dumps(ready, ensure_ascii=False)[1:-1])
            buf = buf[len(ready) :]
        self._buf = buf
        return False

    def _step_tail(self, out: list[Event], final: bool) -> bool:
        s = self._buf.lstrip()
        if s.startswith(TOOL_CALL_END):
            self._buf = s[len(TOOL_CALL_END) :]
        elif TOOL_CALL_END.startswith(s):
            self._buf = "" if final else s  # cut off (max_tokens) inside </tool_call>: no markup in the content
            if not final:
                return False
        else:
            self._buf = s  # </tool_call> is missing: what follows is content again
        self._end_call()
        self._state = self._CONTENT
        return True

    # ---- output ----
    def _emit(self, out: list[Event], event: Event) -> None:
        if self._parallel or event.index == 0:
            out.append(event)

    def _content(self, text: str, out: list[Event]) -> None:
        # Trailing whitespace waits in _ws: a call starting next drops it, other text releases it.
        text = self._ws + text
        self._ws = ""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        stripped = text.rstrip()
        self._ws, text = text[len(stripped) :], stripped
        if text:
            out.append(Text("content", text))

    def _arguments(self, out: list[Event], text: str) -> None:
        self._emit(out, ToolCallArguments(self.num_calls - 1, text))

    def _start_call(self, name: str, out: list[Event]) -> None:
        self._emit(out, ToolCallStart(self.num_calls, self._new_id(), name))
        self._ws = ""
        self.num_calls += 1
        self._props = self._schemas.get(name, {})
        self._num_params = 0
        self._param_names = set()

    def _open_parameter(self, name: str, out: list[Event]) -> None:
        self._param_schema = self._props.get(name)
        self._string_value = _is_string_parameter(self._param_schema)
        self._value_started = False
        self._state = self._VALUE
        # a parameter given twice in one call keeps its first value: the arguments stay a JSON object without a
        # repeated key, and a stream never has to take back what it sent
        self._repeated = name in self._param_names
        if self._repeated:
            return
        self._param_names.add(name)
        prefix = "{" if self._num_params == 0 else ", "
        self._arguments(out, prefix + json.dumps(name, ensure_ascii=False) + ": " + ('"' if self._string_value else ""))
        self._num_params += 1

    def _close_value(self, value: str, out: list[Event]) -> None:
        if self._repeated:
            return
        if self._string_value:
            self._arguments(out, json.dumps(value, ensure_ascii=False)[1:-1] + '"')
        else:
            self._arguments(out, json.dumps(convert_parameter(value, self._param_schema), ensure_ascii=False))

    def _close_arguments(self, out: list[Event]) -> None:
        self._arguments(out, "}" if self._num_params else "{}")

    def _end_call(self) -> None:
        self._after_call = True


class OutputParser:
    """One choice's reply: reasoning split first (when the prompt opened a think block), then tool calls in
    the content (when the request has tools). With neither it passes text through as content."""

    def __init__(self, reasoning: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
                 parallel_tool_calls: bool = True, new_id: Callable[[], str] = new_tool_call_id,
                 forced_tool_calls: bool = False) -> None:
        self.reasoning = ReasoningParser() if reasoning else None
        self.tools = (ToolCallParser(tools, parallel_tool_calls, new_id, forced_tool_calls) if tools is not None
                      else None)

    @property
    def tool_calls_made(self) -> bool:
        return self.tools is not None and self.tools.tool_calls_made

    def feed(self, text: str) -> list[Event]:
        if self.reasoning is not None:
            events: list[Event] = list(self.reasoning.feed(text))
        else:
            events = [Text("content", text)] if text else []
        return self._route(events)

    def finish(self) -> list[Event]:
        out = self._route(self.reasoning.finish() if self.reasoning is not None else [])
        if self.tools is not None:
            out += self.tools.finish()
        return out

    def _route(self, events: list[Event]) -> list[Event]:
        if self.tools is None:
            return events
        out: list[Event] = []
        for e in events:
            if isinstance(e, Text) and e.kind == "content":
                out += self.tools.feed(e.text)
            else:
                out.append(e)
        return out


def coalesce(events: Iterable[Event]) -> list[Event]:
    """Merge neighbouring text of one kind and neighbouring argument fragments of one call."""
    out: list[Event] = []
    for e in events:
        prev = out[-1] if out else None
        if isinstance(e, Text) and isinstance(prev, Text) and prev.kind == e.kind:
            out[-1] = Text(e.kind, prev.text + e.text)
        elif isinstance(e, ToolCallArguments) and isinstance(prev, ToolCallArguments) and prev.index == e.index:
            out[-1] = ToolCallArguments(e.index, prev.text + e.text)
        elif not (isinstance(e, Text) and not e.text):
            out.append(e)
    return out


@dataclass
class ParsedReply:
    """A whole reply assembled from events."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # {"id", "name", "arguments"}

    def add(self, events: Iterable[Event]) -> None:
        for e in events:
            if isinstance(e, Text):
                if e.kind == "reasoning":
                    self.reasoning += e.text
                else:
                    self.content += e.text
            elif isinstance(e, ToolCallStart):
                self.tool_calls.append({"id": e.id, "name": e.name, "arguments": ""})
            else:
                self.tool_calls[e.index]["arguments"] += e.text

    @classmethod
    def parse(cls, text: str, reasoning: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
              parallel_tool_calls: bool = True, forced_tool_calls: bool = False) -> ParsedReply:
        """Parse a whole reply's text at once."""
        parser = OutputParser(reasoning, tools, parallel_tool_calls, forced_tool_calls=forced_tool_calls)
        reply = cls()
        reply.add(parser.feed(text))
        reply.add(parser.finish())
        return reply
