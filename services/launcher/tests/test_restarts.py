"""Restarts: the back-off and crash-loop rule, and the Restarter on real child processes (python sleepers)."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import replace
from types import ModuleType

import pytest

from spindle_launcher.plan import ServiceSpec
from spindle_launcher.recovery import Restarter
from spindle_launcher.restarts import DEFAULT_RESTART, RestartPolicy, UnitHistory
from spindle_launcher.supervisor import Supervisor

SLEEP = "import time; time.sleep(1e9)"


def test_backoff_doubles_within_the_window_and_a_crash_loop_gives_up() -> None:
    policy = RestartPolicy(backoff_s=0.5, backoff_max_s=3.0, max_restarts=4, window_s=60.0)
    h = UnitHistory()
    delays = []
    for t in (0.0, 1.0, 2.0, 3.0):
        delays.append(h.delay(policy, t))
        h.restarts.append(t)
    assert delays == [0.5, 1.0, 2.0, 3.0]  # capped at backoff_max_s
    assert h.delay(policy, 4.0) is None  # the 5th death within the window: a crash loop
    assert h.delay(policy, 61.5) == 2.0  # older restarts age out of the window (t=2 and t=3 still count)


@pytest.mark.parametrize(
    "bad",
    [dict(backoff_s=-1), dict(backoff_s=5, backoff_max_s=1), dict(max_restarts=-1), dict(window_s=0)],
)
def test_policy_rejects_nonsense(bad: dict) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**bad)


def _sleeper(name: str, unit: str = "", survivable: bool = False) -> ServiceSpec:
    return ServiceSpec(name, (sys.executable, "-c", SLEEP), {}, survivable=survivable, unit=unit)


def _round_until(restarter: Restarter, done, timeout: float = 10.0) -> tuple[str, int] | None:
    """Run rounds until one says the stack stops (its answer) or `done()` (None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (stops := restarter.round()) is not None:
            return stops
        if done():
            return None
        time.sleep(0.02)
    raise AssertionError("neither stopped nor done")


def test_a_dead_member_restarts_its_whole_unit_and_a_crash_loop_stops_only_essentials(stand_ins: ModuleType) -> None:
    sup = Supervisor()
    specs = [_sleeper("decode-0"), _sleeper("decode-0-tp1", unit="decode-0"), _sleeper("gateway")]
    said: list[str] = []
    reports: list[tuple[dict, list]] = []
    policy = replace(DEFAULT_RESTART, backoff_s=0.0, backoff_max_s=0.0, max_restarts=2)
    restarter = Restarter(sup, specs, policy, said.append, lambda r, g: reports.append((r, g)))
    try:
        for s in specs:
            sup.spawn(s)
        leader, gateway = sup.processes["decode-0"], sup.processes["gateway"]
        sup.processes["decode-0-tp1"].send_signal(signal.SIGKILL)  # a follower dies: the leader goes with it
        assert stand_ins.until(lambda: restarter.round() is None and sup.processes["decode-0"] is not leader)
        assert leader.poll() is not None and gateway.poll() is None  # the rest never stopped
        assert all(sup.processes[n].poll() is None for n in ("decode-0", "decode-0-tp1"))
        role = specs[0].role  # a service's is prefill, decode, ...; a sleeper's is its code
        assert restarter.restarts == {role: 1}
        assert reports[-1] == ({role: 1}, [])

        sup.processes["decode-0"].send_signal(signal.SIGKILL)  # second restart: still within the limit
        assert stand_ins.until(lambda: restarter.round() is None and restarter.restarts == {role: 2})
        sup.processes["decode-0"].send_signal(signal.SIGKILL)  # third death in the window: a crash loop
        assert stand_ins.until(lambda: restarter.round() is None and restarter.gave_up == ["decode-0"])
        assert sup.processes["decode-0-tp1"].poll() is not None  # the unit stays down, the stack goes on
        assert gateway.poll() is None and any("crash loop" in s for s in said)

        outcomes = []
        for _ in range(3):  # an essential service in a crash loop stops the stack
            victim = sup.processes["gateway"]
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            outcomes.append(_round_until(restarter, lambda v=victim: sup.processes["gateway"] is not v))
        assert outcomes[:2] == [None, None] and outcomes[2] is not None and outcomes[2][0] == "gateway"
    finally:
        sup.stop()
