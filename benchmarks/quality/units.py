"""An evaluation saved unit by unit, so a run that stops early keeps what it finished.

A unit is one layout over one block of rounds, written as one JSON file as soon as it ends:
``<dir>/<layout>.r<first>-<end>.json`` (rounds first .. end-1). A later run with the same
setting skips the units on disk (resume) and ``load`` merges every unit of a folder, so
runs of different layouts or rounds (on different machines, in different device calls)
add up to one table. Units of another setting (model, adapters, dtype, ...) are refused,
never mixed. A setting key of ``OPTIONAL`` belongs to the units of some modes only (a second
adapter set): units that carry it must agree on it, the others merge with them.

The reference's hidden states are too large for the results folder (about 7 MB per agent
on SmolLM2 in float32); they go to a cache folder beside it, one torch file per unit.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

AgentKey = tuple[int, str]  # (round, task)
# Setting keys only some units carry: the plain adapters' fingerprint (every mode but the
# activated-LoRA ones), the activated-LoRA adapters' fingerprint, the offset modes' fit
# (modes.py, offsets.py). The aLoRA rows thus join plain rows of any session that trained the
# same plain adapters, or none: trained adapters do not outlive a device machine.
OPTIONAL = ("adapters", "alora_adapters", "offset_fit")


@dataclass(frozen=True)
class AgentResult:
    round: int
    task: str
    item_id: str
    writer: bool
    prompt_tokens: int
    shared_tokens: int   # common prefix of the round's prompts (the catalog)
    reused_tokens: int   # base (or unified) KV found in the cache at open: written by another
    tokens: tuple[int, ...]
    text: str
    valid: bool
    error: str
    f1: float
    layer_cos: tuple[float, ...]  # per layer, mean over compared tokens; () when not compared
    compared_tokens: int

    @property
    def key(self) -> AgentKey:
        return self.round, self.task


@dataclass(frozen=True)
class Unit:
    layout: str
    first: int                   # rounds first .. end-1
    end: int
    available: bool
    note: str
    setting: Mapping[str, Any]   # what must agree for units to merge (EvalParams but rounds)
    agents: tuple[AgentResult, ...] = ()
    prefill_tokens: int = 0
    seconds: float = 0.0
    context_kv_bytes: int = 0  # summed over rounds: the shared context's K/V, every agent on it
    recompute_layers: tuple[int, ...] = ()  # selective recompute: the layers kept exact
    offset_table_bytes: int = 0  # offset correction: its tables (every pair, every layer)
    extra_flops: int = 0         # offset correction: FLOPs spent correcting on read (offsets.py)
    # The source it ran (forkserve.bench.provenance); "" in units saved before it was kept.
    # Not part of the setting: units of several commits merge, and the report lists them.
    commit: str = ""

    @property
    def name(self) -> str:
        return unit_name(self.layout, self.first, self.end)


def unit_name(layout: str, first: int, end: int) -> str:
    return f"{layout}.r{first:03d}-{end:03d}"


def blocks(rounds: int, block: int) -> list[tuple[int, int]]:
    """[first, end) of each block of ``block`` rounds (the last one may be shorter)."""
    return [(a, min(a + block, rounds)) for a in range(0, rounds, block)]


def save(unit: Unit, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{unit.name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(unit), indent=1))
    tmp.replace(path)  # a call killed mid-write leaves no half file for resume to trust
    return path


def read(path: Path) -> Unit:
    d = json.loads(path.read_text())
    agents = tuple(AgentResult(**dict(a, tokens=tuple(a["tokens"]),
                                      layer_cos=tuple(a["layer_cos"])))
                   for a in d.pop("agents"))
    return Unit(**dict(d, recompute_layers=tuple(d.get("recompute_layers", ()))), agents=agents)


def find(folder: Path, layout: str, first: int, end: int,
         setting: Mapping[str, Any]) -> Unit | None:
    """The saved unit, if any; one saved with another setting is an error (mixing would lie)."""
    path = folder / f"{unit_name(layout, first, end)}.json"
    if not path.exists():
        return None
    unit = read(path)
    if dict(unit.setting) != dict(setting):
        raise ValueError(f"{path} was run with another setting: {diff(unit.setting, setting)}; "
                         "use another --tag or delete it")
    return unit


def diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def load(folder: Path) -> dict[str, list[Unit]]:
    """Every unit in ``folder`` by layout, rounds in order; one setting, no overlapping rounds."""
    units = [read(p) for p in sorted(folder.glob("*.r*-*.json"))]
    if not units:
        raise FileNotFoundError(f"no evaluation units in {folder}")
    by: dict[str, list[Unit]] = {}
    for u in units:
        if _core(u.setting) != _core(units[0].setting):
            raise ValueError(f"{folder}: units of two settings: "
                             f"{diff(_core(units[0].setting), _core(u.setting))}")
        by.setdefault(u.layout, []).append(u)
    for key in OPTIONAL:
        values = {json.dumps(u.setting[key]) for u in units if key in u.setting}
        if len(values) > 1:
            raise ValueError(f"{folder}: units of two settings: {key} {sorted(values)}")
    for us in by.values():
        us.sort(key=lambda u: u.first)
        for a, b in zip(us, us[1:], strict=False):
            if b.first < a.end:
                raise ValueError(f"{folder}: {a.name} and {b.name} overlap")
    return by


def _core(setting: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in setting.items() if k not in OPTIONAL}


def agents_of(units: Sequence[Unit]) -> list[AgentResult]:
    return [a for u in units for a in u.agents]


def hidden_path(cache: Path, layout: str, first: int, end: int) -> Path:
    return cache / f"{unit_name(layout, first, end)}.hidden.pt"
