"""The quality benchmark lives under benchmarks/ (not an installed package): put the repo root
on sys.path so `benchmarks.quality` imports however pytest is started."""
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
