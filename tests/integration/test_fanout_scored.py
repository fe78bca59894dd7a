"""The scored fan-out on SmolLM2 (CPU): the cascade's decisions come from real scores on real
text, and pruning early does not change the winner an exhaustive harness would choose.

One tiny workload (2 sessions sharing a trunk, 6 candidates each: the model's sampled
thoughts, a replay of session 1's winner, a loop, a malformed, a proposed and a truncated
call) runs on the Engine with and without the cascade.
"""
from __future__ import annotations

import pytest

from forkserve.bench.scored_judge import Judged, WinnerRule
from forkserve.config import plus_config

CONFIG = plus_config()  # the cascade's thresholds and page size, as the bench's rows run it


def _judged(logprob: float, eligible: bool) -> Judged:
    return Judged(logprob, 1.0 if eligible else 0.22, False, "", eligible, eligible)


def test_winner_rule_takes_the_likeliest_eligible_kept_candidate():
    judged = [_judged(-2.0, True), _judged(-0.5, False), _judged(-1.0, True),
              _judged(-0.1, True)]
    rule = WinnerRule()
    assert rule.choose(judged, range(4)) == 3
    assert rule.choose(judged, [0, 1, 2]) == 2       # 3 pruned: the next likeliest
    assert rule.choose(judged, [1]) == 1             # none eligible: the lowest kept
    assert rule.choose([_judged(-1.0, True)] * 3, [2, 1]) == 1  # a tie: the lower index
    with pytest.raises(ValueError):
        rule.choose(judged, [])


def test_written_calls_follow_the_models_format():
    pytest.importorskip("fastapi")
    from forkserve.bench.scored_workload import CallTexts
    from forkserve.interfaces.server.tools.formats import SmolLM2Format

    fmt = SmolLM2Format()
    calls = CallTexts.of(fmt)
    assert fmt.parse(calls.last).calls[0].name == "search_logs"
    assert fmt.parse(calls.malformed).calls == ()     # its JSON does not parse
    assert calls.truncated.startswith(fmt.prefix) and not calls.truncated.endswith(fmt.suffix)


@pytest.fixture(scope="module")
def scored():
    pytest.importorskip("gguf")
    pytest.importorskip("fastapi")
    pytest.importorskip("xgrammar")
    from forkserve.backend.torch import find_smollm2_gguf
    from forkserve.bench import fanout_scored as fs
    from forkserve.bench.scored_workload import ScoredParams

    try:
        path = find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(f"the SmolLM2 package is not installed: {exc}")
    model = fs.Model(path, "cpu")
    workload = model.workload(ScoredParams(fs.TINY))
    rows = {s: fs.engine_row(s, "tiny", model, workload) for s in ("cascade", "alias")}
    return workload, rows


def _index(workload, session: int, kind: str) -> int:
    return [c.kind for c in workload.sessions[session].candidates].index(kind)


@pytest.mark.slow  # SmolLM2 on the CPU: minutes on 2 cores
def test_the_scorers_judge_real_text(scored):
    workload, _ = scored
    assert workload.checker.startswith("CallLegality")
    first = workload.sessions[0]
    loop = first.candidates[_index(workload, 0, "loop")].judged
    assert loop.is_loop and not loop.eligible
    malformed = first.candidates[_index(workload, 0, "malformed")].judged
    assert "not a smollm2 tool call" in malformed.reason and not malformed.eligible
    truncated = first.candidates[_index(workload, 0, "truncated")].judged
    assert "unterminated" in truncated.reason and not truncated.eligible
    proposed = first.candidates[_index(workload, 0, "proposed")].judged
    assert proposed.legal and not proposed.is_loop and proposed.eligible
    sampled = first.candidates[0]
    assert sampled.kind == "sampled" and all(t < 49152 for t in sampled.tokens)


@pytest.mark.slow  # SmolLM2 on the CPU: minutes on 2 cores
def test_cascade_hits_the_replay_skips_the_loop_and_drops_the_malformed_call(scored):
    workload, rows = scored
    row, drive = rows["cascade"]
    for s in range(len(workload.sessions)):
        actions, kept = drive.actions[s], drive.kept[s]
        assert actions[_index(workload, s, "loop")] == "draft_skip"
        malformed = _index(workload, s, "malformed")
        assert actions[malformed] == "early_abort" and malformed not in kept  # the probe agreed
    # Session 2 replays session 1's reference winner. When session 1 committed it, the index
    # covers every full page of it: whole when it ends on a page boundary, else its tail is
    # computed (probed first when the replay itself scores below tau). When the cascade chose
    # another winner, nothing of it was published.
    step, replay = workload.sessions[1], _index(workload, 1, "duplicate")
    judged, action, miss = (step.candidates[replay].judged, drive.actions[1][replay],
                            drive.misses[1][replay])
    tail = (len(step.trunk) + len(step.candidates[replay].tokens)) % CONFIG.page_size
    if row.winners[0] != workload.sessions[0].reference_winner:
        assert miss > tail
    elif tail == 0:
        assert action == "hash_skip"
    elif judged.is_loop and judged.score < CONFIG.tau_pre:
        assert action == "draft_skip"
    else:
        assert action == ("early_abort" if judged.score < CONFIG.tau else "hash_partial")
        assert miss == tail


@pytest.mark.slow  # SmolLM2 on the CPU: minutes on 2 cores
def test_the_exhaustive_run_prefills_everything_and_the_cascade_loses_a_winner_only_to_a_score(
        scored):
    """The exhaustive run's winners are the reference. The cascade's equal them except where
    its scorers dropped the reference candidate (a score below tau: loop skip or a failed
    probe); never through a hash hit or a lost page."""
    workload, rows = scored
    cascade, cascade_drive = rows["cascade"]
    alias, drive = rows["alias"]
    assert set(a for session in drive.actions for a in session) == {"prefill"}
    reference = tuple(s.reference_winner for s in workload.sessions)
    # The proposed call is eligible, so the choice is the model's, not the fallback to index 0.
    assert all(s.candidates[w].judged.eligible
               for s, w in zip(workload.sessions, reference, strict=True))
    assert alias.winners == reference and alias.same_winner == len(reference)
    for s, (step, won) in enumerate(zip(workload.sessions, cascade.winners, strict=True)):
        ref = step.reference_winner
        if won != ref:
            assert cascade_drive.actions[s][ref] in ("draft_skip", "early_abort")
            assert ref not in cascade_drive.kept[s]
            assert step.candidates[ref].judged.score < CONFIG.tau
        else:
            assert ref in cascade_drive.kept[s]
    assert cascade.same_winner == sum(w == r for w, r in zip(cascade.winners, reference,
                                                             strict=True))
    assert cascade.computed_tokens < alias.computed_tokens
    assert cascade.peak_kv_tokens < alias.peak_kv_tokens


def test_plain_vllm_loads_a_ggufs_hf_copy_in_the_rows_dtype(tmp_path, monkeypatch):
    """vLLM 0.26 reads no GGUF: NativeVllm.start hands build_llm the GGUF's Hugging Face copy
    (skip_tokenizer_init, the TorchBackend rows' dtype); an HF folder goes as it is; a load
    vLLM refuses with an OSError comes back as a RuntimeError, which the bench notes."""
    import torch

    from forkserve.backend.torch import gguf_hf_copy
    from forkserve.backend.vllm import kv_gauge, vllm_loader
    from forkserve.bench import fanout_scored

    gguf, copy = tmp_path / "m.gguf", tmp_path / "m.gguf.hf-key"
    gguf.write_bytes(b"GGUF")
    calls = []

    class FakeLlm:
        llm_engine = object()

        def reset_prefix_cache(self) -> bool:
            return True

    def build_llm(model, config, **kw):
        calls.append((model, kw))
        if model.endswith("refused"):
            raise OSError("not a valid JSON file")
        return FakeLlm()

    monkeypatch.setattr(gguf_hf_copy, "hf_copy", lambda path: copy if path == gguf else None)
    monkeypatch.setattr(vllm_loader, "build_llm", build_llm)
    monkeypatch.setattr(vllm_loader, "api", lambda: "api")
    monkeypatch.setattr(kv_gauge.KvGauge, "attach", classmethod(lambda cls, engine: "gauge"))
    native = fanout_scored.NativeVllm.start(gguf, 16, 256, 0.3, torch.bfloat16)
    assert (native.engine, native.api, native.gauge) == (FakeLlm.llm_engine, "api", "gauge")
    native.reset()
    model, kw = calls[-1]
    assert model == str(copy)
    assert kw["llm_kwargs"] == {"skip_tokenizer_init": True, "dtype": torch.bfloat16}
    assert kw["max_loras"] == 0 and kw["gpu_memory_utilization"] == 0.3
    fanout_scored.NativeVllm.start(tmp_path, 16, 256, 0.3, torch.bfloat16)
    assert calls[-1][0] == str(tmp_path)
    with pytest.raises(RuntimeError, match="vLLM could not load .*refused: OSError"):
        fanout_scored.NativeVllm.start(tmp_path / "refused", 16, 256, 0.3, torch.bfloat16)


def test_a_gguf_without_an_hf_copy_is_a_runtime_error(tmp_path, monkeypatch):
    from forkserve.backend.torch import gguf_hf_copy
    from forkserve.bench import fanout_scored

    def fails(path):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_hf_copy, "hf_copy", fails)
    with pytest.raises(RuntimeError, match="no Hugging Face copy of .*m.gguf.*disk full"):
        fanout_scored.vllm_model_folder(tmp_path / "m.gguf")
