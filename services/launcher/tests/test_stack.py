"""Stack and `spindle up` supervision with stand-in services (sleepers, a stand-in scheduler and gateway)."""

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

from spindle_launcher.plan import ServiceSpec, StackConfig
from spindle_launcher.stack import Stack, StackError

STAND_INS = str(Path(__file__).with_name("stand_ins.py"))


def test_stack_ready_then_child_death(stand_ins: ModuleType) -> None:
    lines: list[str] = []
    stack = Stack(
        StackConfig(prefill=2, decode=1, port=0, ready_timeout=30, restart=None),  # any death stops it
        echo=lines.append,
        plan=stand_ins.stand_in_plan,
        prepare_model=False,
    )
    with stack:
        assert set(stack.processes) == {
            "nats",
            "kvstore-0",
            "scheduler",
            "prefill-0",
            "prefill-1",
            "decode-0",
            "gateway",
        }
        assert stack.base_url == stack.url + "/v1" and stack.nats_url.startswith("nats://127.0.0.1:")
        with urllib.request.urlopen(stack.url + "/health", timeout=5) as r:
            assert r.status == 200
        assert stack.dead() is None
        stack.processes["decode-0"].kill()
        assert stack.wait() == ("decode-0", -signal.SIGKILL)
    assert all(p.poll() is not None for p in stack.processes.values())
    assert any(line.startswith("waiting for") for line in lines)


def test_not_ready_names_what_is_missing(stand_ins: ModuleType) -> None:
    plan = functools.partial(stand_ins.stand_in_plan, live=["kvstore-0", "prefill-0"])
    stack = Stack(StackConfig(prefill=1, decode=1, port=0, ready_timeout=2), plan=plan, prepare_model=False)
    with pytest.raises(StackError, match="not ready after 2 s: waiting for decode-0"):
        stack.start()
    assert all(p.poll() is not None for p in stack.processes.values())


def test_child_death_during_start(stand_ins: ModuleType, tmp_path: Path) -> None:
    def plan(config, runtime):
        # decode-0 never registers, so the stack cannot be ready before the crasher's exit is seen (on a loaded
        # machine the interpreter may take longer to exit than the other stand-ins take to come up)
        specs = stand_ins.stand_in_plan(config, runtime, live=["kvstore-0", "prefill-0"])
        return [*specs, type(specs[0])("crasher", (sys.executable, "-c", "raise SystemExit(7)"), {})]

    stack = Stack(StackConfig(prefill=1, decode=1, port=0, log_dir=str(tmp_path)), plan=plan, prepare_model=False)
    with pytest.raises(StackError, match=r"crasher exit code 7 before the stack was ready \(log: .*crasher.log\)"):
        stack.start()
    assert all(p.poll() is not None for p in stack.processes.values())


def start_launcher(*flags: str) -> tuple[subprocess.Popen, dict[str, int], list[str]]:
    """`spindle up` (stand-in plan) in a subprocess; returns it, its children's pids and its output so far."""
    proc = subprocess.Popen(
        [sys.executable, STAND_INS, "launcher", "--port", "0", "--prefill", "1", "--decode", "1", *flags],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    out: list[str] = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("PIDS "):
            return proc, json.loads(line[5:]), out
    proc.wait()
    raise AssertionError("launcher did not come up:\n" + "".join(out))


@pytest.mark.parametrize("how", ["child dies", "SIGTERM", "SIGINT", "SIGKILL"])
def test_launcher_process(how: str, stand_ins: ModuleType) -> None:
    proc, pids, out = start_launcher(*(["--no-restart"] if how == "child dies" else []))
    try:
        assert set(pids) == {"nats", "kvstore-0", "scheduler", "prefill-0", "decode-0", "gateway"}
        if how == "child dies":
            os.kill(pids["prefill-0"], signal.SIGKILL)
        else:
            proc.send_signal(getattr(signal, how))
        rest, _ = proc.communicate(timeout=20)
        out.append(rest)
        text = "".join(out)
        assert "Spindle is up: http://127.0.0.1:" in text
        if how == "child dies":
            assert proc.returncode == 1
            assert "prefill-0 exited unexpectedly (killed by SIGKILL); stopping the stack" in text
        elif how == "SIGKILL":
            assert proc.returncode == -signal.SIGKILL
        else:
            assert proc.returncode == 0, text
        assert stand_ins.wait_gone(list(pids.values()), 10.0) == []
    finally:
        proc.kill()
        proc.wait()
        for pid in pids.values():
            if stand_ins.alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_dry_run_and_bad_flags() -> None:
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=30)
    r = run([sys.executable, "-m", "spindle_launcher", "up", "--dry-run", "--prefill", "1", "--nats-port", "4999"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    names = ["rendezvous", "kvstore-0", "scheduler", "prefill-0", "decode-0", "gateway"]
    assert [line.split(":")[0] for line in lines] == names
    assert "--world-size 11" in lines[1] and "mesh://127.0.0.1:29500" in lines[1]  # 3 ranks + 8 spare
    assert "nats://127.0.0.1:4999" in lines[-1]
    r = run([sys.executable, "-m", "spindle_launcher", "up", "--decode", "0"])
    assert r.returncode == 2 and "need at least one decode instance" in r.stderr


def test_a_kvp_followers_exit_does_not_stop_the_stack(stand_ins: ModuleType) -> None:
    def plan(config, runtime):
        specs = stand_ins.stand_in_plan(config, runtime)
        return [*specs, ServiceSpec("decode-0-kvp1", stand_ins.SLEEPER, {}, survivable=True)]

    lines: list[str] = []
    config = StackConfig(prefill=1, decode=1, port=0, ready_timeout=30, restart=None)
    stack = Stack(config, echo=lines.append, plan=plan, prepare_model=False)
    with stack:
        stack.processes["decode-0-kvp1"].kill()
        stack.processes["decode-0-kvp1"].wait()
        assert stack.dead() is None and stack.dead() is None
        assert sum("decode-0-kvp1 exited" in line for line in lines) == 1
        stack.processes["decode-0"].kill()
        assert stack.wait() == ("decode-0", -signal.SIGKILL)


def test_dead_children_restart_and_nats_comes_back_on_its_port(stand_ins: ModuleType) -> None:
    lines: list[str] = []
    stack = Stack(StackConfig(prefill=1, decode=1, port=0, ready_timeout=30), echo=lines.append,
                  plan=stand_ins.stand_in_plan, prepare_model=False)  # fmt: skip
    with stack:
        supervisor = threading.Thread(target=stack.wait, daemon=True)
        supervisor.start()
        first = stack.processes["decode-0"]
        first.kill()
        assert stand_ins.until(lambda: stack.processes["decode-0"] is not first and first.poll() is not None)
        assert stack.processes["decode-0"].poll() is None and sum(stack.restarts.values()) == 1
        nats_url, nats = stack.nats_url, stack.processes["nats"]
        nats.kill()
        assert stand_ins.until(lambda: stack.processes["nats"] is not nats, 20)
        assert stack.nats_url == nats_url and stack.restarts["nats"] == 1
        with urllib.request.urlopen(stack.url + "/health", timeout=5) as r:
            assert r.status == 200  # the stand-in scheduler reconnected to the new nats-server
    supervisor.join(10)
    assert not supervisor.is_alive() and all(p.poll() is not None for p in stack.processes.values())
    assert any("restarting decode-0 in 0.5 s" in line for line in lines), lines
