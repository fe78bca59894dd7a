"""Harness adapters end to end against the live server: every example runs, the tool pause
binds the known wrapper, and every session is closed afterwards."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from server_testlib import MODEL_NAME, quiescent_pages

from forkserve.harness import Guess, ReActAgent, ToolPause
from forkserve.interfaces.client import BranchClient

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def assert_no_leak(server) -> None:
    sessions, used, published = quiescent_pages(server)
    assert sessions == 0 and used == published


def test_langgraph_send_example_runs_end_to_end(server):
    final = example("langgraph_send").main(["--url", server.url, "--model", MODEL_NAME,
                                            "--note-tokens", "6"])
    results = sorted(final["results"])
    assert [i for i, _, _ in results] == [0, 1, 2]
    assert len({node for _, node, _ in results}) == 3
    assert [text.split(":")[0] for _, _, text in results] == ["Correctness", "Tests", "Style"]
    assert final["join"]["bound_node"] == results[0][1] and isinstance(final["summary"], str)
    assert_no_leak(server)


@pytest.mark.parametrize("name,argv", [("react_agent", []), ("swe_loop", []),
                                       ("tree_of_thoughts", ["--k", "3", "--depth", "1"])])
def test_examples_run_against_the_server(server, name, argv):
    out = example(name).main(["--url", server.url, "--model", MODEL_NAME, *argv])
    assert out.get("steps", out.get("levels")) >= 1
    assert_no_leak(server)


def test_tool_pause_prefills_the_wrapper_during_the_tool_and_binds_it(server):
    with BranchClient(server.url) as client:
        s = client.open("planner", text="Question: 2+2?\nAction: calc[2+2]")
        result = ToolPause(client, expected_tool_ms=5000).run(
            s.session_id, s.tip, lambda: "4", prefix="\nObservation: ", suffix="\nThought:",
            guesses=(Guess("\nObservation: error", 0.2),))
        assert result.decisions["wrapper"].action in ("prefill", "hash_partial", "hash_skip")
        assert result.commit.bound_node is not None and result.commit.matched_tokens >= 2
        added = client.info(s.session_id).committed_tokens - s.committed_tokens
        # only the tail
        assert result.commit.prefilled_tokens == added - result.commit.matched_tokens
        client.close(s.session_id)
    assert_no_leak(server)


def test_react_runs_a_resumed_action_then_stops_without_one(server):
    calls = []
    with BranchClient(server.url) as client:
        agent = ReActAgent(client, MODEL_NAME, {"calc": lambda a: calls.append(a) or "4"},
                           max_tokens=6)
        result = agent.run("Question: 2+2?\n", resume="Action: calc[2+2]", max_steps=1)
    assert calls == ["2+2"] and len(result.steps) == 1
    assert result.transcript.startswith("Action: calc[2+2]\nObservation: 4\nThought:")
    assert_no_leak(server)
