"""/v1/chat/completions: the conversation rendered with the model's chat template."""
from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from qsaserve.engine.async_engine import RequestStream
from qsaserve.errors import InvalidRequestError
from qsaserve.outputs import RequestOutput
from qsaserve.sampling_params import SamplingParams
from qsaserve.server.errors import ClientGone, bad_request
from qsaserve.server.logprobs import chat_logprobs, prompt_logprobs_json, usage
from qsaserve.server.prompts import EncodedPrompt, add_requests, check_prompt_length, encode_conversation
from qsaserve.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    random_id,
)
from qsaserve.server.state import ServerState
from qsaserve.server.streaming import (
    SSE_DONE,
    ChoiceState,
    SSEResponse,
    final_outputs,
    merge,
    sse,
    sse_error,
)


async def create_chat_completion(state: ServerState, request: Request, req: ChatCompletionRequest) -> Response:
    model = state.model_name(req.model)
    req.check_common(state.limits.max_n, state.limits.max_logprobs)
    if req.tools:
        raise bad_request("tools", "tools: tool calling is not supported by this server")
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise bad_request("response_format", "response_format: only {'type': 'text'} is supported")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs", "top_logprobs: requires logprobs to be true")
        if not 0 <= req.top_logprobs <= state.limits.max_logprobs:
            raise bad_request("top_logprobs", f"top_logprobs: must be in [0, {state.limits.max_logprobs}], got {req.top_logprobs}")
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise bad_request("max_completion_tokens", f"max_completion_tokens: must be >= 1, got {req.max_completion_tokens}")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    num_top = req.top_logprobs or 0
    params = req.sampling_params(max_tokens=max_tokens, logprobs=num_top if req.logprobs else None,
                                 prompt_logprobs=req.prompt_logprobs)
    prompt_ids = await encode_conversation(state, req.messages, req.add_generation_prompt)
    check_prompt_length("messages", len(prompt_ids), state.limits.max_model_len)
    request_id = random_id("chatcmpl")
    created = int(time.time())
    try:
        streams = await add_requests(state, request_id, [EncodedPrompt(None, prompt_ids)], params)
    except InvalidRequestError as e:
        if e.param == "prompt":  # the prompt is the rendered conversation
            raise InvalidRequestError("messages", str(e).removeprefix("prompt: ")) from None
        raise
    if req.stream:
        return SSEResponse(_chat_stream(req, params, request_id, created, model, streams[0]), streams)
    try:
        (out,) = await final_outputs(request, streams)
    except ClientGone:
        return Response(status_code=499)
    choices = [
        ChatChoice(
            index=c.index, message=ChatMessage(content=c.text), finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            logprobs=ChatLogprobs(content=chat_logprobs(c.logprobs or [], c.token_ids, num_top)) if req.logprobs else None,
        )
        for c in out.outputs
    ]
    body = ChatCompletionResponse(
        id=request_id, created=created, model=model, choices=choices, usage=usage([out]),
        prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs) if req.prompt_logprobs is not None else None,
    )
    return JSONResponse(body.model_dump())


async def _chat_stream(req: ChatCompletionRequest, params: SamplingParams, request_id: str, created: int, model: str,
                       stream: RequestStream) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    num_top = req.top_logprobs or 0
    states = [ChoiceState() for _ in range(req.n)]
    last: RequestOutput | None = None

    def chunk(index: int, delta: DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None) -> str:
        body = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[
            ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
        ])
        return sse(body, exclude)

    try:
        for i in range(req.n):  # the role comes first, as OpenAI sends it
            yield chunk(i, DeltaMessage(role="assistant", content=""))
        async for _, out in merge([stream]):
            last = out
            for comp in out.outputs:
                st = states[comp.index]
                if st.finished:
                    continue
                final = comp.finish_reason is not None
                limit = st.sendable(comp.text, final, params.stop_matcher)
                text = ""
                if limit > st.sent_chars:
                    text = comp.text[st.sent_chars:limit]
                    st.sent_chars = limit
                lps = None
                if req.logprobs and len(comp.token_ids) > st.sent_tokens:
                    lps = ChatLogprobs(content=chat_logprobs((comp.logprobs or [])[st.sent_tokens:], comp.token_ids[st.sent_tokens:], num_top))
                st.sent_tokens = len(comp.token_ids)
                if not text and lps is None and not final:
                    continue
                st.finished = final
                yield chunk(comp.index, DeltaMessage(content=text) if text or not final else DeltaMessage(), lps,
                            comp.finish_reason, comp.stop_reason)
        if include_usage and last is not None:
            yield sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage([last])))
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
        yield sse_error(e)
    finally:
        stream.abort()
    yield SSE_DONE
