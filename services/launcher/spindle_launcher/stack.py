"""A running Spindle stack: nats-server plus every service of the plan, supervised, with a readiness wait.

    with Stack(StackConfig(prefill=1, decode=1, port=0)) as stack:   # start() waits until ready
        httpx.get(stack.url + "/health"); OpenAI(base_url=stack.base_url)
        stack.processes["decode-0"].kill()

Before anything starts, start() checks that the stack's fixed ports can be bound (a taken port fails at once,
naming it) and converts a GGUF model that has not been converted on this machine yet (once, with a progress bar,
instead of in every service at once). The gateway gets a random stack token and returns it on /health: readiness
accepts only that answer, never another server that happens to listen on the port.

Call start() from a long-lived thread (the death signal of the children is tied to the forking thread).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from spindle_protocol import Bus, ClusterStatus, StatusQuery, subjects
from spindle_protocol.nats_server import NatsServer, start_nats_server
from spindle_protocol.service import STACK_TOKEN_HEADER

from .gpus import check_visible, gpu_map
from .plan import (
    Runtime,
    ServiceSpec,
    StackConfig,
    added_instance,
    build_plan,
    check_decode_tp,
    plan_ranks,
    rank_capacity,
)
from .recovery import Restarter, StackLink
from .supervisor import Supervisor, describe_exit

log = logging.getLogger("spindle.launcher")
PROGRESS_EVERY_S = 15.0
STOP_TIMEOUT_S = 10.0


class StackError(RuntimeError):
    """The stack could not start (a child died, or it was not ready in time)."""


class StackInterrupted(StackError):
    """request_stop() was called while the stack was starting."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(host: str, port: int, hint: str) -> None:
    """StackError unless `port` can be bound on `host` now (SO_REUSEADDR, as uvicorn and nats-server bind: a
    socket left in TIME_WAIT by an earlier run does not count as taken, a listening one does)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise StackError(f"port {port} on {host} is already in use ({hint})") from e
        raise StackError(f"cannot listen on {host} port {port}: {e.strerror or e}") from e


def check_ports(config: StackConfig) -> None:
    """StackError naming the first fixed port of the stack that cannot be bound: the gateway's HTTP port (unless
    0, any free port) and nats-server's client port when it is given."""
    if config.port:
        check_port(config.host, config.port, "another server? choose --port")
    if config.nats_port is not None:
        check_port("127.0.0.1", config.nats_port, "another nats-server? choose --nats-port, or leave it out")


def gateway_health(url: str, token: str) -> str | None:
    """None when GET `url`/health is 200 from the gateway holding `token` (any gateway when `token` is empty),
    else what is wrong."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            status, answered = r.status, r.headers.get(STACK_TOKEN_HEADER)
    except urllib.error.HTTPError as e:
        status, answered = e.code, e.headers.get(STACK_TOKEN_HEADER)
    except (urllib.error.URLError, OSError):
        return "not listening"
    if token and answered != token:
        return "another server answers there, not this stack's gateway"
    return None if status == 200 else f"/health {status}"


# Converts (or finds) the model in a child process: the launcher itself never loads torch.
_PREPARE_MODEL = "import sys; from spindle_model import resolve_model; resolve_model(sys.argv[1], progress=True)"
# How many CUDA devices torch sees, in a child process for the same reason
_COUNT_GPUS = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
GPU_QUERY_TIMEOUT_S = 120.0


def check_cuda(config: StackConfig, env: dict[str, str]) -> None:
    """StackError unless every GPU of a `device="cuda"` stack exists here (asked of torch in a child process)."""
    if config.device != "cuda":
        return
    argv = [sys.executable, "-c", _COUNT_GPUS]
    try:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S, check=True)
        count = int(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        raise StackError(f"--device cuda: could not ask torch for the GPUs here: {e}") from e
    try:
        check_visible(config.gpus or (0,), count)
    except ValueError as e:
        raise StackError(str(e)) from e


def _client_host(host: str) -> str:
    """Where to reach a server bound to `host` from this machine."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


class Stack:
    def __init__(
        self,
        config: StackConfig,
        *,
        echo: Callable[[str], None] | None = None,
        plan: Callable[[StackConfig, Runtime], list[ServiceSpec]] = build_plan,
        prepare_model: bool = True,
    ) -> None:
        """`prepare_model`: convert the model, if needed, before starting anything (stand-in plans that load no
        model pass False)."""
        self.config = config
        self._echo = echo or log.info
        self._plan = plan
        self._prepare_model = prepare_model
        self._supervisor = Supervisor(config.log_dir)
        self._nats: NatsServer | None = None
        self._stop_requested = threading.Event()
        self._stopped = False
        self._reported: set[str] = set()
        self.runtime: Runtime | None = None
        self.specs: list[ServiceSpec] = []
        self._restarter: Restarter | None = None
        self._round_lock = threading.Lock()
        self._link: StackLink | None = None
        self._next_rank = 0  # the data-plane rank of the next instance added at run time

    # ---- what tests and the CLI read ----

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        """name -> subprocess.Popen, including "nats"."""
        return self._supervisor.processes

    @property
    def url(self) -> str:
        """The gateway's root URL, e.g. http://127.0.0.1:8000 (append /v1 for the OpenAI API)."""
        assert self.runtime is not None, "stack not started"
        return f"http://{_client_host(self.config.host)}:{self.runtime.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def nats_url(self) -> str:
        assert self.runtime is not None, "stack not started"
        return self.runtime.nats_url

    def log_path(self, name: str) -> str | None:
        path = self._supervisor.log_path(name)
        return str(path) if path else None

    # ---- lifecycle ----

    def start(self) -> Stack:
        check_ports(self.config)  # StackError at once, before any model is touched
        if self._prepare_model:
            self._prepare()
        check_decode_tp(self.config)  # ValueError before anything starts
        check_cuda(self.config, {**os.environ, **self.config.env})
        try:
            nats_port = self.config.nats_port if self.config.nats_port is not None else -1
            self._nats = start_nats_server("127.0.0.1", nats_port, preexec_fn=self._supervisor.preexec())
            self._supervisor.adopt("nats", self._nats.process)
            self._echo(f"nats-server (JetStream) at {self._nats.url}")
            self.runtime = Runtime(
                nats_url=self._nats.url,
                dist_init=f"mesh://127.0.0.1:{free_port()}",
                port=self.config.port or free_port(),
                parent_pid=os.getpid(),
                stack_token=secrets.token_hex(16),
            )
            self.specs = self._plan(self.config, self.runtime)
            for line in gpu_map(self.config.rank_devices(), plan_ranks(self.specs)):
                self._echo(f"GPU map: {line}")
            for spec in self.specs:
                self._supervisor.spawn(spec)
            names = ", ".join(s.name for s in self.specs)
            self._echo(f"started {names}; waiting for them (up to {self.config.ready_timeout:g} s)")
            self._run_async(self._wait_ready())
            if self.runtime.dist_init.startswith("mesh://"):
                self._link = StackLink(self.runtime.nats_url)
                self._next_rank = self.config.world_size
                if self.config.restart is not None:
                    self._restarter = Restarter(
                        self._supervisor,
                        self.specs,
                        self.config.restart,
                        self._echo,
                        self._link.update,
                        self._restart_nats,
                    )
        except BaseException:
            self.stop()
            raise
        return self

    def request_stop(self) -> None:
        """Make start() give up and wait() return; safe from a signal handler."""
        self._stop_requested.set()

    @property
    def restarts(self) -> dict[str, int]:
        """Processes restarted so far, per role."""
        return dict(self._restarter.restarts) if self._restarter is not None else {}

    def add_instances(self, role: str, count: int = 1) -> list[str]:
        """Start `count` more one-process instances of `role` (prefill or decode) on the running stack: new ranks of
        the mesh (from the plan's spare ones); they serve once registered. Call it from the thread that supervises
        (`wait`), or before it runs; `spindle add` asks the launcher over NATS. ValueError: what cannot be added."""
        assert self.runtime is not None, "stack not started"
        if role not in ("prefill", "decode"):
            raise ValueError(f"only prefill and decode instances can be added, not {role!r}")
        if not 1 <= count <= 64:
            raise ValueError(f"count must be in [1, 64], got {count}")
        if not self.runtime.dist_init.startswith("mesh://"):
            raise ValueError("instances can be added only on a mesh data plane (mesh://)")
        template = next((s for s in self.specs if s.name == f"{role}-0"), None)
        if template is None or any(s.unit == template.name for s in self.specs):
            raise ValueError(f"the stack has no one-process {role} instance to add more of")
        capacity = rank_capacity(self.config, self.runtime)
        if self._next_rank + count > capacity:
            left = capacity - self._next_rank
            raise ValueError(f"only {left} spare data-plane rank(s) left (StackConfig.spare_ranks); cannot add {count}")
        taken = {s.name for s in self.specs}
        added = []
        for _ in range(count):
            index = next(i for i in range(len(taken) + 1) if f"{role}-{i}" not in taken)
            spec = added_instance(self.config, template, f"{role}-{index}", self._next_rank)
            self._next_rank += 1
            taken.add(spec.name)
            self.specs.append(spec)
            self._supervisor.spawn(spec)
            if self._restarter is not None:
                self._restarter.add(spec)
            added.append(spec.name)
        self._echo(f"added {', '.join(added)}")
        return added

    def _restart_nats(self) -> None:
        """nats-server again on the same port with the same JetStream store (the registry and prompt buckets
        survive); every client reconnects by itself."""
        assert self._nats is not None
        old = self._nats
        new = start_nats_server("127.0.0.1", old.port, store_dir=old.store_dir, preexec_fn=self._supervisor.preexec())
        new._owns_store = old._owns_store  # the stack's store: removed at stop as before
        self._nats = new
        self._supervisor.adopt("nats", new.process)

    def dead(self) -> tuple[str, int] | None:
        """The first child that exited and whose exit stops the stack (a KVP follower's does not: its group
        goes on without it; its exit is reported once)."""
        survivable = {s.name for s in self.specs if s.survivable}
        for name, code in self._supervisor.exited():
            if name not in survivable:
                return name, code
            if name not in self._reported:
                self._reported.add(name)
                self._echo(f"{name} exited (code {code}); its KVP group goes on without it")
        return None

    def wait(self, poll_s: float = 0.2) -> tuple[str, int] | None:
        """Supervise until request_stop() was called (None) or a death stops the stack: (name, return code).

        With a restart policy (the default, on a mesh data plane) a dead process's instance is restarted after a
        back-off while the rest serve on; only nats-server's death, or a crash loop of a service nothing works
        without, stops the stack. Without one, the first death does."""
        while not self._stop_requested.is_set():
            with self._round_lock:  # stop() never runs beside a round that may be starting processes
                if self._stopped:
                    return None
                dead = self._restarter.round() if self._restarter is not None else self.dead()
                for request, done in self._link.take_adds() if self._link is not None else []:
                    try:
                        done.set_result(self.add_instances(request.role, request.count))
                    except ValueError as e:
                        done.set_exception(e)
            if dead is not None:
                return dead
            self._stop_requested.wait(poll_s)
        return None

    def stop(self) -> None:
        """Gateway first, then the instances, the scheduler, the rendezvous, nats-server; SIGKILL after ~10 s."""
        self._stop_requested.set()
        with self._round_lock:
            if self._stopped:
                return
            self._stopped = True
        if self._link is not None:
            self._link.close()
        names = [s.name for s in self.specs]
        workers = [n for n in names if n not in ("gateway", "scheduler", "rendezvous")]
        order = [["gateway"], workers, ["scheduler"], ["rendezvous"], ["nats"]]
        self._supervisor.stop(order, timeout=STOP_TIMEOUT_S)
        if self._nats is not None:
            self._nats.stop()  # already exited; removes its JetStream store

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the model, converted once before the services start ----

    def _prepare(self) -> None:
        from spindle_tokenizer import locate_model

        env = {**os.environ, **self.config.env}
        cache = env.get("SPINDLE_CACHE_DIR")
        try:
            location = locate_model(self.config.model, cache_dir=Path(cache) if cache else None)
        except ValueError as e:
            raise StackError(str(e)) from e
        if location.ready:
            return
        self._echo(f"converting {location.gguf} into {location.path} (once per machine)")
        start = time.monotonic()
        argv = [sys.executable, "-c", _PREPARE_MODEL, self.config.model]
        proc = subprocess.Popen(argv, env=env, preexec_fn=self._supervisor.preexec())  # its progress bar: stderr
        try:
            while proc.poll() is None:
                if self._stop_requested.wait(0.1):
                    raise StackInterrupted("stopped while converting the model")
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
        if proc.returncode != 0:
            raise StackError(f"converting the model failed ({describe_exit(proc.returncode)})")
        self._echo(f"model {self.config.model} ready in {time.monotonic() - start:.1f} s")

    # ---- readiness ----

    def _run_async(self, coro: object) -> None:
        """Run a coroutine to completion on a private loop (works whether or not the caller has a loop)."""
        errors: list[BaseException] = []

        def target() -> None:
            try:
                asyncio.run(coro)  # type: ignore[arg-type]
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=target, name="spindle-ready", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
        if errors:
            raise errors[0]

    def _child_died(self) -> StackError | None:
        dead = self.dead()
        if dead is None:
            return None
        name, code = dead
        where = self.log_path(name)
        hint = f" (log: {where})" if where else ""
        return StackError(f"{name} {describe_exit(code)} before the stack was ready{hint}")

    def _health(self) -> str | None:
        assert self.runtime is not None
        return gateway_health(self.url, self.runtime.stack_token)

    async def _status(self, bus: Bus) -> tuple[list[str], str | None]:
        """(instances not yet live, what is wrong with the scheduler or None when it answered)."""
        expected = self.config.instance_ids()
        try:
            status = await bus.request(subjects.STATUS, StatusQuery(), ClusterStatus, timeout=1.0)
        except Exception as e:  # no responders, timeout, a reply we cannot decode: all mean "not yet"
            return [], f"no reply: {type(e).__name__}"
        live = {i.instance_id for i in status.instances} - set(status.dead_instances)
        return [i for i in expected if i not in live], None

    async def _wait_ready(self) -> None:
        assert self.runtime is not None
        deadline = time.monotonic() + self.config.ready_timeout
        started = time.monotonic()
        bus = await Bus.connect(self.runtime.nats_url, "spindle-launcher")
        last, last_at = "", 0.0
        try:
            while True:
                if self._stop_requested.is_set():
                    raise StackInterrupted("stopped while starting")
                if (err := self._child_died()) is not None:
                    raise err
                missing, scheduler = await self._status(bus)
                health = await asyncio.to_thread(self._health)
                waiting = [f"scheduler ({scheduler})"] if scheduler else []
                waiting += missing
                if health is not None:
                    waiting.append(f"gateway ({health})")
                if not waiting:
                    return
                now = time.monotonic()
                line = "waiting for " + ", ".join(waiting)
                if line != last or now - last_at >= PROGRESS_EVERY_S:
                    self._echo(f"{line} [{now - started:.0f} s]")
                    last, last_at = line, now
                if now > deadline:
                    raise StackError(f"not ready after {self.config.ready_timeout:g} s: {line}")
                await asyncio.sleep(0.25)
        finally:
            await bus.close()
