"""Structured-output request fields to one StructuredOutputsParams, compiled before the request
reaches the engine.

Accepted spellings: OpenAI's `response_format` ({"type": "json_object"} or {"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}), vLLM's `structured_outputs`
({"json" | "regex" | "choice" | "grammar" | "json_object": ..., "disable_any_whitespace"}) and
its legacy `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. At most one of them
per request; each error names the field the client sent.
"""
from __future__ import annotations

import asyncio
from typing import Any

from qsaserve.engine.structured_output import GrammarCompileError
from qsaserve.errors import InvalidRequestError
from qsaserve.sampling_params import StructuredOutputsParams
from qsaserve.server.errors import bad_request
from qsaserve.server.state import ServerState

_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_VLLM_KEYS = (*StructuredOutputsParams.KINDS, "disable_any_whitespace")


def requested_spec(req) -> tuple[StructuredOutputsParams, str] | None:
    """The request's grammar and the field it came from (None without one)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        spec = _from_response_format(rf)
        if spec is not None:
            found.append((spec, "response_format"))
    if req.structured_outputs is not None:
        found.append((_from_vllm(req.structured_outputs), "structured_outputs"))
    for name, kind in _LEGACY.items():
        value = getattr(req, name)
        if value is not None:
            found.append((_build(name, **{kind: value}), name))
    if len(found) > 1:
        raise bad_request(found[1][1], f"{found[1][1]}: only one of response_format, structured_outputs and guided_* "
                                       f"may be given; got {', '.join(f for _, f in found)}")
    return found[0] if found else None


def _build(param: str, **kwargs) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except InvalidRequestError as e:
        message = str(e).split(": ", 1)[1] if ": " in str(e) else str(e)
        raise bad_request(param, f"{param}: {message}") from None


def _from_response_format(rf: Any) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict):
        raise bad_request("response_format", "response_format: must be an object with a 'type'")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _build("response_format", json_object=True, disable_any_whitespace=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("response_format.json_schema", "response_format.json_schema: must be an object with "
                                                             "'name' and 'schema'")
        schema = js.get("schema", {"type": "object"})  # OpenAI: without a schema, any object
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema", "response_format.json_schema.schema: must be a "
                                                                    "JSON schema object")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("response_format.json_schema.strict", "response_format.json_schema.strict: must be a boolean")
        # The output always follows the schema exactly (xgrammar's strict mode: no properties the
        # schema does not list), so strict=true is honoured and strict=false is stricter than asked.
        # No free whitespace between JSON tokens: small models given it emit newlines until
        # max_tokens (structured_outputs.json keeps vLLM's default, whitespace allowed).
        return _build("response_format.json_schema.schema", json=schema, disable_any_whitespace=True)
    raise bad_request("response_format.type", f"response_format.type: must be text, json_object or json_schema, got {kind!r}")


def _from_vllm(so: Any) -> StructuredOutputsParams:
    if not isinstance(so, dict):
        raise bad_request("structured_outputs", "structured_outputs: must be an object")
    unknown = sorted(set(so) - set(_VLLM_KEYS))
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]}", f"structured_outputs.{unknown[0]}: is not supported "
                                                               f"(supported: {', '.join(_VLLM_KEYS)})")
    try:
        return StructuredOutputsParams(**so)
    except InvalidRequestError as e:
        raise bad_request(e.param, str(e)) from None


async def compile_spec(state: ServerState, spec: StructuredOutputsParams, field: str) -> None:
    """Waits for spec's grammar on the compile pool (never the event loop or the engine thread);
    a grammar that cannot compile is a 400 naming `field`."""
    try:
        await asyncio.wrap_future(state.engine.engine.structured_outputs.compile(spec))
    except GrammarCompileError as e:
        detail = str(e).split(": ", 1)[1] if ": " in str(e) else str(e)
        raise bad_request(field, f"{field}: {detail}") from None
