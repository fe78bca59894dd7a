"""The parts of tool calling and structured outputs alone (no server, tiny tokenizer): formats,
their grammars, the template probe, the streamed-call parser, the constrained sampler."""

from __future__ import annotations

import json

import pytest
import torch

from forkserve.backend.protocol import SamplingParams
from forkserve.backend.torch.sampler import Sampler
from forkserve.backend.torch.tokenizer import Tokenizer
from forkserve.interfaces.server.grammar import GrammarConstraint
from forkserve.interfaces.server.token_log import TokenLog
from forkserve.interfaces.server.tools.chat_prompt import TemplateCaps, build_prompt
from forkserve.interfaces.server.tools.formats import (
    HermesFormat,
    Llama3JsonFormat,
    SmolLM2Format,
    choose_format,
)
from forkserve.interfaces.server.tools.grammar import calls_rule
from forkserve.interfaces.server.tools.stream import ToolCallStream

FORMATS = [HermesFormat(), Llama3JsonFormat(), SmolLM2Format()]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
# A Hermes-style template that renders tools and calls itself (as Qwen2.5's does).
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>"
    "{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)



@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_format_round_trip_and_grammar(fmt, grammars, tokenizer):
    text = fmt.render_calls([("add", {"a": 1, "b": 2}), ("now", {})])
    reply = fmt.parse("Sure. " + text if fmt.prefix else text)
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [
        ("add", {"a": 1, "b": 2}),
        ("now", {}),
    ]
    assert fmt.parse("no call here").calls == ()
    compiled = grammars.ebnf(
        "root ::= calls\n" + calls_rule(fmt, [ADD, NOW], parallel=True), "tools"
    )
    ok = GrammarConstraint(compiled, 0)
    ids = tokenizer.encode(text) + list(tokenizer.eos_token_ids)
    for pos, token in enumerate(ids):
        ok.accept(token, pos)
    assert ok.completed
    bad = GrammarConstraint(compiled, 0)
    with pytest.raises(RuntimeError, match="violates"):
        for pos, token in enumerate(tokenizer.encode(fmt.render_calls([("sub", {"a": 1})]))):
            bad.accept(token, pos)


def test_format_is_chosen_by_the_template():
    assert choose_format(HERMES_TEMPLATE).name == "hermes"
    assert choose_format("{{ '<|python_tag|>' }}{{ 'Environment: ipython' }}").name == "llama3_json"
    assert (
        choose_format("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}").name
        == "smollm2"
    )


def test_history_through_a_template_that_renders_tools_and_one_that_cannot(tokenizer):
    history = [
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
    ]
    hermes = Tokenizer(type(tokenizer.hf).from_pretrained(tokenizer.hf.name_or_path))
    hermes.hf.chat_template = HERMES_TEMPLATE
    caps = TemplateCaps.probe(hermes.render_chat)
    assert caps == TemplateCaps(renders_tools=True, renders_tool_calls=True)
    native = build_prompt(history, [ADD], HermesFormat(), caps)
    text = hermes.render_chat(native.messages, native.tools)
    assert '<tools>{"type": "function"' in text and '"arguments": {"a": 1, "b": 2}' in text

    plain = TemplateCaps.probe(tokenizer.render_chat)  # the tiny model's ChatML template
    assert plain == TemplateCaps(renders_tools=False, renders_tool_calls=False)
    filled = build_prompt(history, [ADD], SmolLM2Format(), plain)
    text = tokenizer.render_chat(filled.messages, filled.tools)
    assert (
        filled.tools is None
        and "<tools>" in text
        and '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>' in text
        and "tool\n3" in text
    )


def test_streamed_reply_holds_a_possible_marker_and_sends_calls_whole():
    stream = ToolCallStream(SmolLM2Format())
    assert stream.push("Let me <tool") == "Let me "
    assert stream.push('_call>[{"name": "now", "arguments": {}}]') == ""
    rest, reply = stream.finish()
    assert rest == "" and [c.name for c in reply.calls] == ["now"]
    prose = ToolCallStream(SmolLM2Format())
    assert prose.push("a <b") + prose.finish()[0] == "a <b"


def test_sampler_applies_grammar_bias_penalties_and_records_logprobs(grammars, tokenizer):
    sampler = Sampler(torch.device("cpu"))
    vocab = len(tokenizer.hf)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    constraint, log = (
        GrammarConstraint(grammars.json_schema(schema, "response_format"), 5),
        TokenLog(5),
    )
    gen = torch.Generator().manual_seed(0)
    plain = SamplingParams()
    constrained = SamplingParams(
        temperature=1.0, seed=3, logprobs=2, constraint=constraint, log=log
    )
    out: list[int] = []
    for pos in range(5, 40):
        logits = torch.randn(2, vocab, generator=gen)
        token = sampler.sample(logits, [plain, constrained], [pos, pos])[1]
        rec = log.entries(pos - 5, pos - 4)[0]
        assert rec.token == token and rec.logprob == pytest.approx(
            torch.log_softmax(logits[1], -1)[token].item()
        )
        assert rec.top[0][1] == pytest.approx(torch.log_softmax(logits[1], -1).max().item())
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
    assert json.loads(tokenizer.decode(out))["ok"] in (True, False) and constraint.completed

    logits = torch.zeros(1, vocab)
    logits[0, 7] = 5.0
    assert sampler.sample(logits, [SamplingParams(logit_bias=((9, 10.0),))], [0]) == [9]
    history = TokenLog(0)
    history.record(0, 7, 0.0, ())
    penalised = SamplingParams(frequency_penalty=2.0, presence_penalty=2.0, log=history)
    logits[0, 8] = 2.0
    assert sampler.sample(logits, [penalised], [1]) == [8]  # 5 - 2*1 - 2 = 1 < 2


def test_a_resampled_position_rolls_the_grammar_back(grammars, tokenizer):
    constraint = GrammarConstraint(grammars.json_schema({"type": "object"}, "response_format"), 0)
    ids = tokenizer.encode('{"a": 1}')
    for pos, token in enumerate(ids):
        constraint.accept(token, pos)
    again = GrammarConstraint(grammars.json_schema({"type": "object"}, "response_format"), 0)
    for pos, token in enumerate(ids[:2]):
        again.accept(token, pos)
    bitmask, expected = (
        torch.zeros(1, (len(tokenizer.hf) + 31) // 32, dtype=torch.int32),
        torch.zeros(1, (len(tokenizer.hf) + 31) // 32, dtype=torch.int32),
    )
    constraint.filler.fill(bitmask, [(constraint, 0, 2)])  # back to position 2
    again.filler.fill(expected, [(again, 0, 2)])
    assert torch.equal(bitmask, expected)


def test_a_rule_across_fields_is_refused_in_its_own_words(server):
    import httpx

    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=30,
        json={
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "x"}],
            "top_logprobs": 2,
        },
    )
    assert r.status_code == 400 and "top_logprobs needs logprobs" in r.json()["error"]["message"]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=30,
        json={
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "x"}],
            "reasoning_effort": "low",
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
