"""BFCL-style AST checking of a function-call answer, and token F1 of the call text.

Follows bfcl_eval's ``ast_checker`` for Python (simple, multiple and parallel categories):
the answer is parsed as a Python list of calls with keyword arguments; the number of calls
must equal the gold's; the gold calls are paired one to one, in any order, with
a call of the same function name whose arguments are all documented, whose required
arguments are all present, whose optional arguments are only left out where the gold allows
it ("" among the allowed values), and whose every value has the schema's type (an int passes
where a float is expected) and is among the allowed values, strings compared after BFCL's
standardisation (case, spaces and ``,./-_*^`` ignored). Dicts are checked key by key, lists
of dicts dict by dict, as BFCL does.
"""
from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

# Schema type -> the Python type a literal must have (BFCL's PYTHON_TYPE_MAPPING).
PYTHON_TYPES: dict[str, type] = {"integer": int, "float": float, "number": float, "string": str,
                                 "boolean": bool, "array": list, "tuple": list, "dict": dict,
                                 "object": dict}


@dataclass(frozen=True)
class Call:
    name: str
    args: Mapping[str, Any]


@dataclass(frozen=True)
class CheckResult:
    valid: bool
    error: str  # "" when valid


def gold_value(allowed: Any) -> Any:
    """A concrete value from one allowed-value entry of a BFCL gold answer: dicts there map
    each key to a list of allowed values (take the first; drop keys that may be left out),
    lists of dicts hold such dicts."""
    if isinstance(allowed, dict) and all(isinstance(v, list) and v for v in allowed.values()):
        return {k: gold_value(v[0]) for k, v in allowed.items() if "" not in v}
    if isinstance(allowed, list):
        return [gold_value(v) for v in allowed]
    return allowed


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise ValueError(f"not a function name: {ast.dump(node)}")


def parse_calls(text: str) -> tuple[Call, ...]:
    """`[f(a=1), g.h(b='x')]` (or one bare call) -> calls; ValueError if it is not that."""
    text = text.strip()
    if "[" in text and "]" in text:  # tolerate words around the list, as BFCL's decoders do
        text = text[text.index("["):text.rindex("]") + 1]
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not Python: {e.msg}") from e
    nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call):
            raise ValueError(f"not a call: {ast.unparse(node)[:60]}")
        if node.args:
            raise ValueError(f"{_dotted(node.func)}: positional arguments (keywords required)")
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise ValueError(f"{_dotted(node.func)}: **kwargs")
            args[kw.arg] = ast.literal_eval(kw.value)  # ValueError on anything but a literal
        calls.append(Call(_dotted(node.func), args))
    return tuple(calls)


def standardize(s: str) -> str:
    """BFCL's standardize_string."""
    return re.sub(r"[ ,./\-_*^]", "", s).lower().replace("'", '"')


def _norm(value: Any) -> Any:
    if isinstance(value, str):
        return standardize(value)
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    return value


def _dict_ok(value: dict, allowed: dict) -> bool:
    for key, v in value.items():
        if key not in allowed or _norm(v) not in [_norm(a) for a in allowed[key]]:
            return False
    return all(key in value or "" in options for key, options in allowed.items())


def _value_ok(value: Any, options: Sequence[Any], schema: Mapping[str, Any]) -> str:
    """"" if value has the schema's type and is among the allowed options, else why not."""
    kind = schema.get("type", "any")
    if kind == "tuple" and isinstance(value, tuple):
        value = list(value)
    if kind in ("float", "number") and type(value) is int:
        value = float(value)
    expected = PYTHON_TYPES.get(kind)
    if expected is not None and type(value) is not expected:
        return f"type {type(value).__name__}, schema says {kind}"
    item_type = (PYTHON_TYPES.get(schema.get("items", {}).get("type", "any")) if kind == "array"
                 else None)
    if item_type is not None and item_type is not dict:
        if item_type is float:
            value = [float(v) if type(v) is int else v for v in value]
        if any(type(v) is not item_type for v in value):
            return f"list items are not all {item_type.__name__}"
    candidates = [o for o in options if o != ""]
    if isinstance(value, dict):
        ok = any(isinstance(o, dict) and _dict_ok(value, o) for o in candidates)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        ok = any(isinstance(o, list) and len(o) == len(value)
                 and all(isinstance(d, dict) and _dict_ok(v, d)
                         for v, d in zip(value, o, strict=True)) for o in candidates)
    else:
        ok = _norm(value) in [_norm(o) for o in candidates]
    return "" if ok else f"{value!r} not in {candidates!r}"


def check_call(call: Call, gold: Mapping[str, Mapping[str, list[Any]]],
               schemas: Mapping[str, Mapping[str, Any]]) -> str:
    """"" if `call` satisfies the one gold call `gold` ({name: {arg: allowed}}), else why not."""
    (name, allowed), = gold.items()
    if call.name != name:
        return f"function {call.name!r}, expected {name!r}"
    params = schemas[name]["parameters"]
    props = params.get("properties", {})
    for arg in params.get("required", []):
        if arg not in call.args:
            return f"{name}: missing required argument {arg!r}"
    for arg, value in call.args.items():
        if arg not in allowed or arg not in props:
            return f"{name}: unexpected argument {arg!r}"
        why = _value_ok(value, allowed[arg], props[arg])
        if why:
            return f"{name}.{arg}: {why}"
    for arg, options in allowed.items():
        if arg not in call.args and "" not in options:
            return f"{name}: missing argument {arg!r}"
    return ""


def _match(calls: list[Call], golds: list[Mapping[str, Mapping[str, list[Any]]]],
           schemas: Mapping[str, Mapping[str, Any]]) -> str:
    """"" if the calls can be paired one to one with the gold calls, in any order, else why not.
    A search rather than BFCL's greedy pass: a call that fits two gold calls (one with an
    optional argument left out) must not take the one its sibling needs."""
    if not golds:
        return ""
    first_why = ""
    for i, call in enumerate(calls):
        why = (check_call(call, golds[0], schemas)
               or _match(calls[:i] + calls[i + 1:], golds[1:], schemas))
        if not why:
            return ""
        first_why = first_why or why
    return first_why


def check(text: str, ground_truth: Sequence[Mapping[str, Mapping[str, list[Any]]]],
          functions: Sequence[Mapping[str, Any]]) -> CheckResult:
    """The whole answer against an item's gold calls; the item's schemas give the types."""
    try:
        calls = parse_calls(text)
    except (ValueError, SyntaxError) as e:  # literal_eval raises either on non-literals
        return CheckResult(False, f"unparsable: {e}")
    if len(calls) != len(ground_truth):
        return CheckResult(False, f"{len(calls)} calls, expected {len(ground_truth)}")
    schemas = {f["name"]: f for f in functions}
    why = _match(list(calls), list(ground_truth), schemas)
    if why:
        return CheckResult(False, why)
    return CheckResult(True, "")


def tokens(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]", text.lower())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD-style bag-of-tokens F1 over words and punctuation of the call text."""
    pred, ref = tokens(prediction), tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)
