"""Agent frameworks, unchanged, against the demo model (SmolLM2-135M-Instruct, CPU): LangChain
``bind_tools`` / ``with_structured_output``, a LangGraph ReAct agent, the OpenAI Agents SDK,
litellm. A 135M model needs the server's enforcement to produce valid calls at all, so the
tests ask for it (``tool_choice``, schemas) and check what the frameworks receive."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pydantic import BaseModel, Field
from server_testlib import DEMO_NAME


class Person(BaseModel):
    age: int = Field(ge=0, le=150)
    mood: str = Field(json_schema_extra={"enum": ["happy", "sad"]})


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@pytest.fixture(scope="module")
def chat(demo_server):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(
        model=DEMO_NAME,
        base_url=demo_server.url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=48,
        max_retries=0,
    )


def test_langchain_bind_tools_required(chat):
    from langchain_core.tools import tool

    msg = chat.bind_tools(
        [tool(add), tool(multiply)], tool_choice="required", parallel_tool_calls=False
    ).invoke("What is 6 times 7?")
    (call,) = msg.tool_calls
    assert call["name"] in ("add", "multiply") and set(call["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in call["args"].values())


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(chat, method):
    person = chat.with_structured_output(Person, method=method).invoke(
        "Describe a happy 30 year old."
    )
    assert isinstance(person, Person) and person.mood in ("happy", "sad")


def test_langgraph_react_agent_two_step_calculator(chat):
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    tools = [tool(add), tool(multiply)]
    plan = ["add", "multiply"]  # (3 + 4) * 5: the step each tool call is forced to

    def model(state, runtime):
        done = sum(isinstance(m, ToolMessage) for m in state["messages"])
        if done < len(plan):
            return chat.bind_tools(tools, tool_choice=plan[done], parallel_tool_calls=False)
        return chat.bind(max_tokens=8).bind_tools(tools, tool_choice="none")

    agent = create_react_agent(model, tools)
    out = agent.invoke(
        {"messages": [("user", "Compute (3 + 4) * 5 with the tools: add first, then multiply.")]},
        {"recursion_limit": 8},
    )
    calls = [c for m in out["messages"] for c in getattr(m, "tool_calls", [])]
    results = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert [c["name"] for c in calls] == plan and len(results) == 2
    assert all(
        r.status == "success" and int(r.content) == fn(**c["args"])
        for r, c, fn in zip(results, calls, (add, multiply), strict=True)
    )
    assert out["messages"][-1].type == "ai" and not out["messages"][-1].tool_calls


def test_agents_sdk_function_tool_and_output_type(demo_server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    used: list[tuple[int, int]] = []

    @agents.function_tool
    def add_numbers(a: int, b: int) -> int:
        """Add two integers."""
        used.append((a, b))
        return a + b

    class AnswerAfterTheTool(agents.AgentHooks):
        """The app's rule for a model this small: call the tool once, then answer (enforced
        by the server through tool_choice, as the framework sends it)."""

        async def on_tool_end(self, context, agent, tool, result) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    client = AsyncOpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="calc",
        instructions="Add the numbers with the tool, then describe a person.",
        tools=[add_numbers],
        output_type=Person,
        model=agents.OpenAIChatCompletionsModel(model=DEMO_NAME, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
        hooks=AnswerAfterTheTool(),
        reset_tool_choice=False,
    )
    result = agents.Runner.run_sync(agent, "What is 2 + 3?", max_turns=6)
    assert used and isinstance(result.final_output, Person)


def test_litellm_tools(demo_server, monkeypatch):
    # Offline: litellm would otherwise try to download its model price list on import.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(
        model=f"openai/{DEMO_NAME}",
        api_base=demo_server.url + "/v1",
        api_key="unused",
        messages=[{"role": "user", "content": "What is 2 plus 3?"}],
        max_tokens=48,
        temperature=0,
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "add",
                    "description": "Add two integers.",
                    "parameters": {
                        "type": "object",
                        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["a", "b"],
                    },
                },
            }
        ],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
