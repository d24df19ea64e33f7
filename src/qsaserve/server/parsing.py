"""Request bodies: the JSON object (bounded, strict), the pydantic model, prompts and messages."""
from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from qsaserve.entrypoints.llm import validate_messages
from qsaserve.errors import InvalidRequestError
from qsaserve.server.errors import bad_request, validation_error


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
        # Lone surrogates ("\ud800") decode from JSON but cannot be tokenized.
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


def normalize_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(is_token_id(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(is_token_id(t) for t in p) for p in prompt):
            return list(prompt)
    raise bad_request("prompt", "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists")


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
