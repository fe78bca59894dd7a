"""What sharing the base cache across adapters costs a deployment, as measured.

A deployment whose adapters read base-side K/V another forward wrote (``ShareBase``
``cross_adapter`` or ``neutral`` in a layout with a base pool) answers differently from one
that shares nothing, by an amount only a quality run can say (docs/QUALITY.md). The operator
hands the server that run's report (``--quality-report``, a ``quality_*.json`` of
``benchmarks/quality/report.py``); this module picks the report's row for the deployment's
configuration and ``/v1/models`` shows it on every card (``share_base_cost``), so a client
sees the measured price of the sharing it gets. Nothing here estimates a cost: without a
report, or for a deployment that reads no other forward's K/V, the card says ``null``.

The report is read once, at start-up, before the model loads; a file that is missing, is
not a report, or has no measured row for the deployment is a ``UsageError`` (one line).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from forkserve.config import ForkServeConfig
from forkserve.interfaces.server.schemas import SharingCostCard
from forkserve.interfaces.usage import UsageError
from forkserve.sharing_mode import quality_mode


def load_sharing_cost(report: str | Path, config: ForkServeConfig) -> SharingCostCard | None:
    """The card for ``config`` from the report at ``report`` (None: the deployment reads no
    other forward's base K/V, so there is nothing to pay)."""
    mode = quality_mode(config)
    data = _read(Path(report))
    if mode is None:
        return None
    rows = {s.get("layout"): s for s in data["summaries"] if isinstance(s, dict)}
    row = rows.get(mode)
    paired = (row or {}).get("paired") or {}
    delta = paired.get("delta_f1")
    if not row or not row.get("available", True) or not isinstance(delta, dict):
        measured = sorted(k for k, s in rows.items() if (s.get("paired") or {}).get("delta_f1"))
        raise UsageError(f"--quality-report {report} has no measured row for this deployment's "
                         f"sharing (mode {mode!r}); measured: {measured}")
    setting = data.get("setting") or {}
    return SharingCostCard(
        mode=mode, model=str(setting.get("model", "")),
        delta_f1=_points(delta["mean"]), ci95=(_points(delta["low"]), _points(delta["high"])),
        readers=int(delta["n"]), rounds=int(row.get("rounds", delta.get("clusters", 0))),
        reference=str(row.get("reference", "unified")),
        kv_vs_unified=row.get("kv_vs_unified"), source=Path(report).name)


def _points(fraction: float) -> float:
    """F1 as a fraction -> F1 points, as the report's tables print it."""
    return round(100.0 * float(fraction), 2)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"--quality-report {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--quality-report {path} is not readable JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("summaries"), list):
        raise UsageError(f"--quality-report {path} is not a quality report (no 'summaries' "
                         "list: benchmarks/quality/report.py writes quality_*.json)")
    return data
