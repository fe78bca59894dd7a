"""BranchClient: the engine's verbs over HTTP (the branch routes of ``forkserve serve``).

    client = BranchClient("http://127.0.0.1:8000")
    s = client.open("SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": "hi"}])
    wrap = client.fork(s.session_id, s.tip, text="Observation: ")   # the known harness wrapper
    client.speculate(s.session_id, wrap, priority=1.0, t_idle_ms=2000)
    ...                                                              # the tool runs meanwhile
    c = client.commit(s.session_id, s.tip, text="Observation: 3 files\n")
    out = client.generate(s.session_id, 64)

Every method maps to one route and raises ``BranchAPIError`` (status, message) on a 4xx/5xx.
For the OpenAI routes use the official ``openai`` client against ``{url}/v1``. ``api_key``
is sent as ``Authorization: Bearer`` (the server's ``--api-key``); session ids are opaque
strings, valid only for the key's tenant.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Iterator, Mapping, Sequence, TypeVar

import httpx

T = TypeVar("T")


class BranchAPIError(Exception):
    def __init__(self, status: int, message: str, type: str = "") -> None:
        super().__init__(f"{status} {type}: {message}")
        self.status, self.message, self.type = status, message, type


@dataclass(frozen=True)
class Session:
    session_id: str
    tip: int
    model: str
    committed_tokens: int


@dataclass(frozen=True)
class Decision:
    action: str          # hash_skip | draft_skip | rejected | hash_partial | early_abort | prefill
    score: float | None
    hit_tokens: int
    miss_tokens: int
    reason: str


@dataclass(frozen=True)
class Commit:
    session_id: str
    tip: int
    bound_node: int | None
    matched_tokens: int
    prefilled_tokens: int
    aborted: tuple[int, ...]


@dataclass(frozen=True)
class Abort:
    released_nodes: tuple[int, ...]
    freed_pages: int


@dataclass(frozen=True)
class Generation:
    text: str
    tokens: tuple[int, ...]
    finish_reason: str
    tip: int


@dataclass(frozen=True)
class GenerationChunk:
    text: str
    tokens: tuple[int, ...]
    finish_reason: str | None


@dataclass(frozen=True)
class Drain:
    ticks: int
    prefill_tokens: int
    decode_tokens: int
    slack_filled_tokens: int


def _build(cls: type[T], data: Mapping[str, Any]) -> T:
    """A result dataclass from its JSON (lists become tuples: results are immutable)."""
    return cls(**{f.name: tuple(data[f.name]) if isinstance(data[f.name], list) else data[f.name]
                  for f in fields(cls)})


def _segment(text: str | None, tokens: Sequence[int] | None) -> dict[str, Any]:
    if (text is None) == (tokens is None):
        raise ValueError("give exactly one of text= or tokens=")
    return {"text": text} if text is not None else {"tokens": list(tokens)}


REPLICA_HEADER = "x-forkserve-replica"


class BranchClient:
    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 120.0,
                 http: httpx.Client | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else None
        self._http = http or httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)
        # Behind `forkserve serve --replicas N`: the engine replica that served the last
        # response (its `x-forkserve-replica` header); None from a single server.
        self.last_replica: str | None = None

    def __enter__(self) -> "BranchClient":
        return self

    def __exit__(self, *_: object) -> None:
        self._http.close()

    # ------------------------------------------------------------------ verbs
    def open(self, model: str, *, text: str | None = None, tokens: Sequence[int] | None = None,
             messages: Sequence[Mapping[str, str]] | None = None,
             add_generation_prompt: bool = True, cache_salt: str | None = None) -> Session:
        body: dict[str, Any] = {"model": model, "add_generation_prompt": add_generation_prompt}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if messages is not None:
            body["messages"] = [dict(m) for m in messages]
        if text is not None:
            body["text"] = text
        if tokens is not None:
            body["tokens"] = list(tokens)
        return _build(Session, self._post("/v1/sessions", body))

    def info(self, session_id: str) -> Session:
        return _build(Session, self._request("GET", f"/v1/sessions/{session_id}"))

    def sessions(self) -> list[Session]:
        """This key's open sessions."""
        return [_build(Session, s) for s in self._request("GET", "/v1/sessions")["data"]]

    def fork(self, session_id: str, parent: int, *, text: str | None = None,
             tokens: Sequence[int] | None = None, label: str = "branch") -> int:
        body = {"parent": parent, "label": label, **_segment(text, tokens)}
        return self._post(f"/v1/sessions/{session_id}/fork", body)["node"]

    def speculate(self, session_id: str, node: int, *, priority: float = 1.0,
                  t_idle_ms: float | None = None) -> Decision:
        body = {"node": node, "priority": priority, "t_idle_ms": t_idle_ms}
        return _build(Decision, self._post(f"/v1/sessions/{session_id}/speculate", body))

    def commit(self, session_id: str, tip: int, *, text: str | None = None,
               tokens: Sequence[int] | None = None) -> Commit:
        body = {"tip": tip, **_segment(text, tokens)}
        return _build(Commit, self._post(f"/v1/sessions/{session_id}/commit", body))

    def join(self, session_id: str, nodes: Sequence[int], *, separator_text: str | None = None,
             separator_tokens: Sequence[int] | None = None) -> Commit:
        body: dict[str, Any] = {"nodes": list(nodes)}
        if separator_text is not None:
            body["separator_text"] = separator_text
        if separator_tokens is not None:
            body["separator_tokens"] = list(separator_tokens)
        return _build(Commit, self._post(f"/v1/sessions/{session_id}/join", body))

    def abort(self, session_id: str, node: int) -> Abort:
        return _build(Abort, self._post(f"/v1/sessions/{session_id}/abort", {"node": node}))

    def generate(self, session_id: str, max_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
                 ignore_eos: bool = False) -> Generation:
        body = self._generate_body(max_tokens, temperature, top_p, seed, stop, ignore_eos,
                                   stream=False)
        return _build(Generation, self._post(f"/v1/sessions/{session_id}/generate", body))

    def stream(self, session_id: str, max_tokens: int, *, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
               ignore_eos: bool = False) -> Iterator[GenerationChunk]:
        """Chunks as they are decoded. Leaving the loop early closes the connection, which
        aborts the session on the server (its pages are freed)."""
        body = self._generate_body(max_tokens, temperature, top_p, seed, stop, ignore_eos,
                                   stream=True)
        with self._http.stream("POST", f"/v1/sessions/{session_id}/generate", json=body) as r:
            self.last_replica = r.headers.get(REPLICA_HEADER)
            if r.status_code >= 400:
                r.read()
                self._raise(r)
            for line in r.iter_lines():
                if line:
                    chunk = json.loads(line)
                    if "error" in chunk:  # failed after the 200 was sent: the error is in-band
                        err = chunk["error"]
                        raise BranchAPIError(err.get("code", 500), err.get("message", ""),
                                             err.get("type", ""))
                    yield _build(GenerationChunk, chunk)

    def close(self, session_id: str) -> Session:
        return _build(Session, self._request("DELETE", f"/v1/sessions/{session_id}"))

    def drain(self) -> Drain:
        return _build(Drain, self._post("/v1/drain", {}))

    def metrics(self) -> str:
        r = self._http.get("/metrics")
        self._check(r)
        return r.text

    # ------------------------------------------------------------------ http
    @staticmethod
    def _generate_body(max_tokens: int, temperature: float, top_p: float, seed: int | None,
                       stop: Sequence[str], ignore_eos: bool, stream: bool) -> dict[str, Any]:
        return {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
                "stop": list(stop), "ignore_eos": ignore_eos, "stream": stream}

    def _post(self, path: str, body: Mapping[str, Any]) -> Any:
        return self._request("POST", path, json=dict(body))

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        r = self._http.request(method, path, **kwargs)
        self.last_replica = r.headers.get(REPLICA_HEADER)
        self._check(r)
        return r.json()

    def _check(self, r: httpx.Response) -> None:
        if r.status_code >= 400:
            self._raise(r)

    @staticmethod
    def _raise(r: httpx.Response) -> None:
        try:
            err = r.json()["error"]
            raise BranchAPIError(r.status_code, err.get("message", ""), err.get("type", ""))
        except (ValueError, KeyError, TypeError):
            raise BranchAPIError(r.status_code, r.text) from None
