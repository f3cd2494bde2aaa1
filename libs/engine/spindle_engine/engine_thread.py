"""Drive an `Engine` from its own thread, so a service's event loop never waits on a model step.

Everything that touches the engine runs on that thread: `call(fn)` queues `fn(engine)` between steps and
returns a concurrent future; step outputs go to `on_outputs`. `snapshot` is replaced (never mutated)
after every iteration, so other threads can read it without locks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .engine import Engine, StepOutput
from .errors import EngineFatal

T = TypeVar("T")
log = logging.getLogger("spindle.engine")


@dataclass(frozen=True)
class EngineSnapshot:
    num_blocks: int
    num_used_blocks: int
    num_running: int
    num_waiting: int
    waiting_tokens: int  # prompt tokens queued or running but not computed yet
    blocks_held: dict[str, int] = field(default_factory=dict)


def take_snapshot(engine: Engine) -> EngineSnapshot:
    seqs = list(engine.requests.values())
    return EngineSnapshot(
        num_blocks=engine.allocator.num_blocks,
        num_used_blocks=engine.allocator.num_used,
        num_running=engine.num_running,
        num_waiting=engine.num_waiting,
        waiting_tokens=sum(s.num_uncomputed for s in seqs),
        blocks_held=engine.blocks_held(),
    )


class EngineThread:
    """The engine is built on this thread too (`make_engine`), and nothing else should run torch ops: GNU
    OpenMP gives every thread that runs a parallel op its own team, and two teams on few cores make every
    small op of a step wait for a thread wake-up (a batch-1 decode step went from 46 to 70 ms here)."""

    def __init__(
        self,
        make_engine: Callable[[], Engine],
        on_outputs: Callable[[list[StepOutput], float, float], None],
    ) -> None:
        """`on_outputs(outputs, step_start, step_end)` runs on the engine thread after every step."""
        self._make_engine = make_engine
        self._on_outputs = on_outputs
        self._calls: queue.SimpleQueue[tuple[Callable[[Engine], Any], Future] | None] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._ready: Future[Engine] = Future()
        self.engine: Engine
        self.snapshot: EngineSnapshot
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)

    def start(self) -> Future[Engine]:
        """Start the thread; the future resolves to the engine once it is built (or to the error)."""
        self._thread.start()
        return self._ready

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _main(self) -> None:
        try:
            self.engine = self._make_engine()
            self.snapshot = take_snapshot(self.engine)
        except BaseException as e:
            self._ready.set_exception(e)
            return
        self._ready.set_result(self.engine)
        try:
            self._loop()
        finally:  # also when a step raised: later calls fail at once instead of waiting forever
            self._stopped.set()
            self._fail_queued()

    def call(self, fn: Callable[[Engine], T]) -> Future[T]:
        future: Future[T] = Future()
        if self._stopped.is_set():
            future.set_exception(RuntimeError("engine thread stopped"))
        else:
            self._calls.put((fn, future))
        return future

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._calls.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run_calls(self, block: bool) -> None:
        while True:
            try:
                item = self._calls.get(block=block, timeout=0.1 if block else None)
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine))
            except BaseException as e:
                future.set_exception(e)
                if isinstance(e, EngineFatal):
                    log.error("engine call failed, the engine cannot go on: %s", e)
                    raise

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopped.is_set():
            self._run_calls(block=not engine.has_unfinished())
            if engine.has_unfinished():
                self.snapshot = take_snapshot(engine)  # what the step is about to work on
                t0 = time.time()
                try:
                    outputs = engine.step()
                except Exception:
                    log.exception("engine step failed")
                    raise
                self._on_outputs(outputs, t0, time.time())
            self.snapshot = take_snapshot(engine)

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].set_exception(RuntimeError("engine thread stopped"))
