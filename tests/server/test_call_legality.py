"""The branch cascade's legality scorer with the server's grammar: a residual that cannot parse
as a tool call of the model's format is rejected exactly (cases the JSON parse check passes)."""

from __future__ import annotations

import pytest

from forkserve.control.scorers import LegalityScorer
from forkserve.interfaces.server.tools.formats import HermesFormat, Llama3JsonFormat, SmolLM2Format
from forkserve.interfaces.server.tools.legality import CallLegality

FORMATS = [HermesFormat(), Llama3JsonFormat(), SmolLM2Format()]



def _check(fmt, grammars, tokenizer):
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=False)
    return CallLegality(fmt, grammars, decode)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_calls_of_the_format_are_legal_and_anything_else_is_not(fmt, grammars, tokenizer):
    check = _check(fmt, grammars, tokenizer)

    def verdict(text: str) -> str | None:
        return check(tokenizer.encode(text))

    calls = fmt.render_calls([("add", {"a": 1, "b": [2, 3]}), ("now", {})])
    lead = "Thought: add them.\n" if fmt.prefix else ""
    assert verdict(lead + calls) is None
    assert verdict(lead + calls.replace(": ", ":")) is None  # JSON whitespace is free
    assert verdict("no call here, only prose") is None
    # JSON that parses but is no call: a name that is not a string, arguments not an object.
    bad_name = fmt.render_calls([("add", {})]).replace('"add"', "3")
    assert "tool call" in verdict(bad_name)
    bad_args = fmt.render_calls([("add", {})]).replace("{}", "[1]")
    assert "tool call" in verdict(bad_args)
    cut = fmt.render_calls([("add", {"a": 1})])[:-3]
    assert "unterminated" in verdict(cut)


def test_text_after_the_calls_is_not_judged(grammars, tokenizer):
    fmt = SmolLM2Format()
    check = _check(fmt, grammars, tokenizer)
    call = fmt.render_calls([("add", {"a": 1})])
    assert check(tokenizer.encode(call + "\nObservation: 4")) is None


def test_the_scorer_rejects_what_only_the_grammar_sees(grammars, tokenizer):
    fmt = SmolLM2Format()

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=False)
    plain = LegalityScorer(decode)
    exact = LegalityScorer(decode, calls=_check(fmt, grammars, tokenizer))
    residual = tokenizer.encode('<tool_call>[{"arguments": {"a": 1}}]</tool_call>')  # no name
    assert plain.score([], residual).value == 1.0  # the JSON parses
    judged = exact.score([], residual)
    assert judged.value == exact.illegal_score and "smollm2 tool call" in judged.reason
    legal = tokenizer.encode(fmt.render_calls([("add", {"a": 1})]))
    assert exact.score([], legal).value == 1.0


def test_the_served_engine_scores_with_the_grammar(server):
    """The server wires the check into its engine's cascade (the tiny model: SmolLM2 format)."""
    tok = server.model.tokenizer
    text = '<tool_call>[{"name": 1, "arguments": {}}]</tool_call>'
    ids = server.on_engine(lambda _: tok.encode(text))
    score = server.on_engine(lambda e: e.scorer.score([], ids))
    assert score.value < 1.0 and "tool call" in score.reason
