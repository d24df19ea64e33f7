"""Logprobs in the response formats: OpenAI's legacy completions format, chat's, vLLM's prompt_logprobs."""
from __future__ import annotations

from typing import Sequence

from qsaserve.outputs import PositionLogprobs, RequestOutput
from qsaserve.server.protocol import CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob, UsageInfo


def legacy_logprobs(entries: Sequence[PositionLogprobs | None], token_ids: Sequence[int], num_top: int,
                    offset: int, first_token: str | None = None) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy completions format. text_offset indexes the choice's `text` (which starts
    with the prompt when echo is on). top_logprobs holds the top num_top plus the chosen token."""
    lp = CompletionLogprobs()
    for tid, entry in zip(token_ids, entries):
        if entry is None:  # the first prompt token has no context, so no logprob
            text = first_token or ""
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
        else:
            chosen = entry[tid]
            text = chosen.decoded_token or ""
            lp.token_logprobs.append(chosen.logprob)
            top: dict[str, float] = {}
            for t, item in sorted(entry.items(), key=lambda kv: kv[1].rank):
                if item.rank <= num_top or t == tid:
                    top.setdefault(item.decoded_token or "", item.logprob)
            lp.top_logprobs.append(top)
        lp.tokens.append(text)
        lp.text_offset.append(offset)
        offset += len(text)
    return lp, offset


def concat_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset,
    )


def chat_logprobs(entries: Sequence[PositionLogprobs], token_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    out = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry[tid]
        tops = sorted((item for item in entry.values() if item.rank <= num_top), key=lambda item: item.rank)[:num_top]
        token = chosen.decoded_token or ""
        out.append(TokenLogprob(
            token=token, logprob=chosen.logprob, bytes=list(token.encode("utf-8")),
            top_logprobs=[TopLogprob(token=t.decoded_token or "", logprob=t.logprob,
                                     bytes=list((t.decoded_token or "").encode("utf-8"))) for t in tops],
        ))
    return out


def prompt_logprobs_json(entries) -> list[dict[str, PromptLogprob] | None] | None:
    if entries is None:
        return None
    return [
        None if e is None else {str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token) for t, lp in e.items()}
        for e in entries
    ]


def usage(outputs: Sequence[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
