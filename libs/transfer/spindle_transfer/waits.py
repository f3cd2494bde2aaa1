"""Waiting on torch.distributed ops without ever letting gloo time out (which would break the group)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from .errors import TransferError

log = logging.getLogger("spindle.transfer")

_FOREVER = timedelta(days=3650)
_CANCEL_POLL_S = 0.01  # how often a waiting transfer looks at its cancel event


def block(work: dist.Work, nccl: bool) -> None:
    """Wait for `work` with no deadline: it ends on completion, on the peer's death or on close()."""
    if nccl:  # NCCL's wait() only orders streams; completion is polled on the host
        delay = 1e-5
        while not work.is_completed():
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)
        work.wait()
    else:
        work.wait(_FOREVER)  # never let gloo time out: that closes every pair of the group


class Pending:
    """One posted isend/irecv and a daemon thread that waits for it.

    gloo marks a Work complete only inside `wait()` (`is_completed()` stays False otherwise), and a gloo
    wait that times out closes every pair of the process group. So the thread waits without a deadline
    (it returns on completion, on the peer's death, or when the group is destroyed) and deadlines and
    cancellation live in Python: the caller stops waiting and `abandon`s the op; `on_late` then runs if
    the op completes after all, to finish the exchange so that the peer is not left blocked.
    """

    def __init__(self, work: dist.Work, nccl: bool, on_late: Callable[[], None] | None = None) -> None:
        self.work = work
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._nccl = nccl
        self._on_late = on_late
        self._abandoned = False
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="spindle-transfer-wait", daemon=True).start()

    def _run(self) -> None:
        try:
            block(self.work, self._nccl)
        except BaseException as e:  # the peer died or the group was destroyed
            self.error = e
        with self._lock:
            self.done.set()
            late = self._abandoned and self.error is None
        if late and self._on_late is not None:
            try:
                self._on_late()
            except Exception as e:
                log.debug("late continuation of an abandoned transfer failed: %s", e)

    def abandon(self) -> bool:
        """Stop caring about the op; False when it had already completed (the caller goes on with it)."""
        with self._lock:
            if self.done.is_set():
                return False
            self._abandoned = True
            return True


def wait_for(pending: Pending, what: str, deadline: float, cancel: threading.Event | None = None) -> None:
    """Wait for an op the peer may never match, within `deadline` and until `cancel`."""
    while True:
        remaining = deadline - time.monotonic()
        step = remaining if cancel is None else min(remaining, _CANCEL_POLL_S)
        if pending.done.wait(max(step, 0.0)):
            break
        if cancel is not None and cancel.is_set():
            reason = "was cancelled"
        elif time.monotonic() >= deadline:
            reason = "timed out"
        else:
            continue
        if pending.abandon():
            raise TransferError(f"{what} {reason}")
        break  # completed just now
    if pending.error is not None:
        raise TransferError(f"{what} failed: {pending.error}") from pending.error
