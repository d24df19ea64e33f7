"""Tool calling: the request's `tools` / `tool_choice` / `parallel_tool_calls`, the tools in the
prompt, and the parser that turns the output into OpenAI tool calls.

tool_choice:
- "none": the tools are rendered into the prompt; the output is text.
- "auto" (the default when tools are given): the output is parsed by the server's
  --tool-call-parser; needs --enable-auto-tool-choice, as in vLLM.
- "required": grammar-constrained to a JSON array of one or more {name, arguments} calls (one
  with parallel_tool_calls=false), each arguments object following its tool's schema.
- {"type": "function", "function": {"name": N}}: grammar-constrained to N's arguments object.

Templates that know tools (they mention `tools`) get them through apply_chat_template(tools=);
for the others (SmolLM2's) the tools are described in a system message in the parser's format
and earlier calls / results are written into the messages' text, so they still round-trip.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from qsaserve.sampling_params import StructuredOutputsParams
from qsaserve.server.errors import bad_request
from qsaserve.server.tool_parsers import TOOL_CALL_PARSERS, JsonArrayParser, NamedParser

MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict] | None  # the validated tools (None without any)
    name: str | None = None  # the named function
    spec: StructuredOutputsParams | None = None  # the grammar of required / named
    parser: str | None = None  # auto: the --tool-call-parser

    def new_parser(self):
        """A fresh parser for one choice (None: the output is plain text)."""
        if self.mode == "required":
            return JsonArrayParser(self.tools)
        if self.mode == "named":
            return NamedParser(self.name)
        if self.mode == "auto":
            return TOOL_CALL_PARSERS[self.parser](self.tools)
        return None


def plan_tools(req, auto_enabled: bool, parser: str | None) -> ToolPlan:
    tools = _validate_tools(req.tools) if req.tools else None
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if tools is None:
        if choice != "none":
            raise bad_request("tool_choice", "tool_choice: needs tools")
        return ToolPlan("none", None)
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise bad_request("tool_choice", 'tool_choice: "auto" needs the server to run with --enable-auto-tool-choice '
                                             "and --tool-call-parser (or send tool_choice \"required\" or a named function)")
        return ToolPlan("auto", tools, parser=parser)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                    "arguments": _parameters(t)},
                  "required": ["name", "arguments"]} for t in tools]
        schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, spec=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice", 'tool_choice: must be "none", "auto", "required" or '
                                             '{"type": "function", "function": {"name": ...}}')
        match = [t for t in tools if t["function"]["name"] == name]
        if not match:
            raise bad_request("tool_choice", f"tool_choice: names {name!r}, which is not among the tools")
        return ToolPlan("named", tools, name=name,
                        spec=StructuredOutputsParams(json=_parameters(match[0]), disable_any_whitespace=True))
    raise bad_request("tool_choice", f'tool_choice: must be "none", "auto", "required" or a named function, got {choice!r}')


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _validate_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request("tools", f"tools: must be a list of at most {MAX_TOOLS} tools")
    seen = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}]", f'tools[{i}]: must be {{"type": "function", "function": {{...}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise bad_request(f"tools[{i}].function.name", f"tools[{i}].function.name: must be a string of 1 to 64 characters")
        if name in seen:
            raise bad_request(f"tools[{i}].function.name", f"tools[{i}].function.name: {name!r} is given twice")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters", f"tools[{i}].function.parameters: must be a JSON schema object")
        if fn.get("description") is not None and not isinstance(fn.get("description"), str):
            raise bad_request(f"tools[{i}].function.description", f"tools[{i}].function.description: must be a string")
    return tools


# ---- the prompt (runs on a tokenizer worker, with the normalized messages) ----
def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def prepare_messages(messages: list[dict], tools: list[dict] | None, template: str | None,
                     parser: str | None) -> tuple[list[dict], list[dict] | None]:
    """The messages and the `tools` argument for apply_chat_template."""
    if template_knows_tools(template):
        return [_arguments_as_objects(m) for m in messages], tools
    fmt = parser if parser in TOOL_CALL_PARSERS else "hermes"
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_render_call(c.get("function") or {}, fmt) for c in m["tool_calls"] if isinstance(c, dict))
            m = {**m, "content": (m.get("content") or "") + ("\n" if m.get("content") else "") + calls}
        elif m.get("role") == "tool":
            m = {**m, "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if tools:
        text = _tools_system_text(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


def _arguments_as_objects(m: dict) -> dict:
    """Templates write tool_call.arguments with tojson: give them the object, not its text."""
    if m.get("role") != "assistant" or not m.get("tool_calls"):
        return m
    calls = copy.deepcopy(m["tool_calls"])
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
    return {**m, "tool_calls": calls}


def _render_call(fn: dict, fmt: str) -> str:
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if fmt == "qwen3_coder" and isinstance(args, dict):
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                         for k, v in args.items())
        return f"<tool_call>\n<function={fn.get('name')}>\n{params}</function>\n</tool_call>"
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def _tools_system_text(tools: list[dict], fmt: str) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if fmt == "qwen3_coder":
        how = ("Call a function with:\n<tool_call>\n<function=NAME>\n<parameter=PARAMETER>\nvalue\n</parameter>\n"
               "</function>\n</tool_call>")
    else:
        how = ('For each function call, return a JSON object with the function name and arguments within '
               '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
               '\n</tool_call>')
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n{how}")
