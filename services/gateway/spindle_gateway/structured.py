"""Structured output: `response_format`, vLLM's `guided_json` / `guided_regex` / `guided_choice`, and `tools` with
`tool_choice`, turned into the one grammar the engine constrains decoding with (spindle_engine.grammar).

Tools: Spindle has no model-specific tool-call parser, and SmolLM2's chat template does not render tools, so it
cannot let the model choose between text and a call (`tool_choice: "auto"`, OpenAI's default when tools are sent):
that is a 400 saying so. `"none"` answers in text (the tools are not shown to the model). `"required"` or a named
function constrains the output to `{"name": <a tool's name>, "arguments": <that tool's parameters>}` (JSON, by the
tools' JSON schemas; an object of parameters takes only the properties it declares unless it says otherwise, as in
OpenAI's strict mode, else a small model invents arguments until max_tokens), which comes back as OpenAI's
`tool_calls` with finish_reason "tool_calls". The model never
sees the tools' descriptions (the template has no place for them): the grammar guarantees the call's shape, not
that the model picked the arguments well.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from spindle_protocol.messages import Grammar
from spindle_tokenizer.grammar import check_grammar

from .errors import bad_request


@dataclass(frozen=True)
class Structure:
    grammar: Grammar | None = None
    tool_call: bool = False  # the output is a call: answer with tool_calls


def _grammar(kind: str, source: str, param: str) -> Grammar:
    try:
        check_grammar(kind, source)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None
    return Grammar(kind, source)


def _schema(schema: Any, param: str) -> Grammar:
    if not isinstance(schema, dict | bool):
        raise bad_request(f"{param} must be a JSON schema (an object)", param)
    return _grammar("json_schema", json.dumps(schema), param)


def _response_format(fmt: dict[str, Any]) -> Grammar | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _grammar("json_schema", '{"type": "object"}', "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            why = "response_format json_schema needs {'json_schema': {'name', 'schema'}}"
            raise bad_request(why, "response_format")
        return _schema(spec["schema"], "response_format")
    raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format")


def _tool_schema(tool: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    fn = tool.get("function") if tool.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request("each tool must be {'type': 'function', 'function': {'name', 'parameters'?}}", "tools")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise bad_request(f"the parameters of tool {fn['name']!r} must be a JSON schema", "tools")
    if params.get("type") == "object" and "additionalProperties" not in params:
        params = {**params, "additionalProperties": False}  # as OpenAI's strict mode: only the declared arguments
    call = {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return fn["name"], call


def _tools(tools: list[dict[str, Any]], choice: str | dict[str, Any] | None) -> Structure:
    if choice == "none":
        return Structure()
    if choice in (None, "auto"):
        raise bad_request(
            "tool_choice 'auto' needs a model whose chat template renders tools and a parser for its calls; this "
            "model has neither. Send tool_choice 'required' or {'type': 'function', 'function': {'name': ...}} for a "
            "call constrained to the tools' schemas, or 'none'",
            "tool_choice",
        )
    calls = dict(_tool_schema(t) for t in tools)
    if choice == "required":
        schemas = list(calls.values())
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in calls:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        schemas = [calls[name]]
    else:
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return Structure(_schema(schema, "tools"), tool_call=True)


def structure(req: Any) -> Structure:
    """The request's grammar (at most one way of asking for one) and whether its output is a tool call."""
    asked = [
        name
        for name in ("response_format", "guided_json", "guided_regex", "guided_choice")
        if getattr(req, name, None) is not None
    ]
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if tools and choice != "none":
        asked.append("tools")
    elif not tools and choice not in (None, "none", "auto"):
        raise bad_request("tool_choice names a tool, but the request has no tools", "tool_choice")
    if len(asked) > 1:
        raise bad_request(f"ask for one output structure, not {' and '.join(asked)}", asked[1])
    if not asked:
        return Structure()
    what = asked[0]
    if what == "tools":
        return _tools(tools, choice)
    if what == "response_format":
        return Structure(_response_format(req.response_format))
    if what == "guided_json":
        value = req.guided_json
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad_request(f"guided_json is not valid JSON: {e}", "guided_json") from None
        return Structure(_schema(value, "guided_json"))
    if what == "guided_regex":
        if not isinstance(req.guided_regex, str):
            raise bad_request("guided_regex must be a string", "guided_regex")
        return Structure(_grammar("regex", req.guided_regex, "guided_regex"))
    options = req.guided_choice
    if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
        raise bad_request("guided_choice must be a non-empty list of non-empty strings", "guided_choice")
    return Structure(_grammar("regex", "|".join(re.escape(o) for o in options), "guided_choice"))


def tool_calls(text: str) -> list[dict[str, Any]] | None:
    """A constrained call's text -> OpenAI's `tool_calls` (None when it is not a whole call: cut by max_tokens)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    function = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}]
