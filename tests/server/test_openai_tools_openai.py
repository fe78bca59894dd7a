"""Tools, structured outputs and logprobs through the official ``openai`` client, on the demo
model (SmolLM2-135M-Instruct, CPU). A 135M model cannot choose tools well, so these check
the plumbing and the enforcement: a required call always parses and names an offered tool,
a json_schema reply always validates."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_testlib import DEMO_NAME

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is 2 plus 3? Use the tools."}]
PERSON = {
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad"]},
        "tall": {"type": "boolean"},
    },
    "required": ["age", "mood", "tall"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(demo_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0)


def _args(call) -> dict:
    return json.loads(call.function.arguments)


def test_required_tool_call_always_parses_and_names_an_offered_tool(client):
    r = client.chat.completions.create(
        model=DEMO_NAME,
        messages=ASK,
        tools=[ADD, WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=1.0,
        seed=0,
        n=3,
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name in ("add", "get_weather") and call.id.startswith("call_")
        spec = ADD if call.function.name == "add" else WEATHER
        jsonschema.validate(_args(call), spec["function"]["parameters"])


NAMED = dict(
    model=DEMO_NAME,
    messages=ASK,
    tools=[ADD, WEATHER],
    max_tokens=40,
    temperature=0,
    tool_choice={"type": "function", "function": {"name": "add"}},
    parallel_tool_calls=False,
)


@pytest.fixture(scope="module")
def named(client):
    return client.chat.completions.create(**NAMED)


def test_named_tool_choice_calls_that_tool_once(named):
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "add" and set(_args(call)) == {"a", "b"}
    assert named.choices[0].message.content is None


def test_tool_choice_none_shows_the_tools_but_answers_in_text(client):
    plain = client.chat.completions.create(
        model=DEMO_NAME, messages=ASK, max_tokens=2, temperature=0
    )
    none = client.chat.completions.create(
        model=DEMO_NAME, messages=ASK, tools=[ADD], tool_choice="none", max_tokens=2, temperature=0
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    # The tools are in the prompt (SmolLM2's function-calling system turn), so every turn of a
    # conversation shares one prefix whatever its tool_choice.
    assert none.usage.prompt_tokens > plain.usage.prompt_tokens + 50


def test_tool_round_trip_renders_the_call_and_the_result(client, named):
    msg = named.choices[0].message
    history = ASK + [
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "5"},
    ]
    second = client.chat.completions.create(
        model=DEMO_NAME, messages=history, tools=[ADD, WEATHER], max_tokens=2, temperature=0
    )
    # The call (as the model wrote it) and the tool's answer are in the prompt, not dropped.
    assert second.usage.prompt_tokens > named.usage.prompt_tokens + named.usage.completion_tokens


def test_streamed_tool_calls_equal_the_whole_reply(client, named):
    chunks = list(client.chat.completions.create(stream=True, **NAMED))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (i, t.function.name, t.function.arguments)
        for i, t in enumerate(named.choices[0].message.tool_calls)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_json_schema_reply_always_validates(client):
    r = client.chat.completions.create(
        model=DEMO_NAME,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=40,
        temperature=1.0,
        seed=0,
        n=2,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_reply_is_an_object(client):
    r = client.chat.completions.create(
        model=DEMO_NAME,
        messages=[{"role": "user", "content": "Give JSON."}],
        max_tokens=16,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # ran out of tokens inside the object: still a prefix of one
        assert r.choices[0].message.content.startswith("{")


def test_chat_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(
        model=DEMO_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:  # greedy: the sampled token is the most likely one
        assert (
            len(t.top_logprobs) == 3
            and t.logprob <= 0
            and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        )


def test_completions_logprobs_echo_penalties_and_bias(client, demo_server):
    r = client.completions.create(
        model=DEMO_NAME, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.top_logprobs[0]) <= 2 and lp.text_offset[0] == 0
    echo = client.completions.create(
        model=DEMO_NAME, prompt="The capital of France is", max_tokens=4, temperature=0, echo=True
    )
    assert echo.choices[0].text == "The capital of France is" + r.choices[0].text
    tok = demo_server.model.tokenizer
    first_ids = demo_server.on_engine(lambda _: tok.encode(r.choices[0].text))[:1]
    banned = client.completions.create(
        model=DEMO_NAME,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        logprobs=0,
        logit_bias={str(t): -100 for t in first_ids},
    )
    assert banned.choices[0].text != r.choices[0].text
    penal = client.completions.create(
        model=DEMO_NAME,
        prompt="1, 1, 1, 1, 1, 1,",
        max_tokens=12,
        temperature=0,
        frequency_penalty=2.0,
        presence_penalty=2.0,
    )
    plain = client.completions.create(
        model=DEMO_NAME, prompt="1, 1, 1, 1, 1, 1,", max_tokens=12, temperature=0
    )
    assert len(set(penal.choices[0].text.split())) > len(set(plain.choices[0].text.split()))
