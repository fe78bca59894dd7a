"""forkserve.bench.output.save_figure: a bench's PNG is written in a palette, a fraction of
matplotlib's RGBA file (committed results travel with every device call), and a file the
palette would not shrink is left as it is."""
from __future__ import annotations

from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")


def test_a_figure_is_saved_in_a_palette(tmp_path: Path, capsys) -> None:
    from PIL import Image

    from forkserve.bench.output import new_figure, save_figure

    fig, (ax,) = new_figure(1, width=6, height=3)
    for k in range(12):
        ax.plot(range(50), [x * (k + 1) for x in range(50)], label=f"line {k}")
    ax.legend()
    fig.savefig(tmp_path / "rgba.png", dpi=120)
    save_figure(fig, tmp_path / "plot.png")
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'plot.png'}"
    with Image.open(tmp_path / "plot.png") as im, Image.open(tmp_path / "rgba.png") as rgba:
        assert im.mode == "P" and im.size == rgba.size
    assert (tmp_path / "plot.png").stat().st_size < (tmp_path / "rgba.png").stat().st_size / 2


def test_a_png_the_palette_would_not_shrink_is_kept(tmp_path: Path) -> None:
    from PIL import Image

    from forkserve.bench.output import shrink_png

    path = tmp_path / "tiny.png"
    Image.new("P", (4, 4)).save(path)
    before = path.read_bytes()
    shrink_png(path)
    assert path.read_bytes() == before
