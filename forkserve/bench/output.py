"""Where a bench writes, and how it says so: every bench writes its JSON (and PNG) into
one folder, outside the committed ``benchmarks/results`` unless ``--out`` names it, and
prints each path it wrote."""
from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path("forkserve-bench-results")


def add_out_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="folder for the JSON and PNG; benchmarks/results holds the committed "
                         "runs, name it only to replace them")


def write_json(path: Path, data: Any, *, quiet: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    if not quiet:
        print(f"wrote {path}")


def write_tables(out: Path, stem: str, markdown: str, data: Any) -> None:
    """A joined report's Markdown table (printed too) and its JSON: ``out/stem.{md,json}``."""
    print(markdown)
    path = out / f"{stem}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown + "\n")
    print(f"wrote {path}")
    write_json(out / f"{stem}.json", data)


def save_figure(fig, path: Path, *, dpi: int = 120, quiet: bool = False) -> None:
    """``fig`` as a PNG at ``path``, then closed; in a palette (``shrink_png``)."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    shrink_png(path)
    if not quiet:
        print(f"wrote {path}")


def shrink_png(path: Path) -> None:
    """The PNG at ``path`` rewritten in a 256-colour palette, where that is smaller: a plot's
    few flat colours lose nothing the eye sees, and the file a third of its size. Committed
    results travel with every device call, whose 64 MiB the checkout shares with the
    carries (benchmarks/carry_budget.py). No dithering: flat areas stay flat."""
    from PIL import Image

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT,
                                           dither=Image.Dither.NONE)
    buf = io.BytesIO()
    small.save(buf, "PNG", optimize=True)
    if buf.tell() < path.stat().st_size:
        path.write_bytes(buf.getvalue())


def new_figure(ncols: int, *, width: float, height: float = 4.0):
    """A figure of ``ncols`` axes laid out so a legend placed outside them fits
    (``legend_below``): a legend inside an axes covers a line."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), layout="constrained", squeeze=False)
    return fig, list(axes[0])


def legend_below(fig, ax, max_cols: int = 6) -> None:
    """``max_cols``: entries per row (fewer, for long labels that would run off the figure)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), max_cols))


def titled(title: str, tiny: bool) -> str:
    """Tiny runs say so, so a CPU plot is never read as the committed GPU one."""
    return f"{title} (tiny / CPU)" if tiny else title
