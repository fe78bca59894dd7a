"""What every tick plan must satisfy, stated without the scheduler's own loop: committed
work is served before any speculation (seed 000's two classes).

Shared by the hypothesis machines (every plan of a random run) and the property test over
random demands, which reaches budget and memory contention the machines rarely do.
"""
from __future__ import annotations

from typing import Sequence

from forkserve.config import ForkServeConfig
from forkserve.control.scheduler import Demand, Grant, WorkClass


def check_plan(config: ForkServeConfig, committed: Sequence[Demand], speculative: Sequence[Demand],
               decode_slots: int, spec_memory_tokens: int, granted: int,
               grants: Sequence[Grant]) -> None:
    """``granted``: one-token decodes of the steady set, planned outside the demands (they
    count against budget and memory like committed work)."""
    mine = [g for g in grants if g.work_class is WorkClass.COMMITTED]
    spec = [g for g in grants if g.work_class is WorkClass.SPECULATIVE]
    # The stepper makes pages writable in grant order: committed grants must come first, or
    # a speculative write could take the pages committed work needs in the same tick.
    assert list(grants) == mine + spec, f"speculative grant before committed work: {grants}"
    used = granted + sum(g.tokens for g in mine)
    assert used + sum(g.tokens for g in spec) <= config.max_batch_tokens
    # Speculation gets the memory committed work leaves, not what it is about to take.
    assert sum(g.tokens for g in spec) <= max(0, spec_memory_tokens - used)
    if not spec:
        return
    # Any speculation at all means committed work was fully served: every committed
    # prefill in full and every decode step within the decode slots.
    served = {g.node_id: g.tokens for g in mine}
    for d in committed:
        if not d.decode:
            assert served.get(d.node_id) == d.tokens, \
                f"committed prefill {d} cut while speculation ran"
    for d in [d for d in committed if d.decode][:decode_slots]:
        assert served.get(d.node_id) == d.tokens, \
            f"committed decode {d} skipped while speculation ran"
    demanded = {d.node_id: d for d in speculative}
    for g in spec:
        assert g.node_id in demanded and g.tokens <= demanded[g.node_id].tokens
