"""Soak: many concurrent clients against a live server, then the engine's own page accounting.

    python benchmarks/soak_bench.py                          # 64 clients, 60 s, demo model, CPU
    python benchmarks/soak_bench.py --clients 16 --duration 10 --model path/to/hf_folder

Each client loops until the deadline over a random mix of: chat completions (n = 1 or 2,
some streamed), streamed chats it abandons mid-stream (a disconnect), branch steps (open,
fork 2-3 branches, speculate, commit one, generate, close; some abandon their generate
stream), and bad requests that must come back 4xx. Afterwards it waits for every session
to end (sessions abandoned mid-step end when their lease runs out) and checks, through
the engine: no session left, every page in use is held by
the prefix index (``pool.num_used == index.num_pages``), zero pages after ``evict_all``,
and ``check_integrity`` (refcounts equal holders). It prints the figures; the exit status
is 1 on any 5xx, unexpected status or leaked page. ``tests/server`` runs a short version.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from forkserve.bench.output import write_json
from forkserve.interfaces.server.launcher import RunningServer, serve_in_thread

SEGMENTS = ["Thought: check the logs.", "Action: search[pages]", "Observation: 3 results.",
            "Final Answer: yes.", " the cache", " a branch", "\nObservation: error: timeout\n"]


@dataclass(frozen=True)
class SoakConfig:
    clients: int = 64
    duration_s: float = 60.0
    max_tokens: int = 12
    seed: int = 0
    disconnect_prob: float = 0.15
    # After the deadline a client waits this long for its last request, then abandons it
    # (closing the connection: one more disconnect the server must clean up after).
    grace_s: float = 5.0
    # Branch sessions abandoned mid-step (no close) are the server's to reclaim: their lease
    # is this short, and the audit waits for it to run out.
    session_ttl_s: float = 30.0


@dataclass
class _Tally:
    statuses: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    disconnects: int = 0
    abandoned: int = 0

    def record(self, kind: str, status: int, ok: bool, started: float) -> None:
        self.statuses[status] += 1
        self.latencies_s.append(time.monotonic() - started)
        if not ok and len(self.unexpected) < 20:
            self.unexpected.append(f"{kind}: {status}")


@dataclass(frozen=True)
class SoakReport:
    clients: int
    duration_s: float
    requests: int
    by_kind: dict[str, int]
    by_status: dict[int, int]
    five_xx: int
    unexpected: list[str]
    disconnects: int
    abandoned_at_deadline: int
    completion_tokens: int
    completion_tokens_per_s: float
    latency_p50_ms: float
    latency_p95_ms: float
    sessions_left: int
    pages_used_after: int
    pages_published_after: int
    pages_used_after_evict: int
    integrity_ok: bool
    peak_pages: int

    @property
    def passed(self) -> bool:
        return (self.five_xx == 0 and not self.unexpected and self.sessions_left == 0
                and self.pages_used_after == self.pages_published_after
                and self.pages_used_after_evict == 0 and self.integrity_ok)

    def table(self) -> str:
        rows = [("clients", self.clients), ("duration s", f"{self.duration_s:.1f}"),
                ("requests", self.requests), ("by kind", dict(sorted(self.by_kind.items()))),
                ("by status", dict(sorted(self.by_status.items()))),
                ("5xx", self.five_xx), ("unexpected", self.unexpected or "none"),
                ("client disconnects", self.disconnects),
                ("abandoned at deadline", self.abandoned_at_deadline),
                ("completion tokens", self.completion_tokens),
                ("completion tokens/s", f"{self.completion_tokens_per_s:.1f}"),
                ("latency p50 / p95 ms", f"{self.latency_p50_ms:.0f} / {self.latency_p95_ms:.0f}"),
                ("peak pages", self.peak_pages), ("sessions left", self.sessions_left),
                ("pages used / published after",
                 f"{self.pages_used_after} / {self.pages_published_after}"),
                ("pages used after evict_all", self.pages_used_after_evict),
                ("integrity", "ok" if self.integrity_ok else "FAILED"),
                ("result", "PASS" if self.passed else "FAIL")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


class _Client:
    def __init__(self, http: httpx.AsyncClient, models: list[str], cfg: SoakConfig,
                 rng: random.Random, tally: _Tally) -> None:
        self.http, self.models, self.cfg, self.rng, self.t = http, models, cfg, rng, tally

    async def run(self, deadline: float) -> None:
        actions = [(self.chat, 4), (self.chat_stream, 3), (self.branch_step, 3),
                   (self.bad_request, 1)]
        while time.monotonic() < deadline:
            action = self.rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
            try:
                await action()
            except httpx.TransportError as e:  # the server dropped a connection: a failure
                self.t.unexpected.append(f"{action.__name__}: {type(e).__name__}: {e}")

    def _messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": "You are a shell agent."},
                {"role": "user", "content": " ".join(self.rng.sample(SEGMENTS, 2))}]

    def _chat_body(self, stream: bool) -> dict:
        return {"model": self.rng.choice(self.models), "messages": self._messages(),
                "stream": stream, "max_tokens": self.rng.randint(1, self.cfg.max_tokens),
                "n": self.rng.choice([1, 1, 2]), "temperature": self.rng.choice([0.0, 0.7]),
                "seed": self.rng.randrange(1000)}

    async def _post(self, kind: str, path: str, body: dict,
                    expect: tuple[int, ...] = (200,)) -> httpx.Response:
        started = time.monotonic()
        r = await self.http.post(path, json=body)
        self.t.kinds[kind] += 1
        self.t.record(kind, r.status_code, r.status_code in expect, started)
        return r

    async def chat(self) -> None:
        r = await self._post("chat", "/v1/chat/completions", self._chat_body(False))
        if r.status_code == 200:
            self.t.completion_tokens += r.json()["usage"]["completion_tokens"]

    async def chat_stream(self) -> None:
        body = self._chat_body(True)
        body["stream_options"] = {"include_usage": True}
        disconnect = self.rng.random() < self.cfg.disconnect_prob * 3
        started = time.monotonic()
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            self.t.kinds["chat_stream"] += 1
            self.t.record("chat_stream", r.status_code, r.status_code == 200, started)
            if r.status_code != 200:
                await r.aread()
                return
            async for line in r.aiter_lines():
                if disconnect:
                    self.t.disconnects += 1
                    return  # leaving the block closes the connection mid-stream
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):
                        self.t.unexpected.append(f"chat_stream: in-band error {chunk['error']}")
                    if chunk.get("usage"):
                        self.t.completion_tokens += chunk["usage"]["completion_tokens"]

    async def branch_step(self) -> None:
        r = await self._post("open", "/v1/sessions", {"model": self.rng.choice(self.models),
                                                       "messages": self._messages()})
        if r.status_code != 200:
            return
        sid, tip = r.json()["session_id"], r.json()["tip"]
        texts = self.rng.sample(SEGMENTS, self.rng.randint(2, 3))
        nodes = []
        for i, text in enumerate(texts):
            f = await self._post("fork", f"/v1/sessions/{sid}/fork", {"parent": tip, "text": text})
            if f.status_code == 200:
                nodes.append(f.json()["node"])
                await self._post("speculate", f"/v1/sessions/{sid}/speculate",
                                 {"node": nodes[-1], "priority": 1.0 if i == 0 else 0.3,
                                  "t_idle_ms": 50})
        if self.rng.random() < 0.3:
            await self._post("drain", "/v1/drain", {})
        if self.rng.random() < 0.2 and len(nodes) >= 2:
            await self._post("join", f"/v1/sessions/{sid}/join",
                             {"nodes": nodes[:2], "separator_text": "\n"})
        else:
            await self._post("commit", f"/v1/sessions/{sid}/commit",
                             {"tip": tip, "text": texts[0] + " observed"})
        gen = {"max_tokens": self.rng.randint(1, self.cfg.max_tokens), "temperature": 0.0}
        if self.rng.random() < self.cfg.disconnect_prob:
            gen.update(stream=True, max_tokens=self.cfg.max_tokens * 4, ignore_eos=True)
            started = time.monotonic()
            async with self.http.stream("POST", f"/v1/sessions/{sid}/generate", json=gen) as s:
                self.t.kinds["generate_stream"] += 1
                self.t.record("generate_stream", s.status_code, s.status_code == 200, started)
                async for _ in s.aiter_lines():
                    self.t.disconnects += 1
                    return  # the server aborts the session: no close needed
        g = await self._post("generate", f"/v1/sessions/{sid}/generate", gen)
        if g.status_code == 200:
            self.t.completion_tokens += len(g.json()["tokens"])
        started = time.monotonic()
        c = await self.http.delete(f"/v1/sessions/{sid}")
        self.t.kinds["close"] += 1
        self.t.record("close", c.status_code, c.status_code == 200, started)

    async def bad_request(self) -> None:
        model = self.models[0]
        body, path = self.rng.choice([
            ({"model": "no-such-model", "messages": self._messages()}, "/v1/chat/completions"),
            ({"model": model, "messages": self._messages(), "max_tokens": -1},
             "/v1/chat/completions"),
            ({"model": model, "prompt": [0, 10 ** 9]}, "/v1/completions"),
            ({"parent": 1, "tokens": [1]}, "/v1/sessions/987654321/fork"),
        ])
        await self._post("bad_request", path, body, expect=(400, 404))


async def _drive(url: str, models: list[str], cfg: SoakConfig) -> tuple[_Tally, float]:
    tally = _Tally()
    limits = httpx.Limits(max_connections=cfg.clients * 2, max_keepalive_connections=cfg.clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        start = time.monotonic()
        deadline = start + cfg.duration_s
        clients = [_Client(http, models, cfg, random.Random(cfg.seed * 1000 + i), tally)
                   for i in range(cfg.clients)]

        async def run(client: _Client) -> None:
            try:
                await asyncio.wait_for(client.run(deadline), timeout=cfg.duration_s + cfg.grace_s)
            except asyncio.TimeoutError:
                tally.abandoned += 1
        await asyncio.gather(*(run(c) for c in clients))
        return tally, time.monotonic() - start


def run_soak(server: RunningServer, cfg: SoakConfig) -> SoakReport:
    """Drive ``server`` (started with ``session_ttl_s=cfg.session_ttl_s``), then audit it."""
    models = [server.model.name, *sorted(server.model.adapters)]
    tally, elapsed = asyncio.run(_drive(server.url, models, cfg))
    deadline = time.monotonic() + cfg.session_ttl_s + 30.0
    while server.on_engine(lambda e: len(e.sessions)) and time.monotonic() < deadline:
        time.sleep(0.05)  # last aborts on their way to the engine; abandoned leases running out

    def audit(engine) -> tuple[int, int, int, int, bool, int]:
        sessions = len(engine.sessions)
        cache = engine.cache_stats()
        used, published = cache.base.used, cache.base.published
        try:
            engine.check_integrity()
            ok = True
        except AssertionError:
            ok = False
        if sessions == 0:
            engine.evict_all()
        after = engine.cache_stats().base.used
        return sessions, used, published, after, ok, engine.metrics.peak_pages
    sessions, used, published, after_evict, ok, peak = server.on_engine(audit)
    lat = sorted(tally.latencies_s) or [0.0]
    return SoakReport(
        clients=cfg.clients, duration_s=elapsed, requests=sum(tally.kinds.values()),
        by_kind=dict(tally.kinds), by_status=dict(tally.statuses),
        five_xx=sum(n for s, n in tally.statuses.items() if s >= 500),
        unexpected=tally.unexpected, disconnects=tally.disconnects,
        abandoned_at_deadline=tally.abandoned, completion_tokens=tally.completion_tokens,
        completion_tokens_per_s=tally.completion_tokens / elapsed,
        latency_p50_ms=statistics.median(lat) * 1e3,
        latency_p95_ms=lat[int(0.95 * (len(lat) - 1))] * 1e3, sessions_left=sessions,
        pages_used_after=used, pages_published_after=published,
        pages_used_after_evict=after_evict, integrity_ok=ok, peak_pages=peak)


def main(argv: list[str] | None = None) -> int:
    from forkserve.config import app_config
    from forkserve.interfaces.server.served_model import load_served_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds the clients run")
    ap.add_argument("--max-tokens", type=int, default=12, help="largest max_tokens a client asks")
    ap.add_argument("--seed", type=int, default=0, help="seed of the clients' random choices")
    ap.add_argument("--model", help="HF folder or .gguf (default: the SmolLM2-135M demo model)")
    ap.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                    help="a PEFT adapter to serve (repeatable)")
    ap.add_argument("--device", default="cpu", help="torch device")
    ap.add_argument("--num-pages", type=int, default=2048, help="KV pages per pool")
    ap.add_argument("--json", type=Path, help="also write the report here")
    args = ap.parse_args(argv)
    if args.model is None:
        from forkserve.backend.torch import find_smollm2_gguf
        args.model = find_smollm2_gguf()
    config = app_config(num_pages=args.num_pages, num_residual_pages=args.num_pages)
    loras = dict(spec.split("=", 1) for spec in args.lora)
    print(f"loading {args.model} on {args.device} ...", flush=True)
    model = load_served_model(args.model, config=config, loras=loras, device=args.device)
    cfg = SoakConfig(args.clients, args.duration, args.max_tokens, args.seed)
    print(f"soak: {cfg.clients} clients for {cfg.duration_s:.0f} s (loopback)", flush=True)
    with serve_in_thread(model, session_ttl_s=cfg.session_ttl_s) as server:
        report = run_soak(server, cfg)
    print(report.table())
    if args.json:
        write_json(args.json, asdict(report))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
