"""OpenAI's Responses API (``/v1/responses``) through the official ``openai`` SDK and raw HTTP."""

from __future__ import annotations

import json

import openai
import pytest
from server_process import API_KEY


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_a_string_input_gives_a_completed_response(client):
    r = client.responses.create(model="gpt-4o-mini", input="Once upon a time", max_output_tokens=300,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "gpt-4o-mini"
    assert r.status in ("completed", "incomplete")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.content[0].type == "output_text" and r.output_text == item.content[0].text
    assert r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model="m", input="Once upon a time", max_output_tokens=4, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4 and r.max_output_tokens == 4


def test_messages_and_instructions_render_as_the_chat_does(client, server):
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]}]
    r = client.responses.create(model="m", instructions="Be brief.", input=messages, max_output_tokens=8,
                                temperature=0)
    chat = client.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, *messages[:2], {"role": "user", "content": "Tell me a story"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.instructions == "Be brief."


def test_stream_events_in_openai_order(client):
    events = list(client.responses.create(model="m", input="Once upon a time", max_output_tokens=6,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-4].text == text and events[-1].response.output_text == text
    whole = client.responses.create(model="m", input="Once upon a time", max_output_tokens=6, temperature=0)
    assert whole.output_text == text and events[-1].response.usage.output_tokens == 6


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"]}
    r = client.responses.create(model="m", input="How do you feel?", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "mood", "schema": schema,
                                                 "strict": True}})
    assert json.loads(r.output_text)["mood"] in ("happy", "sad")


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input", "must be a message"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content",
     "only text parts"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", "not served"),
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    ({"input": []}, "input", "holds no message"),
])
def test_what_is_not_served_is_one_400(server, body, param, says):
    with server.client() as c:
        r = c.post("/v1/responses", json={"model": "m", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and says in err["message"]
