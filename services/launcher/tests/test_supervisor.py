"""Process management with plain `python -c` sleepers: ordered stop, SIGKILL escalation, death signal."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

from spindle_launcher.plan import ServiceSpec
from spindle_launcher.supervisor import Supervisor, describe_exit

# A sleeper that, on SIGTERM, appends its name to a file and exits 0 (or ignores SIGTERM if told to).
SLEEPER = """
import signal, sys, time
name, path, ignore = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
def on_term(*_):
    if not ignore:
        with open(path, "a") as f:
            f.write(name + "\\n")
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(1e9)
"""


def sleeper(name: str, path: Path, ignore_term: bool = False) -> ServiceSpec:
    return ServiceSpec(name, (sys.executable, "-c", SLEEPER, name, str(path), "1" if ignore_term else "0"), {})


def test_stop_in_order_then_kill(tmp_path: Path) -> None:
    order = tmp_path / "order"
    sup = Supervisor(log_dir=str(tmp_path / "logs"))
    names = ["kvstore-0", "scheduler", "prefill-0", "decode-0", "gateway", "stubborn"]
    try:
        for n in names:
            sup.spawn(sleeper(n, order, ignore_term=n == "stubborn"))
        _wait_logged(tmp_path / "logs", names)
        t0 = time.monotonic()
        sup.stop([["gateway"], ["prefill-0", "decode-0", "kvstore-0"], ["scheduler"]], timeout=2.0)
        took = time.monotonic() - t0
    finally:
        sup.stop(timeout=0)
    lines = order.read_text().split()
    assert lines[0] == "gateway" and lines[-1] == "scheduler"
    assert sorted(lines[1:4]) == ["decode-0", "kvstore-0", "prefill-0"]
    assert all(p.returncode is not None for p in sup.processes.values())
    assert sup.processes["stubborn"].returncode == -signal.SIGKILL
    assert 1.5 < took < 5
    assert (tmp_path / "logs" / "gateway.log").read_text().strip() == "ready"


def _wait_logged(log_dir: Path, names: list[str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((log_dir / f"{n}.log").exists() and (log_dir / f"{n}.log").read_text() for n in names):
            return
        time.sleep(0.05)
    raise TimeoutError("sleepers did not start")


def test_exited_reports_name_and_code(tmp_path: Path) -> None:
    sup = Supervisor()
    try:
        sup.spawn(sleeper("sleeper", tmp_path / "x"))
        sup.spawn(ServiceSpec("quitter", (sys.executable, "-c", "raise SystemExit(3)"), {}))
        sup.processes["quitter"].wait(10)
        assert sup.exited() == [("quitter", 3)]
    finally:
        sup.stop(timeout=2)
    assert describe_exit(3) == "exit code 3" and describe_exit(-9) == "killed by SIGKILL"


DRIVER = """
import sys, time
from spindle_launcher.plan import ServiceSpec
from spindle_launcher.supervisor import Supervisor
sup = Supervisor()
for i in range(3):
    sup.spawn(ServiceSpec(f"sleeper-{i}", (sys.executable, "-c", "import time; time.sleep(1e9)"), {}))
print(" ".join(str(p.pid) for p in sup.processes.values()), flush=True)
time.sleep(1e9)
"""


def test_sigkilled_parent_takes_children_down(stand_ins: ModuleType) -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert driver.stdout is not None
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 3 and all(stand_ins.alive(p) for p in pids)
        driver.kill()
        driver.wait()
        assert stand_ins.wait_gone(pids, 5.0) == []
    finally:
        driver.kill()
        driver.wait()
        for p in pids:
            if stand_ins.alive(p):
                os.kill(p, signal.SIGKILL)
