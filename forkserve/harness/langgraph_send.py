"""LangGraph ``Send`` fan-out / fan-in lowered onto the verbs (the real ``langgraph`` package).

    plan ──Send("work", …) × k──▶ work ──▶ reduce

* ``plan`` opens one session on the shared context: every worker's branch aliases it.
* each ``work`` node (run in parallel by LangGraph) does the graph's own work (any
  function: an LLM call, a tool) and records its result as a branch forked from the
  shared tip, speculated so it is prefilled while the other workers still run;
* ``reduce`` joins the branches in Send order (``join``: the first binds its pages, the
  rest are prefilled as the tail) and decodes the summary from the committed spine.

The graph's text (context, results, separator) is used as given; at most
``ForkServeConfig.branch_cap`` workers may fan out from one tip.
"""
from __future__ import annotations

import operator
from typing import Annotated, Any, Callable, Sequence, TypedDict

from forkserve.interfaces.client import BranchClient, Commit, Generation, Session

Worker = Callable[[str, str], str]  # (context, subtask) -> result text


class SendFanout:
    """The verbs a Send fan-out needs, bound to one model."""

    def __init__(self, client: BranchClient, model: str) -> None:
        self.client, self.model = client, model

    def open(self, context: str) -> Session:
        return self.client.open(self.model, text=context)

    def branch(self, session_id: str, tip: int, text: str, *, label: str, priority: float) -> int:
        node = self.client.fork(session_id, tip, text=text, label=label)
        self.client.speculate(session_id, node, priority=priority)
        return node

    def join(self, session_id: str, nodes: Sequence[int], separator: str) -> Commit:
        return self.client.join(session_id, nodes, separator_text=separator or None)

    def finish(self, session_id: str, max_tokens: int, stop: Sequence[str]) -> Generation:
        try:
            return self.client.generate(session_id, max_tokens, stop=stop)
        finally:
            self.client.close(session_id)


class FanoutState(TypedDict, total=False):
    context: str
    subtasks: list[str]
    session_id: str
    tip: int
    results: Annotated[list[tuple[int, int, str]], operator.add]  # (Send index, branch node, text)
    join: dict[str, Any]
    summary: str


class WorkItem(TypedDict):
    context: str
    subtask: str
    index: int
    count: int
    session_id: str
    tip: int


def build_send_graph(fanout: SendFanout, worker: Worker, *, separator: str = "\n",
                     summary_tokens: int = 32, summary_stop: Sequence[str] = ()) -> Any:
    """A compiled LangGraph ``StateGraph``; invoke it with
    ``{"context": ..., "subtasks": [...]}``."""
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Send

    def plan(state: FanoutState) -> dict[str, Any]:
        s = fanout.open(state["context"])
        return {"session_id": s.session_id, "tip": s.tip}

    def fan_out(state: FanoutState) -> list:  # of Send; LangGraph resolves hints in module scope
        n = len(state["subtasks"])
        return [Send("work", WorkItem(context=state["context"], subtask=sub, index=i, count=n,
                                      session_id=state["session_id"], tip=state["tip"]))
                for i, sub in enumerate(state["subtasks"])]

    def work(item: WorkItem) -> dict[str, Any]:
        text = worker(item["context"], item["subtask"])
        node = fanout.branch(item["session_id"], item["tip"], text, label=f"send{item['index']}",
                             priority=1.0 / item["count"])
        return {"results": [(item["index"], node, text)]}

    def reduce(state: FanoutState) -> dict[str, Any]:
        ordered = sorted(state["results"])
        commit = fanout.join(state["session_id"], [node for _, node, _ in ordered], separator)
        out = fanout.finish(state["session_id"], summary_tokens, summary_stop)
        return {"join": {"tip": commit.tip, "bound_node": commit.bound_node,
                         "matched_tokens": commit.matched_tokens,
                         "prefilled_tokens": commit.prefilled_tokens},
                "summary": out.text}

    graph = StateGraph(FanoutState)
    graph.add_node("plan", plan)
    graph.add_node("work", work)
    graph.add_node("reduce", reduce)
    graph.add_edge(START, "plan")
    graph.add_conditional_edges("plan", fan_out, ["work"])
    graph.add_edge("work", "reduce")
    graph.add_edge("reduce", END)
    return graph.compile()
