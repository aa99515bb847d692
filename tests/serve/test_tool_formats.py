"""Tool calls parsed back out of the text each template family writes, the grammars that force them, and
what a stream may send before it knows whether a call follows (no server: ggmoe.serve.structured alone)."""

from __future__ import annotations

import json

import llama_cpp
import pytest

from ggmoe.serve import structured
from ggmoe.serve.errors import APIError

NAMES = {"get_weather", "search"}


@pytest.mark.parametrize("family,text,content", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Let me check."),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
               '<tool_call>{"name": "search", "arguments": {"q": "rain"}}</tool_call>', None),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', None),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "search", "parameters": '
               '{"q": "rain"}}', None),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', None),
    ("gpt-oss", '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>', None),
])
def test_each_family_parses_its_calls(family, text, content):
    parsed = structured.parse_tool_calls(family, text, NAMES)
    assert parsed.tool_calls, text
    first = parsed.tool_calls[0]
    assert first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"]["name"] == "get_weather"
    assert json.loads(first["function"]["arguments"]) == {"city": "Oslo"}
    assert parsed.content == content
    if "search" in text:
        assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "search"]


@pytest.mark.parametrize("family,text", [
    ("hermes", "The weather is fine."),
    ("llama3", "{\"answer\": 42}"),
    ("mistral", "no calls here"),
])
def test_text_without_a_valid_call_stays_content(family, text):
    parsed = structured.parse_tool_calls(family, text, NAMES)
    assert parsed.tool_calls == [] and parsed.content == text


@pytest.mark.parametrize("text,content", [
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '{"name": "rm_rf", "arguments": {}}'),
    ("<tool_call>{not json</tool_call>", "{not json"),
    ("Let me look. <tool_call>\n{\"name\": \"get_wea", "Let me look. "),  # cut off inside a call
    ("Sure.</tool", "Sure."),
    ("Sure. <tool_ca", "Sure. "),
])
def test_markup_never_reaches_the_content(text, content):
    parsed = structured.parse_tool_calls("hermes", text, NAMES)
    assert parsed.tool_calls == [] and parsed.content == content


def test_a_call_cut_off_in_its_close_tag_leaves_no_partial_tag():
    """serve-dropin on the tools fixture: the generation stopped inside the close tag, and ``</tool`` stayed."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool'
    parsed = structured.parse_tool_calls("hermes", text, NAMES)
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather"] and parsed.content is None
    parsed = structured.parse_tool_calls("hermes", "Checking.\n" + text, NAMES)
    assert parsed.content == "Checking."


def test_parallel_tool_calls_gives_every_call_or_the_first():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
            '<tool_call>{"name": "search", "arguments": {"q": "rain"}}</tool_call>')
    assert len(structured.parse_tool_calls("hermes", text, NAMES, parallel=True).tool_calls) == 2
    assert len(structured.parse_tool_calls("hermes", text, NAMES, parallel=False).tool_calls) == 1


@pytest.mark.parametrize("template,family", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}<tool_call>", "hermes"),
    ("<|start_header_id|>ipython<|end_header_id|>{{ tools }}<|python_tag|>", "llama3"),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
    ("<|start|>assistant<|channel|>commentary to=functions.{{ name }}", "gpt-oss"),
    (None, "hermes"),
])
def test_families_are_recognised_from_the_template(template, family):
    assert structured.family_of(template) == family


def test_a_stream_holds_back_what_may_become_a_call():
    assert structured.safe_prefix("hermes", "Hello there") == len("Hello there")
    assert structured.safe_prefix("hermes", "Hello <tool") == len("Hello ")
    assert structured.safe_prefix("hermes", "Hi <tool_call>{") == len("Hi ")
    assert structured.safe_prefix("hermes", "Hi </tool") == len("Hi ")
    assert structured.safe_prefix("hermes", "Hi <") == len("Hi ")
    assert structured.safe_prefix("llama3", ' {"na') == 0
    assert structured.safe_prefix("llama3", "Sunny") == len("Sunny")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("family", structured.FAMILIES)
def test_tool_grammars_are_valid_gbnf(family, parallel):
    text = structured.tool_grammar(family, TOOLS, parallel)
    assert "root ::=" in text
    llama_cpp.LlamaGrammar.from_string(text, verbose=False)  # the Python side; the server trial-parses too


def test_strict_schemas_admit_no_extra_properties_and_bad_ones_are_refused():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert structured._strict(schema)["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is left alone
    with pytest.raises(APIError) as e:
        structured.schema_grammar({"$ref": "https://example.com/schema.json"}, strict=True)
    assert e.value.status == 400
    assert structured.schema_grammar({"$ref": "https://example.com/schema.json"}, strict=False) \
        == structured.json_object_grammar()
    with pytest.raises(APIError) as e:  # json_object with a schema: an invalid one is refused, never ignored
        structured.schema_grammar({"$ref": "https://example.com/schema.json"}, strict=False, refuse=True)
    assert e.value.status == 400


@pytest.mark.parametrize("family", structured.FAMILIES)
def test_tool_grammars_leave_no_free_whitespace(family):
    grammar = structured.tool_grammar(family, TOOLS)
    assert 'space ::= ""' in grammar and '" "?' not in grammar


def test_a_forced_call_is_compact_json_in_few_tokens():
    """On the embedded model, a forced call of one tool with a bounded argument: its fixed start goes in as
    prompt, its end is added, and the grammar leaves no token to spend on spaces, so the call takes at most
    16 tokens (the whole call spelled by the model took over 48)."""
    import ggmoe

    head, rest, tail = structured.forced_call("hermes", TOOLS[0])
    assert (head, tail) == ('<tool_call>\n{"name":"get_weather","arguments":', "}\n</tool_call>")
    with ggmoe.load(n_ctx=256) as llm:
        prompt = llm.tokenize(b"User: the weather in Oslo?\nAssistant:") + llm.tokenize(head.encode(), add_bos=False)
        out = llm.create_completion(prompt, max_tokens=16, temperature=0,
                                    grammar=llama_cpp.LlamaGrammar.from_string(rest, verbose=False))
    text = out["choices"][0]["text"]
    assert text in ('{"city":"Oslo"}', '{"city":"Paris"}'), text
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] <= 16
    parsed = structured.parse_tool_calls("hermes", head + text + tail, NAMES)
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("family", structured.FAMILIES)
def test_forced_call_rests_are_valid_gbnf_and_parse_back(family):
    head, rest, tail = structured.forced_call(family, TOOLS[1])
    llama_cpp.LlamaGrammar.from_string(rest, verbose=False)
    parsed = structured.parse_tool_calls(family, head + '{"q":"rain"}' + tail, NAMES)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] \
        == [("search", {"q": "rain"})]
