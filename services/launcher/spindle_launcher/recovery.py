"""The launcher's answer to a dead process: restart its unit after a back-off, and tell the cluster.

`Restarter.round()` runs from the launcher's wait loop: it notices exits, ends the rest of a dead process's unit (a
TP group without its follower cannot serve), schedules the unit's restart by `RestartPolicy`, respawns units whose
back-off is over and counts restarts per role. `StackLink` sends the totals to the scheduler over NATS
(`StackRestarts`), which puts them in `ClusterStatus` for the gateway's `spindle:worker_restarts_total`, and takes
`spindle add`'s requests for more instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from spindle_protocol import AddedInstances, AddInstances, Bus, StackRestarts, subjects

from .plan import ServiceSpec
from .restarts import ESSENTIAL, RestartPolicy, UnitHistory
from .supervisor import Supervisor, describe_exit

log = logging.getLogger("spindle.launcher")
END_UNIT_TIMEOUT_S = 5.0  # the rest of a dead process's unit gets this long to exit on SIGTERM
REPORT_EVERY_S = 2.0
NATS = "nats"  # nats-server's name among the supervised processes (adopted, not planned)
ADD_TIMEOUT_S = 10.0


class Restarter:
    def __init__(
        self,
        supervisor: Supervisor,
        specs: list[ServiceSpec],
        policy: RestartPolicy,
        echo: Callable[[str], None],
        on_restart: Callable[[dict[str, int], list[str]], None] | None = None,
        restart_nats: Callable[[], None] | None = None,
    ) -> None:
        """`restart_nats`: starts nats-server again (same port, same JetStream store) and adopts it as "nats";
        without it, nats-server's death stops the stack."""
        self._supervisor = supervisor
        self._specs = {s.name: s for s in specs}
        self._units: dict[str, list[ServiceSpec]] = {}
        for s in specs:
            self._units.setdefault(s.unit_name, []).append(s)
        self._policy = policy
        self._echo = echo
        self._on_restart = on_restart
        self._restart_nats = restart_nats
        self._history: dict[str, UnitHistory] = {u: UnitHistory() for u in [*self._units, NATS]}
        self._due: dict[str, float] = {}  # unit -> when to start it again
        self._reported: set[str] = set()
        self.restarts: dict[str, int] = {}  # role -> restarts so far

    def add(self, spec: ServiceSpec) -> None:
        """Supervise one more unit (an instance added at run time)."""
        self._specs[spec.name] = spec
        self._units[spec.unit_name] = [spec]
        self._history[spec.unit_name] = UnitHistory()

    @property
    def gave_up(self) -> list[str]:
        return sorted(u for u, h in self._history.items() if h.gave_up)

    def round(self, now: float | None = None) -> tuple[str, int] | None:
        """Handle exits and due restarts; (name, code) of a death that stops the stack (nats-server's, or a crash
        loop of an essential service), else None."""
        now = time.monotonic() if now is None else now
        for name, code in self._supervisor.exited():
            spec = self._specs.get(name)
            if spec is None and (name != NATS or self._restart_nats is None):
                return name, code  # not ours to restart: its death stops the stack
            unit = spec.unit_name if spec is not None else NATS
            if unit in self._due or self._history[unit].gave_up:
                continue
            if spec is not None and spec.survivable and spec.name != unit:
                if name not in self._reported:
                    self._reported.add(name)
                    self._echo(f"{name} exited ({describe_exit(code)}); its KVP group goes on without it")
                continue
            stops = self._unit_died(unit, name, code, now)
            if stops:
                return name, code
        for unit, at in list(self._due.items()):
            if now >= at:
                del self._due[unit]
                self._start(unit, now)
        return None

    def _unit_died(self, unit: str, name: str, code: int, now: float) -> bool:
        others = [s.name for s in self._units.get(unit, []) if s.name != name]
        self._supervisor.end(others, END_UNIT_TIMEOUT_S)  # the group's state died with its member
        history = self._history[unit]
        delay = history.delay(self._policy, now)
        if delay is None:
            history.gave_up = True
            self._echo(
                f"{name} {describe_exit(code)} again: {unit} restarted {self._policy.max_restarts} times within "
                f"{self._policy.window_s:g} s (a crash loop); left down"
            )
            self._report()
            return unit in ESSENTIAL
        self._echo(f"{name} {describe_exit(code)}; restarting {unit} in {delay:.1f} s")
        self._due[unit] = now + delay
        return False

    def _start(self, unit: str, now: float) -> None:
        if unit == NATS:
            assert self._restart_nats is not None
            try:
                self._restart_nats()
            except RuntimeError as e:  # its dead process stays in place: the next round counts another death
                self._history[unit].restarts.append(now)
                self._echo(f"nats-server did not start again: {e}")
                return
        for spec in self._units.get(unit, []):
            self._supervisor.spawn(spec)
            self._reported.discard(spec.name)
        self._history[unit].restarts.append(now)
        role = self._units[unit][0].role if unit != NATS else NATS
        self.restarts[role] = self.restarts.get(role, 0) + 1
        self._echo(f"restarted {unit} (restart {len(self._history[unit].restarts)})")
        self._report()

    def _report(self) -> None:
        if self._on_restart is not None:
            self._on_restart(dict(self.restarts), self.gave_up)


class StackLink:
    """The launcher on NATS, from a thread of its own: publishes `StackRestarts` (on each change and every
    REPORT_EVERY_S) and answers `AddInstances` by queueing them for the supervising thread (`take_adds`), which
    starts the processes (children must be forked by that long-lived thread: see supervisor.py)."""

    def __init__(self, nats_url: str) -> None:
        self._nats_url = nats_url
        self._latest = StackRestarts(restarts={})
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._adds: queue.Queue[tuple[AddInstances, Future[list[str]]]] = queue.Queue()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="spindle-stack-link", daemon=True)
        self._thread.start()

    def update(self, restarts: dict[str, int], gave_up: list[str]) -> None:
        self._latest = StackRestarts(restarts=restarts, gave_up=gave_up)
        self._changed.set()

    def take_adds(self) -> list[tuple[AddInstances, Future[list[str]]]]:
        """Add requests waiting for the supervising thread; it sets each future (instance ids, or an exception)."""
        out = []
        while True:
            try:
                out.append(self._adds.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        self._thread.join(2.0)

    async def _on_add(self, msg: AddInstances, raw: object) -> AddedInstances:
        done: Future[list[str]] = Future()
        self._adds.put((msg, done))
        try:
            return AddedInstances(instance_ids=await asyncio.wait_for(asyncio.wrap_future(done), ADD_TIMEOUT_S))
        except ValueError as e:
            return AddedInstances(error=str(e))
        except TimeoutError:
            return AddedInstances(error=f"the launcher did not start them within {ADD_TIMEOUT_S:g} s")

    async def _run(self) -> None:
        bus = None
        try:
            while not self._stop.is_set():
                try:
                    if bus is None:
                        bus = await Bus.connect(self._nats_url, "spindle-launcher")
                        await bus.subscribe(subjects.ADD_INSTANCES, AddInstances, self._on_add)
                    if self._latest.restarts or self._latest.gave_up:
                        await bus.publish(subjects.RESTARTS, self._latest)
                except Exception as e:  # nats-server away: try again at the next report
                    log.debug("stack link: %s", e)
                await asyncio.to_thread(self._changed.wait, REPORT_EVERY_S)
                self._changed.clear()
        finally:
            if bus is not None:
                with contextlib.suppress(Exception):
                    await bus.close()
