"""Offset correction (docs/QUALITY.md, mode d) on a tiny random Llama with two random LoRA
adapters: fitted on anchor prompts, it brings a reader's base K/V closer to its own on a
held-out prompt; it is zero where the writer is the reader; the base model, exact sharing and
a session over reused pages never see a correction."""
import sys
from pathlib import Path

import pytest
import torch

from forkserve import Engine, ForkServeConfig, KVLayout, ShareBase
from forkserve.backend.protocol import KVSlots, SeqWork
from forkserve.config import BaseCorrection, KVForm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from tiny_llama import VOCAB, save_tiny_llama  # noqa: E402

LAYERS = 3
gen = torch.Generator().manual_seed(1)
ANCHORS = [torch.randint(3, VOCAB, (48,), generator=gen).tolist() for _ in range(8)]
HELD_OUT = torch.randint(3, VOCAB, (40,), generator=gen).tolist()   # ten pages of 4 tokens
QUESTION = [11, 12, 13]


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny3_offset"), layers=LAYERS)


def _backend(model, layout=KVLayout.DISAGGREGATED, correction=BaseCorrection.OFFSET,
             share=ShareBase.CROSS_ADAPTER, attention="eager"):
    from forkserve.backend.torch import TorchBackend

    path, adapters = model
    cfg = ForkServeConfig(page_size=4, num_pages=64, num_residual_pages=64, kv_layout=layout,
                          share_base=share, base_correction=correction, node_ttl_s=None)
    return TorchBackend(cfg, path, adapters, device="cpu", dtype=torch.float32,
                        attention=attention, use_cuda_graphs=False)


@pytest.fixture(scope="module")
def tables(tiny3):
    from forkserve.backend.torch.offset_fit import fit_offsets

    unified = _backend(tiny3, KVLayout.UNIFIED, BaseCorrection.NONE)
    return {rank: fit_offsets(unified, ANCHORS, ["planner", "critic"], rank) for rank in (0, 8)}


def _write(backend, name, seq_id, tokens, pages, res):
    backend.step([SeqWork(seq_id, tuple(tokens), 0, KVSlots(pages, res), backend.adapter_id(name),
                          form=KVForm.SPLIT)])


@pytest.mark.parametrize("rank", [0, 8])
def test_fitted_offsets_bring_a_readers_base_kv_closer_to_its_own_on_a_held_out_prompt(
        tiny3, tables, rank):
    """The planner writes the held-out prompt's base pages; what the critic's read returns
    (the attention path's own correction over the stored pages and their writer tags) is
    compared with the base K/V the critic's own forward writes over the same prompt."""
    pages = tuple(range(10))
    own = _backend(tiny3)
    _write(own, "critic", 0, HELD_OUT, pages, pages)
    shared = _backend(tiny3)
    shared.install_offsets(tables[rank])
    _write(shared, "planner", 0, HELD_OUT, pages, pages)
    reader = torch.tensor(shared._resident[shared.adapter_id("critic")].slot)
    err_before, err_after = [], []
    for n in range(LAYERS):
        kv, mine = shared.pool.layer(n), own.pool.layer(n)
        keys, values = kv.k[list(pages)].flatten(0, 1), kv.v[list(pages)].flatten(0, 1)
        writers = kv.writer[list(pages)].reshape(-1)
        assert (writers == shared._resident[shared.adapter_id("planner")].slot + 1).all()
        k2, v2 = shared.correction.correct(keys, values, writers, reader, n, shared.model.rope)
        exact_k, exact_v = mine.k[list(pages)].flatten(0, 1), mine.v[list(pages)].flatten(0, 1)
        err_before.append(((keys - exact_k).norm() ** 2 + (values - exact_v).norm() ** 2).item())
        err_after.append(((k2 - exact_k).norm() ** 2 + (v2 - exact_v).norm() ** 2).item())
    assert err_before[0] == err_after[0] == 0.0             # layer 0 reads the embeddings
    if rank == 0:  # the mean offset: random tokens on random adapters drift with little mean
        assert sum(err_after) < sum(err_before)
    else:          # the map from the writer's base K/V: a measurable part of the drift
        assert sum(err_after) < 0.85 * sum(err_before)


def test_the_reader_attends_over_the_corrected_base(tiny3, tables):
    """End to end through EagerAttention: the critic reading the planner's pages gets logits
    closer to its unified logits than without the correction."""
    pages, res = tuple(range(10)), tuple(range(10))
    prompt = tuple(HELD_OUT + QUESTION)

    def reader_logits(backend):
        _write(backend, "planner", 0, HELD_OUT, pages, res)
        aid = backend.adapter_id("critic")
        backend.step([SeqWork(1, tuple(HELD_OUT), 0, KVSlots(pages, tuple(range(10, 20))), aid,
                              write_base=False, form=KVForm.SPLIT)])
        reader = tuple(range(10)) + (20,)
        return backend.forward([SeqWork(1, tuple(QUESTION), len(HELD_OUT),
                                        KVSlots(reader, tuple(range(10, 20)) + (21,)), aid,
                                        form=KVForm.SPLIT)], all_logits=True).logits[0]

    unified = _backend(tiny3, KVLayout.UNIFIED, BaseCorrection.NONE)
    exact = unified.forward([SeqWork(0, prompt, 0, KVSlots(tuple(range(11))),
                                     unified.adapter_id("critic"))], all_logits=True).logits[0]
    plain = reader_logits(_backend(tiny3, correction=BaseCorrection.NONE))
    corrected_backend = _backend(tiny3)
    corrected_backend.install_offsets(tables[8])
    corrected = reader_logits(corrected_backend)
    tail = exact[-len(QUESTION):]
    assert (corrected - tail).norm() < (plain - tail).norm()


def test_a_pair_fits_zero_when_the_writer_is_the_reader(tiny3):
    from forkserve.backend.torch.offset_table import fit_pair

    z = [torch.randn(50, 8), torch.randn(50, 8)]
    for rank in (0, 4):
        p = fit_pair("critic", "critic", z, z, z, z, rank, 1e-2)
        assert not p.c.any() and not p.u.any()


def _session_logits(backend, steps):
    """Logits of the last of ``steps``: (adapter, tokens, start, pages, residual pages,
    write_base) each."""
    out = None
    for i, (name, tokens, start, pages, res, write_base) in enumerate(steps):
        aid = None if name is None else backend.adapter_id(name)
        out = backend.forward([SeqWork(i, tuple(tokens), start, KVSlots(pages, res), aid,
                                       write_base=write_base, form=KVForm.SPLIT)], all_logits=True)
    return out.logits[0]


def _loud(table):
    """The same pairs with offsets 100x, and a pair of each adapter with itself (which the read
    path must skip): any read they reached would show."""
    from dataclasses import replace

    pairs = tuple(replace(p, c=p.c * 100 + 1.0) for p in table.pairs)
    selves = tuple(replace(p, writer=p.reader) for p in pairs if p.writer != "")
    return replace(table, pairs=pairs + selves)


def test_own_pages_base_model_reads_and_reused_pages_are_never_corrected(tiny3, tables):
    """Equal logits with and without a (loud) correction: a reader of its own pages, the base
    model reading base-model pages, and a session whose pages another adapter wrote earlier but
    that it overwrote (pages reused after eviction: the tags follow the last write)."""
    pages, res = tuple(range(10)), tuple(range(10))
    RES2 = tuple(range(30, 40))  # noqa: N806
    cases = {
        "own": [("critic", HELD_OUT, 0, pages, res, True),
                ("critic", QUESTION, 40, pages + (20,), res + (20,), True)],
        "base model": [(None, HELD_OUT, 0, pages, None, True),
                       (None, QUESTION, 40, pages + (20,), None, True)],
        "reused pages": [("planner", HELD_OUT, 0, pages, res, True),
                         ("critic", HELD_OUT[::-1], 0, pages, tuple(range(30, 40)), True),
                         ("critic", QUESTION, 40, pages + (20,), RES2 + (41,), True)],
    }
    for what, steps in cases.items():
        loud = _backend(tiny3)
        loud.install_offsets(_loud(tables[8]))
        plain = _backend(tiny3, correction=BaseCorrection.NONE)
        torch.testing.assert_close(_session_logits(loud, steps), _session_logits(plain, steps),
                                   rtol=0, atol=0, msg=what)
    # ... while a cross read under the loud table does move (the cases above are not vacuous).
    cross = [("planner", HELD_OUT, 0, pages, res, True),
             ("critic", HELD_OUT, 0, pages, tuple(range(30, 40)), False),
             ("critic", QUESTION, 40, pages + (20,), tuple(range(30, 40)) + (41,), True)]
    loud = _backend(tiny3)
    loud.install_offsets(_loud(tables[8]))
    plain = _backend(tiny3, correction=BaseCorrection.NONE)
    assert not torch.allclose(_session_logits(loud, cross), _session_logits(plain, cross))


def test_a_base_model_row_in_a_decode_batch_with_a_reader_is_not_corrected(tiny3, tables):
    """The batched decode path: the base model's row reads base-model pages (a pair base ->
    adapter exists) beside a critic row reading the planner's pages, in one step."""
    def decode(correction):
        backend = _backend(tiny3, correction=correction)
        if correction is BaseCorrection.OFFSET:
            backend.install_offsets(_loud(tables[8]))
        base_pages, pages, res = tuple(range(20, 30)), tuple(range(10)), tuple(range(10))
        _session_logits(backend, [(None, HELD_OUT, 0, base_pages, None, True)])
        _write(backend, "planner", 0, HELD_OUT, pages, res)
        critic = backend.adapter_id("critic")
        backend.step([SeqWork(1, tuple(HELD_OUT), 0, KVSlots(pages, tuple(range(30, 40))), critic,
                              write_base=False, form=KVForm.SPLIT)])
        first = (QUESTION[0],)
        items = [SeqWork(2, first, 40, KVSlots(base_pages + (40,)), None, form=KVForm.SPLIT),
                 SeqWork(1, first, 40, KVSlots(pages + (41,), tuple(range(30, 40)) + (41,)),
                         critic, form=KVForm.SPLIT)]
        return backend.forward(items, all_logits=True).logits

    loud, plain = decode(BaseCorrection.OFFSET), decode(BaseCorrection.NONE)
    torch.testing.assert_close(loud[0], plain[0], rtol=0, atol=0)
    assert not torch.allclose(loud[1], plain[1])


@pytest.mark.parametrize("share", [ShareBase.EXACT, ShareBase.NEUTRAL])
def test_engine_sessions_that_read_no_other_adapter_answer_as_without_correction(tiny3, tables,
                                                                                 share):
    """Through the Engine: under exact or neutral sharing, an adapter after another adapter's
    session (before any base-model pass) and the base model: the same tokens as with no
    correction."""
    def run(correction):
        backend = _backend(tiny3, correction=correction, share=share)
        if correction is BaseCorrection.OFFSET:
            backend.install_offsets(_loud(tables[8]))
        eng = Engine(backend)
        out = []
        for adapter in ("planner", "critic", None, None):
            h = eng.open(HELD_OUT + QUESTION, adapter=adapter)
            out.append(eng.generate(h.id, 6).tokens)
            eng.close(h.id)
        eng.check_integrity()
        return out

    assert run(BaseCorrection.OFFSET) == run(BaseCorrection.NONE)


def test_a_removed_adapters_tags_name_no_writer(tiny3):
    from forkserve.backend.torch.kv_pool import UNKNOWN_WRITER

    backend = _backend(tiny3)
    pages = tuple(range(10))
    _write(backend, "planner", 0, HELD_OUT, pages, pages)
    backend.remove_adapter("planner")
    assert (backend.pool.writer[0, list(pages)] == UNKNOWN_WRITER).all()


def test_offset_correction_is_refused_where_it_cannot_run(tiny3, tables):
    from forkserve.backend.torch.errors import InvalidWorkError, UnsupportedModelError

    with pytest.raises(ValueError, match="residual pool"):
        ForkServeConfig(kv_layout=KVLayout.UNIFIED, base_correction="offset")
    with pytest.raises(UnsupportedModelError, match="Triton"):
        _backend(tiny3, attention="triton")
    assert type(_backend(tiny3, attention="auto").attention).__name__ == "EagerAttention"
    with pytest.raises(InvalidWorkError, match="base_correction"):
        _backend(tiny3, correction=BaseCorrection.NONE).install_offsets(tables[0])


def test_tables_and_tags_are_costed(tiny3, tables):
    from forkserve.backend.protocol import PageKind

    cfg = _backend(tiny3).model_config
    plain, corrected = _backend(tiny3, correction=BaseCorrection.NONE), _backend(tiny3)
    per_token = corrected.kv_bytes_per_token()[PageKind.BASE]
    assert per_token == plain.kv_bytes_per_token()[PageKind.BASE] + 4      # an int32 tag
    assert corrected.pool.bytes_per_page(PageKind.BASE) == per_token * 4   # pages of 4 tokens
    t0, t8 = tables[0], tables[8]
    assert len(t8.pairs) == 4  # base -> planner, base -> critic, planner <-> critic
    assert t8.nbytes == 4 * LAYERS * 2 * (cfg.kv_size + 2 * 8 * cfg.kv_size) * 4
    assert t0.flops_per_read(cfg.kv_size) < t8.flops_per_read(cfg.kv_size)
