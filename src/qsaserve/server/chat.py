"""/v1/chat/completions: the conversation rendered with the model's chat template; structured
outputs (server/structured.py) and tool calls (server/tools.py, server/tool_parsers.py)."""
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_id,
)
from qsaserve.server.state import ServerState
from qsaserve.server.structured import compile_spec, requested_spec
from qsaserve.server.tool_parsers import CallArgs, CallStart
from qsaserve.server.tools import ToolPlan, plan_tools
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
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs", "top_logprobs: requires logprobs to be true")
        if not 0 <= req.top_logprobs <= state.limits.max_logprobs:
            raise bad_request("top_logprobs", f"top_logprobs: must be in [0, {state.limits.max_logprobs}], got {req.top_logprobs}")
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        raise bad_request("max_completion_tokens", f"max_completion_tokens: must be >= 1, got {req.max_completion_tokens}")
    plan = plan_tools(req, state.enable_auto_tool_choice, state.tool_call_parser)
    structured = requested_spec(req)
    if plan.spec is not None:
        if structured is not None:
            raise bad_request(structured[1], f"{structured[1]}: cannot be combined with tool_choice {plan.mode!r} "
                                             "(its calls are grammar-constrained already)")
        structured = (plan.spec, "tools")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    num_top = req.top_logprobs or 0
    params = req.sampling_params(max_tokens=max_tokens, logprobs=num_top if req.logprobs else None,
                                 prompt_logprobs=req.prompt_logprobs, defaults=state.sampling_defaults,
                                 structured_outputs=structured and structured[0])
    if structured is not None:
        await compile_spec(state, *structured)
    prompt_ids = await encode_conversation(state, req.messages, req.add_generation_prompt, plan.tools)
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
        return SSEResponse(_chat_stream(req, plan, params, request_id, created, model, streams[0]), streams)
    try:
        (out,) = await final_outputs(request, streams)
    except ClientGone:
        return Response(status_code=499)
    choices = []
    for c in out.outputs:
        message, finish_reason = _message(plan, c.text, c.finish_reason)
        choices.append(ChatChoice(
            index=c.index, message=message, finish_reason=finish_reason, stop_reason=c.stop_reason,
            logprobs=ChatLogprobs(content=chat_logprobs(c.logprobs or [], c.token_ids, num_top)) if req.logprobs else None,
        ))
    body = ChatCompletionResponse(
        id=request_id, created=created, model=model, choices=choices, usage=usage([out]),
        prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs) if req.prompt_logprobs is not None else None,
    )
    return JSONResponse(body.model_dump())


def _message(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[ChatMessage, str | None]:
    """The assistant message of one finished choice, its tool calls parsed out of the text."""
    parser = plan.new_parser()
    if parser is None:
        return ChatMessage(content=text), finish_reason
    parsed = parser.update(text, True)
    calls: dict[int, list[str]] = {}
    for ev in parsed.events:
        if isinstance(ev, CallStart):
            calls[ev.index] = [ev.name, ""]
        else:
            calls[ev.index][1] += ev.fragment
    if not calls:  # auto without a call, or a required array cut short by max_tokens
        return ChatMessage(content=text), finish_reason
    tool_calls = [ToolCall(id=random_id("call"), function=FunctionCall(name=name, arguments=args))
                  for name, args in calls.values()]
    return ChatMessage(content=parsed.content.strip() or None, tool_calls=tool_calls), _call_finish(plan, finish_reason)


def _call_finish(plan: ToolPlan, finish_reason: str | None) -> str | None:
    # OpenAI: "tool_calls" when the model chose to call (auto, required); a forced named call ends with "stop".
    return "tool_calls" if finish_reason == "stop" and plan.mode in ("auto", "required") else finish_reason


class _ToolStream:
    """One streamed choice's tool-call parser and what it has sent."""

    def __init__(self, plan: ToolPlan):
        self.parser = plan.new_parser()
        self.num_calls = 0
        self.content_started = False

    def deltas(self, text: str, final: bool) -> list[DeltaMessage]:
        parsed = self.parser.update(text, final)
        out = []
        content = parsed.content
        if not self.content_started:
            content = content.lstrip()
        if content and not (self.num_calls and not content.strip()):  # no whitespace between calls
            self.content_started = True
            out.append(DeltaMessage(content=content))
        for ev in parsed.events:
            if isinstance(ev, CallStart):
                self.num_calls += 1
                call = DeltaToolCall(index=ev.index, id=random_id("call"), type="function",
                                     function=DeltaFunctionCall(name=ev.name, arguments=""))
            else:
                call = DeltaToolCall(index=ev.index, function=DeltaFunctionCall(arguments=ev.fragment))
            out.append(DeltaMessage(tool_calls=[call]))
        return out


async def _chat_stream(req: ChatCompletionRequest, plan: ToolPlan, params: SamplingParams, request_id: str, created: int,
                       model: str, stream: RequestStream) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    num_top = req.top_logprobs or 0
    states = [ChoiceState() for _ in range(req.n)]
    tool_streams = [_ToolStream(plan) if plan.new_parser() is not None else None for _ in range(req.n)]
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
                tools = tool_streams[comp.index]
                if tools is not None:
                    deltas = tools.deltas(comp.text[:limit], final)
                    finish = _call_finish(plan, comp.finish_reason) if tools.num_calls else comp.finish_reason
                else:
                    deltas = [DeltaMessage(content=text)] if text else []
                    finish = comp.finish_reason
                if not deltas and lps is None and not final:
                    continue
                st.finished = final
                deltas = deltas or [DeltaMessage() if final else DeltaMessage(content="")]
                for k, delta in enumerate(deltas):
                    last_one = k == len(deltas) - 1
                    yield chunk(comp.index, delta, lps if k == 0 else None, finish if last_one else None,
                                comp.stop_reason if last_one else None)
        if include_usage and last is not None:
            yield sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage([last])))
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
        yield sse_error(e)
    finally:
        stream.abort()
    yield SSE_DONE
