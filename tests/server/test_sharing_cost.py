"""``--quality-report``: /v1/models carries the measured F1 cost of the sharing the server
does, picked by its configuration from a quality report; a bad report is one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.quality.modes import ORDER, Adapters, Prelude, mode
from forkserve.config import BaseCorrection, ForkServeConfig, KVLayout, ShareBase
from forkserve.interfaces.server.generation_defaults import OPENAI_DEFAULTS
from forkserve.interfaces.server.openai_wire import model_list
from forkserve.interfaces.server.sharing_cost import load_sharing_cost, quality_mode
from forkserve.interfaces.usage import UsageError
from forkserve.sharing_mode import NoQualityMode, deployment_mode
from tests.server.test_cli import run_cli

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "benchmarks" / "results" / "quality_h200.json"


def config(**kw) -> ForkServeConfig:
    return ForkServeConfig(**{"kv_layout": KVLayout.DISAGGREGATED, **kw})


def summary(layout: str, mean: float, low: float, high: float, n: int = 120) -> dict:
    interval = {"mean": mean, "low": low, "high": high, "n": n, "clusters": n // 3}
    return {"layout": layout, "available": True, "rounds": n // 3, "reference": "unified",
            "kv_vs_unified": 1 / 3, "paired": {"delta_f1": interval}}


@pytest.fixture
def report(tmp_path) -> Path:
    path = tmp_path / "quality_x.json"
    path.write_text(json.dumps({"setting": {"model": "m.gguf"}, "summaries": [
        {"layout": "unified", "available": True, "paired": None},
        summary("disaggregated", -0.033, -0.069, 0.002),
        summary("neutral", -0.107, -0.148, -0.068, n=160)]}))
    return path


@pytest.mark.parametrize("kw,expected", [
    ({"kv_layout": KVLayout.UNIFIED}, None),
    ({"share_base": ShareBase.EXACT}, None),
    ({}, "disaggregated"),
    ({"kv_layout": KVLayout.ADAPTIVE}, "disaggregated"),
    ({"share_base": ShareBase.NEUTRAL}, "neutral"),
    ({"kv_layout": KVLayout.FULL_REUSE}, "full_reuse"),
    ({"recompute_layers": (3, 7, 9)}, "recompute3"),
    ({"base_correction": BaseCorrection.OFFSET}, "offset"),
])
def test_a_deployment_maps_to_the_report_row_of_its_reads(kw, expected):
    assert quality_mode(config(**kw)) == expected


@pytest.mark.parametrize("name", ["disaggregated", "full_reuse", "neutral", "recompute5",
                                  "recompute15", "offset"])
def test_the_mapping_names_the_mode_the_quality_eval_configures_alike(name):
    m = mode(name)
    assert quality_mode(m.config(range(m.recompute))) == name


@pytest.mark.parametrize("name", [n for n in ORDER if n not in ("alora_unified", "offset0")]
                         + ["recompute3"])
def test_every_quality_mode_is_the_deployment_mode_of_its_own_setup(name):
    # alora_unified reuses no published page at all: a choice per request, not a deployment;
    # an offset mode's rank lives in its fitted tables, not the config (all read as "offset").
    m = mode(name)
    assert deployment_mode(m.config(range(m.recompute)), lora=m.adapters is not Adapters.NONE,
                           activated=m.adapters is Adapters.ALORA,
                           base_pass=m.prelude is Prelude.BASE_ACTIVATIONS) == name


def test_a_deployment_no_quality_mode_runs_as_is_refused():
    with pytest.raises(NoQualityMode, match="unified layout only"):
        deployment_mode(config(), activated=True)


def test_the_card_holds_the_rows_paired_change_in_points(report):
    card = load_sharing_cost(report, config())
    assert (card.mode, card.model) == ("disaggregated", "m.gguf")
    assert (card.readers, card.rounds) == (120, 40)
    assert (card.delta_f1, card.ci95) == (-3.3, (-6.9, 0.2))
    assert card.kv_vs_unified == pytest.approx(1 / 3) and card.source == "quality_x.json"
    assert load_sharing_cost(report, config(share_base=ShareBase.NEUTRAL)).readers == 160
    # Exact deployments pay nothing: no card, whatever the report holds.
    assert load_sharing_cost(report, config(share_base=ShareBase.EXACT)) is None


def test_v1_models_shows_the_cost_on_every_card(report):
    card = load_sharing_cost(report, config())
    listed = model_list("base", ["a", "b"], 0, OPENAI_DEFAULTS, ShareBase.CROSS_ADAPTER, card)
    assert [c.share_base_cost for c in listed.data] == [card] * 3
    wire = json.loads(listed.model_dump_json())["data"][0]["share_base_cost"]
    assert wire["delta_f1"] == -3.3 and wire["ci95"] == [-6.9, 0.2]
    plain = model_list("base", [], 0, OPENAI_DEFAULTS, ShareBase.EXACT)
    assert json.loads(plain.model_dump_json())["data"][0]["share_base_cost"] is None


def test_the_committed_h200_report_has_a_row_for_every_sharing_deployment():
    for kw in ({}, {"share_base": ShareBase.NEUTRAL}, {"kv_layout": KVLayout.FULL_REUSE},
               {"base_correction": BaseCorrection.OFFSET}):
        card = load_sharing_cost(COMMITTED, config(**kw))
        assert card.readers >= 120 and card.ci95[0] <= card.delta_f1 <= card.ci95[1]


@pytest.mark.parametrize("content,message", [
    (None, "does not exist"),
    ("{not json", "is not readable JSON"),
    ('{"rows": []}', "is not a quality report"),
])
def test_an_unusable_report_is_a_usage_error(tmp_path, content, message):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=message):
        load_sharing_cost(path, config())


def test_a_report_without_the_deployments_row_names_what_it_measured(report):
    with pytest.raises(UsageError, match=r"mode 'full_reuse'.*\['disaggregated', 'neutral'\]"):
        load_sharing_cost(report, config(kv_layout=KVLayout.FULL_REUSE))


def test_the_serve_flag_reports_a_bad_report_before_the_model_loads(capsys, tiny_model_dir,
                                                                   tmp_path):
    err = run_cli(capsys, "--model", tiny_model_dir[0], "--layout", "disaggregated",
                  "--quality-report", tmp_path / "missing.json")
    assert "--quality-report" in err and "does not exist" in err
