"""ContextTree: one session's copy-on-write tree of branches.

A ``Node`` is a token segment ``tokens`` at absolute positions ``[start, end)`` on top of
its parent's path, plus a ``PageTable`` covering ``[0, kv_len)`` of that whole path. A
fork copies the parent's table (aliasing the trunk: one incref per page) and pays only
for the pages its own residual writes.

Lifetime rules:
* The committed spine is a chain of COMMITTED nodes; only its tip holds a page table.
  When the tip advances, the previous tip drops its table (the new tip aliases the same
  pages), so the spine's partial last page stays exclusively owned and is never copied.
* SPECULATIVE nodes hold their own tables. Abort releases a node's whole subtree, then
  walks up: a speculative ancestor left with no live child is released too, up to the
  committed spine.
* ABORTED nodes hold nothing; they stay only so that a late verb on them gets a clear
  error instead of a crash.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from forkserve.adapter_key import AdapterId
from forkserve.control.activation import ActivationScan
from forkserve.control.cascade import Decision
from forkserve.control.node_kv import NodeKV


class NodeState(str, enum.Enum):
    SPECULATIVE = "speculative"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(eq=False)
class Node:
    id: int
    session_id: int
    parent: "Node | None"
    label: str
    tokens: list[int]
    start: int
    table: NodeKV | None
    state: NodeState
    adapter: AdapterId | None = None
    children: list["Node"] = field(default_factory=list)
    child_index: int = 0
    # Bumped whenever this node's tokens change; queued speculative work on a child
    # remembers the value it saw and is dropped when it moves.
    generation: int = 0
    # Speculation: the harness prior, the cascade's verdict, pinning and TTL bookkeeping.
    priority: float = 0.0
    decision: Decision | None = None
    speculated: bool = False
    pinned_until: float | None = None
    slack_only: bool = False
    last_touch: float = 0.0
    probe_left: int = 0    # decode steps before the early-abort verdict
    extend_left: int = 0   # decode steps granted after clearing tau
    # The model's next token after ``end`` when all KV is written (cached from the step
    # that completed it), so generation never recomputes the last position.
    next_token: int | None = None
    next_token_sampling: object = None
    spec_generation: int = 0  # the parent's generation when speculation was queued
    generated_count: int = 0  # tokens a speculative probe/extension has decoded
    # Full pages (base, residual) already in the index, and where that insert ended.
    published: tuple[int, int] = (0, 0)
    publish_cursor: object = None
    # aLoRA: the activation point on this node's path, as far as it was scanned.
    activation: ActivationScan = field(default_factory=ActivationScan)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def kv_len(self) -> int:
        return self.table.length if self.table is not None else 0

    @property
    def live(self) -> bool:
        return self.state is not NodeState.ABORTED

    def live_children(self) -> list["Node"]:
        return [c for c in self.children if c.live]

    def subtree(self) -> Iterator["Node"]:
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children)


class ContextTree:
    """The nodes of one session, rooted at its first committed segment."""

    def __init__(self, root: Node) -> None:
        self.root = root
        self.tip = root
        self.nodes: dict[int, Node] = {root.id: root}
        self.committed: list[int] = list(root.tokens)  # the whole committed path

    def add(self, node: Node) -> None:
        self.nodes[node.id] = node
        if node.parent is not None:
            node.child_index = len(node.parent.children)
            node.parent.children.append(node)

    def path_tokens(self, node: Node) -> list[int]:
        if node.state is NodeState.COMMITTED:
            return self.committed[:node.end]
        return self.path_tokens(node.parent)[:node.start] + node.tokens

    def path_view(self, node: Node) -> Sequence[int]:
        """``path_tokens(node)``, without a copy where the path is the whole committed list:
        read it at once, before the tree changes (publishing a page on the decode path)."""
        if node.state is NodeState.COMMITTED and node.end == len(self.committed):
            return self.committed
        return self.path_tokens(node)

    def path_slice(self, node: Node, start: int, end: int) -> list[int]:
        """``path_tokens(node)[start:end]`` without copying the whole path (the step hot path)."""
        if node.state is NodeState.COMMITTED:
            return self.committed[start:end]
        if start >= node.start:
            return node.tokens[start - node.start:end - node.start]
        return self.path_tokens(node)[start:end]

    def abort(self, node: Node) -> list[Node]:
        """Release ``node``'s subtree and any speculative ancestor left childless."""
        released = []
        for n in node.subtree():
            if n.state is NodeState.SPECULATIVE:
                if n.table is not None:
                    n.table.release()
                    n.table = None
                n.state = NodeState.ABORTED
                released.append(n)
        parent = node.parent
        while (parent is not None and parent.state is NodeState.SPECULATIVE
               and not parent.live_children()):
            released.extend(self.abort_single(parent))
            parent = parent.parent
        return released

    def abort_single(self, node: Node) -> list[Node]:
        if node.table is not None:
            node.table.release()
            node.table = None
        node.state = NodeState.ABORTED
        return [node]

    def stage_tip(self, new_tip: Node) -> None:
        """Make ``new_tip`` (a COMMITTED child of the tip) the tip while its tokens are still
        being written; the old tip keeps its table until ``settle_tip`` settles the move,
        or ``unstage_tip`` takes it back (a commit whose tail failed)."""
        self.add(new_tip)
        self.committed.extend(new_tip.tokens)
        self.tip = new_tip

    def unstage_tip(self, old: Node) -> None:
        """Undo ``stage_tip``: ``old`` is the tip again, the staged node is gone."""
        staged = self.tip
        if staged.table is not None:
            staged.table.release()
            staged.table = None
        del self.nodes[staged.id]
        old.children.remove(staged)
        del self.committed[old.end:]
        self.tip = old

    def settle_tip(self, old: Node) -> None:
        """The staged tip's tokens are written: ``old`` drops its table (the tip aliases or
        took over its pages), so the spine's partial last page stays exclusively owned."""
        if old.table is not None and old is not self.tip:
            old.table.release()
            old.table = None

    def release_all(self) -> None:
        for node in self.nodes.values():
            if node.table is not None:
                node.table.release()
                node.table = None
            if node.state is NodeState.SPECULATIVE:
                node.state = NodeState.ABORTED
