"""The verb state machine with faults injected: one request's failure never reaches another.

Among the verbs of ``test_stateful.VerbMachine`` (every layout, cascade on and off), rules
inject, at random points:

* an over-long prompt (past the context window) and one no pool could ever hold;
* a backend exception for every item of one session, raised in the middle of a batched
  step (items before it are already written), sometimes naming its item (``seq_ids``),
  sometimes not (the Stepper must find it by halving the batch);
* an adapter removed behind the engine's back while its sessions decode, and one removed
  through ``Engine.remove_adapter`` (refused while in use);
* a client abort in the middle of a batched generation;
* the leader of a burst of sessions on one prefix failing mid-prefill while the others
  wait for its pages (in-flight deduplication hands them back to the normal path).

After every step the base machine's invariants hold (``check_integrity`` with the
written-positions check, every table and every published page holds exactly the KV of its
key), and here: the sessions that were not faulted produced exactly what a fresh engine
that only saw their committed tokens produces, no session carries an error it was not
given, and a failed commit left its session exactly as before.
"""
from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from test_stateful import TOKENS, VerbMachine

from forkserve import Engine
from forkserve.backend.mock import MockBackend
from forkserve.errors import (
    AdapterInUseError,
    BackendError,
    CapacityError,
    ContextLengthError,
    ForkServeError,
    UnknownAdapterError,
)


class Injected(RuntimeError):
    """The fault the backend raises for a victim's items."""


class FaultMachine(VerbMachine):
    faults = 0  # injected faults, over all runs of the class (the fault bench reads it)

    def make_backend(self) -> MockBackend:
        adapters = [a for a in self.adapters if a is not None]
        return MockBackend(self.config, invocations=self.invocations, adapters=adapters)

    def _baseline(self, tokens, adapter, n) -> tuple[int, ...]:
        eng = Engine(MockBackend(self.config, invocations=self.invocations))
        return eng.generate(eng.open(tokens, adapter=adapter).id, n).tokens

    def _snapshot(self, sid):
        s = self.engine.sessions[sid]
        return (s.tree.tip.id, list(s.tree.committed), s.tree.tip.kv_len,
                sorted((n.id, n.state.value, n.kv_len) for n in s.tree.nodes.values()))

    def _count(self) -> None:
        type(self).faults += 1

    # ------------------------------------------------------------ faults at the verb
    @rule(adapter=st.data())
    def over_long_prompt(self, adapter):
        self._count()
        try:
            self.engine.open([3] * (self.config.max_context + 1),
                             adapter=adapter.draw(st.sampled_from(self.adapters)))
        except ContextLengthError:
            return
        raise AssertionError("an over-long prompt was admitted")

    @rule()
    def prompt_no_pool_can_hold(self):
        self._count()
        n = self.config.num_pages * self.config.page_size + 1
        config = self.config.replace(max_context=n + 8)
        eng = Engine(MockBackend(config))
        try:
            eng.open([3] * n)
        except CapacityError:
            return
        raise AssertionError("a prompt larger than the pool was admitted")

    # ------------------------------------------------------------ faults inside a tick
    @precondition(lambda self: len(self.engine.sessions) >= 1)
    @rule(data=st.data(), n=st.integers(1, 5), named=st.booleans(), victim=st.booleans())
    def batched_generate_with_a_failing_session(self, data, n, named, victim):
        """Several sessions decode in one batch; the victim's items raise mid-step."""
        sids = data.draw(st.lists(st.sampled_from(sorted(self.engine.sessions)), min_size=1,
                                  max_size=4, unique=True))
        bad = sids[0] if victim else None
        before = {sid: list(self.committed[sid]) for sid in sids}
        adapters = {sid: self.engine.node(sid, self.engine.tip(sid)).adapter for sid in sids}

        def fault(item):
            if bad is not None and bad in self.engine.sessions and \
                    item.seq_id in self.engine.sessions[bad].tree.nodes:
                return Injected(f"injected for seq {item.seq_id}") if not named else \
                    BackendError("injected", seq_ids=(item.seq_id,))
            return None

        for sid in sids:
            self.engine.start_generate(sid, n)
        self.backend.fault = fault
        try:
            self.engine.stepper.run_until(
                lambda: all(self.engine.sessions[s].decode_left == 0 for s in sids))
        finally:
            self.backend.fault = None
        for sid in sids:
            session = self.engine.sessions[sid]
            self._record(sid, session.generated)
            if sid == bad and session.error is not None:
                self._count()
                assert isinstance(session.error, ForkServeError)
                assert session.finish_reason == "error"
                session.error = None  # the test is the client that heard of it
                continue
            assert session.error is None, f"session {sid} got {session.error!r}"
            assert tuple(session.generated) == self._baseline(before[sid], adapters[sid], n)

    @precondition(lambda self: self.engine.sessions)
    @rule(data=st.data(), tail=st.lists(st.integers(3, 8), min_size=1, max_size=9))
    def commit_that_fails_changes_nothing(self, data, tail):
        sid = self._pick_session(data)
        before = self._snapshot(sid)
        # While its tail is written, the session's branches wait: only the tail runs for it.
        self.backend.fault = lambda item: Injected("commit tail") \
            if item.seq_id in self.engine.sessions[sid].tree.nodes else None
        try:
            self.engine.commit(sid, self.engine.tip(sid), tail)
        except BackendError:
            self._count()
            assert self._snapshot(sid) == before
            return
        finally:
            self.backend.fault = None
        self._record(sid, tail)  # a tail wholly covered by a bound branch runs no step

    @precondition(lambda self: any(a is not None for a in self.adapters) and self.engine.sessions)
    @rule(data=st.data(), n=st.integers(1, 4))
    def adapter_removed_behind_the_engine(self, data, n):
        """Sessions of the removed adapter fail; every other session decodes unharmed."""
        adapter = data.draw(st.sampled_from([a for a in self.adapters if a is not None]))
        sids = sorted(self.engine.sessions)
        before = {sid: list(self.committed[sid]) for sid in sids}
        users = {sid for sid in sids if any(
            node.live and node.adapter == adapter
            for node in self.engine.sessions[sid].tree.nodes.values())}
        for sid in sids:
            self.engine.start_generate(sid, n)
        self.backend.remove_adapter(adapter)
        try:
            self.engine.stepper.run_until(
                lambda: all(self.engine.sessions[s].decode_left == 0 for s in sids))
        finally:
            self.backend.add_adapter(adapter)
        for sid in sids:
            session = self.engine.sessions[sid]
            self._record(sid, session.generated)
            if session.error is not None:
                assert sid in users and isinstance(session.error, UnknownAdapterError), \
                    session.error
                self._count()
                session.error = None
                continue
            tip_adapter = self.engine.node(sid, self.engine.tip(sid)).adapter
            assert tuple(session.generated) == self._baseline(before[sid], tip_adapter, n)

    @precondition(lambda self: any(a is not None for a in self.adapters))
    @rule(data=st.data())
    def remove_adapter_through_the_engine(self, data):
        adapter = data.draw(st.sampled_from([a for a in self.adapters if a is not None]))
        self._count()
        try:
            self.engine.remove_adapter(adapter)
        except AdapterInUseError:
            return
        with_it = [a for a in self.adapters if a == adapter]
        try:
            self.engine.open([3, 4], adapter=with_it[0])
            raise AssertionError("a removed adapter was accepted")
        except UnknownAdapterError:
            pass
        finally:
            self.backend.add_adapter(adapter)

    @rule(data=st.data(), prefix=st.lists(st.integers(3, 8), min_size=8, max_size=40),
          k=st.integers(2, 4), n=st.integers(1, 3), ticks=st.integers(0, 2))
    def burst_whose_leader_fails(self, data, prefix, k, n, ticks):
        """Sessions opened in one burst on one prefix; the oldest (the leader the others wait
        for under in-flight deduplication) fails after ``ticks`` ticks of its prefill. The
        others are handed back to the normal path: one leads, all generate what a fresh
        engine generates, none hears of the leader's error."""
        adapter = data.draw(st.sampled_from(self.adapters))
        prompts = [prefix + [3 + i] for i in range(k)]
        sids = [self.engine.open(t, adapter=adapter).id for t in prompts]
        for sid, tokens in zip(sids, prompts, strict=True):
            self.committed[sid] = list(tokens)
            self.ever_committed.append(tuple(tokens))
        leader, rest = sids[0], sids[1:]
        for sid in sids:
            self.engine.start_generate(sid, n)
        for _ in range(ticks):
            self.engine.tick()
        self.backend.fault = lambda item: Injected("leader") \
            if item.seq_id in self.engine.sessions[leader].tree.nodes else None
        try:
            self.engine.stepper.run_until(lambda: all(
                self.engine.sessions[s].decode_left == 0 for s in sids))
        finally:
            self.backend.fault = None
        session = self.engine.sessions[leader]
        self._record(leader, session.generated)
        if session.error is not None:
            self._count()
            session.error = None  # the test is the client that heard of it
        for sid, tokens in zip(rest, prompts[1:], strict=True):
            assert self.engine.sessions[sid].error is None
            generated = tuple(self.engine.sessions[sid].generated)
            self._record(sid, generated)
            assert generated == self._baseline(tokens, adapter, n)

    @precondition(lambda self: len(self.engine.sessions) >= 2)
    @rule(data=st.data(), n=st.integers(2, 6), ticks=st.integers(0, 3))
    def client_abort_mid_generation(self, data, n, ticks):
        sids = data.draw(st.lists(st.sampled_from(sorted(self.engine.sessions)), min_size=2,
                                  max_size=4, unique=True))
        gone, rest = sids[0], sids[1:]
        before = {sid: list(self.committed[sid]) for sid in rest}
        adapters = {sid: self.engine.node(sid, self.engine.tip(sid)).adapter for sid in rest}
        for sid in sids:
            self.engine.start_generate(sid, n)
        for _ in range(ticks):
            self.engine.tick()
        self._count()
        self._record(gone, self.engine.sessions[gone].generated)  # published before the abort
        self.engine.abort(gone)
        del self.committed[gone]
        self.engine.stepper.run_until(
            lambda: all(self.engine.sessions[s].decode_left == 0 for s in rest))
        for sid in rest:
            generated = tuple(self.engine.sessions[sid].generated)
            self._record(sid, generated)
            assert generated == self._baseline(before[sid], adapters[sid], n)

    @rule(tokens=TOKENS)
    def bad_tokens(self, tokens):
        self._count()
        try:
            self.engine.open(tokens + [self.config.vocab_size])
        except ForkServeError:
            return
        raise AssertionError("an out-of-vocabulary token was admitted")

    # ------------------------------------------------------------ invariants
    @invariant()
    def no_session_carries_an_error_it_was_not_given(self):
        for sid, session in self.engine.sessions.items():
            assert session.error is None, f"session {sid}: {session.error!r}"
