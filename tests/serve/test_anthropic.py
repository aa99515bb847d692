"""Anthropic's Messages API with the official ``anthropic`` SDK as the client: text, system prompts, streams
in Anthropic's event order, stop sequences, token counting, tool use and tool results (on the tools fixture,
whose template renders tools), and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import pytest
from server_process import API_KEY
from test_tools import tools_server  # noqa: F401 - the tools fixture's server (a pytest fixture)

ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
GREEDY = {"temperature": 0}  # this SDK's create() has no sampling arguments; the API still takes them
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
                            "required": ["city"]}}


@pytest.fixture()
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


@pytest.fixture()
def claude_tools(tools_server):  # noqa: F811
    return anthropic.Anthropic(base_url=tools_server.url, api_key="none", max_retries=0)


def test_a_message_with_the_sdk(claude):
    r = claude.messages.create(model="claude-x", max_tokens=8, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Once upon a time"}])
    assert r.type == "message" and r.role == "assistant" and r.model == "claude-x"
    assert r.id.startswith("msg_") and r.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in r.content] in (["text"], [])
    assert 0 < r.usage.output_tokens <= 8 and r.usage.input_tokens > 0


def test_system_prompt_blocks_and_count_tokens(claude):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    bare = claude.messages.count_tokens(model="m", messages=msgs).input_tokens
    system = claude.messages.count_tokens(model="m", messages=msgs, system="You are terse.").input_tokens
    blocks = claude.messages.count_tokens(model="m", messages=msgs,
                                          system=[{"type": "text", "text": "You are terse."}]).input_tokens
    assert 0 < bare < system == blocks
    r = claude.messages.create(model="m", max_tokens=4, system="You are terse.", messages=msgs)
    assert r.usage.input_tokens == system


def test_stream_in_anthropics_event_order(claude):
    with claude.messages.stream(model="m", max_tokens=12, extra_body=GREEDY, messages=ASK) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    whole = claude.messages.create(model="m", max_tokens=12, extra_body=GREEDY, messages=ASK)
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    events = [e.type for e in claude.messages.create(model="m", max_tokens=6, messages=ASK, stream=True)]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    blocks = [e for e in events if e.startswith("content_block")]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert set(blocks[1:-1]) <= {"content_block_delta"}


def test_stop_sequences(claude):
    free = claude.messages.create(model="m", max_tokens=16, extra_body=GREEDY, messages=ASK).content[0].text
    word = free.strip()[:2]
    r = claude.messages.create(model="m", max_tokens=16, extra_body=GREEDY, messages=ASK, stop_sequences=[word])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert word not in "".join(b.text for b in r.content)


BAD = [
    ("assistant-first", {"messages": [{"role": "assistant", "content": "hi"}, *ASK]}),
    ("final-assistant", {"messages": [*ASK, {"role": "assistant", "content": "Sunny"}]}),
    ("system-role-in-messages", {"messages": [{"role": "system", "content": "x"}, *ASK]}),
    ("tool-result-without-use", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 C"}]}]}),
    ("tool-use-in-user-turn", {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]}),
    ("image-block", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}),
    ("temperature-above-one", {"messages": ASK, "extra_body": {"temperature": 1.5}}),
    ("empty-messages", {"messages": []}),
]


@pytest.mark.parametrize("extra", [b[1] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_get_anthropics_error_shape(claude, server, extra):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=4, **extra)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with server.client() as c:
        r = c.post("/v1/messages", json={"model": "m", "messages": ASK})  # no max_tokens
        assert r.status_code == 400 and set(r.json()) == {"type", "error"}
        assert set(r.json()["error"]) == {"type", "message"}
        assert c.get("/health").status_code == 200


def test_a_wrong_key_is_anthropics_authentication_error(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m", max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"


def test_tool_use_and_tool_result_loop(claude_tools):
    r = claude_tools.messages.create(model="m", max_tokens=80, messages=ASK, tools=[WEATHER],
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert r.stop_reason == "tool_use"
    uses = [b for b in r.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    assert uses[0].input["city"] in ("Oslo", "Paris")
    assert not any("<tool_call>" in b.text or "</tool" in b.text for b in r.content if b.type == "text")
    follow = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in r.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                            "content": [{"type": "text", "text": "22 C and sunny"}]}]}]
    n_with = claude_tools.messages.count_tokens(model="m", messages=follow, tools=[WEATHER]).input_tokens
    answer = claude_tools.messages.create(model="m", max_tokens=8, messages=follow, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert answer.usage.input_tokens == n_with > r.usage.input_tokens  # the call and its result were rendered


def test_streamed_tool_use(claude_tools):
    with claude_tools.messages.stream(model="m", max_tokens=80, messages=ASK, tools=[WEATHER],
                                      tool_choice={"type": "tool", "name": "get_weather"}) as s:
        events = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Oslo", "Paris")
    deltas = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert json.loads("".join(d.delta.partial_json for d in deltas)) == use.input
