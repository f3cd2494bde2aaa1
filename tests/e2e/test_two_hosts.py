"""Two "hosts" on this machine: network namespaces joined by a veth pair, each running part of the stack, reaching
each other only on their private addresses (what a multi-host deployment does; deploy/README.md).

Host A (10.77.0.1): nats-server, the rendezvous, kvstore, scheduler, the decode instance and the gateway. Host B
(10.77.0.2): the prefill instance. A greedy completion must equal the single engine's, with the prompt's KV
crossing the veth (its byte counters grow by at least the KV's size); then the prefill instance on host B dies and
a new one rejoins across hosts and serves. Needs root and `ip netns` (skipped, saying so, without them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from spindle_protocol.nats_server import nats_server_binary

from .conftest import engine_greedy

pytestmark = pytest.mark.slow

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "multi-host"
A, B = "spx-a", "spx-b"
IP_A, IP_B = "10.77.0.1", "10.77.0.2"
HTTP_PORT = 8000  # the gateway's in deploy/multi-host/control.yml

CLIENT = """
import json, sys, urllib.request
body = json.dumps({"model": "smollm2", "prompt": json.loads(sys.argv[2]), "max_tokens": 8, "temperature": 0,
                   "ignore_eos": True}).encode()
req = urllib.request.Request(sys.argv[1] + "/v1/completions", body, {"content-type": "application/json"})
print(json.dumps(json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["text"]))
"""
HEALTH = """
import json, sys, urllib.request
try:
    print(json.load(urllib.request.urlopen(sys.argv[1] + "/health", timeout=2))["status"])
except Exception as e:
    print(type(e).__name__)
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _in(ns: str, *argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, **kw)


def _tx_bytes(ns: str, dev: str) -> int:
    return int(_in(ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes").stdout)


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (`ip netns`)")
    try:
        _ip("netns", "add", A)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create network namespaces here: {e.stderr.decode().strip()}")
    try:
        _ip("netns", "add", B)
        _ip("link", "add", "vA", "netns", A, "type", "veth", "peer", "name", "vB", "netns", B)
        for ns, dev, addr in ((A, "vA", IP_A), (B, "vB", IP_B)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in (A, B):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class TwoHosts:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.url = f"http://{IP_A}:{HTTP_PORT}"

    def spawn(self, name: str, ns: str, argv: list[str], dev: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": dev, "HF_HUB_OFFLINE": "1"}
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
        self.procs[name] = subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, stdout=log, stderr=log)

    def health(self) -> str:
        """/health's status ("ok", "degraded"), or the error asking it raised (HTTPError for a 503)."""
        return _in(A, sys.executable, "-c", HEALTH, self.url).stdout.strip()

    def complete(self, ids: list[int]) -> str:
        out = _in(A, sys.executable, "-c", CLIENT, self.url, json.dumps(ids), timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def _commands(host_file: str) -> dict[str, list[str]]:
    """Each service's command in deploy/multi-host/HOST_FILE.yml with CONTROL_IP set, run by this Python (and
    nats-server from the wheel, its JetStream store under NATS_STORE)."""
    text = (DEPLOY / f"{host_file}.yml").read_text().replace("${CONTROL_IP}", IP_A)
    out = {}
    for name, svc in yaml.safe_load(text)["services"].items():
        cmd = [str(a) for a in svc["command"]]
        if name == "nats":
            store = cmd.index("-sd") + 1
            out[name] = [nats_server_binary(), *cmd[:store], "NATS_STORE", *cmd[store + 1 :]]
        else:
            out[name] = [sys.executable, *cmd[1:]] if cmd[0] == "python" else cmd
    return out


def test_a_stack_split_over_two_hosts_serves_and_heals(hosts, tmp_path, reference_engine, tokenizer):
    cluster = TwoHosts(tmp_path)
    control, workers = _commands("control"), _commands("workers")
    try:
        for commands, host, dev in ((control, A, "vA"), (workers, B, "vB")):
            for name, argv in commands.items():
                cluster.spawn(name, host, [str(tmp_path / "js") if a == "NATS_STORE" else a for a in argv], dev)
        _wait(lambda: cluster.health() == "ok", 180, "the two-host stack never became healthy")
        words = tokenizer.encode("The lighthouse keeper climbed the stairs again, " * 12, add_special_tokens=False)
        (want,) = engine_greedy(reference_engine, [words], 8)
        sent = _tx_bytes(B, "vB")
        assert cluster.complete(words) == tokenizer.decode(want)
        kv_bytes = len(words) * 30 * 2 * 3 * 64 * 4  # SmolLM2: 30 layers, K and V, 3 KV heads of 64, fp32
        assert _tx_bytes(B, "vB") - sent >= kv_bytes  # the KV went from host B to host A over the veth

        cluster.procs["prefill-0"].kill()  # one of host B's instances dies; a new one (same rank) rejoins
        cluster.procs["prefill-0"].wait()
        cluster.spawn("prefill-0", B, workers["prefill-0"], "vB")
        time.sleep(3.0)  # the scheduler notices the loss (no heartbeat for 2.5 s) before the new one registers
        _wait(lambda: cluster.health() == "ok", 120, "the restarted prefill instance never rejoined")
        other = cluster.procs["prefill-1"]
        other.send_signal(signal.SIGSTOP)  # so the restarted one serves: its new pairs cross the hosts
        try:
            _wait(lambda: cluster.health() == "degraded", 15, "prefill-1 never left the plan")
            assert cluster.complete(words) == tokenizer.decode(want)
        finally:
            other.send_signal(signal.SIGCONT)
    finally:
        cluster.stop()
