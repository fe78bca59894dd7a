"""The call-aware loop check: a residual of tool calls is a loop only when it repeats a recent
call (same name, same canonical arguments), never for the markup every call shares."""

from __future__ import annotations

import pytest

from forkserve import Engine, plus_config
from forkserve.backend.byte_tokenizer import ByteTokenizer
from forkserve.backend.mock import MockBackend
from forkserve.control.call_loop import Call, CallLoopScorer
from forkserve.control.cascade import Action
from forkserve.control.scorers import CompositeScorer, LegalityScorer, LoopScorer
from forkserve.interfaces.server.tools.call_reader import ToolCallReader
from forkserve.interfaces.server.tools.formats import HermesFormat, Llama3JsonFormat, SmolLM2Format

tok = ByteTokenizer()
FMT = SmolLM2Format()
TOOLS = [{"type": "function", "function": {"name": n, "description": "d",
                                            "parameters": {"type": "object"}}}
         for n in ("search_logs", "read_file", "run")]
# A trunk like the scored fan-out's: the format's prompt (its example call), two calls, answers.
TRUNK = (FMT.system_prompt(TOOLS) + "\nUser: why does the build fail?\n"
         + FMT.render_calls([("search_logs", {"query": "error", "lines": 20})])
         + "\nObservation: ssl.h not found\n"
         + FMT.render_calls([("read_file", {"path": "build.log"})])
         + "\nObservation: gcc -lssl failed\n")
NEW_CALL = FMT.render_calls([("read_file", {"path": "Makefile"})])
SAME_CALL = FMT.render_calls([("read_file", {"path": "build.log"})])


def scorer() -> CallLoopScorer:
    return CallLoopScorer(ToolCallReader(FMT, tok.decode))


def judge(s, residual: str):
    return s.score(tok.encode(TRUNK), tok.encode(residual))


def test_a_new_call_after_the_same_markup_is_not_a_loop():
    assert judge(LoopScorer(), NEW_CALL).value < 0.45  # the n-gram count reads the frame
    verdict = judge(scorer(), NEW_CALL)
    assert verdict.value == 1.0 and not verdict.is_loop


def test_the_same_call_with_the_same_arguments_is_a_loop():
    verdict = judge(scorer(), SAME_CALL)
    assert verdict.is_loop and verdict.value == 0.0
    twice = FMT.render_calls([("run", {"cmd": "make"}), ("run", {"cmd": "make"})])
    assert judge(scorer(), twice).value == 0.5  # a call repeated inside the residual


def test_argument_order_and_whitespace_do_not_make_a_new_call():
    first = FMT.render_calls([("search_logs", {"query": "error", "lines": 20})])
    shuffled = '<tool_call>[ {"arguments":{ "lines":20,"query" :"error"},"name":"search_logs"}]'
    assert judge(scorer(), shuffled + "</tool_call>").is_loop
    assert ToolCallReader(FMT, tok.decode)(tok.encode(first)) == (
        Call("search_logs", '{"lines":20,"query":"error"}'),)


def test_text_that_is_not_a_call_keeps_the_n_gram_rule():
    for text in ("ssl.h not found\nObservation: gcc -lssl failed", "Let me book a train.",
                 NEW_CALL[:-20]):  # a cut call does not parse: judged as text
        assert judge(scorer(), text) == judge(LoopScorer(), text)


@pytest.mark.parametrize("fmt", [HermesFormat(), Llama3JsonFormat(), SmolLM2Format()],
                         ids=lambda f: f.name)
def test_every_call_of_a_history_is_read_and_a_malformed_one_skipped(fmt):
    calls = [fmt.render_calls([("f", {"a": {"b": 1}})]), fmt.render_calls([("g", {"x": 1})])]
    broken = fmt.render_calls([("h", {})]).replace('"h"', "h")
    history = f"{calls[0]}\nObservation: ok\n{broken}\nprose\n{calls[1]}\n"
    assert [c.name for c in fmt.calls_in(history)] == ["f", "g"]


def _decide(loop_scorer) -> tuple[Action, bool]:
    """A new legal call beside the harness's prior (index 0), scored by ``loop_scorer``: the
    cascade's action and whether the call is still kept after the drain."""
    cfg = plus_config(page_size=4, num_pages=512, vocab_size=300)
    legality = LegalityScorer(tok.decode)
    eng = Engine(MockBackend(cfg), scorer=CompositeScorer([loop_scorer, legality]))
    h = eng.open(tok.encode(TRUNK))
    prior = eng.fork(h.id, h.tip, "prior", tok.encode("Thought: check the Makefile."))
    new = eng.fork(h.id, h.tip, "new", tok.encode(NEW_CALL))
    eng.speculate(h.id, prior, priority=0.9)
    decision = eng.speculate(h.id, new, priority=0.5)
    eng.drain_slack()
    eng.check_integrity()
    kept = not decision.action.prunes and eng.node(h.id, new).live  # a pruned node stays idle
    return decision.action, kept


def test_the_cascade_keeps_a_new_call_the_plain_loop_scorer_drops():
    action, kept = _decide(LoopScorer())
    assert action in (Action.EARLY_ABORT, Action.DRAFT_SKIP) and not kept
    assert _decide(scorer()) == (Action.PREFILL, True)
