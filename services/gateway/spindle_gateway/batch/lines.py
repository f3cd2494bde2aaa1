"""A batch's input file, checked as OpenAI checks it before a batch starts: JSONL, one request per line
(`{"custom_id", "method": "POST", "url": <the batch's endpoint>, "body": {...}}`), custom ids unique, at most
`max_lines` lines. A file that fails any of these fails the batch with every problem found (up to a bound), each
naming its line; what is wrong *inside* a body is the line's own error, found when it runs, in the error file."""

from __future__ import annotations

import json
from typing import Any

from .store import Line

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_REPORTED = 20  # problems listed in a failed batch's `errors`


def problem(code: str, message: str, line: int | None = None, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_input(content: bytes, endpoint: str, max_lines: int) -> tuple[list[Line], list[dict[str, Any]]]:
    """(lines, problems): the requests of a batch input file, or what is wrong with it (lines numbered from 1)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return [], [problem("invalid_file", "the input file is not UTF-8 text")]
    rows = [(n, s) for n, s in enumerate(text.splitlines(), start=1) if s.strip()]
    if not rows:
        return [], [problem("empty_file", "the input file has no requests")]
    if len(rows) > max_lines:
        return [], [problem("too_many_lines", f"the input file has {len(rows)} requests; at most {max_lines} are "
                            "accepted per batch")]  # fmt: skip
    lines: list[Line] = []
    problems: list[dict[str, Any]] = []
    seen: set[str] = set()
    for n, s in rows:
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            problems.append(problem("invalid_json_line", f"line {n} is not valid JSON: {e.msg}", n))
            continue
        if not isinstance(obj, dict):
            problems.append(problem("invalid_json_line", f"line {n} is not a JSON object", n))
            continue
        custom_id, method, url, body = obj.get("custom_id"), obj.get("method"), obj.get("url"), obj.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            problems.append(problem("missing_required_parameter", f"line {n} has no custom_id string", n, "custom_id"))
        elif custom_id in seen:
            problems.append(problem("duplicate_custom_id", f"line {n} repeats custom_id {custom_id!r}", n, "custom_id"))
        if method != "POST":
            problems.append(problem("invalid_method", f"line {n}: method must be POST, got {method!r}", n, "method"))
        if url != endpoint:
            problems.append(problem("invalid_url", f"line {n}: url must be the batch's endpoint {endpoint}, got "
                                    f"{url!r}", n, "url"))  # fmt: skip
        if not isinstance(body, dict):
            problems.append(problem("missing_required_parameter", f"line {n} has no body object", n, "body"))
        if not problems or problems[-1]["line"] != n:
            seen.add(custom_id)  # type: ignore[arg-type]
            lines.append(Line(n, custom_id, {"method": method, "url": url, "body": body}))  # type: ignore[arg-type]
    if problems:
        return [], problems[:MAX_REPORTED]
    return lines, []
