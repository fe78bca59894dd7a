"""The tool pause through the plain OpenAI API: a reply that ends in tool calls pins the
conversation's KV, so the follow-up request that extends it finds its prompt's pages even
after the prefix index was emptied by memory pressure; a reply without calls pins nothing."""

from __future__ import annotations

import openai
from server_testlib import DEMO_NAME

NOW = {
    "type": "function",
    "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
}


def _turn_after_pressure(server, client, system: str, tool_choice: str) -> tuple[int, int]:
    """(pins held after the first reply, tokens the follow-up found cached) with every
    unpinned cached page evicted during the pause."""
    ask = [{"role": "system", "content": system}, {"role": "user", "content": "Time?"}]
    first = client.chat.completions.create(
        model=DEMO_NAME,
        messages=ask,
        tools=[NOW],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=24,
        temperature=0,
    )
    msg = first.choices[0].message
    pins = server.on_engine(lambda e: len(e.kv.retention.tables()))
    server.on_engine(lambda e: e.index.evict())  # memory pressure during the tool's run
    if msg.tool_calls:
        reply = [
            msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "12:00"},
        ]
    else:
        reply = [
            {"role": "assistant", "content": msg.content},
            {"role": "user", "content": "And now?"},
        ]
    hits = server.on_engine(lambda e: e.metrics.base_hit_tokens)
    client.chat.completions.create(
        model=DEMO_NAME,
        messages=ask + reply,
        tools=[NOW],
        tool_choice="none",
        max_tokens=1,
        temperature=0,
    )
    return pins, server.on_engine(lambda e: e.metrics.base_hit_tokens) - hits


def test_tool_calls_pin_the_conversation_through_the_pause(demo_server):
    client = openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0)
    # Other tests' tool pauses hold pins that expire on their own clock: drop them all first,
    # so the counts below are this test's alone.
    demo_server.on_engine(lambda e: e.evict_all())
    before = demo_server.on_engine(lambda e: len(e.kv.retention.tables()))
    assert before == 0
    # A reply in text first: nothing of this conversation is pinned.
    pins, unpinned = _turn_after_pressure(
        demo_server, client, "You are a calendar agent. " * 8, "none"
    )
    assert pins == before
    pins, pinned = _turn_after_pressure(
        demo_server, client, "You are a clock agent. " * 8, "required"
    )
    assert pins == before + 1 and pinned >= 200 and pinned >= unpinned + 100
