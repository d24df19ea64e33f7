"""Request bodies: the JSON object (bounded, strict), the pydantic model, prompts and messages."""
from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from qsaserve.entrypoints.llm import validate_messages
from qsaserve.errors import InvalidRequestError
from qsaserve.server.errors import bad_request, validation_error


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; every malformed body is a 400 naming 'body'."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise bad_request("body", f"body: the request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise bad_request("body", f"body: the request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("body", "body: the request body is empty; expected a JSON object")
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
        # Lone surrogates ("\ud800") decode from JSON but cannot be tokenized. Re-encoding the
        # object finds them; only bodies with a surrogate escape pay for it.
        if _SURROGATE_ESCAPE.search(raw):
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError) as e:
        raise bad_request("body", f"body: malformed JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("body", f"body: must be a JSON object, got {type(obj).__name__}")
    return obj


def parse(model: type[BaseModel], obj: dict):
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


_PROMPT_TYPES = "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists"


def normalize_prompts(prompt: Any, *, n: int, max_seqs: int, max_chars: int, max_model_len: int) -> list[str | list[int]]:
    """The request's prompts, each checked against the limits before any tokenizer or engine work:
    prompts x n at most max_seqs, texts of at most max_chars characters, token lists shorter than
    max_model_len. The checks cost O(limits), never O(body)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and is_token_id(prompt[0])):
        prompts, single = [prompt], True
    elif isinstance(prompt, list) and prompt:
        prompts, single = prompt, False
    else:
        raise bad_request("prompt", _PROMPT_TYPES)
    if len(prompts) * n > max_seqs:
        raise bad_request("prompt", f"prompt: {len(prompts)} prompts x n={n} make {len(prompts) * n} sequences; "
                                    f"at most {max_seqs} per request")
    kind = type(prompts[0])
    for i, p in enumerate(prompts):
        name = "prompt" if single else f"prompt[{i}]"
        if type(p) is not kind:
            raise bad_request("prompt", _PROMPT_TYPES)
        if isinstance(p, str):
            if not p:
                raise bad_request(name, f"{name}: must not be empty")
            if len(p) > max_chars:
                raise bad_request(name, f"{name}: the prompt has {len(p)} characters; at most {max_chars} are accepted "
                                        "(a longer text cannot fit in max_model_len tokens)")
        elif isinstance(p, list) and p:
            if len(p) >= max_model_len:
                raise bad_request(name, f"{name}: the prompt has {len(p)} tokens; max_model_len is {max_model_len} "
                                        "(room for one output token needed)")
            if not all(is_token_id(t) for t in p):
                raise bad_request("prompt", _PROMPT_TYPES)
        else:
            raise bad_request("prompt", _PROMPT_TYPES)
    return list(prompts)


def content_chars(messages: Any) -> int:
    """Characters of text in a conversation's contents (strings and text parts); malformed
    entries count as nothing here and are refused when the conversation is validated."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return total


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Validates roles/contents and flattens content-part lists to text, as chat templates expect strings."""
    validate_messages(messages)
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"messages[{i}].content[{j}]", "only {'type': 'text', 'text': str} parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        out.append({**m, "content": content if content is not None else ""})
    return out
