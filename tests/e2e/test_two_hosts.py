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
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spindle_launcher.plan import Runtime, StackConfig, build_plan
from spindle_protocol.nats_server import nats_server_binary

from .conftest import engine_greedy

pytestmark = pytest.mark.slow

A, B = "spx-a", "spx-b"
IP_A, IP_B = "10.77.0.1", "10.77.0.2"
NATS_PORT, RDV_PORT, HTTP_PORT = 4222, 29500, 8000

CLIENT = """
import json, sys, urllib.request
body = json.dumps({"model": "smollm2", "prompt": json.loads(sys.argv[2]), "max_tokens": 8, "temperature": 0,
                   "ignore_eos": True}).encode()
req = urllib.request.Request(sys.argv[1] + "/v1/completions", body, {"content-type": "application/json"})
print(json.dumps(json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["text"]))
"""
HEALTH = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1] + "/health", timeout=2).status)
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

    def healthy(self) -> bool:
        return _in(A, sys.executable, "-c", HEALTH, self.url).stdout.strip() == "200"

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


def test_a_stack_split_over_two_hosts_serves_and_heals(hosts, tmp_path, reference_engine, tokenizer):
    cluster = TwoHosts(tmp_path)
    config = StackConfig(prefill=1, decode=1, host=IP_A, max_model_len=1024, kv_cache_tokens=4096)
    runtime = Runtime(nats_url=f"nats://{IP_A}:{NATS_PORT}", dist_init=f"mesh://{IP_A}:{RDV_PORT}", port=HTTP_PORT)
    specs = {s.name: s for s in build_plan(config, runtime)}
    try:
        nats = [nats_server_binary(), "-a", IP_A, "-p", str(NATS_PORT), "-js", "-sd", str(tmp_path / "js")]
        cluster.spawn("nats", A, nats, "vA")
        for name, spec in specs.items():
            host, dev = (B, "vB") if name.startswith("prefill") else (A, "vA")
            cluster.spawn(name, host, list(spec.argv), dev)
        _wait(cluster.healthy, 180, "the two-host stack never became healthy")
        words = tokenizer.encode("The lighthouse keeper climbed the stairs again, " * 12, add_special_tokens=False)
        (want,) = engine_greedy(reference_engine, [words], 8)
        sent = _tx_bytes(B, "vB")
        assert cluster.complete(words) == tokenizer.decode(want)
        kv_bytes = len(words) * 30 * 2 * 3 * 64 * 4  # SmolLM2: 30 layers, K and V, 3 KV heads of 64, fp32
        assert _tx_bytes(B, "vB") - sent >= kv_bytes  # the KV went from host B to host A over the veth

        cluster.procs["prefill-0"].kill()  # host B's instance dies; a new one (same rank) rejoins across hosts
        cluster.procs["prefill-0"].wait()
        cluster.spawn("prefill-0", B, list(specs["prefill-0"].argv), "vB")
        time.sleep(3.0)  # the scheduler notices the loss (no heartbeat for 2.5 s) before the new one registers
        _wait(cluster.healthy, 120, "the restarted prefill instance never rejoined")
        assert cluster.complete(words) == tokenizer.decode(want)
    finally:
        cluster.stop()
