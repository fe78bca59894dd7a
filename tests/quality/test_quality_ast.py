"""The BFCL-style AST checker and token F1, on hand-made cases and on the real gold items."""
import pytest
from quality_testlib import needs_bfcl

from benchmarks.quality.ast_check import check, gold_value, parse_calls, token_f1

FUNCS = [{"name": "spotify.play",
          "parameters": {"type": "dict", "required": ["artist", "duration"], "properties": {
    "artist": {"type": "string"}, "duration": {"type": "integer"}, "shuffle": {"type": "boolean"},
    "volume": {"type": "float"}, "tags": {"type": "array", "items": {"type": "string"}}}}}]
GOLD = [{"spotify.play": {"artist": ["Taylor Swift"], "duration": [20], "shuffle": ["", False],
                          "volume": ["", 1.0], "tags": ["", ["pop"]]}},
        {"spotify.play": {"artist": ["Maroon 5"], "duration": [15], "shuffle": ["", False],
                          "volume": ["", 1.0], "tags": ["", ["pop"]]}}]


@pytest.mark.parametrize("text", [
    "[spotify.play(artist='Taylor Swift', duration=20), spotify.play(artist='Maroon 5', "
    "duration=15)]",
    # any order, BFCL's string standardisation, an int where a float is expected, optional args
    # given
    "[spotify.play(artist='maroon-5', duration=15, volume=1), spotify.play(artist='TaylorSwift', "
    "duration=20)]",
    "Sure: [spotify.play(artist='Taylor Swift', duration=20, tags=['Pop']), "
    "spotify.play(artist='Maroon 5', duration=15, shuffle=False)] done",
])
def test_valid_answers_pass(text):
    assert check(text, GOLD, FUNCS).valid, check(text, GOLD, FUNCS).error


@pytest.mark.parametrize("text, why", [
    ("[spotify.play(artist='Taylor Swift', duration=20)]", "1 calls, expected 2"),
    ("[spotify.play(artist='Taylor Swift', duration=20), spotify.play(artist='Adele', "
     "duration=15)]", "not in"),
    ("[spotify.play(artist='Taylor Swift', duration='20'), spotify.play(artist='Maroon 5', "
     "duration=15)]", "type"),
    ("[spotify.play(artist='Taylor Swift'), spotify.play(artist='Maroon 5', duration=15)]",
     "missing required"),
    ("[spotify.play(artist='Taylor Swift', duration=20, loud=True), "
     "spotify.play(artist='Maroon 5', duration=15)]",
     "unexpected argument"),
    ("[spotify.stop(artist='Taylor Swift', duration=20), spotify.play(artist='Maroon 5', "
     "duration=15)]", "function"),
    ("[spotify.play('Taylor Swift', 20), spotify.play(artist='Maroon 5', duration=15)]",
     "unparsable"),
    ("[spotify.play(artist=name, duration=20)]", "unparsable"),
    ("I cannot help with that.", "unparsable"),
])
def test_wrong_answers_fail_with_a_reason(text, why):
    result = check(text, GOLD, FUNCS)
    assert not result.valid and why in result.error


def test_a_call_fitting_two_gold_calls_does_not_steal_its_siblings():
    funcs = [{"name": "f",
              "parameters": {"required": ["h"], "properties": {"h": {"type": "integer"},
                                                               "v": {"type": "integer"}}}}]
    gold = [{"f": {"h": [10], "v": ["", 0]}}, {"f": {"h": [10], "v": [5]}}]
    assert check("[f(h=10, v=5), f(h=10)]", gold, funcs).valid


def test_gold_value_and_parse_and_f1():
    assert gold_value({"a": ["x", "y"], "b": ["", 1]}) == {"a": "x"}
    assert gold_value([{"k": [1]}, {"k": [2]}]) == [{"k": 1}, {"k": 2}]
    calls = parse_calls("[a.b.c(x=-1.5, y=[1, {'k': None}])]")
    assert calls[0].name == "a.b.c" and calls[0].args == {"x": -1.5, "y": [1, {"k": None}]}
    assert token_f1("[f(a=1)]", "[f(a=1)]") == 1.0
    assert token_f1("[f(a=1)]", "[g(b=2)]") == pytest.approx(5 / 8)  # [ ( = ) ] of 8 tokens each
    assert token_f1("", "[f()]") == 0.0


@needs_bfcl
@pytest.mark.parametrize("category", ["simple_python", "multiple", "parallel", "live_simple"])
def test_every_kept_gold_target_passes_and_a_changed_value_fails(category):
    from benchmarks.quality.data import load_category, target_text

    items = load_category(category)
    assert len(items) >= 200
    changed = 0
    for item in items:
        text = target_text(item)
        assert check(text, item.ground_truth, item.functions).valid, (item.id, text)
        # The first call under another function name must fail (multiple: the wrong function).
        first = next(iter(item.ground_truth[0]))
        wrong = text.replace(f"{first}(", f"{first}_x(", 1)
        assert not check(wrong, item.ground_truth, item.functions).valid
        changed += 1
    assert changed == len(items)
