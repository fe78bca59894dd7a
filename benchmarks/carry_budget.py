"""What a device call sends against its limit: 64 MiB for the working tree that travels
(tracked files and untracked ones git does not ignore) and the paths it carries together
(/work/.library/device/README.md, "Limits"). A call over it is refused at once.

    python3 benchmarks/carry_budget.py .fa4/p0       # the tree and that carry: fits? (exit 1)
    python3 benchmarks/carry_budget.py --part-bytes  # the largest part beside the tree

The tree grows as results are committed (benchmarks/results/ holds most of it), so a carry
cut to fit one session may not fit the next: ``fa4_carry.sh --resplit`` cuts FA4's parts
again to ``--part-bytes``. That leaves ``MARGIN`` free for the results a session copies in
between its calls.
"""
from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

LIMIT = 64 << 20
MARGIN = 4 << 20


def tree_bytes(repo: Path) -> int:
    """Bytes of the files a call sends from ``repo``: tracked, and untracked but not ignored
    (a tracked file deleted in the work tree sends nothing)."""
    names = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True).stdout.split(b"\0")
    return sum(p.stat().st_size for name in set(names) if name
               and (p := repo / name.decode()).is_file() and not p.is_symlink())


def path_bytes(paths: list[Path]) -> int:
    """Bytes of the files at or under ``paths`` (the carried ones)."""
    total = 0
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        total += sum(p.stat().st_size for p in files)
    return total


def part_bytes(repo: Path, margin: int = MARGIN) -> int:
    """The largest carry that fits beside ``repo``'s tree with ``margin`` to spare."""
    free = LIMIT - tree_bytes(repo) - margin
    if free < (1 << 20):
        raise ValueError(f"the working tree leaves {max(free, 0) >> 20} MiB of the call's "
                         f"{LIMIT >> 20} MiB (less {margin >> 20} MiB margin): nothing fits")
    return free


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("carry", nargs="*", type=Path, help="the paths a call would carry")
    ap.add_argument("--repo", type=Path, default=Path("."))
    ap.add_argument("--part-bytes", action="store_true",
                    help="print the largest part that fits beside the tree (less the margin)")
    args = ap.parse_args(argv)
    if args.part_bytes:
        try:
            print(part_bytes(args.repo))
        except ValueError as e:
            ap.exit(1, f"carry_budget: {e}\n")
        return 0
    if missing := [str(p) for p in args.carry if not p.exists()]:
        ap.error(f"no such path to carry: {missing[0]}")
    tree, carry = tree_bytes(args.repo), path_bytes(args.carry)
    fits = tree + carry <= LIMIT
    print(f"tree {tree / 2**20:.1f} MiB + carry {carry / 2**20:.1f} MiB = "
          f"{(tree + carry) / 2**20:.1f} MiB of {LIMIT >> 20}: "
          + ("fits" if fits else "OVER: the call would be refused"))
    return 0 if fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
