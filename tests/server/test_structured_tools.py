"""Structured outputs and tool calling through a live server (real SmolLM2 on CPU, the official
openai client): outputs parse and validate against their schemas, tool calls parse and their
arguments validate, streamed deltas reassemble to the non-streamed calls, bad grammars are 400s."""
import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from qsaserve.config import EngineConfig
from qsaserve.engine.async_engine import AsyncLLMEngine
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.server import build_app
from qsaserve.server.cli import BackgroundServer

MODEL = "smol"
WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "north", "south", "yes", "no"]
KEYS = ["name", "id", "count", "color", "tags", "score", "ok", "level", "kind", "items", "size", "city"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                       "required": ["a", "b"]}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What is the weather in Paris?", "What is 12 plus 30?", "Is it cold in Oslo today?"]


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=1024, kv_cache_memory=64 * 2**20), progress=False)
    srv = BackgroundServer(build_app(AsyncLLMEngine(engine), MODEL, enable_auto_tool_choice=True, tool_call_parser="hermes"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A small JSON schema: objects (some keys required), arrays, enums, bounded numbers and strings."""
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array"] + ["object"] * (2 if depth < 2 else 0)) \
        if depth else "object"
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(2, 8)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "array":
        item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 99}, {"enum": rng.sample(WORDS, 3)}, {"type": "boolean"}])
        lo = rng.randint(0, 2)
        return {"type": "array", "items": item, "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    keys = rng.sample(KEYS, rng.randint(1, 3))
    required = [k for k in keys if rng.random() < 0.7] or keys[:1]
    return {"type": "object", "properties": {k: random_schema(rng, depth + 1) for k in keys}, "required": required,
            "additionalProperties": False}


def parallel(fn, args):
    with ThreadPoolExecutor(len(args)) as pool:  # sent together, so the engine batches them
        return list(pool.map(fn, args))


def user(text):
    return [{"role": "user", "content": text}]


# ---------------- structured outputs ----------------
def test_json_schema_outputs_validate_for_random_schemas(client):
    rng = random.Random(27)
    schemas = [random_schema(rng) for _ in range(20)]
    assert any(s["properties"][k].get("type") == "object" for s in schemas for k in s["properties"])  # nesting happens

    def ask(schema):
        return client.chat.completions.create(
            model=MODEL, messages=user("Reply with JSON."), max_tokens=80, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})

    for schema, r in zip(schemas, parallel(ask, schemas)):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_regex_and_choice(client):
    r = client.chat.completions.create(model=MODEL, messages=user("Reply with a JSON object with one key, \"name\"."), max_tokens=64, temperature=0,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)

    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    r = client.completions.create(model=MODEL, prompt="Call us at", max_tokens=20, temperature=0, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text

    options = ["yes", "no", "not sure"]
    r = client.chat.completions.create(model=MODEL, messages=user("Is the sky green?"), max_tokens=8, temperature=1.0,
                                       n=3, seed=5, extra_body={"structured_outputs": {"choice": options}})
    assert len(r.choices) == 3 and all(c.message.content in options for c in r.choices)

    # streamed, legacy field, with whitespace allowed in JSON (vLLM's default)
    stream = client.completions.create(model=MODEL, prompt="Pick a color:", max_tokens=8, temperature=0, stream=True,
                                       extra_body={"guided_choice": ["red", "green", "blue"]})
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("red", "green", "blue")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    r = client.completions.create(model=MODEL, prompt="A digit as JSON:", max_tokens=40, temperature=0,
                                  extra_body={"structured_outputs": {"json": schema}})
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].text), schema)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "response_format"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}, "structured_outputs"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern"),
])
def test_bad_grammar_is_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=4, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    r = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length"


# ---------------- tool calls ----------------
def check_call(call):
    assert call.type == "function" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS[call.function.name])


@pytest.mark.parametrize("parallel_calls", [False, True])
def test_required_tool_choice_always_returns_valid_calls(client, parallel_calls):
    def ask(q):
        return client.chat.completions.create(model=MODEL, messages=user(q), tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=parallel_calls, max_tokens=64, temperature=0)

    for r in parallel(ask, QUESTIONS):
        choice = r.choices[0]
        # With parallel calls a small model may go on adding calls until max_tokens: the calls
        # it completed are returned (a cut-off one is not).
        assert choice.finish_reason == "tool_calls" or (parallel_calls and choice.finish_reason == "length"), choice.message
        calls = choice.message.tool_calls
        assert calls and (parallel_calls or len(calls) == 1)
        for call in calls:
            check_call(call)


def test_named_tool_choice_returns_valid_arguments(client):
    def ask(q):
        return client.chat.completions.create(model=MODEL, messages=user(q), tools=TOOLS, max_tokens=64, temperature=0,
                                              tool_choice={"type": "function", "function": {"name": "add"}})

    for r in parallel(ask, QUESTIONS):
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "add" and r.choices[0].finish_reason == "stop"
        check_call(call)


def test_auto_returns_text_or_calls(client):
    for r in parallel(lambda q: client.chat.completions.create(model=MODEL, messages=user(q), tools=TOOLS, max_tokens=64,
                                                               temperature=0), QUESTIONS):
        msg = r.choices[0].message
        assert msg.tool_calls or isinstance(msg.content, str)
        for call in msg.tool_calls or ():
            assert call.function.name in PARAMS and isinstance(json.loads(call.function.arguments), dict)
        assert (r.choices[0].finish_reason == "tool_calls") == bool(msg.tool_calls)


def reassemble(stream):
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or ():
                if d.id is not None:  # the first delta of a call: id, type and name
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = [d.function.name, d.function.arguments or ""]
                else:
                    assert d.function.name is None
                    calls[d.index][1] += d.function.arguments
    return [tuple(c) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto"])
def test_streamed_deltas_reassemble_to_the_same_calls(client, tool_choice):
    kwargs = dict(model=MODEL, messages=user(QUESTIONS[0]), tools=TOOLS, tool_choice=tool_choice, max_tokens=64, temperature=0)
    r = client.chat.completions.create(**kwargs)
    expected = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or ()]
    calls, finish = reassemble(client.chat.completions.create(**kwargs, stream=True))
    assert calls == expected and finish == r.choices[0].finish_reason
    if tool_choice != "auto":
        assert calls


def test_tool_messages_round_trip(client):
    first = client.chat.completions.create(model=MODEL, messages=user(QUESTIONS[0]), tools=TOOLS, tool_choice="required",
                                           max_tokens=64, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = user(QUESTIONS[0]) + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8,
                                       temperature=0)
    assert isinstance(r.choices[0].message.content, str) and not r.choices[0].message.tool_calls
    # the earlier call and its result are in the prompt the model saw
    base = client.chat.completions.create(model=MODEL, messages=user(QUESTIONS[0]), tools=TOOLS, tool_choice="none",
                                          max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens > base.usage.prompt_tokens + len(call.function.arguments) // 4
