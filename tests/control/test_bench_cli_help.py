"""A newcomer's first commands: the help names documents that exist, mentions --tiny, and
every bench flag says what it does and its default."""
import argparse
import re
from pathlib import Path

import pytest

from forkserve.bench.multilora.cli import parser
from forkserve.bench.multilora.scale import FULL, TINY
from forkserve.interfaces.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        main(argv)
    return capsys.readouterr().out


def test_top_level_and_bench_help_point_at_existing_docs_and_mention_tiny(capsys):
    text = _help(["--help"], capsys) + _help(["bench", "--help"], capsys)
    docs = set(re.findall(r"docs/\w+\.md", text))
    assert docs and all((ROOT / d).is_file() for d in docs)
    assert "--tiny" in text


@pytest.mark.parametrize("scale", [FULL, TINY])
def test_every_multilora_flag_has_help_and_shows_its_default(scale):
    ap = parser(scale)
    assert ap.formatter_class is argparse.ArgumentDefaultsHelpFormatter
    for action in ap._actions:
        assert action.help, action.dest


def test_tiny_help_shows_the_tiny_defaults(capsys):
    text = _help(["bench", "react", "--tiny", "--help"], capsys)
    assert f"(default: {TINY.context})" in " ".join(text.split())


def test_fanout_flags_have_help(capsys):
    text = " ".join(_help(["bench", "fanout", "--help"], capsys).split())
    for flag in ("--sessions", "--trunk", "--residual", "--fanout", "--page-size", "--out"):
        assert flag in text
    assert text.count("(default:") >= 7
