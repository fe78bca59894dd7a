"""BFCL v4 items as K disjoint function-calling tasks, with prompts that share one context.

Data: the PyPI package ``bfcl-eval==2026.3.23`` (install it with ``pip install --no-deps``:
its pins would downgrade numpy). Only its JSONL files are read, never its modules, so none
of its dependencies is needed: questions and function schemas in
``bfcl_eval/data/BFCL_v4_<category>.json``, gold answers in ``possible_answer/``.

Tasks: one per category (default simple_python, multiple, parallel, live_simple), so the
tasks are disjoint by construction and each adapter learns a different calling behaviour
(one call, choosing among several functions, several calls, real user phrasing).

Splits: items that document the same set of functions (live_simple reuses a function for
several questions) fall on the same side, so no held-out item's documentation was seen in
training. The split is a seeded shuffle of these groups.

Prompt: the system message holds the instructions and a catalog of function schemas (JSON);
the user message holds one question. In evaluation the K agents of a round share one
catalog, the documentation of every agent's item plus distractors, so the system message
is the long shared context and only the question differs per agent.
"""
from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from benchmarks.quality.ast_check import check, gold_value

DEFAULT_CATEGORIES = ("simple_python", "multiple", "parallel", "live_simple")
SYSTEM = ("You are an expert in composing functions. You are given a question and a set of "
          "possible functions. Based on the question, make one or more function calls to achieve "
          "the purpose. "
          "Answer with the calls only, in the format [func_name1(param=value, param2=value), "
          "func_name2(param=value)] and nothing else.\n"
          "Here is a list of functions in JSON format that you can invoke:\n")


@dataclass(frozen=True)
class BfclItem:
    id: str
    category: str
    question: str
    functions: tuple[dict[str, Any], ...]
    # One entry per expected call: {function name: {argument: allowed values}}; "" among the
    # allowed values marks an argument that may be left out.
    ground_truth: tuple[dict[str, dict[str, list[Any]]], ...]

    @property
    def doc_group(self) -> tuple[str, ...]:
        return tuple(sorted(f["name"] for f in self.functions))


@dataclass(frozen=True)
class Task:
    name: str
    train: tuple[BfclItem, ...]
    heldout: tuple[BfclItem, ...]


@dataclass(frozen=True)
class Example:
    """One prompt: the system message (catalog) and the user question; target for training."""

    task: str
    item: BfclItem
    system: str
    user: str
    target: str

    def messages(self, with_target: bool) -> list[dict[str, str]]:
        chat = [{"role": "system", "content": self.system}, {"role": "user", "content": self.user}]
        return chat + [{"role": "assistant", "content": self.target}] if with_target else chat


@dataclass(frozen=True)
class Round:
    """K agents, one held-out item each, sharing one catalog (one system message)."""

    index: int
    examples: tuple[Example, ...]  # one per task, in task order

    @property
    def system(self) -> str:
        return self.examples[0].system


def data_dir() -> Path:
    spec = importlib.util.find_spec("bfcl_eval")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("BFCL data not found: pip install --no-deps bfcl-eval==2026.3.23")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def load_category(category: str, root: Path | None = None) -> list[BfclItem]:
    root = root or data_dir()
    gold = {}
    with open(root / "possible_answer" / f"BFCL_v4_{category}.json") as f:
        for line in f:
            row = json.loads(line)
            gold[row["id"]] = tuple(row["ground_truth"])
    items = []
    with open(root / f"BFCL_v4_{category}.json") as f:
        for line in f:
            row = json.loads(line)
            turn = row["question"][0]  # these categories are single-turn
            # A few live items carry their own system message: it becomes part of the question,
            # so that the shared system message stays identical across agents.
            question = "\n\n".join(m["content"] for m in turn)
            items.append(BfclItem(row["id"], category, question, tuple(row["function"]),
                                  gold[row["id"]]))
    # A few gold answers contradict their own schema (they leave out a required argument):
    # no answer could pass, so those items are left out.
    return [item for item in items
            if check(target_text(item), item.ground_truth, item.functions).valid]


def split(items: Sequence[BfclItem], heldout: int,
          seed: int) -> tuple[tuple[BfclItem, ...], tuple[BfclItem, ...]]:
    """(train, heldout) by documentation group; heldout has at least `heldout` items."""
    groups: dict[tuple[str, ...], list[BfclItem]] = {}
    for item in items:
        groups.setdefault(item.doc_group, []).append(item)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    held: list[BfclItem] = []
    while keys and len(held) < heldout:
        held.extend(groups[keys.pop()])
    train = [item for k in keys for item in groups[k]]
    if not train:
        raise ValueError(f"heldout={heldout} leaves no training items ({len(items)} items)")
    return tuple(train), tuple(held)


def build_tasks(categories: Sequence[str] = DEFAULT_CATEGORIES, heldout: int = 40, seed: int = 0,
                root: Path | None = None) -> tuple[Task, ...]:
    if len(set(categories)) != len(categories):
        raise ValueError(f"categories must be distinct, got {categories}")
    return tuple(Task(c, *split(load_category(c, root), heldout, seed + i))
                 for i, c in enumerate(categories))


def format_value(value: Any) -> str:
    """A Python literal (what ast_check parses back)."""
    return repr(value)


def target_text(item: BfclItem) -> str:
    """The canonical answer: every call with its first allowed value for each argument that
    may not be left out (optional arguments are omitted: the shortest correct answer)."""
    schemas = {f["name"]: f for f in item.functions}
    calls = []
    for call in item.ground_truth:
        (name, args), = call.items()
        # A few gold answers allow leaving out an argument that the schema requires: the
        # checker requires it, so the target keeps it.
        required = set(schemas[name]["parameters"].get("required", []))
        parts = [f"{arg}={format_value(gold_value(options[0]))}" for arg, allowed in args.items()
                 if (options := [o for o in allowed if o != ""])
                 and ("" not in allowed or arg in required)]
        calls.append(f"{name}({', '.join(parts)})")
    return "[" + ", ".join(calls) + "]"


def system_message(functions: Sequence[dict[str, Any]]) -> str:
    return SYSTEM + json.dumps(list(functions), ensure_ascii=False)


def catalog(items: Sequence[BfclItem], rng: random.Random) -> list[dict[str, Any]]:
    """The union of the items' function schemas (first occurrence of a name wins), shuffled
    so the position of the right function carries no signal."""
    seen: dict[str, dict[str, Any]] = {}
    for item in items:
        for f in item.functions:
            seen.setdefault(f["name"], f)
    functions = list(seen.values())
    rng.shuffle(functions)
    return functions


def training_examples(tasks: Sequence[Task], task_index: int, distractors: int,
                      seed: int) -> list[Example]:
    """Every training item of one task, each in a catalog that also documents `distractors`
    training items of the other tasks (as in evaluation, where the agents share one catalog)."""
    rng = random.Random(seed)
    others = [item for j, t in enumerate(tasks) if j != task_index for item in t.train]
    task = tasks[task_index]
    out = []
    for item in task.train:
        functions = catalog([item, *rng.sample(others, min(distractors, len(others)))], rng)
        out.append(Example(task.name, item, system_message(functions), item.question,
                           target_text(item)))
    return out


def eval_rounds(tasks: Sequence[Task], rounds: int, distractors: int, seed: int) -> list[Round]:
    """Round r: held-out item r of every task, one catalog for all of them plus the schemas
    of `distractors` held-out items that no round asks about (documentation no agent needs)."""
    n = min(len(t.heldout) for t in tasks)
    if rounds > n:
        raise ValueError(f"{rounds} rounds need {rounds} held-out items per task; the smallest "
                         f"task has {n}")
    rng = random.Random(seed)
    spare = [item for t in tasks for item in t.heldout[rounds:]]
    out = []
    for r in range(rounds):
        items = [t.heldout[r] for t in tasks]
        functions = catalog(items + rng.sample(spare, min(distractors, len(spare))), rng)
        system = system_message(functions)
        out.append(Round(r, tuple(Example(t.name, it, system, it.question, target_text(it))
                                  for t, it in zip(tasks, items, strict=True))))
    return out
