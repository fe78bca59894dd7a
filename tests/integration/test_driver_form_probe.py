"""The bench driver skips the adaptive layout's form probe for a workflow that fits in neither
form (docs/MULTILORA.md "Round 16"): the run is the one that probes at every admission check,
open by open (tick, agent, form), tick by tick (prefill and decode tokens) and output by
output, with fewer probes where agents wait for a wave."""
from __future__ import annotations

import pytest
import torch

from forkserve.backend.mock import MockBackend
from forkserve.bench.multilora import MultiLoraParams, tiny_config
from forkserve.bench.multilora import workload as workload_module
from forkserve.bench.multilora.driver import Driver, Workflow
from forkserve.bench.multilora.systems import SPECS
from forkserve.bench.multilora.workload import engine_config, page_bytes, run_workload
from forkserve.config import KVForm
from forkserve.engine import Engine


class ProbeEveryTime(Driver):
    """The straightforward driver: the layout's form is probed at every admission check."""

    def _no_form_fits(self, flow: Workflow) -> bool:
        return False


class Recorder(Engine):
    """Every open (ticks so far, adapter, form), every tick's tokens and every form probe."""

    def __init__(self, backend: MockBackend) -> None:
        super().__init__(backend)
        self.log: list[tuple] = []
        self.probes = 0

    def layout_form(self, tokens, **kwargs) -> KVForm:
        self.probes += 1
        return super().layout_form(tokens, **kwargs)

    def open(self, tokens, **kwargs):
        handle = super().open(tokens, **kwargs)
        node = self.node(handle.id, self.tip(handle.id))
        self.log.append(("open", node.adapter, len(tokens),
                         self.kv.form_of(node.table, node.adapter)))
        return handle

    def tick(self) -> bool:
        m = self.metrics
        prefill, decode = m.prefill_tokens, m.decode_tokens
        did = super().tick()
        self.log.append(("tick", did, m.prefill_tokens - prefill, m.decode_tokens - decode))
        return did


def run(workload: str, workflows: int, driver: type[Driver],
        monkeypatch: pytest.MonkeyPatch) -> tuple[Recorder, str]:
    """As test_multilora_bench's contention test: a base pool of 95 pages (mark 85.5), agents
    of 38 pages; 3 agents run merged in two waves, 8 split (past ``adaptive_split_waves``)."""
    cfg = tiny_config()
    sizes = page_bytes(cfg, 16, 16, torch.float32)
    params = MultiLoraParams(workload, workflows=workflows, context=512, turns=2, gen=32,
                             observation=8, pause_s=0.0, residual_share=0.5,
                             kv_budget_gib=190 * sizes["base"] / 2 ** 30)
    engine = Recorder(MockBackend(engine_config(SPECS["adaptive"], params, sizes, cfg)))
    monkeypatch.setattr(workload_module, "Driver", driver)
    result = run_workload("adaptive", params, engine, sizes, lambda i: f"agent{i}")
    engine.check_integrity()
    return engine, result.outputs_sha256


@pytest.mark.parametrize("workload", ["react", "mapreduce"])
@pytest.mark.parametrize("workflows, form", [(3, KVForm.MERGED), (8, KVForm.SPLIT)])
def test_skipping_the_probe_changes_no_decision(workload, workflows, form, monkeypatch):
    fast, fast_out = run(workload, workflows, Driver, monkeypatch)
    plain, plain_out = run(workload, workflows, ProbeEveryTime, monkeypatch)
    assert fast.log == plain.log and fast_out == plain_out
    assert {entry[3] for entry in fast.log[:workflows * 2] if entry[0] == "open"} == {form}
    if form is KVForm.MERGED:  # the second wave waited: the plain driver probed as it did
        assert fast.probes < plain.probes
