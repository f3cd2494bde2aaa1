"""`/dashboard` on a real stack (1 prefill + 1 decode instance, the default strategy): a few completions, then the
page in headless Chromium. The screenshot is checked (size, not one colour) and the DOM the page's script drew
names every instance of the stack, prefill chunks and decode batches. Then an elastic stack (LoongServe), whose
spans come from its iterations (the scheduler's Decision per iteration, the group's IterationDone)."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import httpx
import pytest

from spindle_telemetry.timeline import decode_json
from spindle_telemetry.timeline.browser import drawn, png_facts, run_chromium

from .conftest import start_stack, wait_until, write_assumed_profile

pytestmark = pytest.mark.slow


@pytest.fixture
def small_stack(tmp_path_factory):
    s = start_stack(tmp_path_factory, "dashboard", prefill=1, decode=1)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def elastic_stack(tmp_path_factory):
    batch = {"1": {"coeffs": [0.05, 2e-4, 1e-8], "fit_error": 0.0}}  # as test_loongserve_stack.py
    decode = [{"tp": 1, "kvp": 1, "coeffs": [0.04, 0.01, 1.6e-05], "fit_error": 0.0}]
    profile = write_assumed_profile(tmp_path_factory.mktemp("dashboard-profile"), batch, decode, 1.5e9)
    strategy = "loongserve:max_dop=1,migrate=0"
    s = start_stack(tmp_path_factory, "dashboard-elastic", prefill=0, decode=0, elastic=2, strategy=strategy,
                    profile=profile)  # fmt: skip
    try:
        yield s
    finally:
        s.stop()


def _complete(stack, i: int) -> int:
    body = {"model": "smollm2", "prompt": list(range(100 + i, 400 + 37 * i)), "max_tokens": 12, "ignore_eos": True}
    return httpx.post(stack.base_url + "/completions", json=body, timeout=120).status_code


def _window(stack):
    return decode_json(httpx.get(stack.url + "/v1/spindle/timeline", timeout=10).content)


def _heard(stack, kinds: set[str]):
    """The timeline once every instance's heartbeat and spans of `kinds` are in it."""
    expected = set(stack.config.instance_ids())

    def complete() -> bool:
        t = _window(stack)
        return kinds <= {s.kind for s in t.spans} and expected <= {i.id for i in t.instances}

    assert wait_until(complete, timeout=10, interval=0.2), _window(stack)
    return _window(stack)


def test_the_dashboard_draws_the_live_stack(small_stack, tmp_path: Path) -> None:
    stack = small_stack
    with cf.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda i: _complete(stack, i), range(4))) == [200] * 4
    expected = set(stack.config.instance_ids())
    t = _heard(stack, {"prefill", "decode", "transfer"})
    assert len({r for s in t.spans if s.kind == "prefill" for r in s.requests}) == 4
    assert len(t.decisions) == 4 and all(d.text.startswith("whole prompt (") for d in t.decisions)

    png = tmp_path / "dashboard_live.png"
    marks = drawn(run_chromium(stack.url + "/dashboard", screenshot=png, budget_ms=2500))
    assert marks["drawn"] == "1" and set(marks["instances"].split()) == expected
    assert int(marks["prefill-spans"]) >= 1 and int(marks["decode-spans"]) >= 1 and int(marks["requests"]) == 4
    assert int(marks.get("updates", 0)) >= 1  # the page polled the live window and redrew
    width, height, colours = png_facts(png)
    assert (width, height) == (1400, 900) and colours > 20
    assert png.stat().st_size > 10_000
    print(f"\n[dashboard] screenshot of the live stack: {png}")


def test_an_elastic_stack_is_drawn_from_its_iterations(elastic_stack, tmp_path: Path) -> None:
    stack = elastic_stack
    with cf.ThreadPoolExecutor(3) as pool:
        assert list(pool.map(lambda i: _complete(stack, i), range(3))) == [200] * 3
    t = _heard(stack, {"prefill", "decode"})
    iterations = [s for s in t.spans if s.label.startswith("iteration ")]
    assert {s.kind for s in iterations} == {"prefill", "decode"} and {s.instance for s in iterations} <= {
        "elastic-0", "elastic-1"}  # fmt: skip
    assert len({r for s in t.spans if s.kind == "prefill" for r in s.requests}) == 3
    assert len(t.decisions) == 3 and all(d.text.startswith("iteration ") for d in t.decisions)
    png = tmp_path / "dashboard_elastic.png"
    marks = drawn(run_chromium(stack.url + "/dashboard", screenshot=png, budget_ms=2500))
    assert set(marks["instances"].split()) == set(stack.config.instance_ids()) and int(marks["requests"]) == 3
    assert png_facts(png)[2] > 20
    print(f"\n[dashboard] screenshot of the elastic stack: {png}")
