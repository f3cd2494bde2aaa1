"""Test support: the timeline page in headless Chromium (the Debian package `chromium`), as a screenshot and as the
DOM after its script drew it. The page marks what it drew on <body>: data-drawn="1", data-instances (the instance
ids of its rows, space-separated), data-prefill-spans, data-decode-spans, data-requests, and on a live page
data-updates (the polls that came back and redrew)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
MISSING = (
    "headless Chromium is not installed: the Debian package `chromium` (`apt-get install -y chromium`; "
    "`make install` installs it where apt-get is available)"
)


def chromium() -> str:
    """The browser's path (RuntimeError naming the package when there is none)."""
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    raise RuntimeError(MISSING)


def run_chromium(
    url: str,
    screenshot: Path | None = None,
    size: tuple[int, int] = (1400, 900),
    budget_ms: int = 3000,
    timeout_s: float = 60.0,
) -> str:
    """Load `url` headless, let its scripts run `budget_ms` of virtual time, and return the DOM (with a PNG of the
    window at `screenshot`, when given)."""
    outputs = ["--dump-dom"] + ([f"--screenshot={screenshot}"] if screenshot is not None else [])
    dom = ""
    with tempfile.TemporaryDirectory(prefix="spindle-chromium-") as profile:
        for output in outputs:  # one run per output: --dump-dom and --screenshot do not go together
            cmd = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                   f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
                   f"--virtual-time-budget={budget_ms}", output, url]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"chromium exited {done.returncode}: {done.stderr[-2000:]}")
            if output == "--dump-dom":
                dom = done.stdout
    return dom


class _Body(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.attrs: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "body" and not self.attrs:
            self.attrs = {k: v or "" for k, v in attrs}


def drawn(dom: str) -> dict[str, str]:
    """What the page says it drew: <body>'s data-* attributes, without the prefix."""
    parser = _Body()
    parser.feed(dom)
    return {k.removeprefix("data-"): v for k, v in parser.attrs.items() if k.startswith("data-")}


def png_facts(path: Path) -> tuple[int, int, int]:
    """(width, height, distinct colours) of a PNG (Pillow, which the dev requirements carry)."""
    from PIL import Image

    with Image.open(path) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
        return image.width, image.height, len(colours) if colours is not None else 1 << 20
