"""OpenAI-compatible request and response models (the chat completions subset VibeQwen serves).

Requests accept the OpenAI fields plus a few vLLM-style extensions (`top_k`, `chat_template_kwargs`,
`stop_token_ids`, `ignore_eos`, `skip_special_tokens`). Unknown fields are ignored, as OpenAI clients
send many optional ones.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


def random_id(prefix: str) -> str:
    """An OpenAI-style id such as `chatcmpl-<32 hex digits>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in seconds, for `created`."""
    return int(time.time())


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error reply: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


class ContentPart(BaseModel):
    """One part of a message's content list; only `{"type": "text", "text": ...}` is served."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A chat message. Extra fields (`reasoning_content`, ...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str | None:
        """The content as one string; text parts are concatenated as the Qwen chat template does.

        Raises ValueError for non-text parts (this server has no vision or audio tower).
        """
        if not isinstance(self.content, list):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported; send text parts")
            texts.append(part.text)
        return "".join(texts)

    def for_template(self) -> dict[str, Any]:
        """The message as a plain dict for `apply_chat_template`, content flattened to a string."""
        msg = self.model_dump(exclude_none=True)
        msg["content"] = self.text() or ""
        # OpenAI's newer clients send system prompts as "developer"; the Qwen template knows "system".
        if msg["role"] == "developer":
            msg["role"] = "system"
        return msg


class StreamOptions(BaseModel):
    include_usage: bool | None = False


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions. Unset sampling fields fall back to temperature 1, top_p 1 and
    max_tokens = whatever room the prompt leaves in the context."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: bool | None = False
    # Extensions, as in vLLM.
    top_k: int | None = Field(default=None, ge=-1)
    chat_template_kwargs: dict[str, Any] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def max_new_tokens(self) -> int | None:
        """`max_completion_tokens` (the newer OpenAI name) wins over `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: ChatCompletionMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    """The new part of the message in one stream chunk; unset fields are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One `chat.completion.chunk` SSE event. `usage` is only present on the include_usage chunk."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None

    @model_serializer(mode="wrap")
    def _drop_null_usage(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("usage") is None:
            data.pop("usage", None)
        return data


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "vibeqwen"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
