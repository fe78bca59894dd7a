"""The README's first command, shortened: the demo runs end to end on SmolLM2 (CPU)."""
import pytest


def test_demo_runs_on_smollm2(capsys):
    from forkserve.backend.torch import find_smollm2_gguf
    from forkserve.interfaces.demo import main

    try:
        find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(f"the demo model package is not installed: {exc}")

    assert main(["--max-new", "4", "--layouts", "unified,disaggregated"]) == 0
    out = capsys.readouterr().out
    assert "[planner]" in out and "[critic]" in out
    table = out.split("== the same run in each KV layout ==")[1]
    rows = {line.split()[0]: line.split() for line in table.strip().splitlines()[2:]}
    unified_bytes = int(rows["unified"][1].replace(",", ""))
    disagg_bytes = int(rows["disaggregated"][1].replace(",", ""))
    assert disagg_bytes < unified_bytes          # the shared context is stored once
    assert int(rows["disaggregated"][5]) > 0     # later agents found the base pages published
