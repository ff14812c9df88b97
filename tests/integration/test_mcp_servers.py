"""`art_mega.mcp` against a real MCP server written with the `mcp` SDK (tests/integration/
mcp_server.py: tools `add` and `capital`, one resource), reached over stdio (a child process
started by art-mega) and over streamable HTTP on loopback: tools listed as OpenAI tools, tool
calls answered by the server (its call log proves they reached it), failures as one sentence."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from art_mega.errors import MCPServerError, MissingExtraError, UserError

pytest.importorskip("mcp", reason="needs the mcp extra (pip install 'art-mega[mcp]')")

from art_mega.agent.ports import free_port  # noqa: E402
from art_mega.mcp import HttpServer, MCPTool, StdioServer, connect, list_resources, list_tools  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def stdio_server(calls: Path | None = None, **kw) -> StdioServer:
    env = {"PYTHONPATH": str(REPO)} | ({"MCP_TEST_CALLS": str(calls)} if calls else {})
    return StdioServer(
        command=sys.executable, args=("-m", "tests.integration.mcp_server", "stdio"), env=env, **kw
    )


@pytest.fixture(scope="module")
def http_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The test server on streamable HTTP (127.0.0.1, a free port): its /mcp URL and call log."""
    calls = tmp_path_factory.mktemp("mcp-http") / "calls.jsonl"
    port = free_port()
    env = {"PYTHONPATH": str(REPO), "MCP_TEST_CALLS": str(calls), "PATH": "/usr/bin:/bin"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.mcp_server", "http", str(port)], cwd=REPO, env=env
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"the MCP HTTP server exited {process.returncode}"
            try:
                httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the MCP HTTP server did not listen in 120 s"
                time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/mcp", calls
    finally:
        process.terminate()
        process.wait(timeout=30)


def assert_the_two_tools(tools: list[MCPTool]) -> None:
    assert [t.name for t in tools] == ["add", "capital"]
    add, capital = (t.to_tool_schema() for t in tools)
    assert add["type"] == "function"
    assert add["function"]["description"] == "Add two whole numbers from 0 to 99 and return their sum."
    parameters = add["function"]["parameters"]
    assert parameters["required"] == ["a", "b"]
    assert {k: v["type"] for k, v in parameters["properties"].items()} == {"a": "integer", "b": "integer"}
    assert (parameters["properties"]["a"]["minimum"], parameters["properties"]["a"]["maximum"]) == (0, 99)
    assert capital["function"]["parameters"]["properties"]["country"]["type"] == "string"


async def test_stdio_server_lists_tools_and_resources_and_answers_calls(tmp_path: Path) -> None:
    calls = tmp_path / "calls.jsonl"
    server = stdio_server(calls)
    assert_the_two_tools(await list_tools(server))
    (resource,) = await list_resources(server)
    assert (resource.uri, resource.name, resource.mime_type) == (
        "notes://countries",
        "countries",
        "text/plain",
    )
    async with connect(server) as session:
        assert_the_two_tools(await session.list_tools())
        total = await session.call_tool("add", {"a": 19, "b": 23})
        assert (total.text, total.is_error) == ("42", False)
        city = await session.call_tool("capital", {"country": "Kenya"})
        assert (city.text, city.is_error) == ("Nairobi", False)
        # the tool's own refusal and arguments its schema refuses come back as error results
        unknown = await session.call_tool("capital", {"country": "Atlantis"})
        assert unknown.is_error and "no capital known for 'Atlantis'" in unknown.text
        bad = await session.call_tool("add", {"a": 100, "b": 1})
        with pytest.raises(KeyError, match="from the block"):
            async with connect(server):
                raise KeyError("from the block")
        assert bad.is_error and "less than or equal to 99" in bad.text
    lines = [json.loads(line) for line in calls.read_text().splitlines()]
    assert lines == [
        {"tool": "add", "arguments": {"a": 19, "b": 23}},
        {"tool": "capital", "arguments": {"country": "Kenya"}},
        {"tool": "capital", "arguments": {"country": "Atlantis"}},
    ]


async def test_streamable_http_server_lists_tools_and_answers_calls(http_url: tuple[str, Path]) -> None:
    url, calls = http_url
    server = HttpServer(url=url)
    assert_the_two_tools(await list_tools(server))
    async with connect(server) as session:
        total = await session.call_tool("add", {"a": 5, "b": 8})
        assert (total.text, total.is_error) == ("13", False)
        # an exception of the caller's block comes out as raised, not in the transports' group
        with pytest.raises(KeyError, match="from the block"):
            async with connect(server):
                raise KeyError("from the block")
    assert json.loads(calls.read_text().splitlines()[-1]) == {"tool": "add", "arguments": {"a": 5, "b": 8}}


async def test_a_server_that_cannot_start_or_be_reached_is_one_sentence(tmp_path: Path) -> None:
    missing = StdioServer(command=str(tmp_path / "no-such-server"))
    with pytest.raises(MCPServerError) as info:
        await list_tools(missing)
    assert str(info.value).startswith(f"MCP server {tmp_path / 'no-such-server'}: connecting failed: ")
    assert info.value.exit_code == 1 and "\n" not in str(info.value)

    exits = StdioServer(command=sys.executable, args=("-c", "pass"), timeout_s=30)
    with pytest.raises(MCPServerError, match=r"-c pass: connecting failed: "):
        await list_tools(exits)

    down = HttpServer(url=f"http://127.0.0.1:{free_port()}/mcp", timeout_s=10)
    with pytest.raises(MCPServerError, match=r"/mcp: connecting failed: ") as info:
        await list_tools(down)
    assert info.value.server == down.url and info.value.action == "connecting"


def test_refused_server_descriptions(tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="not an http:// or https:// URL"):
        HttpServer(url="127.0.0.1:8000/mcp")
    with pytest.raises(ValidationError, match="timeout_s"):
        StdioServer(command="x", timeout_s=0)
    with pytest.raises(ValidationError, match="command"):
        StdioServer(command="")


async def test_a_server_that_is_not_a_description_is_refused() -> None:
    with pytest.raises(
        UserError, match=r"connect\(server='http://x/mcp'\) is a str; pass art_mega.mcp.StdioServer"
    ):
        async with connect("http://x/mcp"):  # type: ignore[arg-type]
            pass


def test_a_missing_mcp_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from art_mega.mcp import server

    monkeypatch.setitem(sys.modules, "mcp", None)  # what `import mcp` meets where it is not installed
    with pytest.raises(MissingExtraError) as info:
        server._sdk("art_mega.mcp.connect")
    assert str(info.value) == (
        "art_mega.mcp.connect needs the 'mcp' package, which is not installed; pip install 'art-mega[mcp]'"
    )
    assert info.value.exit_code == 2 and info.value.extra == "mcp"


async def test_the_policys_wrong_calls_are_answered_as_tool_results(tmp_path: Path) -> None:
    """What `rollout_with_tools` answers each kind of call the policy makes (openai's own
    tool-call objects, the real server): a wrong call is the policy's mistake, answered with the
    reason; only a well-formed call of an offered tool reaches the server."""
    from openai.types.chat import ChatCompletionMessageToolCall

    from art_mega.mcp import complete_task_tool
    from art_mega.mcp.rollout import _answer
    from art_mega.trajectories import Trajectory

    def call(name: str, arguments: str) -> ChatCompletionMessageToolCall:
        return ChatCompletionMessageToolCall.model_validate(
            {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
        )

    calls = tmp_path / "calls.jsonl"
    trajectory = Trajectory()
    async with connect(stdio_server(calls)) as session:
        offered = {t.name: t for t in [*await session.list_tools(), complete_task_tool]}
        answers = [
            await _answer(session, offered, call(name, arguments), trajectory)
            for name, arguments in [
                ("sub", '{"a": 1}'),
                ("add", '{"a": 1,'),
                ("add", "[1, 2]"),
                ("add", '{"a": 1, "b": 200}'),
                ("capital", '{"country": "japan"}'),
                ("complete_task", '{"summary": 3}'),
                ("complete_task", '{"summary": "Tokyo"}'),
            ]
        ]
    assert answers[0] == (
        "error: there is no tool named 'sub'; the tools are add, capital, complete_task",
        True,
    )
    assert answers[1][0].startswith("error: the arguments of add are not JSON (") and answers[1][1]
    assert answers[2] == ("error: the arguments of add must be a JSON object, not [1, 2]", True)
    assert answers[3][1] and "less than or equal to 99" in answers[3][0]
    assert answers[4] == ("Tokyo", False)
    assert answers[5] == ("error: complete_task needs a 'summary' string", True)
    assert answers[6] == ("The task is marked complete.", False) and trajectory.metadata == {
        "summary": "Tokyo"
    }
    # the server ran only `capital`: add's b=200 reached it but failed its own schema check
    # before the tool ran, and the other wrong calls never left the rollout
    assert [json.loads(line)["tool"] for line in calls.read_text().splitlines()] == ["capital"]
