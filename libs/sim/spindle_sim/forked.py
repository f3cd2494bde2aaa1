"""One function over many items in forked processes (`spindle sim compare --jobs`).

A simulator setup holds caches that do not pickle, so the items stay in the parent and the children inherit them
at fork: only an item's index goes out, and only the function's (picklable) result comes back. With one job, or one
item, everything runs here, in order."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

_WORK: tuple[Callable[[Any], Any], Sequence[Any]] | None = None  # what the forked children run


def _run(index: int) -> Any:
    assert _WORK is not None, "a forked child without work"
    fn, items = _WORK
    return fn(items[index])


def map_forked(fn: Callable[[Any], Any], items: Sequence[Any], jobs: int) -> list[Any]:
    """[fn(x) for x in items], `jobs` at a time in forked processes (results in the items' order)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if jobs == 1 or len(items) < 2:
        return [fn(x) for x in items]
    global _WORK
    _WORK = (fn, items)
    try:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=min(jobs, len(items)), mp_context=ctx) as pool:
            return list(pool.map(_run, range(len(items))))
    finally:
        _WORK = None
