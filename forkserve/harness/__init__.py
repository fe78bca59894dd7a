"""Harness adapters: agent frameworks lowered onto the branch verbs over HTTP.

Adapters announce structure (which text is a known wrapper, which branches are guesses,
where the fan-out and the fan-in are); they never rewrite the framework's prompts.
"""
from forkserve.harness.langgraph_send import SendFanout, build_send_graph
from forkserve.harness.react import ReActAgent, ReActFormat, ReActResult
from forkserve.harness.swe import SweAgent, SweFormat, SweResult
from forkserve.harness.tool_loop import ToolCall, ToolFormat, ToolLoop, ToolLoopRun
from forkserve.harness.tool_pause import Guess, ToolPause, ToolPauseResult
from forkserve.harness.tot import TotResult, TreeOfThoughts

__all__ = [
           "Guess",
           "ReActAgent",
           "ReActFormat",
           "ReActResult",
           "SendFanout",
           "SweAgent",
           "SweFormat",
           "SweResult",
           "ToolCall",
           "ToolFormat",
           "ToolLoop",
           "ToolLoopRun",
           "ToolPause",
           "ToolPauseResult",
           "TotResult",
           "TreeOfThoughts",
           "build_send_graph",
]
