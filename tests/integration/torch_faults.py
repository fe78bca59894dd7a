"""Fault injection on the TorchBackend (tiny random Llama, CPU): random sessions, forks and
commits, with one victim's items failing inside batched steps; every other session's
committed output must equal a fresh engine's greedy continuation of its committed tokens.

Shared by ``test_fault_isolation_torch.py`` (a small budget) and ``benchmarks/fault_bench.py``.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from forkserve import Engine, KVLayout, plus_config
from forkserve.errors import ForkServeError


class Injected(RuntimeError):
    pass


class FaultyBackend:
    """The real backend, with a fault for chosen sequences raised before the step runs
    (sometimes naming its items, sometimes not: the Stepper then halves the batch)."""

    def __init__(self, inner, rng: random.Random) -> None:
        self.inner, self.rng = inner, rng
        self.victims: set[int] = set()  # seq ids (node ids) whose items fail
        # Faults are injected in ``step``: no step may reach the inner backend's ``launch``.
        self.capabilities = dataclasses.replace(inner.capabilities, launch=False, columns=False)

    def step(self, work):
        bad = [w.seq_id for w in work if w.seq_id in self.victims]
        if bad:
            if self.rng.random() < 0.5:
                raise ForkServeError("injected", seq_ids=tuple(bad))
            raise Injected(f"injected for {bad}")
        return self.inner.step(work)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@dataclass
class FaultReport:
    faults: int = 0
    checked_outputs: int = 0
    cross_session_effects: int = 0


def make_backend(model_dir, layout: KVLayout):
    from forkserve.backend.torch import TorchBackend

    path, adapters = model_dir
    cfg = plus_config(page_size=4, num_pages=256, num_residual_pages=256, kv_layout=layout,
                      max_batch_tokens=128, spec_chunk=16, early_abort_probe_tokens=2,
                      speculate_budget_tokens=3, node_ttl_s=None)
    backend = TorchBackend(cfg, path, adapters, device="cpu", dtype=torch.float32,
                           attention="eager", use_cuda_graphs=False)
    backend.track_writes()
    return backend


def run(model_dir, layout: KVLayout, faults: int, seed: int = 0, vocab: int = 96) -> FaultReport:
    rng = random.Random(seed)
    backend = FaultyBackend(make_backend(model_dir, layout), rng)
    ref_backend = make_backend(model_dir, layout)
    eng, ref = Engine(backend), Engine(ref_backend)
    adapters = [None, *backend.adapters.values()]
    report = FaultReport()
    draw = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731

    def expected(tokens, adapter, n):
        h = ref.open(tokens, adapter=adapter)
        out = ref.generate(h.id, n).tokens
        ref.abort(h.id)
        ref.evict_all()  # a fresh engine: nothing cached
        return out

    while report.faults < faults:
        while len(eng.sessions) < 4:
            eng.open(draw(rng.randrange(3, 24)), adapter=rng.choice(adapters))
        sids = sorted(eng.sessions)
        if rng.random() < 0.3:  # a fan-out and a commit on one session, with a failing tail
            sid = rng.choice(sids)
            tip = eng.tip(sid)
            kids = [eng.fork(sid, tip, "r", draw(rng.randrange(2, 8))) for _ in range(2)]
            for k in kids:
                eng.speculate(sid, k, priority=rng.choice([0.5, 1.0]))
            eng.drain_slack()
            before = eng.committed_tokens(sid)
            backend.victims = {n for n in eng.sessions[sid].tree.nodes}
            backend.victims.add(max(backend.victims) + 1)  # the staged tip's id
            try:
                eng.commit(sid, tip, draw(rng.randrange(1, 6)))
            except ForkServeError:
                report.faults += 1
                if eng.committed_tokens(sid) != before or eng.tip(sid) != tip:
                    report.cross_session_effects += 1  # not atomic
            backend.victims = set()
        victim = rng.choice(sids)
        n = rng.randrange(1, 5)
        before = {sid: eng.committed_tokens(sid) for sid in sids}
        adapter = {sid: eng.node(sid, eng.tip(sid)).adapter for sid in sids}
        for sid in sids:
            eng.start_generate(sid, n)
        backend.victims = set(eng.sessions[victim].tree.nodes)
        # Called within this iteration, so the late binding of sids cannot bite.
        eng.stepper.run_until(lambda: all(eng.sessions[s].decode_left == 0 for s in sids))  # noqa: B023
        backend.victims = set()
        for sid in sids:
            session = eng.sessions[sid]
            if session.error is not None:
                report.faults += 1
                if sid != victim:
                    report.cross_session_effects += 1
                session.error = None
                continue
            report.checked_outputs += 1
            if tuple(session.generated) != expected(before[sid], adapter[sid], n):
                report.cross_session_effects += 1
        eng.check_integrity()  # includes: no table claims a position no step wrote
        if rng.random() < 0.3:
            sid = rng.choice(sorted(eng.sessions))
            (eng.close if rng.random() < 0.5 else eng.abort)(sid)
    return report
