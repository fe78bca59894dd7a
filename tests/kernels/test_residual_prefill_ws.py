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
from kernel_testlib import DEVICE, REL_TOL, rel_err, residual_inputs
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
    check_ws_build(__file__, [direct, *launch], tmp_path)


def _inputs(seed: int, seq_lens: list[int], q_lens: list[int], n_kv: int = 2):
    """Rank-16 pools (adapter 1 of rank 8, padded; every fourth row none), head_dim 128,
    GQA 4, B scaled by 0.2; the new tokens of sequence i are its last ``q_lens[i]``."""
    gen, c, b_k, b_v, adapters, inv_freq = residual_inputs(
        seed, seq_lens, n_kv, HEAD_DIM, rank=8, r_max=RANK, b_scale=0.2)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), 4 * n_kv, HEAD_DIM, generator=gen).to(DEVICE, c.k.dtype)
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
    assert rel_err(out, ref) < REL_TOL
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
def test_ws_prefill_under_a_cuda_graph() -> None:
    from forkserve.kernels.residual_prefill_gluon import residual_prefill_ws

    args, _ = _inputs(5, [300, 1000, 17], [20, 64, 17])
    bounds = {"max_q_len": 64, "max_seq_len": 1024}
    eager = residual_prefill_ws(*args, **bounds)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = residual_prefill_ws(*args, **bounds)
    graph.replay()
    assert torch.equal(captured, eager)


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


def test_the_default_launch_by_chunk_length() -> None:
    """The fused Triton kernel's rows by the longest chunk (``residual_launch``), measured for
    ws too: 64 rows on one warp group up to 16-token chunks, 128 on two past them; each with
    the options measured fastest at its rows (round 27)."""
    from forkserve.kernels.residual_prefill_gluon import default_launch

    assert [(default_launch(n).rows, default_launch(n).warps) for n in (1, 16, 17, 512)] == [
        (64, 4), (64, 4), (128, 8), (128, 8)]
    assert [default_launch(n).name for n in (16, 17)] == ["ws_m64_s3_edge_base_bf16",
                                                          "ws_m128_s3_edge"]
    assert default_launch(64).maxnreg == 168 and default_launch(16).maxnreg == 256


def test_ws_prefill_refuses_other_shapes() -> None:
    from forkserve.kernels.residual_prefill_gluon import residual_prefill_ws

    args, _ = _inputs(1, [40], [8], n_kv=2)
    with pytest.raises(ValueError, match="residual_prefill_ws"):
        residual_prefill_ws(args[0][:, :4].contiguous(), *args[1:])


def test_an_option_needs_its_companion() -> None:
    """``bf16_rope`` rounds the rotated residual alone, which only ``base_scores`` builds."""
    with pytest.raises(ValueError, match="bf16_rope .* needs base_scores"):
        WsPrefillLaunch(bf16_rope=True)
    assert WsPrefillLaunch(128, 3, True, True, True).name == "ws_m128_s3_edge_base_bf16"


if __name__ == "__main__":  # check_ws_build's: a folder, then the build test's parameters
    from forkserve.kernels.residual_prefill_gluon import build_sm90a

    direct_, rows_, stages_, *options_ = (int(x) for x in sys.argv[2:])
    ptx, shared = build_sm90a(WsPrefillLaunch(rows_, stages_, *map(bool, options_)),
                              bool(direct_))
    (Path(sys.argv[1]) / "ws.ptx").write_text(ptx)
    (Path(sys.argv[1]) / "shared").write_text(str(shared))
