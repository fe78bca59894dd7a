"""engine/heap.py and bench/gc_pauses.py: a settled heap is frozen out of the collector's
passes (and thawed back), and a watch times the passes of a region."""
import gc
import weakref

from forkserve.bench.gc_pauses import GcWatch
from forkserve.engine.heap import settle, thaw


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_settle_freezes_the_survivors_and_thaw_collects_cycles_frozen_alive() -> None:
    try:
        kept = _Cycle()
        ref = weakref.ref(kept)
        assert settle() > 0 and gc.get_freeze_count() > 0
        del kept
        gc.collect()
        assert ref() is not None  # a cycle frozen alive is out of the collector's reach...
        thaw()
        assert gc.get_freeze_count() == 0 and ref() is None  # ...until thaw collects it
    finally:
        gc.unfreeze()


def test_watch_counts_full_passes_and_their_time_in_a_window() -> None:
    watch = GcWatch().install()
    try:
        mark = watch.window()
        gc.collect(0)
        young = watch.since(mark)
        assert young.full == 0 and young.seconds >= 0
        gc.collect()
        gc.collect()
        both = watch.since(mark)
        assert both.full == 2 and both.seconds > 0
    finally:
        watch.close()
    mark = watch.window()
    gc.collect()
    assert watch.since(mark).full == 0  # closed: no longer counting
