"""The warp-specialized ResidualAttention prefill (residual_prefill_gluon.py, the ``ws`` route).

As for the ws decode: without a GPU the kernel is compiled for sm_90a (both outputs) and
assembled by ptxas; on CUDA it is checked against the plain formulas over NaN-poisoned
pools, with the split plan's partials and under a CUDA graph."""
from __future__ import annotations

import sys
from pathlib import Path

import plain_oracle as plain
import pytest
import torch
from kernel_testlib import (
    DEVICE,
    REL_TOL,
    rel_err,
    replays_as_eager,
    residual_inputs,
    where_wrong,
)
from test_sm90_compile import check_ws_build

from benchmarks.residual_prefill_bench import WS_LAUNCHES
from forkserve.kernels.residual_prefill_gluon import WsPrefillLaunch

HEAD_DIM, RANK = 128, 16
# (rows, stages, edge_masks, base_scores, bf16_rope): the plain launch, the others the
# bench measures, and the options among them at the plain launch's rows and slots.
DEFAULT = (128, 3, False, False, False)
OTHER_LAUNCHES = [lc for lc in WS_LAUNCHES if lc != DEFAULT]
OPTIONS = [lc[2:] for lc in OTHER_LAUNCHES if lc[:2] == DEFAULT[:2]]


def _name(launch: tuple) -> str:
    """A launch's test id: its name (``-k ws_m128_s3_edge``, or ``-k edge``)."""
    return WsPrefillLaunch(*launch).name


@pytest.mark.parametrize("direct,launch", [
    (False, DEFAULT), (True, DEFAULT), *((True, lc) for lc in OTHER_LAUNCHES)],
    ids=lambda x: _name(x) if isinstance(x, tuple) else ("direct" if x else "split"))
def test_ws_prefill_builds_for_sm90(direct: bool, launch: tuple, tmp_path) -> None:
    """The kernel compiles for sm_90a with its TMA copies, wgmma and the loader's register
    cut, fits one program's shared memory (227 KiB) and spills nothing."""
    check_ws_build(__file__, [direct, 4, *launch], tmp_path)


@pytest.mark.parametrize("group,direct,launch", [
    (8, True, (128, 3, True, False, False)), (2, False, (64, 3, True, True, True)),
    (1, True, DEFAULT)])
def test_ws_prefill_builds_at_other_groups(group: int, direct: bool, launch: tuple,
                                           tmp_path) -> None:
    """The GQA groups beside 4 (a program's rows then 8, 32 or 64 tokens a warp group)."""
    check_ws_build(__file__, [direct, group, *launch], tmp_path)


def _inputs(seed: int, seq_lens: list[int], q_lens: list[int], n_kv: int = 2,
            group: int = 4):
    """Rank-16 pools (adapter 1 of rank 8, padded; every fourth row none), head_dim 128,
    a GQA ``group``, B scaled by 0.2; the new tokens of sequence i are its last
    ``q_lens[i]``."""
    gen, c, b_k, b_v, adapters, inv_freq = residual_inputs(
        seed, seq_lens, n_kv, HEAD_DIM, rank=8, r_max=RANK, b_scale=0.2)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), group * n_kv, HEAD_DIM, generator=gen).to(DEVICE, c.k.dtype)
    args = (q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables, c.seq_lens,
            cu.to(DEVICE), b_k, b_v, adapters, inv_freq)
    return args, c


def _formula(args, c):
    q, cu, b_k, b_v, adapters, inv_freq = args[0], args[8], args[9], args[10], args[11], args[12]
    return plain.prefill(q, c.k, c.v, c.block_tables, c.seq_lens, cu,
                         (c.k_res, c.v_res, c.res_block_tables, b_k, b_v, adapters, inv_freq))


cuda_only = pytest.mark.skipif(
    DEVICE.type != "cuda" or torch.cuda.get_device_capability() != (9, 0),
    reason="the kernel is sm_90a's (wgmma)")

# (seq_lens, q_lens): chunks over cached contexts ending mid-page and mid-tile, a cold
# prompt (q == s), one token, an empty chunk, a chunk of several query blocks; 64-token
# chunks over 4K+ keys (the short-chunk case the kernel is for).
CASES = [
    ([37, 100, 16, 70], [37, 30, 1, 21]),
    ([64, 45, 300], [0, 45, 77]),
    ([4099, 4160, 1000, 2050], [64, 64, 64, 64]),
]


@cuda_only
@pytest.mark.parametrize("seq_lens,q_lens", CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_ws_prefill_matches_the_formula(seq_lens: list[int], q_lens: list[int],
                                        num_splits: int | None) -> None:
    from forkserve.kernels.residual_prefill_gluon import residual_prefill_ws

    args, c = _inputs(sum(q_lens), seq_lens, q_lens)
    out = residual_prefill_ws(*args, num_splits=num_splits)
    ref = _formula(args, c)
    assert rel_err(out, ref) < REL_TOL, where_wrong(out, ref, args[8], c.seq_lens, args[11], 4)
    base_only = plain.prefill(args[0], c.k, c.v, c.block_tables, c.seq_lens, args[8])
    assert rel_err(base_only, ref) > 20 * REL_TOL  # the residual is in the test's answer


@cuda_only
@pytest.mark.parametrize("launch", OTHER_LAUNCHES, ids=_name)
@pytest.mark.parametrize("case", [0, 2])
def test_ws_prefill_launches_match_the_formula(launch: tuple, case: int) -> None:
    """Every launch the bench measures: one consumer warp group or two, fewer slots."""
    from forkserve.kernels.residual_prefill_gluon import residual_prefill_ws

    seq_lens, q_lens = CASES[case]
    args, c = _inputs(case, seq_lens, q_lens)
    out = residual_prefill_ws(*args, launch=WsPrefillLaunch(*launch))
    assert rel_err(out, _formula(args, c)) < REL_TOL


@cuda_only
@pytest.mark.parametrize("seq_lens,q_lens", CASES)
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: _name((*DEFAULT[:2], *o)))
def test_ws_prefill_options_match_the_formula(seq_lens: list[int], q_lens: list[int],
                                              num_splits: int | None, options: tuple) -> None:
    """The launch options over every case, whole and split (split ends fall mid-tile):
    the mask on the tiles that cross the diagonal or a split's end only; the base scores
    from the slot (rows without an adapter among them: ``rot`` zero); the rotated residual
    in bf16."""
    from forkserve.kernels.residual_prefill_gluon import residual_prefill_ws

    args, c = _inputs(sum(q_lens) + 7, seq_lens, q_lens)
    out = residual_prefill_ws(*args, num_splits=num_splits,
                              launch=WsPrefillLaunch(128, 3, *options))
    assert rel_err(out, _formula(args, c)) < REL_TOL


@cuda_only
@pytest.mark.parametrize("group", [8, 2, 1])
@pytest.mark.parametrize("case", [0, 2])
def test_ws_prefill_at_other_groups(group: int, case: int) -> None:
    """A GQA group of 8, 2 or 1 (rows of a program: tokens x group), with the default launch
    its chunks take (64 or 128 rows), whole and split."""
    from forkserve.kernels.residual_prefill_gluon import residual_prefill_ws

    seq_lens, q_lens = CASES[case]
    args, c = _inputs(group + case, seq_lens, q_lens, group=group)
    ref = _formula(args, c)
    for num_splits in (None, 1, 3):
        out = residual_prefill_ws(*args, num_splits=num_splits)
        assert rel_err(out, ref) < REL_TOL, num_splits


@cuda_only
def test_ws_prefill_under_a_cuda_graph() -> None:
    from forkserve.kernels.residual_prefill_gluon import residual_prefill_ws

    args, _ = _inputs(5, [300, 1000, 17], [20, 64, 17])
    assert replays_as_eager(lambda: residual_prefill_ws(*args, max_q_len=64,
                                                        max_seq_len=1024))


@cuda_only
def test_the_default_route_is_ws_on_hopper() -> None:
    """The kernels package's default policy sends short chunks over a long context of these
    shapes to ws (where it replaces the fused Triton kernel), with the engine's host counts."""
    from forkserve.kernels import PrefillCounts, PrefillRoute, prefill_kernels, residual_prefill
    from forkserve.kernels.prefill_policy import CostPrefillPolicy

    seq_lens, q_lens = CASES[2]
    args, c = _inputs(7, seq_lens, q_lens)
    counts = PrefillCounts(tuple(q_lens), tuple(seq_lens))
    found = prefill_kernels(args[0], c.k, c.k_res)
    assert found.residual_ws
    assert CostPrefillPolicy().route(counts, True, found) is PrefillRoute.WS
    out = residual_prefill(*args, use_triton=True, counts=counts)
    assert rel_err(out, _formula(args, c)) < REL_TOL


def test_the_default_launch_by_chunk_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused Triton kernel's rows by the longest chunk (``residual_launch``), measured for
    ws too: 64 rows on one warp group up to 16-token chunks, 128 on two past them; each with
    the options measured fastest at its rows (round 27), where no 128-key launch was
    measured faster (``MEASURED_WIDE_LAUNCHES``, emptied here)."""
    from forkserve.kernels import residual_prefill_gluon as ws
    from forkserve.kernels.prefill_attention import residual_launch

    # At a group of 4 the rows are the fused kernel's; at others, the chunk's tokens x group.
    assert all(ws.default_launch(n).rows == residual_launch(n)[0] for n in range(1, 40))
    assert [ws.default_launch(n, 8).rows for n in (8, 9)] == [64, 128]
    assert [ws.default_launch(n, 1).rows for n in (64, 65)] == [64, 128]
    monkeypatch.setattr(ws, "MEASURED_WIDE_LAUNCHES", {})
    assert [(ws.default_launch(n).rows, ws.default_launch(n).warps)
            for n in (1, 16, 17, 512)] == [(64, 4), (64, 4), (128, 8), (128, 8)]
    assert [ws.default_launch(n).name for n in (16, 17)] == ["ws_m64_s3_edge_base_bf16",
                                                             "ws_m128_s3_edge"]
    assert ws.default_launch(64).maxnreg == 168 and ws.default_launch(16).maxnreg == 256


def test_other_groups_are_built_not_routed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GQA group the kernel builds for but the H200 has not measured (2) is taken by the
    kernel and left to the Triton routes by the default policy; a measured one (4, 8) is
    routed; one past its groups (3) is neither."""
    from forkserve.kernels import prefill_kernels, residual_decode_gluon
    from forkserve.kernels.residual_prefill_gluon import supports, ws_prefill_shape

    monkeypatch.setattr(residual_decode_gluon, "hopper", lambda device: True)
    for group, shape, routed in ((4, (4, 16), True), (8, (8, 16), True), (2, (2, 16), False),
                                 (3, None, False)):
        args, c = _inputs(group, [40], [8], group=group)
        q, k, k_res = (t.to(torch.bfloat16) for t in (args[0], c.k, c.k_res))
        assert ws_prefill_shape(q, k, k_res) == shape
        assert supports(q, k, k_res) is (shape is not None)
        assert prefill_kernels(q, k, k_res).residual_ws is routed, group


def test_ws_prefill_refuses_other_shapes() -> None:
    from forkserve.kernels.residual_prefill_gluon import residual_prefill_ws

    args, _ = _inputs(1, [40], [8], n_kv=2, group=3)
    with pytest.raises(ValueError, match="residual_prefill_ws: .*a GQA group of 1, 2, 4 or 8"):
        residual_prefill_ws(*args)


def test_an_option_needs_its_companion() -> None:
    """``bf16_rope`` rounds the rotated residual alone, which only ``base_scores`` builds."""
    with pytest.raises(ValueError, match="bf16_rope .* needs base_scores"):
        WsPrefillLaunch(bf16_rope=True)
    assert WsPrefillLaunch(128, 3, True, True, True).name == "ws_m128_s3_edge_base_bf16"


if __name__ == "__main__":  # check_ws_build's: a folder, then the build test's parameters
    from forkserve.kernels.residual_prefill_gluon import build_sm90a

    direct_, group_, rows_, stages_, *options_ = (int(x) for x in sys.argv[2:])
    ptx, shared = build_sm90a(WsPrefillLaunch(rows_, stages_, *map(bool, options_)),
                              bool(direct_), group_)
    (Path(sys.argv[1]) / "ws.ptx").write_text(ptx)
    (Path(sys.argv[1]) / "shared").write_text(str(shared))
