"""Prompts from request fields to engine inputs: tokenized on the tokenizer pool, each checked
against the context length before it reaches the engine thread."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qsaserve.engine.async_engine import RequestStream
from qsaserve.errors import InvalidRequestError
from qsaserve.sampling_params import SamplingParams
from qsaserve.server.errors import bad_request
from qsaserve.server.parsing import content_chars
from qsaserve.server.state import ServerState
from qsaserve.server.tokenizer import encode_texts, render_chat


@dataclass(frozen=True)
class EncodedPrompt:
    text: str | None  # None for a prompt sent as token ids
    token_ids: list[int]

    def engine_input(self) -> dict:
        return {"prompt_token_ids": self.token_ids} if self.text is None else {"prompt": self.text, "prompt_token_ids": self.token_ids}


def check_prompt_length(name: str, num_tokens: int, max_model_len: int) -> None:
    if num_tokens == 0:
        raise InvalidRequestError(name, "must contain at least one token")
    if num_tokens >= max_model_len:
        raise InvalidRequestError(name, f"the prompt has {num_tokens} tokens; max_model_len is {max_model_len} "
                                        "(room for one output token needed)")


async def encode_prompts(state: ServerState, prompts: list[str | list[int]]) -> list[EncodedPrompt]:
    """Prompts already bounded by normalize_prompts; all texts of a request are one tokenizer job."""
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(await state.tokenizer.run(encode_texts, texts, chars=sum(map(len, texts))) if texts else ())
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            ids = next(encoded)
            check_prompt_length("prompt" if len(prompts) == 1 else f"prompt[{i}]", len(ids), state.limits.max_model_len)
            out.append(EncodedPrompt(p, ids))
        else:
            out.append(EncodedPrompt(None, p))
    return out


def check_conversation_size(state: ServerState, messages: Any) -> int:
    """The conversation's content characters, refused over max_prompt_chars before rendering, as
    is a conversation of max_model_len messages or more (each renders to one token at least)."""
    if isinstance(messages, list) and len(messages) >= state.limits.max_model_len:
        raise bad_request("messages", f"messages: {len(messages)} messages cannot fit in max_model_len "
                                      f"{state.limits.max_model_len} tokens")
    chars = content_chars(messages)
    limit = state.limits.max_prompt_chars
    if chars > limit:
        raise bad_request("messages", f"messages: the conversation has {chars} characters of content; at most {limit} "
                                      "are accepted (a longer text cannot fit in max_model_len tokens)")
    return chars


async def encode_conversation(state: ServerState, messages: Any, add_generation_prompt: bool,
                              tools: list[dict] | None = None) -> list[int]:
    chars = check_conversation_size(state, messages)
    return await state.tokenizer.run(render_chat, messages, add_generation_prompt, state.chat_template, tools,
                                     state.tool_call_parser, chars=chars)


async def add_requests(state: ServerState, request_id: str, prompts: list[EncodedPrompt],
                       params: SamplingParams) -> list[RequestStream]:
    entries = [(f"{request_id}-{i}", p.engine_input(), params) for i, p in enumerate(prompts)]
    streams = await state.engine.add_requests(entries)
    state.drain.watch_streams(streams)  # a shutdown past its grace period ends them
    return streams
