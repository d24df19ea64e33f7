"""Request and response models of the OpenAI-compatible API (OpenAI field names, plus vLLM's
sampling extras). Requests are strict: "5" is not an integer and 1.0 is not a count, so type
mistakes come back as 400s naming the field instead of being silently coerced."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from qsaserve.errors import InvalidRequestError
from qsaserve.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Every integer a request carries fits in 64 bits: larger ones would overflow device tensors.
Int = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class _Request(BaseModel):
    # Unknown fields are ignored (as vLLM does), so clients sending newer OpenAI fields still work.
    # JSON numbers that overflow a double (1e400) arrive as inf: refused, as NaN is.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---------------- errors ----------------
class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# ---------------- shared request fields ----------------
class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    model: str | None = None
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Int | None = None
    # Structured outputs (server/structured.py): OpenAI's response_format, vLLM's fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop", "stop_token_ids", mode="before")
    @classmethod
    def _bounded_stop_count(cls, value, info):
        # Before the elements are validated: a list of 600,000 strings is refused at O(1) cost.
        limit, what = (MAX_STOP_STRINGS, "stop strings") if info.field_name == "stop" else (MAX_STOP_TOKEN_IDS, "stop token ids")
        if isinstance(value, list) and len(value) > limit:
            raise ValueError(f"at most {limit} {what}, got {len(value)}")
        return value

    def check_common(self, max_n: int, max_logprobs: int) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options", "is only allowed when stream is true")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias", "is not supported by this server")
        if isinstance(self.n, int) and self.n > max_n:
            raise InvalidRequestError("n", f"must be <= {max_n}, got {self.n}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise InvalidRequestError("seed", f"must fit in a signed 64-bit integer, got {self.seed}")
        if self.prompt_logprobs is not None and self.prompt_logprobs > max_logprobs:
            raise InvalidRequestError("prompt_logprobs", f"must be <= {max_logprobs}, got {self.prompt_logprobs}")

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                        defaults: dict[str, float] | None = None, structured_outputs=None) -> SamplingParams:
        """Builds validated SamplingParams (raises InvalidRequestError naming the bad field).
        defaults: the server's values for unset fields (--generation-config), else vLLM's."""
        d = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, **(defaults or {})}

        def pick(name: str):
            value = getattr(self, name)
            return d[name] if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty"),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured_outputs,
        )


# ---------------- /v1/completions ----------------
class CompletionRequest(_SamplingRequest):
    # str | list[int] | list[str] | list[list[int]]; checked by the server to name the bad element.
    prompt: Any = Field(...)
    max_tokens: Int | None = 16
    echo: bool = False
    logprobs: Int | None = None
    best_of: Int | None = None
    suffix: str | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    logprob: float
    rank: int
    decoded_token: str | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


# ---------------- /v1/chat/completions ----------------
class ChatCompletionRequest(_SamplingRequest):
    # list of {role, content}; roles and content are checked by validate_messages.
    messages: list[dict[str, Any]]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    # Tool calling (server/tools.py); shapes checked there, to name the bad element.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---------------- models, tokenizer ----------------
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "qsaserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(_Response):
    prompt: str
