"""The wire: Ollama's and OpenAI's request and response shapes as typed structs.

As Ollama's `api/types.go`, this module is the one place that says what goes over HTTP. Requests
are decoded straight into these structs by msgspec (`api.codec`), so a field of the wrong type
is a 400 naming the field before any handler runs. Every request field may be `null`, which
means "absent", as it does for Go's JSON decoder. Responses are encoded from them: structs
marked `omit_defaults` leave out their `None` fields, where Ollama leaves out empty ones, so a
streamed chunk carries no metrics and a load answer carries no `context`. A field without a
default is always written, `null` included (OpenAI's `finish_reason`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

# -- Ollama: requests ---------------------------------------------------------------------------


class GenerateRequest(msgspec.Struct):
    model: str | None = None
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    stream: bool | None = None
    format: Any = None  # "json" or a JSON schema object
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None  # seconds, or a Go duration string
    think: bool | str | None = None
    images: list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    truncate: bool | None = None  # false: a prompt too long for the context is a 400, not cut
    debug_render_only: bool | None = msgspec.field(default=None, name="_debug_render_only")


class Message(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    thinking: str | None = None


class ChatRequest(msgspec.Struct):
    model: str | None = None
    messages: list[Message] | None = None
    stream: bool | None = None
    format: Any = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    think: bool | str | None = None
    tools: list[Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    truncate: bool | None = None  # false: a prompt too long for the context is a 400, not cut
    debug_render_only: bool | None = msgspec.field(default=None, name="_debug_render_only")


class ModelRequest(msgspec.Struct):
    """show, pull and delete: a model by `model` (or Ollama's older `name`)."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None  # show
    stream: bool | None = None  # pull
    insecure: bool | None = None  # pull: accepted for compatibility; the hub is always https


class CopyRequest(msgspec.Struct):
    source: str | None = None
    destination: str | None = None


class CreateRequest(msgspec.Struct):
    """/api/create: a new model `from` an existing one, with adapters ({file name: blob
    digest}), parameters, a system prompt, a template, seed messages; or the legacy
    `modelfile` text."""

    model: str | None = None
    name: str | None = None  # legacy
    from_: str | None = msgspec.field(default=None, name="from")
    adapters: dict[str, str] | None = None
    files: dict[str, str] | None = None
    parameters: dict[str, Any] | None = None
    system: str | None = None
    template: str | None = None
    messages: list[Message] | None = None
    license: str | list[str] | None = None
    quantize: str | None = None
    modelfile: str | None = None  # legacy
    path: str | None = None  # legacy: where the Modelfile was (for relative ADAPTER paths)
    stream: bool | None = None


# -- Ollama: responses --------------------------------------------------------------------------


class GenerateResponse(msgspec.Struct, omit_defaults=True):
    """One object of /api/generate: a chunk (`done` false) or the final one."""

    model: str
    created_at: datetime
    response: str
    done: bool
    thinking: str | None = None
    done_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None
    context: list[int] | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    # mlxd's extras: the prefix cache and speculation (clients ignore unknown keys)
    prompt_cache_tokens: int | None = None
    draft_method: str | None = None
    draft_count: int | None = None
    draft_accepted: int | None = None
    draft_acceptance_rate: float | None = None
    draft_tokens_per_round: float | None = None
    draft_acceptance_by_position: list[float] | None = None
    draft_filled: int | None = None
    draft_filled_accepted: int | None = None
    draft_fallback_reason: str | None = None
    draft_disabled_reason: str | None = None


class ToolCallFunction(msgspec.Struct):
    index: int
    name: str
    arguments: dict[str, Any]


class ToolCallOut(msgspec.Struct):
    """A parsed call as Ollama writes it: `index` inside `function`, arguments an object."""

    id: str
    function: ToolCallFunction


class ResponseMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str
    thinking: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatResponse(msgspec.Struct, omit_defaults=True):
    """One object of /api/chat."""

    model: str
    created_at: datetime
    message: ResponseMessage
    done: bool
    done_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    prompt_cache_tokens: int | None = None
    draft_method: str | None = None
    draft_count: int | None = None
    draft_accepted: int | None = None
    draft_acceptance_rate: float | None = None
    draft_tokens_per_round: float | None = None
    draft_acceptance_by_position: list[float] | None = None
    draft_filled: int | None = None
    draft_filled_accepted: int | None = None
    draft_fallback_reason: str | None = None
    draft_disabled_reason: str | None = None


class ModelSummary(msgspec.Struct, omit_defaults=True):
    """One model of /api/tags."""

    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: dict[str, Any]
    unavailable: str | None = None  # mlxd's: why a pairing that failed its probe is not served
    status: str | None = None  # mlxd's: "probing" while it is opened and checked at startup


class TagsResponse(msgspec.Struct, omit_defaults=True):
    models: list[ModelSummary]
    warning: str | None = None  # mlxd's extra: a registry edit that was not applied


class DraftInfo(msgspec.Struct):
    model: str
    path: str


class ShowResponse(msgspec.Struct, omit_defaults=True):
    modelfile: str
    parameters: str
    template: str
    details: dict[str, Any]
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str
    system: str | None = None
    license: str | None = None  # the model directory's license file
    messages: list[dict[str, str]] | None = None  # the MESSAGE lines a chat starts with
    draft: DraftInfo | None = None  # mlxd's: the pairing's draft model
    unavailable: str | None = None


class RunningModel(msgspec.Struct, omit_defaults=True):
    """One model of /api/ps; `ranks` (mlxd's) for a target sharded over several processes;
    `serves` (mlxd's) every entry a base shared by several (adapter entries) serves now."""

    name: str
    model: str
    size: int
    size_vram: int
    digest: str
    details: dict[str, Any]
    expires_at: str
    context_length: int
    ranks: list[str] | None = None
    serves: list[str] | None = None


class PsResponse(msgspec.Struct):
    models: list[RunningModel]


class ErrorResponse(msgspec.Struct):
    error: str


class VersionResponse(msgspec.Struct):
    version: str


# -- OpenAI: requests ---------------------------------------------------------------------------


class OpenAIMessage(msgspec.Struct):
    role: str | None = None
    content: str | list[Any] | None = None  # a string or content parts
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Any] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: str | None = None
    json_schema: dict[str, Any] | None = None


class Reasoning(msgspec.Struct):
    effort: str | None = None


class ChatCompletionRequest(msgspec.Struct):
    model: str | None = None
    messages: list[OpenAIMessage] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # newer SDKs send this name instead
    seed: int | None = None
    stop: str | list[Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    response_format: ResponseFormat | None = None
    format: Any = None  # the native routes' `format`, accepted here too (not with the above)
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    reasoning: Reasoning | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(msgspec.Struct):
    model: str | None = None
    prompt: str | None = None
    suffix: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: int | None = None  # the legacy API's count of alternatives per token
    response_format: ResponseFormat | None = None
    format: Any = None


# -- OpenAI: responses --------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # restored from the prefix cache, as OpenAI reports its own


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


ZERO_USAGE = Usage(0, 0, 0)


class FunctionOut(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None  # a JSON string, as OpenAI sends it


class OpenAIToolCall(msgspec.Struct, omit_defaults=True):
    """A call in a message, or (with `index`) in a streamed delta."""

    function: FunctionOut
    id: str | None = None
    type: str | None = None
    index: int | None = None


class ChoiceMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None  # Ollama's name for the same text
    tool_calls: list[OpenAIToolCall] | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[OpenAIToolCall] | None = None


class ChatChoice(msgspec.Struct, omit_defaults=True):
    index: int
    message: ChoiceMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # {"content": [...]} when asked for


class ChunkChoice(msgspec.Struct, omit_defaults=True):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class TextChoice(msgspec.Struct, omit_defaults=True):
    text: str
    index: int
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # tokens, token_logprobs, top_logprobs, text_offset


class Completion(msgspec.Struct, omit_defaults=True):
    """Every /v1 completion object: whole answers, stream chunks and the usage chunk.

    `object` tells them apart; `choices` holds the route's choice type; `usage` is omitted
    where OpenAI omits it (stream chunks without `include_usage`).
    """

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice] | list[ChunkChoice] | list[TextChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(msgspec.Struct):
    object: str
    data: list[ModelCard]


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(msgspec.Struct):
    error: OpenAIErrorDetail


# -- embeddings -----------------------------------------------------------------------------------


class EmbedRequest(msgspec.Struct):
    """/api/embed; `input` is checked by the handler (Ollama: "invalid input type")."""

    model: str | None = None
    input: Any = None  # a string or a list of strings
    truncate: bool | None = None
    dimensions: int | None = None
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None
    prefix: str | None = None  # mlxd's: "query", "document" (the model's table) or the text


class EmbedResponse(msgspec.Struct, omit_defaults=True):
    model: str
    embeddings: list[list[float]]
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None


class EmbeddingsRequest(msgspec.Struct):
    """The legacy /api/embeddings."""

    model: str | None = None
    prompt: str | None = None
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None


class EmbeddingsResponse(msgspec.Struct):
    embedding: list[float]


class OpenAIEmbeddingRequest(msgspec.Struct):
    model: str | None = None
    input: Any = None  # a string, a list of strings, token ids or lists of token ids
    encoding_format: str | None = None  # "float" or "base64"
    dimensions: int | None = None
    user: str | None = None
    prefix: str | None = None  # as EmbedRequest.prefix


class EmbeddingItem(msgspec.Struct):
    object: str
    embedding: list[float] | str
    index: int


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    object: str
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage
