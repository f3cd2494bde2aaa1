"""Grammars for constrained decoding, without torch: what a request's `(kind, source)` means to llguidance and
whether it is valid. The gateway checks a request's grammar here (a 400 before anything runs); the engine
(`spindle_engine.grammar`) compiles the same grammar against the tokenizer and masks the logits with it."""

from __future__ import annotations

import json

import llguidance

GRAMMAR_KINDS = ("json_schema", "regex")


def llguidance_grammar(kind: str, source: str) -> str:
    """`source` as an llguidance grammar. JSON is compact (no whitespace between tokens beyond what JSON needs), so
    a model cannot wander into runs of whitespace."""
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(source, defaults={"whitespace_flexible": False})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}")


def check_grammar(kind: str, source: str) -> None:
    """ValueError naming the problem when `source` is not a valid grammar of `kind` (no tokenizer needed)."""
    if kind == "json_schema":
        try:
            json.loads(source)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    try:
        error = llguidance.LLMatcher.validate_grammar(llguidance_grammar(kind, source))
    except ValueError:
        raise
    except Exception as e:  # llguidance raises for sources it cannot even parse
        raise ValueError(f"invalid {kind}: {e}") from None
    if error:
        raise ValueError(f"invalid {kind}: {error}")
