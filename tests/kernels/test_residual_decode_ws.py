"""The warp-specialized ResidualAttention decode (residual_decode_gluon.py, ``variant="ws"``).

Gluon has no interpreter: without a GPU the kernel is compiled for sm_90a (both outputs:
partials and the direct one) and assembled by ptxas; on CUDA it is checked against the plain
formulas (plain_oracle.py) and under a CUDA graph."""
from __future__ import annotations

import sys
from pathlib import Path

import plain_oracle as plain
import pytest
import torch
from kernel_testlib import DEVICE, REL_TOL, rel_err, replays_as_eager, residual_inputs
from test_sm90_compile import check_ws_build

from forkserve.kernels import residual_decode

HEAD_DIM, RANK = 128, 16


# (direct, GQA group, rank): the measured shape both ways (the split partials' epilogue and
# the direct output), the others (a padded group of 8, rank 32, a group of 3 padded to 4)
# once.
BUILDS = [(False, 4, 16), (True, 4, 16), (False, 8, 16), (False, 4, 32), (True, 3, 16)]


@pytest.mark.parametrize("direct,group,rank", BUILDS)
def test_ws_kernel_builds_for_sm90(direct: bool, group: int, rank: int, tmp_path) -> None:
    """The kernel compiles for sm_90a with its TMA copies, wgmma and the loader's register
    cut, fits one program's shared memory (227 KiB) and spills nothing, at each kind of
    shape it takes."""
    check_ws_build(__file__, [direct, group, rank], tmp_path)


def _inputs(seed: int, seq_lens: list[int], n_kv: int = 2, group: int = 4, rank: int = RANK):
    """Pools of ``rank`` (adapter 1 of rank 8, padded), head_dim 128, B scaled by 0.2, a GQA
    group of ``group``."""
    gen, c, b_k, b_v, adapters, inv_freq = residual_inputs(
        seed, seq_lens, n_kv, HEAD_DIM, rank=8, r_max=rank, b_scale=0.2)
    q = torch.randn(len(seq_lens), group * n_kv, HEAD_DIM, generator=gen).to(DEVICE, c.k.dtype)
    args = (q, c.k, c.v, c.k_res, c.v_res, c.block_tables, c.res_block_tables, c.seq_lens,
            b_k, b_v, adapters, inv_freq)
    return args, c


cuda_only = pytest.mark.skipif(
    DEVICE.type != "cuda" or torch.cuda.get_device_capability() != (9, 0),
    reason="the kernel is sm_90a's (wgmma)")


@cuda_only
@pytest.mark.parametrize("seq_lens", [[37, 100, 16, 1], [700, 4099, 65, 2048, 129]])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_ws_matches_the_formula(seq_lens: list[int], num_splits: int | None) -> None:
    """Ragged lengths (mid-page and mid-tile ends, one key, one page: warps whose keys are
    all past the end), a row without an adapter, a rank-8 adapter padded to 16; the plan's
    splits, one (the output written directly) and three (empty splits at the short rows,
    which make no operands)."""
    args, c = _inputs(len(seq_lens), seq_lens)
    out = residual_decode(*args, use_triton=True, variant="ws", num_splits=num_splits)
    q, adapters = args[0], args[10]
    ref = plain.decode(q, c.k, c.v, c.block_tables, c.seq_lens,
                       (c.k_res, c.v_res, c.res_block_tables, args[8], args[9], adapters,
                        args[11]))
    assert rel_err(out, ref) < REL_TOL
    base_only = plain.decode(q, c.k, c.v, c.block_tables, c.seq_lens)
    with_adapter = adapters >= 0
    assert rel_err(base_only[with_adapter], ref[with_adapter]) > 20 * REL_TOL
    assert rel_err(out[~with_adapter], base_only[~with_adapter]) < REL_TOL


@cuda_only
@pytest.mark.parametrize("group,rank", [(8, 16), (4, 32), (3, 16), (7, 16), (1, 16)])
def test_ws_at_other_shapes(group: int, rank: int) -> None:
    """The shapes built beside the measured one: a group padded to 8 query columns (8, 7),
    to 4 (3, 1: the padding heads' columns neither stored nor written to partials), rank
    32; split and direct."""
    seq_lens = [37, 700, 16, 1, 129]
    args, c = _inputs(group + rank, seq_lens, group=group, rank=rank)
    q, adapters = args[0], args[10]
    ref = plain.decode(q, c.k, c.v, c.block_tables, c.seq_lens,
                       (c.k_res, c.v_res, c.res_block_tables, args[8], args[9], adapters,
                        args[11]))
    for num_splits in (None, 1):
        out = residual_decode(*args, use_triton=True, variant="ws", num_splits=num_splits)
        assert rel_err(out, ref) < REL_TOL, num_splits


@cuda_only
def test_ws_under_a_cuda_graph() -> None:
    args, _ = _inputs(5, [300, 1000, 17])
    assert replays_as_eager(lambda: residual_decode(*args, use_triton=True, variant="ws",
                                                    max_seq_len=1024))


def test_the_default_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call naming no variant nor any option of one (the engine's) runs the policy's pick:
    ws where its kernel takes the shapes and they are measured ones (at any batch, unless
    the policy bounds it), two-pass where not; a call with an option of one variant must
    name it (``ValueError``), as paged_prefill's "auto" (round 42's test checked the wrong
    kernel through such a call)."""
    from forkserve.kernels import DEFAULT_DECODE_POLICY, residual_decode_gluon
    from forkserve.kernels import residual_decode_triton as rdt
    from forkserve.kernels.decode_policy import MEASURED_WS_SHAPES, DecodeVariantPolicy

    args, _ = _inputs(1, [40] * 65)
    assert DEFAULT_DECODE_POLICY.variant(args[0], args[1], args[3]) == (
        "ws" if residual_decode_gluon.hopper(args[0].device) else "two_pass")
    monkeypatch.setattr(residual_decode_gluon, "hopper", lambda device: True)
    q, k, k_res = (t.to(torch.bfloat16) for t in (args[0], args[1], args[3]))
    assert DEFAULT_DECODE_POLICY.variant(q, k, k_res) == "ws"
    narrow = q[:, :4].contiguous()  # a GQA group of 2: measured in round 28
    assert residual_decode_gluon.ws_shape(narrow, k, k_res) == (2, 16)
    assert DEFAULT_DECODE_POLICY.variant(narrow, k, k_res) == "ws"
    rank32 = torch.cat([k_res, k_res], dim=2)  # at a group of 2: measured in round 28
    assert residual_decode_gluon.ws_shape(narrow, k, rank32) == (2, 32)
    assert DEFAULT_DECODE_POLICY.variant(narrow, k, rank32) == "ws"
    gqa8 = torch.cat([q, q], dim=1)  # measured in round 27
    assert residual_decode_gluon.ws_shape(gqa8, k, k_res) == (8, 16)
    assert DEFAULT_DECODE_POLICY.variant(gqa8, k, k_res) == "ws"
    # Every shape the kernel builds for is measured; a policy of fewer leaves the rest to
    # two-pass.
    assert all(residual_decode_gluon.builds_for(g, r) == ((g, r) in MEASURED_WS_SHAPES)
               for g in range(1, 10) for r in (8, 16, 32, 64))
    narrower = DecodeVariantPolicy(ws_shapes=MEASURED_WS_SHAPES - {(2, 32)})
    assert narrower.variant(narrow, k, rank32) == "two_pass"
    assert narrower.variant(narrow, k, k_res) == "ws"
    bounded = DecodeVariantPolicy(ws_max_batch=16)
    assert bounded.variant(q[:16], k, k_res) == "ws"
    assert bounded.variant(q[:17], k, k_res) == "two_pass"
    seen = []
    monkeypatch.setattr(rdt, "residual_decode_triton", lambda *a, **k: seen.append(k))
    short = (q[:2], k, args[2], k_res, *args[4:])
    residual_decode(*short, use_triton=True, max_seq_len=64)
    residual_decode(*short, use_triton=True, variant="two_pass", pdl=False)
    assert seen == [{"max_seq_len": 64, "variant": "ws"}, {"variant": "two_pass", "pdl": False}]
    # A variant's own keyword, unpinned, would run whatever the policy picked: refused.
    with pytest.raises(ValueError, match="pdl.*need a pinned variant"):
        residual_decode(*short, use_triton=True, pdl=False)
    assert len(seen) == 2


@pytest.mark.parametrize("group,rank,head_dim,taken", [
    (4, 16, 128, True), (1, 16, 128, True), (3, 16, 128, True), (7, 16, 128, True),
    (8, 16, 128, True), (2, 32, 128, True), (4, 32, 128, True),
    (8, 32, 128, False),  # the folds would not fit beside the slot ring
    (9, 16, 128, False), (4, 8, 128, False), (4, 64, 128, False), (4, 16, 64, False)])
def test_the_shapes_the_kernel_takes(monkeypatch: pytest.MonkeyPatch, group: int, rank: int,
                                     head_dim: int, taken: bool) -> None:
    """``ws_shape``: a GQA group of up to 8 (padded to 4 or 8 query columns), rank 16, or 32
    where the padded group is 4; head_dim 128."""
    from forkserve.kernels import residual_decode_gluon

    monkeypatch.setattr(residual_decode_gluon, "hopper", lambda device: True)
    n_kv = 2
    q = torch.empty(1, group * n_kv, head_dim, dtype=torch.bfloat16)
    k = torch.empty(4, 16, n_kv, head_dim, dtype=torch.bfloat16)
    k_res = torch.empty(4, 16, rank, dtype=torch.bfloat16)
    assert residual_decode_gluon.ws_shape(q, k, k_res) == ((group, rank) if taken else None)


def test_ws_only_on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """sm_90 takes the kernel; Blackwell (sm_100, sm_120) has no wgmma, so the policy falls
    back to two-pass there (and on CPU)."""
    from forkserve.kernels import DEFAULT_DECODE_POLICY, residual_decode_gluon
    from forkserve.kernels import residual_decode_triton as rdt

    args, _ = _inputs(1, [40], n_kv=8)
    cuda = torch.device("cuda", 0)
    for capability, takes in (((9, 0), True), ((10, 0), False), ((12, 0), False),
                              ((8, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i, c=capability: c)
        rdt._capability.cache_clear()
        assert residual_decode_gluon.hopper(cuda) is takes
    rdt._capability.cache_clear()
    assert not residual_decode_gluon.hopper(torch.device("cpu"))
    if DEVICE.type == "cpu":
        assert DEFAULT_DECODE_POLICY.variant(args[0], args[1], args[3]) == "two_pass"


def test_ws_refuses_other_shapes() -> None:
    """A GQA group past 8 is refused on every device (the kernel's query columns are 4 or
    8), with the shapes it takes in the message."""
    args, _ = _inputs(1, [40], n_kv=2, group=9)
    from forkserve.kernels.residual_decode_gluon import residual_decode_ws
    with pytest.raises(ValueError, match="residual_decode_ws: .*a GQA group of at most 8"):
        residual_decode_ws(*args)


if __name__ == "__main__":  # check_ws_build's: a folder, then the build test's parameters
    from forkserve.kernels.residual_decode_gluon import build_sm90a

    ptx, shared = build_sm90a(bool(int(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4]))
    (Path(sys.argv[1]) / "ws.ptx").write_text(ptx)
    (Path(sys.argv[1]) / "shared").write_text(str(shared))
