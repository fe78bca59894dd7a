"""The official ``openai`` client, unchanged, against a live server on loopback."""
from __future__ import annotations

import openai
import pytest
from server_testlib import MODEL_NAME, quiescent_pages


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_list_base_and_adapters(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL_NAME, "planner", "critic"}


def test_completion_greedy_is_deterministic_and_counts_tokens(client):
    kw = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=6, temperature=0)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.completion_tokens == 6 and a.choices[0].finish_reason == "length"
    assert a.usage.total_tokens == a.usage.prompt_tokens + 6


def test_completion_token_prompt_batch_and_n(client):
    r = client.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7, 8], [9, 10, 11]], n=2,
                                  max_tokens=3, temperature=0.8, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 12


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
              temperature=1.0, top_p=0.9, seed=1234)
    assert client.chat.completions.create(**kw).choices[0].message.content == \
        client.chat.completions.create(**kw).choices[0].message.content


def test_chat_uses_the_template_and_adapters_change_the_output(client):
    outs = {}
    for model in (MODEL_NAME, "planner", "critic"):
        r = client.chat.completions.create(model=model, max_tokens=12, temperature=0,
                                           messages=[{"role": "system",
                                                      "content": "You are terse."},
                                                     {"role": "user",
                                                      "content": "What is a page?"}])
        assert r.choices[0].message.role == "assistant" and r.model == model
        # system + user turns and the assistant header, as the template renders them
        assert r.usage.prompt_tokens > 10
        outs[model] = r.choices[0].message.content
    assert len(set(outs.values())) == 3


def test_streaming_chat_equals_the_non_streamed_answer(client):
    kw = dict(model="planner", messages=[{"role": "user", "content": "Thought:"}], max_tokens=10,
              temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_streaming_completion_with_n(client):
    stream = client.completions.create(model="critic", prompt="Action:", max_tokens=5, n=3,
                                       temperature=0.7, seed=0, stream=True)
    texts, reasons = {}, {}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
    # stop: sampled EOS
    assert set(texts) == {0, 1, 2} and set(reasons.values()) <= {"length", "stop"}


def test_stop_strings_cut_the_text(client):
    kw = dict(model=MODEL_NAME, prompt="The lazy dog", max_tokens=24, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 4
    stop = full[2:4]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    streamed = "".join(c.choices[0].text
                       for c in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == cut.text


def test_no_pages_leak_after_requests(server, client):
    client.chat.completions.create(model="planner", messages=[{"role": "user", "content": "x"}],
                                   max_tokens=2)
    sessions, used, published = quiescent_pages(server)
    assert sessions == 0 and used == published
    assert server.on_engine(lambda e: (e.check_integrity(), e.evict_all(), e.pool.num_used)[2]) == 0
