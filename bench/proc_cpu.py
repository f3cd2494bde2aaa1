"""CPU seconds per process of a process tree, from /proc (Linux): where a server's cores went during a run.

`snapshot(root_pid)` reads utime + stime of `root_pid` and every descendant; `cpu_delta(before, after)` turns two
snapshots into seconds per process name (processes of the same name summed: `spindle_gateway`, `VLLM::Worker`).
A process's name is the module of `python -m MODULE`, else its `comm` (vLLM renames its workers there).
"""

from __future__ import annotations

import os
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float, str] | None:
    """(parent pid, CPU seconds, comm) of `pid`, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()  # fields[0] is the state (field 3 of proc(5))
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS, comm


def _name(pid: int, comm: str) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return comm
    args = [a.decode(errors="replace") for a in argv if a]
    if "-m" in args[:-1] and comm.startswith("python"):
        return args[args.index("-m") + 1]
    return comm


def snapshot(root_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds so far) for `root_pid` and all its descendants."""
    stats: dict[int, tuple[int, float, str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            stats[int(entry.name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, tuple[str, float]] = {}
    todo = [root_pid] if root_pid in stats else []
    while todo:
        pid = todo.pop()
        _, seconds, comm = stats[pid]
        out[pid] = (_name(pid, comm), seconds)
        todo += children.get(pid, [])
    return out


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per process name between two snapshots (a process missing from `before` counts from 0)."""
    out: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        spent = seconds - (before[pid][1] if pid in before else 0.0)
        out[name] = round(out.get(name, 0.0) + spent, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
