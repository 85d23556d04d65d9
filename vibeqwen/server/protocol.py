"""OpenAI-compatible request and response models: chat completions, legacy completions, models, errors.

Requests accept the OpenAI fields plus vLLM-style extensions (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`, `include_stop_str_in_output`,
`structured_outputs`, `guided_json` / `_regex` / `_choice` / `_grammar`, `chat_template_kwargs`,
`add_generation_prompt`, `continue_final_message`, `allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`,
`stream_options.continuous_usage_stats`). Unknown fields are ignored, as OpenAI clients send many optional ones (the
server logs their names, as vLLM does); vLLM fields whose behaviour this server lacks are refused (HTTP 400) when
they ask for it. NaN and infinity are refused in every number, and JSON types are not converted (`true` is not 1,
`"0.5"` not a number), as OpenAI's API refuses them; an integer field takes `5.0` (JSON Schema's integers).
Sampling fields left unset (None) take the server's defaults: the checkpoint's `generation_config.json`,
then OpenAI's.
"""

from __future__ import annotations

import json
import time
import uuid
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

# The most choices one request may ask for (n, times the prompts of a batched completion).
MAX_N = 16
MAX_PROMPTS = 64
MAX_TOP_LOGPROBS = 20
# torch.Generator.manual_seed takes any value in [-2**63, 2**64).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def _whole_number(value: Any) -> Any:
    """A JSON number without a fraction (`5.0`, `1e3`) as the int it is: JSON has one number type and JSON Schema's
    `integer` takes them (Python's `json.dumps(1e3)` writes `1000.0`). Anything else as it came, for the strict int
    check (which refuses `true`, `"5"` and `5.5`)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: An integer field of a request: a JSON integer, or a number without a fraction.
JsonInt = Annotated[int, BeforeValidator(_whole_number)]


def _seed_in_range(value: int) -> int:
    """A seed torch.Generator.manual_seed takes; the error names the bounds as integers (pydantic's own `le` message
    prints 2**64 - 1 as a rounded float)."""
    if not SEED_MIN <= value <= SEED_MAX:
        raise ValueError(f"must be an integer from {SEED_MIN} to {SEED_MAX}")
    return value


Seed = Annotated[int, BeforeValidator(_whole_number), AfterValidator(_seed_in_range)]


def random_id(prefix: str) -> str:
    """An OpenAI-style id such as `chatcmpl-<32 hex digits>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in seconds, for `created`."""
    return int(time.time())


def _drop_none(data: dict[str, Any], keep: tuple[str, ...] = ()) -> dict[str, Any]:
    return {k: v for k, v in data.items() if v is not None or k in keep}


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error reply: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# ---- requests ----


class _RequestPart(BaseModel):
    """A part of a request body. JSON types are taken as they are, as OpenAI takes them: `true` is not the integer 1,
    `"yes"` or `1` is not a boolean, `"0.5"` is not a number (pydantic's lax mode would convert each). Integer fields
    (JsonInt) also take numbers without a fraction, as JSON Schema's `integer` does."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class _Request(_RequestPart):
    """A request body. Unknown fields are kept in `model_extra` (the server logs them as ignored, as vLLM does); an
    explicit null in a field that has a default but no null value means that default (OpenAI's spec marks `n`,
    `stream`, `echo`, ... nullable)."""

    model_config = ConfigDict(populate_by_name=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        drop = [k for k, v in data.items() if v is None and k in cls.model_fields
                and not cls.model_fields[k].is_required() and not _allows_none(cls.model_fields[k].annotation)]
        return {k: v for k, v in data.items() if k not in drop} if drop else data


def _allows_none(annotation: Any) -> bool:
    """Whether a field's type admits None (`X | None`, `Optional[X]`, `Any`)."""
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    return get_origin(annotation) in (Union, UnionType) and any(_allows_none(a) for a in get_args(annotation))


class ContentPart(_RequestPart):
    """One part of a message's content list; `{"type": "text", "text": ...}` is served, and in an assistant
    message `{"type": "refusal", "refusal": ...}` (as text)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(_RequestPart):
    """A chat message. Extra fields (`reasoning_content`, ...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # an earlier reply's reasoning, which the template renders in that turn's think block (`reasoning`: vLLM's newer
    # clients' name for it)
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str | None:
        """The content as one string; text parts are concatenated as the Qwen chat template does.

        Raises ValueError for non-text parts (this server has no vision or audio tower).
        """
        if not isinstance(self.content, list):
            return self.content
        texts = []
        for part in self.content:
            if part.type == "refusal" and self.role == "assistant":  # an earlier reply's refusal, as text
                refusal = (part.model_extra or {}).get("refusal")
                if not isinstance(refusal, str):
                    raise ValueError("a content part of type 'refusal' needs its `refusal` text")
                texts.append(refusal)
                continue
            if part.type != "text":
                raise ValueError(f"content parts of type {part.type!r} are not supported; send text parts")
            if part.text is None:
                raise ValueError("a content part of type 'text' needs its `text`")
            texts.append(part.text)
        return "".join(texts)

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        """Every message but an assistant's has content (an assistant's may be null: only tool calls or reasoning,
        as this server's own replies can be), a user's content list at least one part, and a tool message the
        `tool_call_id` of the call it answers (OpenAI's API requires it)."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs its `content` (text, or a list of text parts)")
        if self.role == "user" and isinstance(self.content, list) and not self.content:
            raise ValueError("a user message's `content` list needs at least one part")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the `tool_call_id` of the call it answers")
        return self

    @field_validator("tool_calls")
    @classmethod
    def _tool_call_shape(cls, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """An earlier reply's tool calls, as OpenAI returns them: `{"function": {"name", "arguments"}, ...}`
        (arguments a JSON object's text, or the object)."""
        for call in calls or ():
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                    not isinstance(fn.get("arguments"), (str, dict)) or call.get("type", "function") != "function" \
                    or not isinstance(call.get("id"), str):
                raise ValueError('each tool call needs its `id`, `type` "function" and a `function` with a `name` and '
                                 'its `arguments`: {"id": ..., "type": "function", "function": {"name": ..., '
                                 '"arguments": "{...}"}}')
        return calls

    def for_template(self) -> dict[str, Any]:
        """The message as a plain dict for `apply_chat_template`, content flattened to a string."""
        msg = self.model_dump(exclude_none=True)
        msg["content"] = self.text() or ""
        # OpenAI's newer clients send system prompts as "developer"; the Qwen template knows "system".
        if msg["role"] == "developer":
            msg["role"] = "system"
        # The template reads reasoning from `reasoning_content`; vLLM's newer clients echo it as `reasoning`.
        if isinstance(msg.get("reasoning"), str) and "reasoning_content" not in msg:
            msg["reasoning_content"] = msg["reasoning"]
        return msg


class StreamOptions(_RequestPart):
    """include_usage: a last chunk with the usage of the whole request. continuous_usage_stats (vLLM's): every
    chunk carries the usage so far (with include_usage)."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class FunctionDefinition(_RequestPart):
    """A callable function. The name must survive the XML tool-call format: letters, digits, `_.-`."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema_with_writable_names(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        """The parameters are an object schema (as OpenAI requires: a call's arguments are a JSON object), and their
        names must survive the XML format too (`<parameter=NAME>` ... `</parameter>`): no `<`, `>` or line break (a
        name `a>b` came back as parameter `a` with value `b>...`)."""
        kind = (parameters or {}).get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise ValueError(f"parameters must be a JSON Schema of type 'object' (a call's arguments are a JSON "
                             f"object), got type {str(kind)[:40]!r}")
        props = (parameters or {}).get("properties")
        if isinstance(props, dict):
            for name in props:
                if not name or any(c in name for c in "<>\r\n"):
                    raise ValueError(f"parameter name {name!r} cannot be written in the tool-call format (empty, or "
                                     f"holding <, > or a line break)")
        return parameters


class ChatTool(_RequestPart):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def unique_tool_names(tools: list[ChatTool] | None) -> list[ChatTool] | None:
    """`tools` as given. Raises ValueError when two tools share a name (a call of that name could be either)."""
    seen: set[str] = set()
    for tool in tools or ():
        if tool.function.name in seen:
            raise ValueError(f"two tools are named {tool.function.name!r}; tool names must be unique")
        seen.add(tool.function.name)
    return tools


class NamedFunction(_RequestPart):
    name: str


class NamedToolChoice(_RequestPart):
    """`{"type": "function", "function": {"name": ...}}`: call exactly this function."""

    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaSpec(_RequestPart):
    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_RequestPart):
    """`text` (no constraint), `json_object` (any JSON object) or `json_schema` (that schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(_RequestPart):
    """vLLM's `structured_outputs`: one of a JSON schema (an object, its JSON text, or `true` for any value),
    any JSON object, a regex, one of several strings, or an EBNF grammar (start rule `root`)."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: Any = None  # vLLM's; refused (not enforced here)
    # vLLM's backend options, accepted and without effect here: JSON is written compactly, a schema's undeclared
    # properties are refused unless it allows them, and there is no other backend to fall back to
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool | None = None

    # an unknown key (a typo of one of these) would otherwise leave the output unconstrained
    model_config = ConfigDict(populate_by_name=True, extra="forbid")


class SamplingFields(_Request):
    """Fields shared by chat and legacy completions."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: JsonInt | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[JsonInt, Field(ge=0)]] | None = None
    min_tokens: JsonInt = Field(default=0, ge=0)
    ignore_eos: bool = False
    n: JsonInt = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    # Extensions, as in vLLM: the matched stop string kept at the end of the text; output constraints besides
    # response_format (at most one of them all)
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: sample only these ids; never end on these words (each as tokenized alone and after a space); keep
    # only the prompt's last N tokens (-1: as many as the context holds)
    allowed_token_ids: list[Annotated[JsonInt, Field(ge=0)]] | None = Field(default=None, min_length=1)
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    truncate_prompt_tokens: JsonInt | None = Field(default=None, ge=-1)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, keep: int | None) -> int | None:
        if keep == 0:
            raise ValueError("truncate_prompt_tokens must be at least 1, or -1 (as many as the context holds)")
        return keep

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        """No empty string (it would stop at once), and none with a lone surrogate (JSON "\\ud83d": no UTF-8 text,
        so the reply could never hold it; a prompt with one gets a 400 too)."""
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("stop cannot contain an empty string")
        for i, text in enumerate([stop] if isinstance(stop, str) else stop or []):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"stop string {i}: character {e.start} is a lone surrogate (no UTF-8 text can hold "
                                 f"it)") from None
        return stop

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. max_tokens unset = whatever room the prompt leaves in the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: JsonInt | None = Field(default=None, ge=1)
    max_completion_tokens: JsonInt | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # OpenAI's: Qwen's thinking has no levels, so "none" turns it off (as chat_template_kwargs enable_thinking
    # false) and any other effort leaves it on
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # Extensions, as in vLLM.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    _unique_tools = field_validator("tools")(unique_tool_names)

    def max_new_tokens(self) -> int | None:
        """`max_completion_tokens` (the newer OpenAI name) wins over `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


#: tokens a legacy completion generates when the request sets no max_tokens (OpenAI's default for /v1/completions)
COMPLETION_DEFAULT_MAX_TOKENS = 16


class CompletionRequest(SamplingFields):
    """POST /v1/completions (legacy): a raw prompt, no chat template.

    prompt: a string, a list of strings (one completion each), a token id list, or a list of those.
    echo: the prompt text (and, with logprobs, its token logprobs) precedes each completion; with echo,
    max_tokens may be 0 to score a prompt. max_tokens unset: OpenAI's default for this endpoint,
    :data:`COMPLETION_DEFAULT_MAX_TOKENS`, or the room the prompt leaves in the context where that is less; an
    explicit null: the room left (vLLM's reading), at most the checkpoint's default if it has one (an explicit
    value that does not fit is refused). logprobs: how many top alternatives per token (0..20).
    """

    prompt: str | list[str] | list[Annotated[JsonInt, Field(ge=0)]] | list[list[Annotated[JsonInt, Field(ge=0)]]]
    max_tokens: JsonInt | None = Field(default=None, ge=0)
    echo: bool = False
    logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: JsonInt | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None


# ---- responses ----


class PromptTokensDetails(BaseModel):
    """OpenAI's breakdown of the prompt tokens: cached_tokens came from the prefix cache (not prefilled again)."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    """Chat logprobs: one entry per generated token (reasoning and tool-call markup included)."""

    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionMessage(BaseModel):
    """The assistant's reply. `content` is always present (null when the reply is only reasoning or
    tool calls); `reasoning_content` / `reasoning` (the same text) and `tool_calls` only when there are some."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self), keep=("content",))


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop_token_ids id that ended it


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self))


class DeltaToolCall(BaseModel):
    """One tool call's part of a stream chunk: its first has id, type and the name (arguments ""),
    later ones only argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self))


class DeltaMessage(BaseModel):
    """The new part of the message in one stream chunk; unset fields are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return _drop_none(handler(self))


def with_null_usage(chunk: BaseModel) -> str:
    """A stream chunk's JSON with `"usage": null`, as OpenAI sends on every chunk but the last when
    `stream_options.include_usage` is set."""
    return json.dumps({**chunk.model_dump(mode="json"), "usage": None}, ensure_ascii=False, separators=(",", ":"))


class _OptionalUsage(BaseModel):
    """A response whose `usage` is left out of the JSON while unset (stream chunks, completions)."""

    @model_serializer(mode="wrap")
    def _drop_null_usage(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("usage") is None:
            data.pop("usage", None)
        return data


class ChatCompletionChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop_token_ids id that ended it


class ChatCompletionChunk(_OptionalUsage):
    """One `chat.completion.chunk` SSE event. `usage` is only present on the include_usage chunk."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token (the first prompt token of an
    echo has no logprob)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop_token_ids id that ended it


class CompletionResponse(_OptionalUsage):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ---- tokenizer endpoints (vLLM's /tokenize and /detokenize) ----


class TokenizeRequest(_Request):
    """POST /tokenize: a raw `prompt`, or `messages` rendered by the chat template as /v1/chat/completions renders
    them (with `tools` unless `tool_choice` is "none", `chat_template_kwargs`, `add_generation_prompt`,
    `continue_final_message`); exactly one of the two. add_special_tokens: accepted for vLLM's clients (this tokenizer adds no special tokens either way).
    return_token_strs: also each token's byte-level BPE string."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # "none": tools left out
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    _unique_tools = field_validator("tools")(unique_tool_names)

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of `prompt` (text) or `messages` (a conversation)")
        return self


class TokenizeResponse(BaseModel):
    """`tokens` (ids), their `count`, the server's `max_model_len`, and `token_strs` (byte-level BPE strings) when
    asked."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    """POST /detokenize: token ids (each in the tokenizer's vocabulary) back to text, special tokens included."""

    model: str | None = None
    tokens: list[Annotated[JsonInt, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    """The text of the ids."""

    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "vibeqwen"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionInfo(BaseModel):
    version: str
