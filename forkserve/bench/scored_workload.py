"""The scored fan-out workload (issue 17, item 3): a real agent step written by SmolLM2.

Each session is one step of a tool-using agent, chat-templated by the model's tokenizer: a
system prompt with the tool schemas (SmolLM2's function-calling prompt), the user's task, an
earlier call with a long tool observation (build-log lines, as many as the trunk size asks),
a second call, its short answer and the user's next instruction (without it SmolLM2 mostly
repeats its last call). Its candidate continuations (the residuals), in order:

* ``sampled``    the model's own next turn at temperature > 0, one seed each (index 0 is the
                 harness's prior winner, as in the seed);
* ``duplicate``  the previous session's reference winner (a harness replaying the step it
                 committed last time): a hash hit when the sessions share a trunk and that
                 winner was committed (HASH_SKIP only when it ends on a page boundary: the
                 index keys full pages, so a replay ending mid-page recomputes that tail);
* ``loop``       the trunk's last call again, verbatim (the agent repeating itself);
* ``malformed``  a call whose JSON does not parse (an unquoted argument);
* ``proposed``   a well-formed call to a listed tool that the harness proposes itself (the
                 seed's legal winner; SmolLM2's own samples are often cut or loops);
* ``truncated``  a call cut before its end: whether it is kept depends on what the model
                 writes in the early-abort probe.

Every candidate is judged once, with full information (``scored_judge.judge``): the model's
mean log-probability of it and the scorers' verdict on the whole text. The reference winner
of a session is the exhaustive choice over all of them (``WinnerRule``). The workload is
built by the caller's model and owned by the run that built it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from forkserve.backend.protocol import SamplingParams
from forkserve.bench.fanout import FanoutParams
from forkserve.bench.scored_judge import Judged, WinnerRule, judge
from forkserve.control.scorers import Scorer
from forkserve.engine import Engine

KINDS = ("sampled", "duplicate", "loop", "malformed", "proposed", "truncated")


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(params),
                       "properties": {k: {"type": "string", "description": v}
                                      for k, v in params.items()}}}}


TOOLS = (
    _tool("search_logs", "Search the CI logs", query="words to look for"),
    _tool("read_file", "Read a file of the repository", path="path from the repository root"),
    _tool("run", "Run a shell command in the repository", cmd="the command line"),
)
TASKS = (
    "The nightly build fails since yesterday. Find out why and propose a fix.",
    "The test suite got twice as slow this week. Find the slow tests.",
    "Users report a crash when the config file is empty. Reproduce it.",
    "The release job cannot upload the wheel. Find the cause.",
    "A flaky test fails one run in ten. Find which one and why.",
    "The docs build warns about broken links. List them.",
    "Memory use of the server grew after the last merge. Find the leak.",
    "The linter job fails on main. Find the offending files.",
    "The benchmark numbers dropped by 20%. Find the commit that did it.",
    "The Docker image no longer starts. Find what changed.",
)


class CallFormat(Protocol):
    """How the model writes calls (the server's ``ToolFormat``: chosen by the chat template)."""

    def render_calls(self, calls: Sequence[tuple[str, dict[str, Any]]]) -> str: ...

    def system_prompt(self, tools: Sequence[dict[str, Any]]) -> str: ...


@dataclass(frozen=True)
class CallTexts:
    """The written candidates and the trunk's calls, in the model's own call format."""
    first: str      # the trunk's first call
    last: str       # the trunk's last call: the loop candidate repeats it
    malformed: str  # a call whose JSON does not parse (the command left unquoted)
    proposed: str   # a well-formed call to a listed tool
    truncated: str  # a call cut inside its argument

    @classmethod
    def of(cls, fmt: CallFormat) -> "CallTexts":
        cmd = "make test -k nightly"
        bad = fmt.render_calls([("run", {"cmd": cmd})]).replace(f'"{cmd}"', cmd)
        cut = fmt.render_calls([("read_file", {"path": "Makefile"})])
        return cls(fmt.render_calls([("run", {"cmd": "make nightly"})]),
                   fmt.render_calls([("search_logs", {"query": "error"})]), bad,
                   fmt.render_calls([("run", {"cmd": "grep -n ssl Makefile"})]),
                   cut[:cut.index("Makefile") + len("Makefile")])


@dataclass(frozen=True)
class ScoredParams:
    """The fan-out's shape (trunk: the target trunk tokens; residual: the most tokens a sampled
    thought may take) and how the model samples its thoughts."""
    shape: FanoutParams
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        if self.shape.fanout < 2:
            raise ValueError(f"a fan-out needs at least 2 candidates, got {self.shape.fanout}")
        if self.shape.residual < 1 or self.shape.sessions < 1:
            raise ValueError("residual and sessions must be >= 1")


@dataclass(frozen=True)
class Candidate:
    kind: str
    tokens: tuple[int, ...]
    judged: Judged


@dataclass(frozen=True)
class SessionStep:
    trunk: tuple[int, ...]
    candidates: tuple[Candidate, ...]
    observation: tuple[int, ...]  # the tool's answer, committed after the winner
    reference_winner: int         # the exhaustive choice (WinnerRule over every candidate)


@dataclass(frozen=True)
class ScoredWorkload:
    params: ScoredParams
    sessions: tuple[SessionStep, ...]
    checker: str  # which legality check judged the calls

    def kinds(self) -> dict[str, int]:
        counts = dict.fromkeys(KINDS, 0)
        for step in self.sessions:
            for c in step.candidates:
                counts[c.kind] += 1
        return counts


def _log_lines(n: int) -> str:
    lines = [f"[{i:05d}] tests/test_mod{i % 37}.py::test_case_{i} PASSED" for i in range(n)]
    return "\n".join(lines + ["ERROR: ld: cannot find -lssl (nightly toolchain)"])


FOLLOW_UP = "Check how the build links OpenSSL, then fix it."


class TrunkWriter:
    """Chat-templated trunks of about ``target`` tokens (the log grows until it reaches them),
    with the function-calling system prompt for ``TOOLS`` in the model's call format."""

    def __init__(self, encode_chat: Callable[[list[dict[str, str]]], list[int]],
                 fmt: CallFormat) -> None:
        self.encode_chat, self.calls = encode_chat, CallTexts.of(fmt)
        self.system = fmt.system_prompt(TOOLS)

    def trunk(self, task: str, target: int) -> list[int]:
        lines, ids = 0, self._render(task, 0)
        while len(ids) < target:  # each log line is about 20 tokens
            lines = max(lines + 1, lines + (target - len(ids)) // 24)
            ids = self._render(task, lines)
        return ids

    def _render(self, task: str, lines: int) -> list[int]:
        return self.encode_chat([
            {"role": "system", "content": self.system},
            {"role": "user", "content": task},
            {"role": "assistant", "content": self.calls.first},
            {"role": "tool", "content": _log_lines(lines)},
            {"role": "assistant", "content": self.calls.last},
            {"role": "tool", "content": "1 match: ERROR: ld: cannot find -lssl"},
            {"role": "user", "content": FOLLOW_UP},
        ])


def sample_thoughts(engine: Engine, asks: Sequence[tuple[Sequence[int], int]],
                    params: ScoredParams, stop: Sequence[int]) -> list[list[tuple[int, ...]]]:
    """For each (trunk, n): ``n`` next turns the model writes after the trunk, one seed each;
    every session's thoughts are decoded together, in one batch per tick."""
    handles = []
    for s, (trunk, n) in enumerate(asks):
        handles.append([engine.open(trunk) for _ in range(n)])
        for j, h in enumerate(handles[-1]):
            sampling = SamplingParams(temperature=params.temperature, top_p=params.top_p,
                                      seed=params.seed + 1000 * s + j)
            engine.start_generate(h.id, params.shape.residual, sampling=sampling, stop=stop)
    flat = [h for hs in handles for h in hs]
    while any(engine.generation(h.id) is None for h in flat):
        engine.tick()
    out = [[engine.generation(h.id).tokens for h in hs] for hs in handles]
    for h in flat:
        engine.close(h.id)
    return out


def observation(encode: Callable[[str], list[int]], page_size: int) -> tuple[int, ...]:
    """The tool's answer committed after the winner: at least a page, so the winner's last
    page fills and is published (a later replay of it is then a whole hash hit)."""
    lines = ["exit 0"]
    while True:
        ids = encode("\n<|im_start|>tool\n" + "\n".join(lines) + "<|im_end|>\n"
                     "<|im_start|>assistant\n")
        if len(ids) >= page_size:
            return tuple(ids)
        lines.append(f"step {len(lines)}: ok")


def build_workload(engine: Engine, writer: TrunkWriter, encode: Callable[[str], list[int]],
                   scorers: tuple[Scorer, Scorer], params: ScoredParams, stop: Sequence[int],
                   checker: str) -> ScoredWorkload:
    """The sessions, their candidates judged and each session's reference winner.
    ``engine``: any Engine over the model (the work it does here is not measured);
    ``scorers``: the cascade's and its legality part (``judge``)."""
    shape, rule, calls = params.shape, WinnerRule(), writer.calls
    written = {"loop": tuple(encode(calls.last)) + tuple(stop[:1]),
               "malformed": tuple(encode(calls.malformed)),
               "proposed": tuple(encode(calls.proposed)) + tuple(stop[:1]),
               "truncated": tuple(encode(calls.truncated))}
    fixed = ["duplicate", "loop", "malformed", "proposed", "truncated"][:shape.fanout - 1]
    answer = observation(encode, shape.page_size)
    kinds = [["sampled"] * (shape.fanout - len(fixed)) + fixed for _ in range(shape.sessions)]
    kinds[0] = ["sampled" if k == "duplicate" else k for k in kinds[0]]  # nothing to replay yet
    trunks = [writer.trunk(TASKS[s % len(TASKS)] if shape.distinct_trunks else TASKS[0],
                           shape.trunk) for s in range(shape.sessions)]
    asks = [(t, k.count("sampled")) for t, k in zip(trunks, kinds, strict=True)]
    thoughts = sample_thoughts(engine, asks, params, stop)
    steps: list[SessionStep] = []
    for trunk, names, sampled in zip(trunks, kinds, map(iter, thoughts), strict=True):
        residuals = [next(sampled) if k == "sampled" else written[k] if k in written
                     else steps[-1].candidates[steps[-1].reference_winner].tokens
                     for k in names]
        judged = judge(engine, trunk, residuals, *scorers)
        candidates = tuple(Candidate(k, tuple(r), j)
                           for k, r, j in zip(names, residuals, judged, strict=True))
        winner = rule.choose([c.judged for c in candidates], range(len(candidates)))
        steps.append(SessionStep(tuple(trunk), candidates, answer, winner))
    return ScoredWorkload(params, tuple(steps), checker)
