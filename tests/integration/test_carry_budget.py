"""benchmarks/carry_budget.py: a device call's tree and carry against its 64 MiB, counted
as the device tool counts them (tracked and untracked-not-ignored files, the carried paths),
so a carry cut for one session's tree is caught before the call is refused."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.benchmark_script import load_script

MIB = 1 << 20


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A checkout of 3 MiB tracked, 1 MiB untracked and 5 MiB ignored (sparse files)."""
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("big/\n")
    for name, size in (("tracked.bin", 3 * MIB), ("new.bin", MIB), ("big/carry.bin", 5 * MIB)):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        with open(tmp_path / name, "wb") as f:
            f.truncate(size)
    git("add", "tracked.bin", ".gitignore")
    return tmp_path


def test_the_tree_is_tracked_and_untracked_files_not_ignored_ones(repo: Path) -> None:
    budget = load_script("carry_budget")
    gitignore = (repo / ".gitignore").stat().st_size
    assert budget.tree_bytes(repo) == 4 * MIB + gitignore
    assert budget.path_bytes([repo / "big"]) == 5 * MIB
    assert budget.part_bytes(repo) == budget.LIMIT - 4 * MIB - gitignore - budget.MARGIN


def test_a_carry_over_the_limit_is_refused_here_first(repo: Path, capsys) -> None:
    budget = load_script("carry_budget")
    assert budget.main(["--repo", str(repo), str(repo / "big")]) == 0
    assert capsys.readouterr().out.strip().endswith("fits")
    with open(repo / "big" / "carry.bin", "wb") as f:
        f.truncate(61 * MIB)  # 4 + 61 > 64
    assert budget.main(["--repo", str(repo), str(repo / "big")]) == 1
    assert "OVER: the call would be refused" in capsys.readouterr().out
    with open(repo / "new.bin", "wb") as f:
        f.truncate(60 * MIB + MIB // 2)  # the tree alone leaves under a MiB past the margin
    with pytest.raises(SystemExit) as e:
        budget.main(["--repo", str(repo), "--part-bytes"])
    assert e.value.code == 1 and "nothing fits" in capsys.readouterr().err


def test_fa4_parts_are_cut_again_to_the_tree(tmp_path: Path) -> None:
    """``fa4_carry.sh --resplit`` joins a pack's parts in their order (p10 after p2), checks
    them against its sha256 and cuts them again, each part in a folder of its own; parts
    that do not add up stop it with one line."""
    import hashlib
    import os

    out = tmp_path / "fa4"
    data = os.urandom(3 * MIB)
    cuts = [0, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, len(data)]
    for n, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        (out / f"p{n}").mkdir(parents=True)
        (out / f"p{n}" / f"fa4.part{n:02d}").write_bytes(data[a:b])
    (out / "fa4.sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "fa4_carry.sh"
    run = subprocess.run(["bash", str(script), "--resplit", str(out)], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    parts = sorted(out.glob("p*/fa4.part*"), key=lambda p: p.name)
    assert [p.parent.name for p in parts] == [f"p{n}" for n in range(len(parts))]
    assert b"".join(p.read_bytes() for p in parts) == data
    (out / "fa4.sha256").write_text("0" * 64 + "\n")
    run = subprocess.run(["bash", str(script), "--resplit", str(out)], capture_output=True,
                         text=True)
    assert run.returncode == 1
    assert run.stderr.strip().endswith("parts do not add up to its fa4.sha256")
