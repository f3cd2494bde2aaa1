"""Stand-ins for the real services, to test process management without models.

python stand_ins.py scheduler NATS_URL ID,ID,...     # answers STATUS listing those instances as live
python stand_ins.py gateway PORT                     # GET /health -> 200 (+ the stack token)
python stand_ins.py launcher [spindle up flags]      # `spindle up` with stand_in_plan; prints PIDS {json}
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import sys
import time
from pathlib import Path

from spindle_launcher.plan import Runtime, ServiceSpec, StackConfig
from spindle_protocol.service import STACK_TOKEN_ENV, STACK_TOKEN_HEADER

HERE = str(Path(__file__).resolve())
SLEEPER = (sys.executable, "-c", "import time; time.sleep(1e9)")  # a plain sleeper


def stand_in_plan(config: StackConfig, runtime: Runtime, *, live: list[str] | None = None) -> list[ServiceSpec]:
    """The real plan's process names, with sleepers for the instances and stand-in scheduler and gateway."""
    ids = config.instance_ids() if live is None else live
    env = {"PYTHONUNBUFFERED": "1"}
    specs = [ServiceSpec(name, SLEEPER, env) for name in config.instance_ids()]
    specs.append(ServiceSpec("scheduler", (sys.executable, HERE, "scheduler", runtime.nats_url, ",".join(ids)), env))
    gateway_env = {**env, STACK_TOKEN_ENV: runtime.stack_token} if runtime.stack_token else env
    specs.append(ServiceSpec("gateway", (sys.executable, HERE, "gateway", str(runtime.port)), gateway_env))
    return specs


def alive(pid: int) -> bool:
    """True unless the process is gone or a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def until(cond, timeout: float = 10.0) -> bool:
    """Poll `cond()` until true (True) or `timeout` seconds (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


async def scheduler(nats_url: str, ids: list[str]) -> None:
    from spindle_protocol import Bus, ClusterStatus, InstanceInfo, StatusQuery, subjects

    bus = await Bus.connect(nats_url, "stand-in-scheduler")
    now = time.time()
    instances = [
        InstanceInfo(instance_id=i, role=i.split("-")[0], rank=0, pid=0, started_at=now, updated_at=now) for i in ids
    ]
    status = ClusterStatus(
        instances=instances,
        dead_instances=[],
        num_requests_running=0,
        num_requests_waiting=0,
        strategy="single",
        max_model_len=0,
        model="stand-in",
    )

    async def on_status(query: StatusQuery, msg: object) -> ClusterStatus:
        return status

    await bus.subscribe(subjects.STATUS, StatusQuery, on_status)
    await asyncio.Event().wait()


class Health(http.server.BaseHTTPRequestHandler):
    """GET /health -> 200, with the stack token of SPINDLE_STACK_TOKEN when set (as the real gateway)."""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        if self.path == "/health" and os.environ.get(STACK_TOKEN_ENV):
            self.send_header(STACK_TOKEN_HEADER, os.environ[STACK_TOKEN_ENV])
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def launcher(argv: list[str]) -> None:
    from spindle_launcher.cli import _say, build_parser, config_from_args, serve, stop_on_signals
    from spindle_launcher.stack import Stack

    class PrintingStack(Stack):
        def wait(self, poll_s: float = 0.2) -> tuple[str, int] | None:  # serve() calls it once the stack is up
            print("PIDS " + json.dumps({n: p.pid for n, p in self.processes.items()}), flush=True)
            return super().wait(poll_s)

    config = config_from_args(build_parser().parse_args(["up", *argv]))
    stack = PrintingStack(config, echo=_say, plan=stand_in_plan, prepare_model=False)
    stop_on_signals(stack)
    sys.exit(serve(stack))


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "scheduler":
        asyncio.run(scheduler(sys.argv[2], sys.argv[3].split(",")))
    elif mode == "gateway":
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), Health).serve_forever()
    elif mode == "launcher":
        launcher(sys.argv[2:])
    else:
        raise SystemExit(f"unknown mode {mode}")
