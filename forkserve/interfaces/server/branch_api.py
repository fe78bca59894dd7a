"""Branch routes: the engine's verbs over HTTP, one route per verb.

    POST   /v1/sessions                      open      {model, text|tokens|messages}
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
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Callable, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from forkserve.backend.protocol import SamplingParams
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
    SpeculateRequest,
)
from forkserve.interfaces.server.state import ServerState, StateDep

router = APIRouter(prefix="/v1")
T = TypeVar("T")


def _tokens(st: ServerState, text: str | None, tokens: list[int] | None) -> list[int]:
    """Engine thread only (the tokenizer is not shared across threads)."""
    ids = tokens if tokens is not None else st.model.tokenizer.encode(text or "", add_special_tokens=False)
    st.model.check_vocab(ids)
    return ids


async def _on_session(st: ServerState, sid: int, verb: Callable[[], T]) -> T:
    """Run a verb of session ``sid`` on the engine thread: it must exist and be idle."""
    def run() -> T:
        st.worker.engine.tip(sid)  # 404 for an unknown session, before anything else
        st.worker.ensure_idle(sid)
        st.worker.lease(sid)
        return verb()
    return await st.worker.call(run)


def _info(st: ServerState, sid: int) -> SessionInfo:
    eng = st.worker.engine
    adapter = eng.sessions[sid].adapter
    name = st.model.name if adapter is None else next(n for n, a in st.model.adapters.items() if a == adapter)
    return SessionInfo(session_id=sid, tip=eng.tip(sid), model=name,
                       committed_tokens=len(eng.committed_tokens(sid)))


@router.post("/sessions")
async def open_session(body: OpenSessionRequest, st: StateDep) -> SessionInfo:
    adapter = st.model.adapter_for(body.model)
    tok = st.model.tokenizer

    def run() -> SessionInfo:
        if body.messages is not None:
            ids = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages],
                                          add_generation_prompt=body.add_generation_prompt)
        elif body.text is not None:
            ids = tok.encode(body.text, add_special_tokens=True)
        else:
            ids = list(body.tokens or [])
        st.model.check_vocab(ids)
        st.model.check_length(len(ids), 0)
        sid = st.worker.engine.open(ids, adapter=adapter).id
        st.worker.lease(sid)
        return _info(st, sid)
    return await st.worker.call(run, undo=lambda info: _close(st, info.session_id))


def _close(st: ServerState, sid: int) -> None:
    st.worker.release(sid)
    if sid in st.worker.engine.sessions:
        st.worker.engine.close(sid)


@router.get("/sessions/{sid}")
async def session_info(sid: int, st: StateDep) -> SessionInfo:
    return await _on_session(st, sid, lambda: _info(st, sid))


@router.post("/sessions/{sid}/fork")
async def fork(sid: int, body: ForkRequest, st: StateDep) -> ForkResponse:
    def run() -> ForkResponse:
        ids = _tokens(st, body.text, body.tokens)
        node = st.worker.engine.fork(sid, body.parent, body.label, ids)
        return ForkResponse(node=node, tokens=len(ids))
    return await _on_session(st, sid, run)


@router.post("/sessions/{sid}/speculate")
async def speculate(sid: int, body: SpeculateRequest, st: StateDep) -> DecisionResponse:
    def run() -> DecisionResponse:
        d = st.worker.engine.speculate(sid, body.node, priority=body.priority, t_idle_ms=body.t_idle_ms)
        return DecisionResponse(action=d.action.value, score=d.score, hit_tokens=d.hit_tokens,
                                miss_tokens=d.miss_tokens, reason=d.reason)
    return await _on_session(st, sid, run)


def _commit_response(r) -> CommitResponse:
    return CommitResponse(session_id=r.session_id, tip=r.tip, bound_node=r.bound_node,
                          matched_tokens=r.matched_tokens, prefilled_tokens=r.prefilled_tokens,
                          aborted=list(r.aborted))


@router.post("/sessions/{sid}/commit")
async def commit(sid: int, body: CommitRequest, st: StateDep) -> CommitResponse:
    def run() -> CommitResponse:
        ids = _tokens(st, body.text, body.tokens)
        return _commit_response(st.worker.engine.commit(sid, body.tip, ids))
    return await _on_session(st, sid, run)


@router.post("/sessions/{sid}/join")
async def join(sid: int, body: JoinRequest, st: StateDep) -> CommitResponse:
    if body.separator_text is not None and body.separator_tokens is not None:
        raise APIError(400, "give at most one of 'separator_text' or 'separator_tokens'")

    def run() -> CommitResponse:
        sep = body.separator_tokens if body.separator_tokens is not None else (
            _tokens(st, body.separator_text, None) if body.separator_text else [])
        st.model.check_vocab(sep)
        return _commit_response(st.worker.engine.join(sid, body.nodes, separator=sep))
    return await _on_session(st, sid, run)


@router.post("/sessions/{sid}/abort")
async def abort(sid: int, body: AbortRequest, st: StateDep) -> AbortResponse:
    def run() -> AbortResponse:
        r = st.worker.engine.abort(sid, body.node)
        return AbortResponse(released_nodes=list(r.released_nodes), freed_pages=r.freed_pages)
    return await _on_session(st, sid, run)


@router.delete("/sessions/{sid}")
async def close(sid: int, st: StateDep) -> SessionInfo:
    def run() -> SessionInfo:
        info = _info(st, sid)
        _close(st, sid)
        return info
    return await _on_session(st, sid, run)


@router.post("/sessions/{sid}/generate", response_model=None)
async def generate(sid: int, body: GenerateRequest, request: Request,
                   st: StateDep) -> GenerateResponse | StreamingResponse:
    if any(not s for s in body.stop):
        raise APIError(400, "stop strings must be non-empty", param="stop")

    def check() -> int:
        tip = st.worker.engine.node(sid, st.worker.engine.tip(sid))
        st.model.check_length(tip.end, body.max_tokens)
        return tip.id
    tip = await _on_session(st, sid, check)
    eos = () if body.ignore_eos else st.model.eos_token_ids
    spec = GenerationSpec(body.max_tokens, SamplingParams(body.temperature, body.top_p, body.seed),
                          frozenset(eos), tuple(body.stop), keep_stop_text=True)
    gen = await st.worker.generate(sid, spec)
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
    return GenerateResponse(text=out.text, tokens=list(out.tokens), finish_reason=out.finish_reason or "length",
                            tip=tip)


@router.post("/drain")
async def drain(st: StateDep) -> DrainResponse:
    r = await st.worker.call(st.worker.engine.drain_slack)
    return DrainResponse(ticks=r.ticks, prefill_tokens=r.prefill_tokens, decode_tokens=r.decode_tokens,
                         slack_filled_tokens=r.slack_filled_tokens)
