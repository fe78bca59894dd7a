"""The seed's quickstart, verbatim (with the token lists it assumes defined first)."""
from forkserve.backend.byte_tokenizer import ByteTokenizer

_tok = ByteTokenizer()
system_and_user_tokens = _tok.encode("System: you are a shell agent.\nUser: list /tmp\n"
                                     "Action: run({\"cmd\": \"ls /tmp\"})\n")
wrap = _tok.encode("Observation: ")
recov = _tok.encode("Thought: the command failed, retry with sudo.")
observation = _tok.encode("a.txt b.txt\n")


def test_seed_quickstart_runs_verbatim():
    from forkserve import Engine, ForkServeConfig
    from forkserve.engine import MockBackend
    eng = Engine(MockBackend(ForkServeConfig()))
    h = eng.open(system_and_user_tokens)
    happy = eng.fork(h.id, h.tip, "bash", wrap) # p = 1 known suffix
    fail = eng.fork(h.id, h.tip, "err", recov)
    eng.speculate(h.id, happy, t_idle_ms=2900)
    eng.speculate(h.id, fail, priority=0.2, t_idle_ms=2900)
    eng.drain_slack()
    cr = eng.commit(h.id, h.tip, wrap + observation)
    eng.generate(h.id, 128)

    assert cr.bound_node == happy
    assert cr.matched_tokens == len(wrap)
    assert cr.prefilled_tokens == len(observation)
    assert fail in cr.aborted
    assert (len(eng.committed_tokens(h.id))
            == len(system_and_user_tokens) + len(wrap + observation) + 128)
    eng.check_integrity()
