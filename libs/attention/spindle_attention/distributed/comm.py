"""Small communication helpers shared by the distributed attention functions.

Everything here is plain `torch.distributed` and runs unchanged on gloo (CPU) and NCCL (GPU): metadata is
exchanged with `all_gather` of small int64 tensors on the data's device, tensors of several dtypes travel as
one byte buffer (`pack`/`unpack`) so each peer exchange is a single operation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

Group = dist.ProcessGroup | None


@dataclass
class CommStats:
    """What one call moved, recorded for benchmarks (never asserted on timing).

    `step_bytes_sent[i]`: bytes this rank sent in step/phase i (including padding); `step_payload_bytes[i]`:
    the useful part of them (the theoretical volume). `meta_bytes`: the small metadata exchange.
    `compute_s`/`wait_s`: host time spent in local attention and in waiting for communication (on a GPU
    these are enqueue times unless the caller synchronises).
    """

    step_bytes_sent: list[int] = field(default_factory=list)
    step_bytes_recv: list[int] = field(default_factory=list)
    step_payload_bytes: list[int] = field(default_factory=list)
    meta_bytes: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0

    @property
    def bytes_sent(self) -> int:
        return sum(self.step_bytes_sent) + self.meta_bytes

    def record(self, sent: int, recv: int, payload: int) -> None:
        self.step_bytes_sent.append(sent)
        self.step_bytes_recv.append(recv)
        self.step_payload_bytes.append(payload)


class Timer:
    """Adds elapsed host seconds to an attribute of a `CommStats` (no-op without stats)."""

    def __init__(self, stats: CommStats | None, attr: str) -> None:
        self.stats, self.attr = stats, attr

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.stats is not None:
            setattr(self.stats, self.attr, getattr(self.stats, self.attr) + time.perf_counter() - self.t0)


def group_rank_size(group: Group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group: Group, rank: int) -> int:
    """The global rank of group-local `rank` (what `P2POp` and `isend` expect as the peer)."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def all_gather_ints(values: list[int], group: Group, device: torch.device, stats: CommStats | None) -> list[list[int]]:
    """All-gather a short list of ints from every rank; returns one list per rank (rank order)."""
    _, size = group_rank_size(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(out, mine, group=group)
    if stats is not None:
        stats.meta_bytes += mine.numel() * 8 * max(size - 1, 0)
    return [[int(x) for x in t.tolist()] for t in out]


def as_bytes(t: Tensor) -> Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (a copy only when `t` is not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def pack(tensors: list[Tensor]) -> Tensor:
    """Concatenate tensors of any dtypes into one flat uint8 buffer. Put 8-byte dtypes first for alignment."""
    return torch.cat([as_bytes(t) for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)


def unpack(buf: Tensor, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[Tensor]:
    """Views of `buf` (uint8) as tensors of the given (dtype, shape), in order; inverse of `pack`."""
    out, offset = [], 0
    for dtype, shape in specs:
        n = 1
        for s in shape:
            n *= s
        size = torch.empty(0, dtype=dtype).element_size()
        piece = buf[offset : offset + n * size]
        if piece.storage_offset() % size:
            piece = piece.clone()  # misaligned for this dtype: a fresh buffer is aligned
        out.append(piece.view(dtype).view(shape))
        nbytes = n * size
        offset += nbytes
    assert offset <= buf.numel(), "buffer shorter than its specs"
    return out
