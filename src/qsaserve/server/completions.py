"""/v1/completions: OpenAI's text completions (legacy logprobs, echo, several prompts per request)."""
from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from qsaserve.engine.async_engine import RequestStream
from qsaserve.outputs import RequestOutput
from qsaserve.sampling_params import SamplingParams
from qsaserve.server.errors import ClientGone, bad_request
from qsaserve.server.logprobs import concat_logprobs, legacy_logprobs, prompt_logprobs_json, usage
from qsaserve.server.parsing import normalize_prompts
from qsaserve.server.prompts import EncodedPrompt, add_requests, encode_prompts
from qsaserve.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    random_id,
)
from qsaserve.server.state import ServerState
from qsaserve.server.structured import compile_spec, requested_spec
from qsaserve.server.tokenizer import decode
from qsaserve.server.streaming import (
    SSE_DONE,
    ChoiceState,
    SSEResponse,
    final_outputs,
    merge,
    sse,
    sse_error,
)


async def create_completion(state: ServerState, request: Request, req: CompletionRequest) -> Response:
    model = state.model_name(req.model)
    req.check_common(state.limits.max_n, state.limits.max_logprobs)
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of", "best_of: only best_of == n (or unset) is supported")
    if req.suffix:
        raise bad_request("suffix", "suffix: is not supported by this server")
    if req.logprobs is not None and req.logprobs > state.limits.max_logprobs:
        raise bad_request("logprobs", f"logprobs: must be <= {state.limits.max_logprobs}, got {req.logprobs}")
    echo_lps = req.echo and req.logprobs is not None
    prompt_lps = req.prompt_logprobs
    if echo_lps:
        prompt_lps = max(req.logprobs, prompt_lps or 0)
    structured = requested_spec(req)
    params = req.sampling_params(max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_lps,
                                 defaults=state.sampling_defaults, structured_outputs=structured and structured[0])
    limits = state.limits
    texts_or_ids = normalize_prompts(req.prompt, n=params.n, max_seqs=limits.max_seqs_per_request,
                                     max_chars=limits.max_prompt_chars, max_model_len=limits.max_model_len)

    if structured is not None:
        await compile_spec(state, *structured)
    prompts = await encode_prompts(state, texts_or_ids)
    request_id = random_id("cmpl")
    created = int(time.time())
    streams = await add_requests(state, request_id, prompts, params)
    if req.stream:
        return SSEResponse(_completion_stream(state, req, params, request_id, created, model, prompts, streams), streams)
    try:
        finals = await final_outputs(request, streams)
    except ClientGone:
        return Response(status_code=499)
    choices = []
    for pi, out in enumerate(finals):
        prompt_text, first_tok = await _echo_parts(state, prompts[pi], out, req.echo, echo_lps)
        for comp in out.outputs:
            text, lp, offset = "", None, 0
            if req.echo:
                text = prompt_text
                if echo_lps:
                    lp, offset = legacy_logprobs(out.prompt_logprobs or [], out.prompt_token_ids, req.logprobs, 0, first_tok)
            text += comp.text
            if req.logprobs is not None:
                gen, _ = legacy_logprobs(comp.logprobs or [], comp.token_ids, req.logprobs, offset)
                lp = gen if lp is None else concat_logprobs(lp, gen)
            choices.append(CompletionChoice(
                index=pi * req.n + comp.index, text=text, logprobs=lp, finish_reason=comp.finish_reason,
                stop_reason=comp.stop_reason,
                prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs) if req.prompt_logprobs is not None else None,
            ))
    body = CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage(finals))
    return JSONResponse(body.model_dump())


async def _echo_parts(state: ServerState, prompt: EncodedPrompt, out: RequestOutput, echo: bool,
                      with_logprobs: bool) -> tuple[str, str | None]:
    """The prompt text to echo and the text of its first token (which has no logprob entry)."""
    if not echo:
        return "", None
    pool = state.tokenizer
    text = prompt.text if prompt.text is not None else await pool.run(decode, prompt.token_ids, chars=len(prompt.token_ids))
    first = await pool.run(decode, out.prompt_token_ids[:1]) if with_logprobs else None
    return text, first


async def _completion_stream(state: ServerState, req: CompletionRequest, params: SamplingParams, request_id: str,
                             created: int, model: str, prompts: list[EncodedPrompt],
                             streams: list[RequestStream]) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    echo_lps = req.echo and req.logprobs is not None
    choices: dict[int, ChoiceState] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        async for pi, out in merge(streams):
            if out.finished:
                finals[pi] = out
            for comp in out.outputs:
                idx = pi * req.n + comp.index
                st = choices.setdefault(idx, ChoiceState())
                if st.finished:
                    continue
                final = comp.finish_reason is not None
                text, lp = "", None
                if req.echo and not st.started:
                    if not comp.token_ids and not final:
                        continue  # the prompt (and its logprobs) is not fully processed yet
                    prompt_text, first_tok = await _echo_parts(state, prompts[pi], out, True, echo_lps)
                    text = prompt_text
                    if echo_lps:
                        lp, st.offset = legacy_logprobs(out.prompt_logprobs or [], out.prompt_token_ids, req.logprobs, 0, first_tok)
                    else:
                        st.offset = len(prompt_text)
                st.started = True
                limit = st.sendable(comp.text, final, params.stop_matcher)
                if limit > st.sent_chars:
                    text += comp.text[st.sent_chars:limit]
                    st.sent_chars = limit
                if req.logprobs is not None and len(comp.token_ids) > st.sent_tokens:
                    gen, st.offset = legacy_logprobs((comp.logprobs or [])[st.sent_tokens:], comp.token_ids[st.sent_tokens:],
                                                     req.logprobs, st.offset)
                    lp = gen if lp is None else concat_logprobs(lp, gen)
                st.sent_tokens = len(comp.token_ids)
                if not text and lp is None and not final:
                    continue
                st.finished = final
                chunk = CompletionStreamResponse(
                    id=request_id, created=created, model=model,
                    choices=[CompletionStreamChoice(index=idx, text=text, logprobs=lp, finish_reason=comp.finish_reason,
                                                    stop_reason=comp.stop_reason)],
                )
                yield sse(chunk, exclude)
        if include_usage:
            total = usage([finals[i] for i in sorted(finals)])
            yield sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=total))
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
        yield sse_error(e)
    finally:
        for s in streams:
            s.abort()
    yield SSE_DONE
