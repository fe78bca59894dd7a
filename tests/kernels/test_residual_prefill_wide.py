"""The ResidualAttention prefill over 128-key tiles (residual_prefill_wide.py).

Without a GPU the kernel is compiled for sm_90a (both outputs, every GQA group) and assembled
by ptxas with no spills; on CUDA it is checked against the plain formulas over NaN-poisoned
pools (test_residual_prefill_ws.py's cases: chunks ending mid-page and mid-tile, an empty
chunk, rows without an adapter), whole and split, and under a CUDA graph."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import plain_oracle as plain
import pytest
from kernel_testlib import REL_TOL, rel_err, replays_as_eager, where_wrong
from test_residual_prefill_ws import CASES, _formula, _inputs, cuda_only
from test_sm90_compile import check_ws_build

from benchmarks.residual_prefill_bench import WIDE_LAUNCHES
from forkserve.kernels.residual_prefill_gluon import MEASURED_WIDE_LAUNCHES
from forkserve.kernels.residual_prefill_wide import WideLaunch

# The registers cut to ~72 a thread in the rebuilding warp group and 40 in the loader's
# leave a value or two spilled across the loops (none inside a tile's: checked in the SASS
# when this was written, 8-20 bytes).
MAX_SPILL = 24
# Below 200 consumer registers, by launch: two consumers cut to 184 (round 33's deferred
# stores give the rebuild 16 more) spill four instructions a tile in their loop (76 bytes in
# all); the next half's up-projection held across the writes (round 34) spills the
# rebuild's loop at 184 (6 instructions, 88 bytes in all), the consumers' at 176 (16, 172
# bytes); the held chunks written two at a time (round 35) spill the rebuild's loop at 184
# (4 instructions a tile; 84 bytes in all: until round 39 this test built join 2 and 4 as
# join 1, its arguments all made bools), a half at once the consumers' at 176 (16, 176
# bytes): the trades the bench weighs. The cos|sin read from global memory
# (round 39) add the chunk read ahead to the rebuild's registers: without deferred stores
# nothing spills in the rebuild's loop, the consumers' four (84 bytes in all; 76 with three
# key slots, with the cos|sin made by angle addition too: round 40).
MAX_SPILL_BELOW_200 = {"wide_m128_r184_c16_bf16_pp_ta_el_ds": 80,
                       "wide_m128_r184_c16_bf16_pp_ta_el_cg": 84,
                       "wide_m128_r184_c16_bf16_pp_ta_el_cg_k3": 80,
                       "wide_m128_r184_c16_bf16_pp_ta_el_cg_k3_aa": 80,
                       "wide_m128_r184_c16_bf16_pp_ta_el_ds_ha": 88,
                       "wide_m128_r176_c16_bf16_pp_ta_el_ds_ha": 176,
                       "wide_m128_r184_c16_bf16_pp_ta_el_ds_j2": 84,
                       "wide_m128_r176_c16_bf16_pp_ta_el_ds_j4": 176}


def _name(launch: tuple) -> str:
    return WideLaunch(*launch).name


@pytest.mark.parametrize("direct,group,launch", [
    (True, 4, WIDE_LAUNCHES[0]), (False, 8, WIDE_LAUNCHES[0]), (True, 1, WIDE_LAUNCHES[0]),
    (False, 2, WIDE_LAUNCHES[-1]), *((True, 4, lc) for lc in WIDE_LAUNCHES[1:])],
    ids=lambda x: _name(x) if isinstance(x, tuple) else str(x))
def test_wide_prefill_builds_for_sm90(direct: bool, group: int, launch: tuple,
                                      tmp_path) -> None:
    """The kernel compiles for sm_90a with its TMA copies, wgmma and the register cuts and
    fits one program's shared memory, at every group and launch the bench measures; its
    barriers count the arrivals each release makes (``thread_arrive``: a warp group's 128
    threads each): the slots' keys and values a consumer's, the cos|sin halves and the
    ping-pong turns a warp group's, the rest one (TMA's expects, the rebuilt key) or all
    roles' (``started``)."""
    lc = WideLaunch(*launch)
    check_ws_build(__file__, [direct, group, *launch], tmp_path,
                   MAX_SPILL if lc.consumer_regs >= 200
                   else MAX_SPILL_BELOW_200[lc.name])
    a = 128 if lc.thread_arrive else 1
    counts = sorted(int(n) for n in re.findall(
        r"mbarrier\.init\.shared::cta\.b64 \[[^\]]+\], (\d+);",
        (tmp_path / "ws.ptx").read_text()))
    # full_k, ready (a key slot's each), full_v (a value slot's), and the cos|sin halves'
    # full (2; none read from global memory) or the deep ring's last values and zeroed (2);
    # empty_k, empty_v; cos|sin free (2, where they are loaded), turn (2); started.
    ks, cs = lc.key_slots, 0 if lc.cs_global else 2
    want = ([1] * (2 * ks + 2 + cs + 2 * (ks == 3)) + [lc.consumers * a] * (ks + 2)
            + [a] * (cs + 2) + [lc.consumers + 1])
    assert counts == sorted(want)


def test_the_launch_splits_the_registers() -> None:
    """Two consumer warp groups at ``consumer_regs`` and the loader's warp group at 40 leave
    the rebuilding warp group 72 a thread of the SM's 64K; every thread starts at a quarter
    of them (16 warps), at a third with one consumer (12 warps)."""
    launch = WideLaunch()
    assert launch.name == "wide_m128_r200_c16" and launch.maxnreg == 128
    assert launch.rows == 128 and WideLaunch(1, 232, 32).rows == 64
    assert WideLaunch(1, 232, 32).maxnreg == 168
    assert WideLaunch(2, 200, 8, True).name == "wide_m128_r200_c8_bf16"
    assert WideLaunch(2, 200, 16, True, True).name == "wide_m128_r200_c16_bf16_pp"
    assert 65536 - 128 * (2 * launch.consumer_regs + 40) == 128 * 72
    with pytest.raises(ValueError, match="chunk is a wgmma N"):
        WideLaunch(chunk=24)
    with pytest.raises(ValueError, match="pingpong takes two"):
        WideLaunch(1, 232, 32, pingpong=True)
    with pytest.raises(ValueError, match="overlap holds two score tiles"):
        WideLaunch(overlap=True)
    assert WideLaunch(1, 232, 32, True, overlap=True).name == "wide_m64_r232_c32_bf16_ov"
    assert WideLaunch(1, 232, 64, True, thread_arrive=True).name == "wide_m64_r232_c64_bf16_ta"
    assert WideLaunch(thread_arrive=True).constexprs()["THREAD_ARRIVE"]
    early = WideLaunch(2, 200, 16, True, True, False, True, True)
    assert early.name == "wide_m128_r200_c16_bf16_pp_ta_el" and early.constexprs()["EARLY_LOADS"]
    deferred = WideLaunch(2, 184, 16, True, True, False, True, True, True)
    assert deferred.name == "wide_m128_r184_c16_bf16_pp_ta_el_ds"
    assert deferred.constexprs()["DEFER_STORES"] and not early.constexprs()["DEFER_STORES"]
    with pytest.raises(ValueError, match="at chunk 64 a half is one chunk"):
        WideLaunch(1, 232, 64, defer_stores=True)
    whole = WideLaunch(2, 176, 16, True, True, False, True, True, True, join=4)
    assert whole.name == "wide_m128_r176_c16_bf16_pp_ta_el_ds_j4"
    assert whole.constexprs()["JOIN"] == 4 and deferred.constexprs()["JOIN"] == 1
    with pytest.raises(ValueError, match="join writes the chunks defer_stores holds"):
        WideLaunch(2, 184, 16, True, join=2)
    for join, chunk in ((3, 16), (4, 32)):  # not 2 or 4; past a half's 64 columns
        with pytest.raises(ValueError, match="2 or 4 at a time, within a key half's 64"):
            WideLaunch(2, 184, chunk, True, defer_stores=True, join=join)
    deep = WideLaunch(2, 184, 16, True, True, False, True, True, cs_global=True, key_slots=3)
    assert deep.name == "wide_m128_r184_c16_bf16_pp_ta_el_cg_k3"
    angles = WideLaunch(2, 184, 16, True, True, False, True, True, cs_global=True,
                        key_slots=3, angle_add=True)
    assert angles.name == "wide_m128_r184_c16_bf16_pp_ta_el_cg_k3_aa"
    with pytest.raises(ValueError, match="angle_add makes the cos.sin cs_global would read"):
        WideLaunch(angle_add=True)
    assert deep.constexprs()["CS_GLOBAL"] and deep.constexprs()["KEY_SLOTS"] == 3
    for slots, cs_global in ((3, False), (4, True), (1, True)):
        with pytest.raises(ValueError, match="key_slots is 2, or 3 with cs_global"):
            WideLaunch(cs_global=cs_global, key_slots=slots)


@cuda_only
@pytest.mark.parametrize("seq_lens,q_lens", CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("launch", WIDE_LAUNCHES, ids=_name)
def test_wide_prefill_matches_the_formula(seq_lens: list[int], q_lens: list[int],
                                          num_splits: int | None, launch: tuple) -> None:
    """Every launch the bench measures, whole and split (split ends fall mid-tile)."""
    from forkserve.kernels.residual_prefill_wide import residual_prefill_wide

    args, c = _inputs(sum(q_lens) + 11, seq_lens, q_lens)
    out = residual_prefill_wide(*args, num_splits=num_splits, launch=WideLaunch(*launch))
    ref = _formula(args, c)
    assert rel_err(out, ref) < REL_TOL, where_wrong(out, ref, args[8], c.seq_lens, args[11], 4)
    base_only = plain.prefill(args[0], c.k, c.v, c.block_tables, c.seq_lens, args[8])
    assert rel_err(base_only, ref) > 20 * REL_TOL  # the residual is in the test's answer


@cuda_only
@pytest.mark.parametrize("group", [8, 2, 1])
@pytest.mark.parametrize("case", [0, 2])
def test_wide_prefill_at_other_groups(group: int, case: int) -> None:
    """A GQA group of 8, 2 or 1 (a program's 128 rows are then 16, 64 or 128 tokens; 64
    rows, half that), whole and split."""
    from forkserve.kernels.residual_prefill_wide import residual_prefill_wide

    seq_lens, q_lens = CASES[case]
    args, c = _inputs(group + case + 20, seq_lens, q_lens, group=group)
    ref = _formula(args, c)
    for launch in (WideLaunch(), WideLaunch(*WIDE_LAUNCHES[-1])):
        for num_splits in (None, 1, 3):
            out = residual_prefill_wide(*args, num_splits=num_splits, launch=launch)
            assert rel_err(out, ref) < REL_TOL, (launch.name, num_splits, where_wrong(
                out, ref, args[8], c.seq_lens, args[11], group))


@cuda_only
@pytest.mark.parametrize("launch", list(dict.fromkeys([
    WIDE_LAUNCHES[0], WIDE_LAUNCHES[3], *MEASURED_WIDE_LAUNCHES.values(), WIDE_LAUNCHES[-1],
    *(lc for lc in WIDE_LAUNCHES if WideLaunch(*lc).key_slots == 3)])), ids=_name)
def test_wide_prefill_under_a_cuda_graph(launch: tuple) -> None:
    """The first CUDA test h200_issue15.sh runs (a hang then costs its short timeout): the
    first launch, the default launches, each release protocol (``thread_arrive``) with
    two consumers in turns and with one scoring a tile ahead, and the deep key ring."""
    from forkserve.kernels.residual_prefill_wide import residual_prefill_wide

    args, _ = _inputs(5, [300, 1000, 17], [20, 64, 17])
    assert replays_as_eager(lambda: residual_prefill_wide(
        *args, max_q_len=64, max_seq_len=1024, launch=WideLaunch(*launch)))


def test_the_default_launch_takes_a_measured_wide_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``default_launch`` takes the 128-key kernel at the GQA group and rows
    ``MEASURED_WIDE_LAUNCHES`` holds (rounds 31 and 34: both program sizes at GQA 4), the ws
    launches elsewhere; the ws entry point runs whichever it is given."""
    from forkserve.kernels import residual_prefill_gluon as ws

    assert ws.default_launch(64).name == "wide_m128_r184_c16_bf16_pp_ta_el_ds"
    assert ws.default_launch(16).name == "wide_m64_r232_c64_bf16_ta"
    assert ws.default_launch(16, group=8).name == "ws_m128_s3_edge"  # 128 rows at GQA 8
    assert ws.default_launch(8, group=8).name == "ws_m64_s3_edge_base_bf16"
    monkeypatch.delitem(ws.MEASURED_WIDE_LAUNCHES, (4, 64))
    assert ws.default_launch(16).name == "ws_m64_s3_edge_base_bf16"
    monkeypatch.setitem(ws.MEASURED_WIDE_LAUNCHES, (8, 64), WIDE_LAUNCHES[-1])
    assert ws.default_launch(8, group=8) == WideLaunch(*WIDE_LAUNCHES[-1])
    assert ws.default_launch(9, group=8).rows == 128


def test_wide_prefill_refuses_other_shapes() -> None:
    from forkserve.kernels.residual_prefill_wide import residual_prefill_wide

    args, _ = _inputs(1, [40], [8], n_kv=2, group=3)
    with pytest.raises(ValueError, match="residual_prefill_wide: .*a GQA group of 1, 2, 4"):
        residual_prefill_wide(*args)


if __name__ == "__main__":  # check_ws_build's: a folder, then the build test's parameters
    from dataclasses import fields

    from forkserve.kernels.residual_prefill_wide import build_sm90a

    direct_, group_, *launch_ = (int(x) for x in sys.argv[2:])
    # Each field as its type: the flags as bools, the counts (join, key_slots) as ints.
    launch_ = [bool(x) if f.type == "bool" else x
               for f, x in zip(fields(WideLaunch), launch_, strict=False)]
    ptx, shared = build_sm90a(WideLaunch(*launch_), bool(direct_), group_)
    (Path(sys.argv[1]) / "ws.ptx").write_text(ptx)
    (Path(sys.argv[1]) / "shared").write_text(str(shared))
