"""KV that reaches each rank of a tensor-parallel decode instance directly from the prefill holders.

A holder's KV part is `[2, layers, n, Hkv, D]` for its positions (in the order it holds them). Instead of
sending it whole to the leader, which would forward each follower its heads, the holder cuts it by the decode
ranks' head ranges (`spindle_engine.sp.split_for_decode`) and sends rank t its slice under tag `tags[t]`:
the sequence-sharded prefill layout becomes the head-sharded decode layout in that one transfer.

The leader tells each follower, in its control stream (a `ReceiveKV` call), where each part comes from and
which positions it covers; the follower posts the receive at once (`DirectReceives.post`) and puts its parts
in place by position when the mirrored `Resume` arrives (`DirectReceives.take`). Positions travel as runs
`[start, end)` of consecutive positions (`to_runs`), a few per holder for every SP layout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..sp.kv_parts import assemble_kv

# (src rank, tag, shape, dtype, cancel) -> the received tensor, later
Receiver = Callable[[int, int, tuple[int, ...], torch.dtype, threading.Event], "Future[Tensor]"]


def to_runs(positions: Tensor | list[int]) -> list[list[int]]:
    """`positions` in their order as `[[start, end), ...]` runs of consecutive increasing positions."""
    pos = torch.as_tensor(positions, dtype=torch.int64).flatten()
    if pos.numel() == 0:
        return []
    breaks = (pos[1:] != pos[:-1] + 1).nonzero().flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    ends = torch.cat([breaks, torch.tensor([pos.numel()])])
    return [[int(pos[s]), int(pos[e - 1]) + 1] for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]


def from_runs(runs: list[list[int]]) -> Tensor:
    """The positions `to_runs` encoded, in the same order."""
    for run in runs:
        if len(run) != 2 or not 0 <= run[0] < run[1]:
            raise ValueError(f"bad position run {run}")
    if not runs:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(s, e, dtype=torch.int64) for s, e in runs])


def slice_bytes(num_tokens: int, num_layers: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of the K and V of `num_tokens` tokens, `heads` KV heads, every layer: what one decode rank receives."""
    return 2 * num_layers * num_tokens * heads * head_dim * torch.empty(0, dtype=dtype).element_size()


@dataclass
class _Pending:
    parts: list[tuple[Tensor, Future[Tensor]]] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)


class DirectReceives:
    """A follower's receives of KV parts sent straight from the holders, per request, until `take` or `drop`."""

    def __init__(self, receiver: Receiver, kv_shape: Callable[[int], tuple[int, ...]], dtype: torch.dtype) -> None:
        self.receiver = receiver
        self.kv_shape = kv_shape
        self.dtype = dtype
        self.bytes = 0  # received and put in place, over the life of the engine
        self._pending: dict[str, _Pending] = {}

    def post(self, request_id: str, src: int, tag: int, runs: list[list[int]]) -> None:
        positions = from_runs(runs)
        pending = self._pending.setdefault(request_id, _Pending())
        future = self.receiver(src, tag, self.kv_shape(positions.numel()), self.dtype, pending.cancel)
        pending.parts.append((positions, future))

    def take(self, request_id: str, num_tokens: int, timeout_s: float) -> Tensor:
        """This rank's KV heads for positions [0, num_tokens), from every part posted for the request."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            raise ValueError(f"no KV parts were posted for {request_id!r}")
        try:
            parts = [(pos, fut.result(timeout_s)) for pos, fut in pending.parts]
        except BaseException:
            pending.cancel.set()
            raise
        kv = assemble_kv(parts, num_tokens)
        self.bytes += sum(t.numel() * t.element_size() for _, t in parts)
        return kv

    def drop(self, request_id: str) -> None:
        """The request went away before its KV was used: stop its receives."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending.cancel.set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending
