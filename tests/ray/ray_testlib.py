"""Shared by tests/ray (a uniquely named module: tests/server has a conftest of its own)."""
from __future__ import annotations

from dataclasses import dataclass

# Replicas report routing stats this often in the tests (the default is 2 s).
STATS_PERIOD_S = 0.5
# The cluster's Frontend requires API keys (SECURITY.md): two tenants.
KEY, OTHER_KEY = "sk-ray-tests", "sk-ray-other"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass(frozen=True)
class Cluster:
    url: str
