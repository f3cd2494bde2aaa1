"""Child processes of the launcher: start with a death signal, watch for exits, stop in order.

Every child gets PR_SET_PDEATHSIG=SIGTERM, so a SIGKILLed launcher still takes its stack down, and its own
process group, so a terminal's Ctrl-C reaches only the launcher, which then stops the stack in order.
Linux sends the death signal when the *thread* that forked the child exits: spawn from a long-lived thread
(the main thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .plan import ServiceSpec

PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def child_preexec(parent_pid: int) -> Callable[[], None]:
    """The preexec_fn of every child: own process group, SIGTERM when the launcher dies."""

    def preexec() -> None:
        os.setpgid(0, 0)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Supervisor:
    """Named child processes; `stop` ends them group by group with SIGTERM, then SIGKILL at the deadline."""

    def __init__(self, log_dir: str | None = None) -> None:
        self.processes: dict[str, subprocess.Popen] = {}
        self.log_dir = Path(log_dir) if log_dir else None
        self._pid = os.getpid()
        self._logs: list = []

    def preexec(self) -> Callable[[], None]:
        return child_preexec(self._pid)

    def log_path(self, name: str) -> Path | None:
        return self.log_dir / f"{name}.log" if self.log_dir else None

    def spawn(self, spec: ServiceSpec) -> subprocess.Popen:
        if spec.name in self.processes and self.processes[spec.name].poll() is None:
            raise ValueError(f"process {spec.name!r} is already running")
        out = None
        path = self.log_path(spec.name)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            out = open(path, "ab")  # noqa: SIM115 (closed in stop)
            self._logs.append(out)
        proc = subprocess.Popen(
            list(spec.argv),
            env={**os.environ, **spec.env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            preexec_fn=self.preexec(),
        )
        self.processes[spec.name] = proc
        return proc

    def adopt(self, name: str, proc: subprocess.Popen) -> None:
        """Supervise a process started elsewhere (nats-server)."""
        self.processes[name] = proc

    def exited(self) -> list[tuple[str, int]]:
        """(name, return code) of every child that has exited."""
        return [(name, p.returncode) for name, p in self.processes.items() if p.poll() is not None]

    def end(self, names: Sequence[str], timeout: float) -> None:
        """SIGTERM the named children, SIGKILL those still there after `timeout`; wait for all of them."""
        self.stop_group([self.processes[n] for n in names if n in self.processes], time.monotonic() + timeout)

    def stop_group(self, procs: Sequence[subprocess.Popen], deadline: float) -> None:
        for p in procs:
            if p.poll() is None:
                _signal(p, signal.SIGTERM)
        for p in procs:
            _wait_until(p, deadline)
        for p in procs:
            if p.poll() is None:
                _signal(p, signal.SIGKILL)
                p.wait()

    def stop(self, order: Sequence[Sequence[str]] = (), timeout: float = 10.0) -> None:
        """SIGTERM the groups of `order` one after the other (then everyone else), waiting for each group
        until the shared deadline; SIGKILL whatever is left. Idempotent."""
        deadline = time.monotonic() + timeout
        named = [n for group in order for n in group]
        groups = [list(g) for g in order] + [[n for n in self.processes if n not in named]]
        for group in groups:
            procs = [self.processes[n] for n in group if n in self.processes]
            for p in procs:
                if p.poll() is None:
                    _signal(p, signal.SIGTERM)
            for p in procs:
                _wait_until(p, deadline)
        for p in self.processes.values():
            if p.poll() is None:
                _signal(p, signal.SIGKILL)
                p.wait()
        for f in self._logs:
            f.close()
        self._logs.clear()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """Signal the child's process group (its own helpers too); the child leads it (see child_preexec)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def _wait_until(proc: subprocess.Popen, deadline: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(max(0.0, deadline - time.monotonic()))
