"""Tool-call parsers: the model's text to OpenAI tool calls, incrementally.

Each parser reads the cumulative output text (the engine's outputs are cumulative) and returns
what is new: content text and call events. The non-streaming response runs the same parser once
over the final text, so a stream's deltas reassemble to exactly the non-streamed calls.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5, Qwen3)
- `qwen3_coder`: `<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`
  (Qwen3-Coder; values are JSON-decoded unless the tool's schema says the parameter is a string)
- `json_array` (tool_choice="required", grammar-constrained): `[{"name": ..., "arguments": {...}}, ...]`
- `named` (a named tool_choice, grammar-constrained): the output is the arguments object itself
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass
class CallStart:
    index: int
    name: str


@dataclass
class CallArgs:
    index: int
    fragment: str


@dataclass
class Parsed:
    """What one update found: content text and call events, in order."""
    content: str = ""
    events: list = field(default_factory=list)


def _arguments_text(arguments) -> str | None:
    if isinstance(arguments, str):
        return arguments
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    return None


class TaggedCallParser:
    """Calls between `<tool_call>` and `</tool_call>`; the text outside them is content. Content
    that might be the start of a tag is held back until the next update shows it is not."""
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or ()}
        self.pos = 0
        self.in_call = False
        self.num_calls = 0

    def parse_body(self, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON text) of one call's text, None if it is not a call."""
        raise NotImplementedError

    def update(self, text: str, final: bool) -> Parsed:
        out = Parsed()
        while True:
            if not self.in_call:
                i = text.find(self.open_tag, self.pos)
                if i >= 0:
                    out.content += text[self.pos:i]
                    self.pos, self.in_call = i + len(self.open_tag), True
                    continue
                end = len(text) if final else len(text) - _partial_suffix(text, self.pos, self.open_tag)
                out.content += text[self.pos:end]
                self.pos = end
                return out
            j = text.find(self.close_tag, self.pos)
            if j < 0 and not final:
                return out
            body = text[self.pos:j] if j >= 0 else text[self.pos:]
            call = self.parse_body(body)
            if call is None:  # not a call after all: its text is content
                out.content += self.open_tag + body + (self.close_tag if j >= 0 else "")
            else:
                out.events += [CallStart(self.num_calls, call[0]), CallArgs(self.num_calls, call[1])]
                self.num_calls += 1
            self.pos, self.in_call = (j + len(self.close_tag) if j >= 0 else len(text)), False
            if j < 0:
                return out


class HermesParser(TaggedCallParser):
    def parse_body(self, body: str) -> tuple[str, str] | None:
        try:
            obj = json.loads(body.strip())
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = _arguments_text(obj.get("arguments", obj.get("parameters", {})))
        return None if args is None else (obj["name"], args)


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


class Qwen3CoderParser(TaggedCallParser):
    def parse_body(self, body: str) -> tuple[str, str] | None:
        m = _FUNCTION.search(body)
        if m is None:
            return None
        name = m.group(1).strip()
        props = (self.tools.get(name, {}).get("parameters") or {}).get("properties") or {}
        args = {}
        for pm in _PARAMETER.finditer(m.group(2)):
            key, raw = pm.group(1).strip(), pm.group(2)
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            if (props.get(key) or {}).get("type") == "string":
                args[key] = raw
            else:
                try:
                    args[key] = json.loads(raw)
                except ValueError:
                    args[key] = raw
        return name, json.dumps(args, ensure_ascii=False)


class JsonArrayParser:
    """tool_choice="required": the grammar makes the output a JSON array of {name, arguments};
    each element is a call as soon as its closing brace arrives."""

    def __init__(self, tools: list[dict] | None = None):
        self.pos = 0
        self.depth = 0
        self.in_string = self.escape = False
        self.item_start = -1
        self.num_calls = 0

    def update(self, text: str, final: bool) -> Parsed:
        out = Parsed()
        for k in range(self.pos, len(text)):
            ch = text[k]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2 and ch == "{":
                    self.item_start = k
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and ch == "}" and self.item_start >= 0:
                    obj = json.loads(text[self.item_start:k + 1])
                    args = _arguments_text(obj.get("arguments", {}))
                    out.events += [CallStart(self.num_calls, obj["name"]), CallArgs(self.num_calls, args or "{}")]
                    self.num_calls += 1
                    self.item_start = -1
        self.pos = len(text)
        if final and not self.num_calls:  # cut by max_tokens before one call was complete: the text
            out.content = text
        return out


class NamedParser:
    """A named tool_choice: the grammar makes the whole output the arguments object, streamed
    as argument fragments after one call start."""

    def __init__(self, name: str):
        self.name = name
        self.pos = 0
        self.started = False

    def update(self, text: str, final: bool) -> Parsed:
        out = Parsed()
        if not self.started:
            out.events.append(CallStart(0, self.name))
            self.started = True
        if len(text) > self.pos:
            out.events.append(CallArgs(0, text[self.pos:]))
            self.pos = len(text)
        return out


TOOL_CALL_PARSERS = {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser}


def _partial_suffix(text: str, start: int, tag: str) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
