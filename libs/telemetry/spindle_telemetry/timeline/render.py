"""`render_html`: a timeline as ONE self-contained HTML page (inline CSS, vanilla JS drawing SVG; nothing is fetched
but the live URL). Static: the data is embedded. Live: the embedded data draws at once, then the page polls
`live_url` (a JSON Timeline) every second and redraws the window it returns."""

from __future__ import annotations

import html
import re
from functools import cache
from importlib.resources import files

from .model import Timeline, decode_json, encode_json

_DATA_RE = re.compile(r'<script type="application/json" id="timeline-data">(.*?)</script>', re.S)


@cache
def _asset(name: str) -> str:
    return (files(__package__) / name).read_text(encoding="utf-8")


def render_html(timeline: Timeline, live_url: str | None = None) -> str:
    # in JSON, "<" only occurs inside strings, where \u003c means the same: no "</script>" can end the block early
    data = encode_json(timeline).decode().replace("<", "\\u003c")
    page = _asset("page.html")
    for key, value in (
        ("__TITLE__", html.escape(timeline.title or "Spindle timeline")),
        ("__LIVE__", html.escape(live_url or "", quote=True)),
        ("__SCRIPT__", _asset("timeline.js")),
        ("__DATA__", data),
    ):
        page = page.replace(key, value, 1)
    return page


def embedded_timeline(page: str) -> Timeline:
    """The timeline a page rendered by `render_html` carries (ValueError when it carries none)."""
    m = _DATA_RE.search(page)
    if m is None:
        raise ValueError("not a timeline page: no embedded timeline data")
    return decode_json(m.group(1))
