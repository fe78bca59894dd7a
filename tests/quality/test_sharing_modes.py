"""The sharing modes that keep quality (issue 16, item 3) in the engine, on a tiny random Llama
with two random LoRA adapters: (a) the neutral writer, (b) selective recompute."""
import sys
from pathlib import Path

import pytest
import torch

from forkserve import Engine, ForkServeConfig, KVLayout, ShareBase
from forkserve.config import KVForm
from forkserve.control.recompute_policy import LayerDrift, most_drifting, resampled

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from tiny_llama import save_tiny_llama  # noqa: E402

LAYERS = 3
CONTEXT = [3 + (i * 7) % 90 for i in range(32)]   # eight full pages of 4 tokens
QUESTION = {"planner": [11, 12, 13], "critic": [21, 22, 23, 24]}


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny3"), layers=LAYERS)


def _engine(model, layout=KVLayout.DISAGGREGATED, share=ShareBase.CROSS_ADAPTER, recompute=()):
    from forkserve.backend.torch import TorchBackend

    path, adapters = model
    cfg = ForkServeConfig(page_size=4, num_pages=256, num_residual_pages=256, kv_layout=layout,
                          share_base=share, recompute_layers=recompute, node_ttl_s=None)
    return Engine(TorchBackend(cfg, path, adapters, device="cpu", dtype=torch.float32,
                               attention="eager", use_cuda_graphs=False))


def _answer(eng, adapter, tokens, n=8):
    h = eng.open(tokens, adapter=adapter)
    out = eng.generate(h.id, n).tokens
    eng.close(h.id)
    return out


def _reads(eng, adapter, tokens):
    """(answer, base tokens found in the cache at open)."""
    before = eng.metrics.base_hit_tokens
    h = eng.open(tokens, adapter=adapter)
    hit = eng.metrics.base_hit_tokens - before
    out = eng.generate(h.id, 8).tokens
    eng.close(h.id)
    return out, hit


# ---- (a) neutral writer -----------------------------------------------------------------

def test_neutral_writer_pages_are_exact_for_the_base_model_and_read_by_every_adapter(tiny3):
    eng = _engine(tiny3, share=ShareBase.NEUTRAL)
    _answer(eng, None, CONTEXT, n=1)                      # the neutral pass publishes the context
    out, hit = _reads(eng, None, CONTEXT + [9, 10])
    assert hit == len(CONTEXT) and out == _answer(_engine(tiny3), None, CONTEXT + [9, 10])
    for name, question in QUESTION.items():              # both adapters read the same base pages
        _, hit = _reads(eng, name, CONTEXT + question)
        assert hit == len(CONTEXT)
    eng.check_integrity()


def test_neutral_writer_never_shares_one_adapters_pages_with_another(tiny3):
    eng = _engine(tiny3, share=ShareBase.NEUTRAL)
    _answer(eng, "planner", CONTEXT)                       # no base pass: the planner writes
    out, hit = _reads(eng, "critic", CONTEXT + QUESTION["critic"])
    assert hit == 0
    unified = _engine(tiny3, KVLayout.UNIFIED)
    assert out == _answer(unified, "critic", CONTEXT + QUESTION["critic"])
    # An agent's own pages are exact for it: a second turn over them equals unified.
    again, hit = _reads(eng, "planner", CONTEXT + QUESTION["planner"])
    assert hit == len(CONTEXT)
    assert again == _answer(unified, "planner", CONTEXT + QUESTION["planner"])
    eng.check_integrity()


# ---- (b) selective recompute ------------------------------------------------------------

def _writer_then_reader(eng):
    _answer(eng, "planner", CONTEXT + QUESTION["planner"])
    return _reads(eng, "critic", CONTEXT + QUESTION["critic"])


def test_recomputing_every_layer_is_unified_and_none_is_the_plain_shared_mode(tiny3):
    unified = _answer(_engine(tiny3, KVLayout.UNIFIED), "critic", CONTEXT + QUESTION["critic"])
    shared, hit = _writer_then_reader(_engine(tiny3))
    assert hit == len(CONTEXT) and shared != unified    # the approximation shows on this model
    every, hit = _writer_then_reader(_engine(tiny3, recompute=tuple(range(LAYERS))))
    assert hit == len(CONTEXT) and every == unified  # it matched the base pages, read in no layer


def test_all_layers_recomputed_give_unified_logits_to_the_reader(tiny3):
    """Logits, not only greedy tokens: the reader's prefill over the writer's base pages."""
    from forkserve.backend.protocol import KVSlots, SeqWork

    logits = {}
    every = tuple(range(LAYERS))
    for layout, recompute in ((KVLayout.UNIFIED, ()), (KVLayout.DISAGGREGATED, every)):
        eng = _engine(tiny3, layout, recompute=recompute)
        backend = eng.backend
        pages = tuple(range(10))
        res = tuple(range(10)) if layout is KVLayout.DISAGGREGATED else None
        form = KVForm.MERGED if res is None else KVForm.SPLIT
        writer = SeqWork(0, tuple(CONTEXT), 0, KVSlots(pages, res), backend.adapter_id("planner"),
                         form=form)
        backend.step([writer])
        reader_res = tuple(range(10, 20)) if res is not None else None
        reader_pages = pages if res is not None else tuple(range(10, 20))
        if res is None:                                   # unified: the reader writes its own copy
            backend.step([SeqWork(1, tuple(CONTEXT), 0, KVSlots(reader_pages),
                                  backend.adapter_id("critic"))])
        else:                                             # its residual (and own layers) only
            backend.step([SeqWork(1, tuple(CONTEXT), 0, KVSlots(reader_pages, reader_res),
                                  backend.adapter_id("critic"), write_base=False, form=form)])
        q = tuple(QUESTION["critic"])
        out = backend.forward([SeqWork(1, q, len(CONTEXT), KVSlots(reader_pages, reader_res),
                                       backend.adapter_id("critic"), form=form)], all_logits=True)
        logits[layout] = out.logits[0]
    torch.testing.assert_close(logits[KVLayout.DISAGGREGATED], logits[KVLayout.UNIFIED],
                               atol=1e-5, rtol=1e-5)


def test_a_step_of_split_and_base_model_items_equals_them_run_apart(tiny3):
    from forkserve.backend.protocol import GREEDY, KVSlots, SeqWork

    def run(together):
        eng = _engine(tiny3, recompute=(1,))
        b = eng.backend
        base = SeqWork(0, tuple(CONTEXT), 0, KVSlots(tuple(range(8))), None, GREEDY)
        split = SeqWork(1, tuple(CONTEXT), 0, KVSlots(tuple(range(8, 16)), tuple(range(8))),
                        b.adapter_id("critic"), GREEDY, form=KVForm.SPLIT)
        outs = [b.forward([base, split], all_logits=True)] if together else \
            [b.forward([base], all_logits=True), b.forward([split], all_logits=True)]
        return [x for o in outs for x in o.logits], [t for o in outs for t in o.result.next_tokens]

    (apart, apart_tokens), (together, tokens) = run(False), run(True)
    assert tokens == apart_tokens
    for a, t in zip(apart, together, strict=True):
        torch.testing.assert_close(t, a)


def test_recompute_layers_are_refused_where_they_cannot_hold():
    with pytest.raises(ValueError, match="residual pool"):
        ForkServeConfig(kv_layout=KVLayout.UNIFIED, recompute_layers=(1,))
    with pytest.raises(ValueError, match="increasing"):
        ForkServeConfig(kv_layout=KVLayout.DISAGGREGATED, recompute_layers=(2, 1))
    with pytest.raises(ValueError, match="host tier"):
        ForkServeConfig(kv_layout=KVLayout.DISAGGREGATED, recompute_layers=(1,),
                        host_residual_pages=8)


def test_recompute_bytes_ride_in_the_residual_page(tiny3):
    from forkserve.backend.protocol import PageKind

    plain, two = _engine(tiny3).backend, _engine(tiny3, recompute=(0, 2)).backend
    cfg = plain.model_config
    extra = 2 * 2 * cfg.kv_size * 4                      # K and V of 2 layers, float32
    per_token = two.kv_bytes_per_token()[PageKind.RESIDUAL]
    assert per_token == plain.kv_bytes_per_token()[PageKind.RESIDUAL] + extra
    assert two.pool.bytes_per_page(PageKind.RESIDUAL) == per_token * 4  # pages of 4 tokens


def test_the_layers_recomputed_are_the_most_drifting():
    drift = LayerDrift(k=(0.0, 0.30, 0.10, 0.20), v=(0.0, 0.10, 0.40, 0.20))
    assert most_drifting(drift, 0) == ()
    assert most_drifting(drift, 1) == (2,)                # mean 0.25 beats 0.20 and 0.20
    assert most_drifting(drift, 2) == (1, 2)  # the tie at 0.20 goes to the earlier layer
    assert most_drifting(drift, 4) == (0, 1, 2, 3)
    with pytest.raises(ValueError):
        most_drifting(drift, 5)
    with pytest.raises(ValueError):
        LayerDrift(k=(0.1,), v=(0.1, 0.2))


def test_a_profile_of_another_depth_is_read_at_the_same_relative_depth():
    drift = LayerDrift((0.0, 0.1, 0.2, 0.3, 0.4), (0.0, 0.1, 0.2, 0.3, 0.4))
    assert resampled(drift, 5) is drift
    assert resampled(drift, 3).k == (0.0, 0.2, 0.4)      # first, middle, last
    assert resampled(drift, 9).k == (0.0, 0.0, 0.1, 0.2, 0.2, 0.2, 0.3, 0.4, 0.4)
    assert most_drifting(resampled(drift, 2), 1) == (1,)
