"""The mesh data plane with real processes: a rendezvous process, members that die, come back, join late, and a
rendezvous that restarts. Each member is `mesh_member.py` (a separate Python process, real gloo pairs)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spindle_transfer.mesh import parse_joins

MEMBER = str(Path(__file__).with_name("mesh_member.py"))


def test_parse_joins_keeps_each_ranks_latest_token() -> None:
    assert parse_joins("") == {}
    assert parse_joins("0:a;1:b;0:c;1:-;") == {0: "c", 1: "-"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, _free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self.step = 0

    def rendezvous(self) -> None:
        argv = [sys.executable, "-m", "spindle_transfer.rendezvous", "--port", str(self.port)]
        self.procs["rendezvous"] = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        line = self.procs["rendezvous"].stderr.readline()
        assert "ready" in line, line

    def member(self, rank: int) -> None:
        argv = [sys.executable, MEMBER, str(rank), str(self.port), str(self.folder), str(self.step)]
        proc = self.procs[f"m{rank}"] = subprocess.Popen(argv)
        deadline = time.monotonic() + 60
        while not (self.folder / f"joined-{rank}-{proc.pid}").exists():
            assert proc.poll() is None and time.monotonic() < deadline, f"rank {rank} did not join"
            time.sleep(0.05)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def run(self, members: list[int], dead: list[int] = (), timeout: float = 60) -> dict[int, dict]:
        go = self.folder / f"go-{self.step}"
        go.write_text(json.dumps({"members": members, "dead": list(dead)}))
        deadline = time.monotonic() + timeout
        out = {}
        for rank in members:
            path = self.folder / f"{rank}-{self.step}.json"
            while not path.exists():
                assert time.monotonic() < deadline, f"rank {rank} did not finish step {self.step}"
                for name, p in self.procs.items():
                    assert p.poll() is None or name not in {f"m{r}" for r in members}, f"{name} exited"
                time.sleep(0.05)
            out[rank] = json.loads(path.read_text())
        self.step += 1
        return out

    def stop(self) -> None:
        (self.folder / f"go-{self.step}").write_text(json.dumps({"exit": True}))
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _all_ok(results: dict[int, dict]) -> dict[tuple[int, str], str]:
    """(rank, peer) -> error for every exchange that failed."""
    return {(r, p): x["error"] for r, res in results.items() for p, x in res["exchange"].items() if not x["ok"]}


@pytest.mark.slow
def test_members_die_rejoin_and_join_late_while_the_rest_go_on(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        c.rendezvous()
        for rank in (0, 1, 2):
            c.member(rank)
        first = c.run([0, 1, 2])
        assert _all_ok(first) == {}
        assert all(r["not_ready"] == {} for r in first.values())
        assert all(r["joined_s"] < 5 for r in first.values())  # joining never waits for the others

        c.kill("m2")  # a member dies without a goodbye
        survivors = c.run([0, 1], dead=[2])
        failed = _all_ok(survivors)
        assert set(failed) == {(0, "2"), (1, "2")}  # only the pairs with the dead one
        assert all(survivors[r]["exchange"]["2"]["seconds"] < 3 for r in (0, 1))  # fails fast, no hang

        c.member(2)  # the same rank comes back: new groups with everyone, the old ones dropped
        again = c.run([0, 1, 2])
        assert _all_ok(again) == {}
        assert again[0]["stats"]["replaced"] == 1 and again[1]["stats"]["replaced"] == 1

        c.member(5)  # a rank that was never there joins while the others run
        grown = c.run([0, 1, 2, 5])
        assert _all_ok(grown) == {}
        assert grown[0]["peers"] == {"1": "ready", "2": "ready", "5": "ready"}

        c.kill("rendezvous")  # formed groups carry on without the store
        assert _all_ok(c.run([0, 1, 2, 5])) == {}
        c.rendezvous()  # it comes back empty: every member says who it is again; a new member meets them all
        c.member(6)
        last = c.run([0, 1, 2, 5, 6], timeout=90)
        assert _all_ok(last) == {}
        assert last[0]["stats"]["replaced"] == 1  # nobody re-formed with a peer that merely re-announced
    finally:
        c.stop()
