"""Rendering a model's Jinja chat template the way Hugging Face `transformers` does (same environment, same globals).

Chat templates come from model repositories, so they run in jinja2's immutable sandbox.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

_TEMPLATE_FILE = "chat_template.jinja"
_TEMPLATE_DIR = "additional_chat_templates"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson escapes HTML characters, which a prompt must not see.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` in templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes (a way into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed attribute {name!r}")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def load_chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The model's default chat template: chat_template.jinja (or additional_chat_templates/default.jinja) wins
    over tokenizer_config.json's `chat_template` (one template, or a list of named ones of which "default")."""
    if (path / _TEMPLATE_FILE).is_file():
        return _read(path / _TEMPLATE_FILE)
    if (path / _TEMPLATE_DIR / "default.jinja").is_file():
        return _read(path / _TEMPLATE_DIR / "default.jinja")
    value = tokenizer_config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the chat template {path}: {e}") from e


# Names a message's reasoning goes by; templates read the first (transformers fills it and `thinking` from any).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    # As transformers: a copy without None values (templates handle a missing key, not a None one).
    out = {key: value for key, value in message.items() if value is not None}
    reasoning = next((out[key] for key in _REASONING_FIELDS if key in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def render(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool, **variables: Any) -> str:
    """The rendered prompt; ValueError when the template rejects the messages (raise_exception) or fails."""
    messages = [_template_message(m) for m in messages]
    try:
        template = compile_template(source)
        return template.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.TemplateError as e:  # also syntax errors, sandbox violations, undefined-attribute errors
        raise ValueError(f"chat template rejected the messages: {e}") from e
