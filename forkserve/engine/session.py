"""Session: one agent conversation — its context tree and its generation state."""
from __future__ import annotations

from dataclasses import dataclass, field

from forkserve.adapter_key import AdapterId
from forkserve.backend.protocol import GREEDY, SamplingParams
from forkserve.control.context_tree import ContextTree
from forkserve.errors import ForkServeError


@dataclass(eq=False)
class Session:
    id: int
    tree: ContextTree
    adapter: AdapterId | None = None  # the backend's id (the Engine resolved any name)
    # False: its prompt is computed whole though published pages cover a prefix (its
    # logits are wanted): it never waits for another session's in-flight prefill either.
    reuse_prefix: bool = True
    # Generation in progress on the committed tip.
    decode_left: int = 0
    sampling: SamplingParams = GREEDY
    stop: frozenset = frozenset()
    generated: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    # The tip's last token was sampled and its KV is not written yet.
    generated_unwritten: bool = False
    # A verb needs that last token written now (a fork aliases the whole trunk).
    flush: bool = False
    # A commit's tail is being written: the old tip's branches wait (they are aborted if it
    # lands, and must be intact if it fails).
    hold_speculation: bool = False
    # Largest KV (tokens) this session held that could not be reclaimed.
    peak_tokens: int = 0
    # When its last generation ended (a tool pause starts); the next commit measures it.
    paused_since: float | None = None
    # Why its last work failed inside a tick (set by the Stepper; other sessions never see
    # it). While set, ticks skip the session; the next verb on it clears it and retries.
    error: ForkServeError | None = None

    def begin_generate(self, max_tokens: int, sampling: SamplingParams, stop: frozenset) -> None:
        self.decode_left, self.sampling, self.stop = max_tokens, sampling, stop
        self.generated = []
        self.finish_reason = "length"

    def fail(self, error: ForkServeError) -> None:
        """Its work failed: stop the generation (tokens already generated stay committed)."""
        self.error = error
        if self.decode_left:
            self.decode_left = 0
            self.finish_reason = "error"

    def take(self, token: int) -> None:
        """``token``, sampled after the tip, joins the committed path and this generation;
        its KV is written by the next step (the general path's ``emit``; ``SteadyDecode.apply``
        does the same inline for its members)."""
        tree = self.tree
        tree.tip.tokens.append(token)
        tree.committed.append(token)
        self.generated.append(token)
        self.decode_left -= 1
        if token in self.stop:
            self.decode_left = 0
            self.finish_reason = "stop"
        self.generated_unwritten = True
