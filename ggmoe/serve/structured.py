"""Structured output: grammars from JSON schemas, and tool calls rendered, forced and parsed back.

Grammars come from llama-cpp-python's JSON-schema converter (``llama_cpp.llama_grammar``, the port of
llama.cpp's ``json_schema_to_grammar``). Tool calls follow the format the model's chat template defines;
the family is recognised from the template text:

| family | what the model writes |
|---|---|
| ``hermes`` (Qwen, Hermes, ggmoe's default template) | ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` |
| ``llama3`` | ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``) |
| ``mistral`` | ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`` or ``[TOOL_CALLS]name[ARGS]{...}`` |
| ``gpt-oss`` | ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`` |

``tool_choice`` ``required`` or a named tool forces one call with a grammar in that format; ``auto`` lets the
model choose and parses what it wrote; ``none`` neither offers the tools' grammar nor parses.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from llama_cpp.llama_grammar import JSON_GBNF, SchemaConverter, json_schema_to_gbnf

from ggmoe.serve.errors import APIError

FAMILIES = ("hermes", "llama3", "mistral", "gpt-oss")

# What ggmoe tells a model whose template does not render tools itself (hermes format).
TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query. The functions are described here:\n"
    "{tools}\n"
    "To call a function, answer with a JSON object with its name and arguments inside <tool_call></tool_call> "
    "tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def family_of(template: str | None) -> str:
    """The tool-call format a chat template defines (hermes when it defines none)."""
    t = template or ""
    if "to=functions" in t or "<|channel|>" in t:
        return "gpt-oss"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "tools" in t):
        return "llama3"
    return "hermes"


def template_renders_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    return TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t["function"]) for t in tools))


# -- grammars
def _converter() -> SchemaConverter:
    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _strict(schema: Any) -> Any:
    """OpenAI's strict mode: objects admit no properties beyond the listed ones unless they say so."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _rules(schema: dict[str, Any], name: str, param: str, compact: bool = False) -> str:
    """GBNF rules for ``schema`` with its top rule called ``name`` (400 when the converter cannot); ``compact``:
    JSON without any space between its tokens (the converter's ``space`` rule allows one everywhere)."""
    conv = _converter()
    try:
        resolved = conv.resolve_refs(copy.deepcopy(schema), "request")
        conv.visit(resolved, name)
        if compact:
            conv._rules["space"] = '""'  # the converter's own table; no API sets it
        return conv.format_grammar()
    except Exception as e:  # the converter raises ValueError, KeyError, AssertionError... on what it lacks
        raise APIError(400, f"{param}: the JSON schema cannot be turned into a grammar: {e!r}", param=param,
                       code="invalid_value") from e


def schema_grammar(schema: dict[str, Any], strict: bool | None, param: str = "response_format",
                   refuse: bool = False) -> str:
    """GBNF for JSON that follows ``schema``; a schema the converter lacks parts of falls back to any JSON
    object unless ``strict`` or ``refuse``, which then refuse it (400)."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: the schema must be a JSON object", param=param, code="invalid_value")
    try:
        return json_schema_to_gbnf(json.dumps(_strict(schema) if strict else schema))
    except Exception as e:
        if strict or refuse:
            why = "strict mode needs" if strict else "the schema must be"
            raise APIError(400, f"{param}: {why} a schema llama.cpp's converter supports: {e!r}",
                           param=param, code="invalid_value") from e
        return JSON_GBNF


def json_object_grammar() -> str:
    return JSON_GBNF


def _args_schema(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters") or {"type": "object", "properties": {}}
    return _strict(params) if tool["function"].get("strict") else params


def _lit(s: str) -> str:
    return json.dumps(s)  # a GBNF string literal: the same escapes as JSON


def tool_grammar(family: str, tools: list[dict[str, Any]], parallel: bool = False) -> str:
    """GBNF forcing one call of one of ``tools`` in the family's format (one or more when ``parallel``), its JSON
    in the compact form (no free whitespace: a forced call takes the fewest tokens)."""
    more = "+" if parallel else ""
    if family == "gpt-oss":
        alts = []
        rules = []
        for i, t in enumerate(tools):
            rules.append(_rules(_args_schema(t), f"args{i}", "tools", compact=True))
            alts.append(f"{_lit('<|channel|>commentary to=functions.' + t['function']['name'])} "
                        f"{_lit(' <|constrain|>json<|message|>')} args{i} {_lit('<|call|>') if parallel else ''}")
        return "\n".join(rules) + "\none ::= " + " | ".join(alts) + f"\nroot ::= one{more}\n"
    args_key = "parameters" if family == "llama3" else "arguments"
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               args_key: _args_schema(t)},
              "required": ["name", args_key], "additionalProperties": False} for t in tools]
    body = _rules(calls[0] if len(calls) == 1 else {"anyOf": calls}, "call", "tools", compact=True)
    if family == "hermes":
        block = f"{_lit('<tool_call>' + chr(10))} call {_lit(chr(10) + '</tool_call>')}"
        root = f"root ::= {block} ({_lit(chr(10))} {block})*" if parallel else f"root ::= {block}"
    elif family == "mistral":
        tail = f" ({_lit(', ')} call)*" if parallel else ""
        root = f"root ::= {_lit('[TOOL_CALLS] [')} call{tail} {_lit(']')}"
    else:
        root = f"root ::= call ({_lit('; ')} call)*" if parallel else "root ::= call"
    return body + "\n" + root + "\n"


def forced_call(family: str, tool: dict[str, Any]) -> tuple[str, str, str]:
    """One forced call of one tool: the text every such call starts with, up to its arguments, which is given
    to the model after the prompt; the GBNF of the arguments, compact; and the text that closes the call,
    added once the arguments are complete. A grammar constrains characters, not tokens: a model may spell
    a forced name or tag in many small tokens, so only the arguments are sampled."""
    name = tool["function"]["name"]
    args = _rules(_args_schema(tool), "args", "tools", compact=True).rstrip("\n") + "\nroot ::= args\n"
    if family == "gpt-oss":
        return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", args, ""
    head = '{"name":' + json.dumps(name) + ',"' + ("parameters" if family == "llama3" else "arguments") + '":'
    if family == "hermes":
        return "<tool_call>\n" + head, args, "}\n</tool_call>"
    if family == "mistral":
        return "[TOOL_CALLS] [" + head, args, "}]"
    return head, args, "}"


# -- parsing
@dataclass(frozen=True)
class Parsed:
    content: str | None
    tool_calls: list[dict[str, Any]]


def _call(name: Any, args: Any) -> dict[str, Any] | None:
    if not isinstance(name, str) or not name:
        return None
    if args is None:
        args = {}
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": text}}


def _objects(text: str, start: int) -> tuple[list[Any], int]:
    """JSON values one after another from ``text[start:]`` (separated by whitespace, commas or ';')."""
    dec = json.JSONDecoder()
    out: list[Any] = []
    i = start
    while True:
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i >= len(text) or text[i] not in "{[":
            return out, i
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return out, i
        out.append(value)


def _parse_hermes(text: str) -> tuple[list[dict[str, Any]], str]:
    calls: list[dict[str, Any]] = []
    pieces = []
    pos = 0
    for m in re.finditer(r"<tool_call>", text):
        if m.start() < pos:
            continue
        values, end = _objects(text, m.end())
        close = text.find("</tool_call>", end)
        got = [c for v in values if isinstance(v, dict)
               for c in [_call(v.get("name"), v.get("arguments", v.get("parameters")))] if c]
        if not got:
            continue
        calls += got
        pieces.append(text[pos:m.start()])
        pos = close + len("</tool_call>") if close >= 0 else end
    pieces.append(text[pos:])
    return calls, "".join(pieces) if calls else text


def _parse_llama3(text: str) -> tuple[list[dict[str, Any]], str]:
    stripped = text.replace("<|python_tag|>", "").lstrip()
    if not stripped.startswith("{"):
        return [], text
    values, end = _objects(stripped, 0)
    calls = [c for v in values if isinstance(v, dict)
             for c in [_call(v.get("name"), v.get("parameters", v.get("arguments")))] if c]
    return calls, stripped[end:] if calls else text


def _parse_mistral(text: str) -> tuple[list[dict[str, Any]], str]:
    i = text.find("[TOOL_CALLS]")
    if i < 0:
        return [], text
    calls: list[dict[str, Any]] = []
    rest = text[i + len("[TOOL_CALLS]"):]
    values, _ = _objects(rest, 0)
    for v in values:
        for item in v if isinstance(v, list) else [v]:
            c = _call(item.get("name"), item.get("arguments")) if isinstance(item, dict) else None
            if c:
                calls.append(c)
    for m in re.finditer(r"([A-Za-z0-9_.\-]+)\[ARGS\]", rest):
        values, _ = _objects(rest, m.end())
        c = _call(m.group(1), values[0]) if values else None
        if c:
            calls.append(c)
    return calls, text[:i] if calls else text


def _parse_gpt_oss(text: str) -> tuple[list[dict[str, Any]], str]:
    calls: list[dict[str, Any]] = []
    for m in re.finditer(r"to=functions\.([A-Za-z0-9_.\-]+)[^<]*(?:<\|constrain\|>\w*)?<\|message\|>", text):
        values, _ = _objects(text, m.end())
        c = _call(m.group(1), values[0]) if values else None
        if c:
            calls.append(c)
    final = re.search(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|end\|>|<\|return\|>|$)", text, re.S)
    return calls, (final.group(1) if final else "") if calls else text


_PARSERS = {"hermes": _parse_hermes, "llama3": _parse_llama3, "mistral": _parse_mistral, "gpt-oss": _parse_gpt_oss}


def parse_tool_calls(family: str, text: str, names: set[str], parallel: bool = True) -> Parsed:
    """The tool calls the model wrote in ``text`` (the first only unless ``parallel``) and the content around
    them, the family's markup removed from it (partial markers included); no calls: the text so cleaned.

    Only calls to tools in ``names`` count.
    """
    calls, content = _PARSERS[family](text)
    calls = [c for c in calls if c["function"]["name"] in names]
    if not calls:
        return Parsed(strip_markup(family, text), [])
    content = strip_markup(family, content).strip()
    return Parsed(content or None, calls if parallel else calls[:1])


MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "mistral": ("[TOOL_CALLS]", "[ARGS]"),
           "gpt-oss": ("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"), "llama3": ("<|python_tag|>",)}


def _partial_tail(text: str, markers: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that begin one of ``markers`` (two at least; 0: none)."""
    best = 0
    for marker in markers:
        for k in range(len(marker) - 1, 1, -1):
            if k > best and text.endswith(marker[:k]):
                best = k
    return best


def strip_markup(family: str, text: str) -> str:
    """Content with the family's tool-call markup removed: whole markers, an unclosed hermes call that did not
    parse (to the end) and a marker cut off at the end (``</tool`` when the generation stopped inside it)."""
    markers = MARKERS[family]
    if family == "hermes":
        i = text.rfind("<tool_call>")
        if i >= 0 and "</tool_call>" not in text[i:]:
            text = text[:i]
    for marker in markers:
        text = text.replace(marker, "")
    cut = _partial_tail(text, markers)
    return text[:len(text) - cut] if cut else text


def safe_prefix(family: str, text: str) -> int:
    """How much of ``text`` (what a stream generated so far) is surely content, not the start of a tool call:
    a stream sends that much and holds the rest back until the end."""
    if family == "hermes":
        found = [i for i in (text.find(m) for m in MARKERS["hermes"]) if i >= 0]
        if found:
            return min(found)
        cut = _partial_tail(text, MARKERS["hermes"])
        if not cut and text.endswith("<"):
            cut = 1
        return len(text) - cut
    s = text.lstrip()
    marker = {"mistral": "[TOOL_CALLS]", "gpt-oss": "<|channel|>", "llama3": "{"}[family]
    if family == "llama3" and (s.startswith("<|python_tag|>") or "<|python_tag|>".startswith(s)):
        return 0
    if marker in text or marker.startswith(s) or s.startswith(marker):
        return 0
    return len(text)
