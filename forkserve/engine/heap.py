"""The serving process's cycle-collector policy: the heap a server (or a benchmark's timed
run) starts with is frozen, so the collector's full passes walk only what serving allocates.

Python's collector runs a full (generation 2) pass whenever the objects that survived the
younger passes reach a quarter of the long-lived heap, and a full pass walks every tracked
object: after a model load, Triton's and Inductor's kernels and the captured decode graphs
that is millions of objects, ~0.1-0.3 s a pass (0.22 s for 2M objects on the CI machine),
paid inside whichever tick allocates across the threshold. Publishing a shared context
(33 index paths of 512 pages at W = 32) allocates ~70K objects; on the H200 (Python 3.12,
whose collector runs at the next function call) that publish took ~0.4 s where this CPU
takes 0.06 (docs/MULTILORA.md "Round 12"). vLLM freezes its start-up heap the same way
(``gc.freeze`` once the engine is built).

Freezing moves every live object into the permanent generation; reference counting still
frees them, but a cycle among them is never collected until ``thaw``. A process that frees
a large structure held in cycles (a benchmark dropping one backend before building the
next) thaws first.
"""
from __future__ import annotations

import gc


def settle() -> int:
    """Collect what earlier work left (frozen objects included) and freeze the survivors.
    Call once start-up (model load, warm-up, graph capture) is done (the server and each Ray
    replica do, after loading), or before a timed run; it costs one full pass. Returns how
    many objects are frozen."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Unfreeze and collect: cycles among formerly frozen objects (a dropped backend's) go
    now, before anything large is allocated in their place."""
    gc.unfreeze()
    gc.collect()
