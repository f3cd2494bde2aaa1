"""A minimal SSE client for the tests: the events of one streaming response, as parsed JSON (or "[DONE]")."""

from __future__ import annotations

import json
from typing import Any

import httpx


def read_events(response: httpx.Response) -> list[Any]:
    events: list[Any] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        data = line[len("data: ") :]
        events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return events


def stream_text(events: list[Any], chat: bool) -> str:
    parts = []
    for e in events:
        if e == "[DONE]" or "error" in e or not e["choices"]:
            continue
        c = e["choices"][0]
        parts.append((c["delta"].get("content") or "") if chat else c["text"])
    return "".join(parts)
