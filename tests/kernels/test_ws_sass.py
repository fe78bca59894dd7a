"""benchmarks/ws_sass.py: the ws kernels' instructions a tile (the consumers', and the
128-key kernel's rebuilding warp group's), counted in the sm_90a SASS on the CPU. The
counting on a hand-made listing (a loop, its cold blocks, the loops it must not take), then
the tool on real builds in a process of its own (the compiler refuses the interpreted
helpers of these tests' TRITON_INTERPRET=1)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("triton.backends.nvidia")

from forkserve.kernels.sm90_build import has_tool  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The tool runs on real builds only where cuobjdump is found (sm90_build._tool): the CPU
# machines' Triton wheel ships it.
needs_cuobjdump = pytest.mark.skipif(not has_tool("cuobjdump"), reason="no cuobjdump here")


def _listing(blocks: list[list[str]]) -> str:
    """cuobjdump-like lines, 16 bytes an instruction, from ``blocks`` of opcodes; a
    ``BRA <k>`` jumps to block ``k``'s first instruction."""
    starts, at = [], 0
    for block in blocks:
        starts.append(at)
        at += 16 * len(block)
    lines, at = [], 0
    for block in blocks:
        for op in block:
            if "BRA " in op:
                head, k = op.rsplit(" ", 1)
                op = f"{head} {starts[int(k)]:#x}"
            lines.append(f"        /*{at:04x}*/                   {op} ;")
            at += 16
    return "\n".join(lines)


def test_a_tile_is_the_loop_less_its_cold_blocks():
    from benchmarks import ws_sass as tool

    softmax = ["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ"] * 20 + ["FMNMX R1, R2, R3"] * 4
    zeroing = ["PRMT R1, R2, 0x7632, R1"] * 16 + ["SEL R1, R2, RZ, P0"] * 16

    def listing(tile_tail: list[str]) -> str:
        return _listing([
            ["MOV R1, R2"],                               # 0: before the loops
            ["ISETP.GT.AND P0, PT, R1, R2, PT", "@P0 BRA 3"],   # 1: the loop's head
            zeroing,                                      # 2: cold (a split's last tile)
            [*softmax, *tile_tail, "@P1 BRA 1"],          # 3: the tile, back to 1
            ["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ"] * 20
            + ["STG.E [R2], R4", "@P2 BRA 4"],            # 4: the epilogue's loop: a store
            ["EXIT"],
        ])

    sass = listing(["FADD R1, R1, R2"])
    c = tool.count("a", "a", sass)
    assert c.per_tile == 2 + 25 + 1 and c.barriers == 0
    assert c.by_class["wgmma"] == 20 and c.by_class["fp32"] == 5
    assert c.loop_instructions == 2 + 32 + 26
    fewer = tool.count("b", "a", listing([]))
    assert tool.ratios([c, fewer]) == {"a": 1.0, "b": 27 / 28}
    with pytest.raises(ValueError, match="no consumer loop"):
        tool.count("a", "a", _listing([["MOV R1, R2"], ["EXIT"]]))


def _python(*argv: str) -> subprocess.CompletedProcess:
    """Python on ``argv`` at the repository root, without the interpreter mode."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _run(*args: str) -> subprocess.CompletedProcess:
    return _python("benchmarks/ws_sass.py", *args)


@needs_cuobjdump
def test_the_prefill_launches(tmp_path):
    measured = tmp_path / "bench.json"
    measured.write_text(json.dumps({"rows": [
        {"batch": 8, "new": 64, "keys": 8256,
         "device": {"unified_paged": 0.3, "residual_ws_m128_s3": 0.27,
                    "residual_ws_m128_s3_edge_base_bf16": 0.25}}]}))
    run = _run("prefill", "--out", str(tmp_path), "--launches",
               "ws_m128_s3_edge_base_bf16", "--measured", str(measured))
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads((tmp_path / "ws_prefill_sass.json").read_text())
    counts = {c["launch"]: c for c in saved["launches"]}
    assert list(counts) == ["ws_m128_s3", "ws_m128_s3_edge_base_bf16"]
    plain, cut = counts["ws_m128_s3"], counts["ws_m128_s3_edge_base_bf16"]
    # Round 23's loop: a few hundred instructions a tile, every class counted once.
    assert 500 < plain["per_tile"] < 1200
    assert sum(plain["by_class"].values()) == pytest.approx(plain["per_tile"])
    assert cut["by_class"]["bf16x2"] > 0
    assert cut["per_tile"] < 0.75 * plain["per_tile"]  # what the options are for
    assert saved["measured"]["ws_m128_s3_edge_base_bf16"] == pytest.approx(0.25 / 0.27)
    assert (tmp_path / "ws_prefill_sass.png").stat().st_size > 0
    assert "x plain" in run.stdout


@needs_cuobjdump
def test_the_wide_prefill_counts_three_roles(tmp_path):
    """The 128-key kernel: each launch's consumer, rebuilding warp group and loader, each
    against the default launch's same role; bf16 pairs halve the rebuild's instructions and
    leave the consumer's alone; a release by every thread (``thread_arrive``) leaves a
    consumer's tile one CTA barrier of four and a rebuild tile three fewer; the loader's
    tile is its TMA copies' uniform arithmetic, on scheduler 0 beside a warp of every other
    role; a measured run puts each launch's time over the default's."""
    measured = tmp_path / "bench.json"
    measured.write_text(json.dumps({"rows": [
        {"batch": 8, "new": 64, "keys": 8256,
         "device": {"unified_paged": 0.3, "residual_wide_m128_r200_c16": 0.2,
                    "residual_wide_m128_r200_c16_bf16": 0.18}}]}))
    run = _run("prefill_wide", "--out", str(tmp_path), "--launches",
               "wide_m128_r200_c16_bf16", "wide_m128_r200_c16_bf16_ta",
               "--measured", str(measured))
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads((tmp_path / "ws_prefill_wide_sass.json").read_text())
    counts = {c["launch"]: c for c in saved["launches"]}
    assert list(counts) == [f"{name}{role}" for name in (
        "wide_m128_r200_c16", "wide_m128_r200_c16_bf16", "wide_m128_r200_c16_bf16_ta")
        for role in ("", ":rebuild", ":loader")]
    loader = counts["wide_m128_r200_c16_bf16_ta:loader"]
    assert 400 < loader["per_tile"] < 900 and loader["barriers"] == 0
    assert loader["by_class"]["uniform"] > loader["per_tile"] / 2
    assert loader["by_class"].get("wgmma", 0) == loader["by_class"].get("exp2", 0) == 0
    sched = saved["schedulers"]["wide_m128_r200_c16_bf16_ta"]
    each = counts["wide_m128_r200_c16_bf16_ta:rebuild"]["per_tile"] + \
        2 * counts["wide_m128_r200_c16_bf16_ta"]["per_tile"]
    assert sched == {"scheduler_0": pytest.approx(each + loader["per_tile"]),
                     "schedulers_1_3": pytest.approx(each)}
    ta = counts["wide_m128_r200_c16_bf16_ta"]
    ta_rebuild = counts["wide_m128_r200_c16_bf16_ta:rebuild"]
    assert counts["wide_m128_r200_c16_bf16"]["barriers"] == 4 and ta["barriers"] == 1
    assert ta_rebuild["barriers"] == counts["wide_m128_r200_c16_bf16:rebuild"]["barriers"] - 3
    assert counts["wide_m128_r200_c16_bf16:rebuild"]["plain"] == "wide_m128_r200_c16:rebuild"
    assert counts["wide_m128_r200_c16_bf16"]["per_tile"] == counts["wide_m128_r200_c16"]["per_tile"]
    fp32, bf16 = counts["wide_m128_r200_c16:rebuild"], counts["wide_m128_r200_c16_bf16:rebuild"]
    # The rebuild's own loop: no softmax in it (the consumer's has its exponentials).
    assert counts["wide_m128_r200_c16"]["by_class"]["exp2"] > 0
    assert fp32["by_class"].get("exp2", 0) == bf16["by_class"].get("exp2", 0) == 0
    assert 700 < fp32["per_tile"] < 1400 and bf16["by_class"]["bf16x2"] > 0
    assert bf16["per_tile"] < 0.6 * fp32["per_tile"]
    assert saved["measured"]["wide_m128_r200_c16_bf16"] == pytest.approx(0.18 / 0.2)


@needs_cuobjdump
def test_the_decode(tmp_path):
    """The decode's one form (round 26's deferred sum): only the max crosses the warps, in
    one barrier, so four barriers a tile; a measured run to weigh it against is refused in
    one line (it has no other form)."""
    run = _run("decode", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads((tmp_path / "ws_decode_sass.json").read_text())
    (count,) = saved["launches"]
    assert count["launch"] == "ws" and count["barriers"] == 4
    assert 250 < count["per_tile"] < 329  # round 26's two-exchange form: 329
    measured = tmp_path / "variants.json"
    measured.write_text(json.dumps({"decode_variants": []}))
    run = _run("decode", "--out", str(tmp_path), "--measured", str(measured))
    assert run.returncode == 2 and "prefill's" in run.stderr.splitlines()[-1]


@needs_cuobjdump
def test_the_decode_at_another_shape(tmp_path):
    """``--shape``: the GQA-8 build (16 interleaved query columns, folds of 128 rows) counts
    more a tile than Llama-3-8B's, into a file of its own; a shape the kernel is not built
    for, or a shape for the prefill, is one line."""
    run = _run("decode", "--out", str(tmp_path), "--shape", "8", "16", "--launches", "ws")
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads((tmp_path / "ws_decode_sass_g8_r16.json").read_text())
    assert saved["shape"] == {"group": 8, "rank": 16} and "GQA 8" in saved["case"]
    (count,) = saved["launches"]
    assert 330 < count["per_tile"] < 600 and count["barriers"] == 4
    for bad in (["decode", "--shape", "8", "32"], ["prefill", "--shape", "8", "16"]):
        run = _run(*bad, "--out", str(tmp_path))
        assert run.returncode == 2 and "--shape" in run.stderr.splitlines()[-1]


@needs_cuobjdump
def test_cuobjdump_where_ptxas_has_none_beside_it(tmp_path, monkeypatch):
    """The H200 machine compiles with torch's ptxas, which has no cuobjdump beside it: the
    one in Triton's wheel is taken, else the PATH's; with neither, a clear BuildError."""
    import triton
    from triton.backends.nvidia import compiler

    from forkserve.kernels import sm90_build

    lone = tmp_path / "bin" / "ptxas"
    lone.parent.mkdir()
    lone.write_text("")
    monkeypatch.setattr(compiler, "get_ptxas", lambda arch: SimpleNamespace(path=str(lone)))
    assert sm90_build._tool("ptxas") == lone
    found = sm90_build._tool("cuobjdump")
    assert found.name == "cuobjdump" and found.is_file() and found.parent != lone.parent
    monkeypatch.setattr(sm90_build.shutil, "which", lambda name: None)
    monkeypatch.setattr(triton, "__file__", str(tmp_path / "triton" / "__init__.py"))
    with pytest.raises(sm90_build.BuildError, match="no cuobjdump beside"):
        sm90_build._tool("cuobjdump")
    assert not sm90_build.has_tool("cuobjdump")


def test_an_unknown_launch_is_one_line(tmp_path):
    run = _run("prefill", "--out", str(tmp_path), "--launches", "ws_m96_s3")
    assert run.returncode == 2
    assert "unknown prefill launch ws_m96_s3" in run.stderr.splitlines()[-1]


# The scripts' start: ``rebuild(*fields)``, a WideLaunch's rebuilding warp group's loop
# in its SASS and the CTA barriers of its steady tile (``ws_sass.count``).
_REBUILD = """
import json
from benchmarks import ws_sass
from forkserve.kernels.residual_prefill_wide import WideLaunch, build_sm90a
from forkserve.kernels.sm90_build import sass_sm90a
def rebuild(*fields):
    sass = sass_sm90a(build_sm90a(WideLaunch(*fields), True)[0])
    return (ws_sass.rebuild_loop(ws_sass.parse(sass)),
            ws_sass.count("", "", sass, ws_sass.rebuild_loop).barriers)
"""

_READS_AFTER_WAITS = _REBUILD + """
loop, _ = rebuild(2, 200, 16, True, True, False, True, True)
reads, after = [], None
for _, text in loop:
    if "WARPGROUP.DEPBAR" in text:
        after = 0
    elif "LDSM" in text and after is not None:
        after += 1
    elif "STSM" in text and after is not None:
        reads.append(after)
        after = None
print(json.dumps({"reads_after_waits": reads, "ldsm": sum("LDSM" in t for _, t in loop)}))
"""


@needs_cuobjdump
def test_early_loads_read_a_chunk_before_waiting_on_its_up_projection():
    """``early_loads``: in the rebuilding warp group's tile no shared-memory read stands
    between a wait on an up-projection and the writes that follow it (without the option,
    a chunk's four reads do: round 31's profile had the packed multiply-adds waiting on
    them)."""
    run = _python("-c", _READS_AFTER_WAITS)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["ldsm"] == 32  # 8 chunks a tile, 4 reads each
    assert got["reads_after_waits"] == [0] * 8, got


_READ_AND_WRITE_RUNS = _REBUILD + """
out = {}
for defer in (False, True):
    loop, barriers = rebuild(2, 184 if defer else 200, 16, True, True, False, True, True, defer)
    runs = []  # the tile's shared-memory reads and writes in runs: "R4", "W2", ...
    for _, text in loop:
        kind = "R" if "LDSM" in text else "W" if "STSM" in text else None
        if kind and runs and runs[-1][0] == kind:
            runs[-1] = kind + str(int(runs[-1][1:]) + 1)
        elif kind:
            runs.append(kind + "1")
    out[str(defer)] = {"runs": runs, "barriers": barriers}
print(json.dumps(out))
"""


@needs_cuobjdump
def test_deferred_stores_write_a_half_after_its_last_read():
    """``defer_stores``: the rebuilding warp group's tile reads a half's four chunks (16
    reads) before it writes any of them (8 writes), where the launch without the option
    alternates chunk by chunk; Triton's barriers between a write and the next chunk's reads
    go (six fewer a tile: the writes still need them among themselves)."""
    run = _python("-c", _READ_AND_WRITE_RUNS)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["False"]["runs"] == ["R4", "W2"] * 8
    assert got["True"]["runs"] == ["R16", "W8"] * 2
    assert got["True"]["barriers"] == got["False"]["barriers"] - 6


_UP_PROJECTIONS_BEFORE_WRITES = _REBUILD + """
out = {}
for ahead in (False, True):
    loop, barriers = rebuild(2, 184, 16, True, True, False, True, True, True, ahead)
    texts = [text for _, text in loop]
    first_write = next(i for i, text in enumerate(texts) if "STSM" in text)
    out[str(ahead)] = {"before": sum("HGMMA" in t for t in texts[:first_write]),
                       "issued": sum("HGMMA" in t for t in texts),
                       "waits": sum("WARPGROUP.DEPBAR" in t for t in texts),
                       "barriers": barriers}
print(json.dumps(out))
"""


_WRITES_BETWEEN_BARRIERS = _REBUILD + """
out = {}
for join, regs in ((1, 184), (2, 184), (4, 176)):
    loop, barriers = rebuild(2, regs, 16, True, True, False, True, True, True, False, join)
    runs, n = [], 0
    for _, text in loop:
        if "STSM" in text:
            n += 1
        elif "BAR.SYNC" in text and n:
            runs.append(n)
            n = 0
    out[str(join)] = {"runs": runs + ([n] if n else []), "barriers": barriers}
print(json.dumps(out))
"""


@needs_cuobjdump
def test_joined_chunks_write_between_fewer_barriers():
    """``join``: the rebuilding warp group's writes of a half's four chunks (low and high
    columns, eight ``stmatrix``) cross a barrier after every pair alone (Triton's
    write-after-write barrier on one buffer), after every four with two chunks joined, and
    none with the half joined; the tile crosses 4 and 6 barriers fewer. The launches the
    bench measures: a half joined at 176 consumer registers, where the rebuild's loop does
    not spill (at 184 it would)."""
    run = _python("-c", _WRITES_BETWEEN_BARRIERS)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["1"]["runs"] == [2] * 8
    assert got["2"]["runs"] == [4] * 4
    assert got["4"]["runs"] == [8] * 2
    assert got["2"]["barriers"] == got["1"]["barriers"] - 4
    assert got["4"]["barriers"] == got["1"]["barriers"] - 6


@needs_cuobjdump
def test_half_ahead_issues_the_next_halfs_up_projection_before_the_writes():
    """``half_ahead``: the rebuilding warp group's tile issues the second key half's first
    up-projection (two wgmma: its low and high columns) before the first half's writes,
    not after them; the tile issues and waits as many as without the option, and crosses
    as many barriers."""
    run = _python("-c", _UP_PROJECTIONS_BEFORE_WRITES)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["False"]["before"] == 8  # the half's four chunks, low and high
    assert got["True"]["before"] == 10
    for key in ("issued", "waits", "barriers"):
        assert got["True"][key] == got["False"][key], key
