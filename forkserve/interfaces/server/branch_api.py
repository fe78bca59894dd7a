"""Branch routes: the engine's verbs over HTTP, one route per verb.

    POST   /v1/sessions                      open      {model, text|tokens|messages, cache_salt}
    GET    /v1/sessions                      the caller's open sessions
    GET    /v1/sessions/{sid}                the committed tip and length
    POST   /v1/sessions/{sid}/fork           fork      {parent, label, text|tokens}
    POST   /v1/sessions/{sid}/speculate      speculate {node, priority, t_idle_ms}
    POST   /v1/sessions/{sid}/commit         commit    {tip, text|tokens}
    POST   /v1/sessions/{sid}/join           join      {nodes, separator_text|separator_tokens}
    POST   /v1/sessions/{sid}/abort          abort     {node}
    POST   /v1/sessions/{sid}/generate       generate  {max_tokens, temperature, ..., stream}
    DELETE /v1/sessions/{sid}                close
    POST   /v1/drain                         drain_slack

Generated text is the decode of every generated token, a matched ``stop`` string
included: a session keeps all of them in its context, and the text says so. Text is
encoded by the server's tokenizer exactly as given (no special tokens added
after the prompt): adapters announce structure, they never rewrite prompts. Every verb
validates before it mutates, so a 4xx leaves the engine as it was. A verb on a session
renews its lease (see EngineWorker); a session that is generating accepts no other verb;
a client that disconnects while its session generates (streamed or not) aborts the session.
An open waits in the engine worker's admission queue as OpenAI opens do; a client that
disconnects meanwhile leaves it and opens nothing (gone as it opened: the session is closed).

``sid`` is the session's public id (tenancy.py): random, and only its tenant's; any other
caller gets 404 for it, as for an id that never existed. Verbs that add tokens are admitted
against the tenant's limits first (limits.py).
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Callable, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from forkserve.backend.protocol import SamplingParams
from forkserve.control.layout_policy import Queued
from forkserve.interfaces.server.auth import TenantDep
from forkserve.interfaces.server.disconnect import unless_disconnected
from forkserve.interfaces.server.engine_worker import GenerationSpec
from forkserve.interfaces.server.errors import APIError, stream_error
from forkserve.interfaces.server.schemas import (
    AbortRequest,
    AbortResponse,
    CommitRequest,
    CommitResponse,
    DecisionResponse,
    DrainResponse,
    ForkRequest,
    ForkResponse,
    GenerateChunk,
    GenerateRequest,
    GenerateResponse,
    JoinRequest,
    OpenSessionRequest,
    SessionInfo,
    SessionList,
    SpeculateRequest,
)
from forkserve.interfaces.server.state import ServerState, StateDep

router = APIRouter(prefix="/v1")
T = TypeVar("T")


def _tokens(st: ServerState, text: str | None, tokens: list[int] | None) -> list[int]:
    """Engine thread only (the tokenizer is not shared across threads)."""
    ids = (tokens if tokens is not None
           else st.model.tokenizer.encode(text or "", add_special_tokens=False))
    st.model.check_vocab(ids)
    return ids


async def _on_session(st: ServerState, tenant: str, sid: str, verb: Callable[[int], T],
                      grows_by: int = 0) -> T:
    """Run a verb of the tenant's session ``sid`` on the engine thread with its engine id: it
    must be the tenant's and idle; a verb that adds ``grows_by`` tokens is admitted first."""
    def run() -> T:
        eid = st.tenancy.resolve(tenant, sid)  # 404 for unknown and for another tenant's alike
        st.worker.ensure_idle(eid)
        st.worker.lease(eid)
        if grows_by:
            return st.tenancy.grow(tenant, grows_by, lambda: verb(eid))
        return verb(eid)
    return await st.worker.call(run)


def _info(st: ServerState, eid: int) -> SessionInfo:
    eng = st.worker.engine
    adapter = eng.session_summary(eid).adapter
    name = st.model.name if adapter is None else next(n for n, a in st.model.adapters.items()
                                                      if a == adapter)
    return SessionInfo(session_id=st.tenancy.public_id(eid), tip=eng.tip(eid), model=name,
                       committed_tokens=len(eng.committed_tokens(eid)))


def _prompt(st: ServerState, body: OpenSessionRequest) -> list[int]:
    """Engine thread only (the tokenizer is not shared across threads)."""
    tok = st.model.tokenizer
    if body.messages is not None:
        return tok.apply_chat_template([{"role": m.role, "content": m.text()}
                                        for m in body.messages],
                                       add_generation_prompt=body.add_generation_prompt)
    if body.text is not None:
        return tok.encode(body.text, add_special_tokens=True)
    return list(body.tokens or [])


@router.post("/sessions")
async def open_session(body: OpenSessionRequest, request: Request, st: StateDep,
                       tenant: TenantDep) -> SessionInfo:
    adapter = st.model.adapter_for(body.model)
    salt = st.tenancy.salt(tenant, body.cache_salt)
    # Encoded before the open is submitted: it waits in the admission queue as its prompt.
    ids = await st.worker.call(lambda: _prompt(st, body))
    st.model.check_vocab(ids)
    st.model.check_length(len(ids), 0)

    def run(queued: Queued) -> SessionInfo:
        eid = st.tenancy.open(tenant, ids, adapter, salt, 0, expose=True,
                              queued=queued).engine_id
        st.worker.lease(eid)
        return _info(st, eid)
    # Watch the connection while the open waits: a client gone leaves the queue at once.
    return await unless_disconnected(request, st.worker.open(
        ids, 0, run, salt=salt,
        undo=lambda info: _close(st, st.tenancy.resolve(tenant, info.session_id))))


def _close(st: ServerState, eid: int) -> None:
    st.worker.release(eid)
    st.tenancy.forget(eid)
    if st.worker.engine.has_session(eid):
        st.worker.engine.close(eid)


@router.get("/sessions")
async def list_sessions(st: StateDep, tenant: TenantDep) -> SessionList:
    return await st.worker.call(lambda: SessionList(data=[_info(st, s.engine_id)
                                                          for s in st.tenancy.sessions_of(tenant)]))


@router.get("/sessions/{sid}")
async def session_info(sid: str, st: StateDep, tenant: TenantDep) -> SessionInfo:
    return await _on_session(st, tenant, sid, lambda eid: _info(st, eid))


@router.post("/sessions/{sid}/fork")
async def fork(sid: str, body: ForkRequest, st: StateDep, tenant: TenantDep) -> ForkResponse:
    def run(eid: int) -> ForkResponse:
        ids = _tokens(st, body.text, body.tokens)
        node = st.tenancy.grow(tenant, len(ids),
                               lambda: st.worker.engine.fork(eid, body.parent, body.label, ids))
        return ForkResponse(node=node, tokens=len(ids))
    return await _on_session(st, tenant, sid, run)


@router.post("/sessions/{sid}/speculate")
async def speculate(sid: str, body: SpeculateRequest, st: StateDep,
                    tenant: TenantDep) -> DecisionResponse:
    def run(eid: int) -> DecisionResponse:
        d = st.worker.engine.speculate(eid, body.node, priority=body.priority,
                                       t_idle_ms=body.t_idle_ms)
        return DecisionResponse(action=d.action.value, score=d.score, hit_tokens=d.hit_tokens,
                                miss_tokens=d.miss_tokens, reason=d.reason)
    return await _on_session(st, tenant, sid, run)


def _commit_response(sid: str, r) -> CommitResponse:
    return CommitResponse(session_id=sid, tip=r.tip, bound_node=r.bound_node,
                          matched_tokens=r.matched_tokens, prefilled_tokens=r.prefilled_tokens,
                          aborted=list(r.aborted))


@router.post("/sessions/{sid}/commit")
async def commit(sid: str, body: CommitRequest, st: StateDep, tenant: TenantDep) -> CommitResponse:
    def run(eid: int) -> CommitResponse:
        ids = _tokens(st, body.text, body.tokens)
        return _commit_response(sid, st.tenancy.grow(
            tenant, len(ids), lambda: st.worker.engine.commit(eid, body.tip, ids)))
    return await _on_session(st, tenant, sid, run)


@router.post("/sessions/{sid}/join")
async def join(sid: str, body: JoinRequest, st: StateDep, tenant: TenantDep) -> CommitResponse:
    if body.separator_text is not None and body.separator_tokens is not None:
        raise APIError(400, "give at most one of 'separator_text' or 'separator_tokens'")

    def run(eid: int) -> CommitResponse:
        sep = body.separator_tokens if body.separator_tokens is not None else (
            _tokens(st, body.separator_text, None) if body.separator_text else [])
        st.model.check_vocab(sep)
        # The branches' tokens were admitted when they were forked; only separators are new.
        grows = len(sep) * (len(body.nodes) - 1)
        return _commit_response(sid, st.tenancy.grow(
            tenant, grows, lambda: st.worker.engine.join(eid, body.nodes, separator=sep)))
    return await _on_session(st, tenant, sid, run)


@router.post("/sessions/{sid}/abort")
async def abort(sid: str, body: AbortRequest, st: StateDep, tenant: TenantDep) -> AbortResponse:
    def run(eid: int) -> AbortResponse:
        r = st.worker.engine.abort(eid, body.node)
        return AbortResponse(released_nodes=list(r.released_nodes), freed_pages=r.freed_pages)
    return await _on_session(st, tenant, sid, run)


@router.delete("/sessions/{sid}")
async def close(sid: str, st: StateDep, tenant: TenantDep) -> SessionInfo:
    def run(eid: int) -> SessionInfo:
        info = _info(st, eid)
        _close(st, eid)
        return info
    return await _on_session(st, tenant, sid, run)


@router.post("/sessions/{sid}/generate", response_model=None)
async def generate(sid: str, body: GenerateRequest, request: Request, st: StateDep,
                   tenant: TenantDep) -> GenerateResponse | StreamingResponse:
    if any(not s for s in body.stop):
        raise APIError(400, "stop strings must be non-empty", param="stop")

    def check(eid: int) -> tuple[int, int]:
        tip = st.worker.engine.node(eid, st.worker.engine.tip(eid))
        st.model.check_length(tip.end, body.max_tokens)
        return eid, tip.id
    eid, tip = await _on_session(st, tenant, sid, check, grows_by=body.max_tokens)
    eos = () if body.ignore_eos else st.model.eos_token_ids
    spec = GenerationSpec(body.max_tokens, SamplingParams(body.temperature, body.top_p, body.seed),
                          frozenset(eos), tuple(body.stop), keep_stop_text=True)
    gen = await st.worker.generate(eid, spec)
    if body.stream:
        async def events() -> AsyncIterator[str]:
            try:
                async for c in gen:
                    yield GenerateChunk(text=c.text, tokens=list(c.tokens),
                                        finish_reason=c.finish_reason).model_dump_json() + "\n"
            except Exception as exc:  # noqa: BLE001 - the headers are sent: the error goes in-band
                yield json.dumps(stream_error(exc)) + "\n"
            finally:
                gen.cancel()  # a disconnect aborts the session and frees its pages
        return StreamingResponse(events(), media_type="application/x-ndjson")
    try:
        out = await unless_disconnected(request, gen.collect())
    finally:
        gen.cancel()
    return GenerateResponse(text=out.text, tokens=list(out.tokens),
                            finish_reason=out.finish_reason or "length", tip=tip)


@router.post("/drain")
async def drain(st: StateDep) -> DrainResponse:
    r = await st.worker.call(st.worker.engine.drain_slack)
    return DrainResponse(ticks=r.ticks, prefill_tokens=r.prefill_tokens,
                         decode_tokens=r.decode_tokens, slack_filled_tokens=r.slack_filled_tokens)
