"""Small communication helpers shared by the distributed attention functions.

Everything here is plain `torch.distributed` and runs unchanged on gloo (CPU) and NCCL (GPU): metadata is
exchanged with `all_gather` of small int64 tensors on the data's device, tensors of several dtypes travel as
one byte buffer (`pack`/`unpack`) so each peer exchange is a single operation. On a gloo group, CUDA tensors go
through host memory (`staging`): point-to-point ops in `p2p`, the collectives of a process group here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from . import p2p, staging


@dataclass(frozen=True)
class RankGroup:
    """A group named by its global ranks that talks over the default group with point-to-point ops only.

    It needs no `new_group` (a collective over the whole world, or, with local synchronisation, broken on
    gloo in torch 2.13), so any set of ranks can form one at any moment, as SP chunks of a serving cluster
    do. Its traffic uses tags from `TAG_BASE` up, apart from the small tags other code uses.
    """

    ranks: tuple[int, ...]
    tag_base: int = 1 << 30  # RANK_GROUP_TAG; a caller that may abandon a group's ops gives each use its own

    def __post_init__(self) -> None:
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ValueError(f"a rank group needs distinct non-negative ranks, got {self.ranks}")


RANK_GROUP_TAG = 1 << 30  # RankGroup traffic: ring steps use this tag, metadata and all-to-all the next ones
_waits = threading.local()


def wait(work: dist.Work) -> None:
    """Wait for a RankGroup op: `work.wait()`, or the policy `waiting_with` installed on this thread (one that
    can give up, e.g. when a peer abandoned the group)."""
    policy = getattr(_waits, "policy", None)
    if policy is None:
        work.wait()
    else:
        policy(work)


@contextlib.contextmanager
def waiting_with(policy: Callable[[dist.Work], None]) -> Iterator[None]:
    """Within the block, this thread's RankGroup waits go through `policy(work)`."""
    before = getattr(_waits, "policy", None)
    _waits.policy = policy
    try:
        yield
    finally:
        _waits.policy = before


Group = dist.ProcessGroup | RankGroup | None


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
    bytes_by_phase: dict[str, int] = field(default_factory=dict)  # named phases' bytes sent (CSA: per level)
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
    if isinstance(group, RankGroup):
        me = p2p.rank()
        if me not in group.ranks:
            raise ValueError(f"rank {me} is not a member of {group}")
        return group.ranks.index(me), len(group.ranks)
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group: Group, rank: int) -> int:
    """The global rank of group-local `rank` (what `P2POp` and `isend` expect as the peer)."""
    if isinstance(group, RankGroup):
        return group.ranks[rank]
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def p2p_args(group: Group, tag: int = 0) -> tuple[dist.ProcessGroup | None, int]:
    """(group, tag) for a `P2POp`: a RankGroup sends on the default group under its own tag range."""
    if isinstance(group, RankGroup):
        return None, group.tag_base + tag
    return group, tag


def exchange(sends: list[Tensor], recvs: list[Tensor], group: Group, tag: int) -> None:
    """Send `sends[p]` to and receive `recvs[p]` from every other group rank p (own entries are ignored)."""
    rank, size = group_rank_size(group)
    pg, t = p2p_args(group, tag)
    ops = []
    for p in range(size):
        if p != rank:
            peer = global_rank(group, p)
            ops += [p2p.Op(p2p.isend, sends[p], peer, pg, t), p2p.Op(p2p.irecv, recvs[p], peer, pg, t)]
    if ops:
        for work in p2p.batch_isend_irecv(ops):
            wait(work)


def all_to_all_bytes(recv: Tensor, send: Tensor, recv_sizes: list[int], send_sizes: list[int], group: Group) -> None:
    """`all_to_all_single` on flat uint8 buffers; over point-to-point ops for a RankGroup; through host buffers for
    CUDA tensors on a gloo process group."""
    if not isinstance(group, RankGroup):
        if staging.stages(send, group):
            host = staging.recv_buffer(recv)
            dist.all_to_all_single(host, staging.to_host(send), recv_sizes, send_sizes, group=group)
            recv.copy_(host, non_blocking=host.is_pinned())  # the caching host allocator keeps `host` till done
        else:
            dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
        return
    rank, _ = group_rank_size(group)
    send_parts, recv_parts = list(send.split(send_sizes)), list(recv.split(recv_sizes))
    recv_parts[rank].copy_(send_parts[rank])
    # zero-byte messages still travel (1 byte) so both sides always post a matching pair
    sends = [p if p.numel() else send.new_zeros(1) for p in send_parts]
    bufs = [p if p.numel() else recv.new_empty(1) for p in recv_parts]
    exchange(sends, bufs, group, tag=2)
    for part, buf in zip(recv_parts, bufs, strict=True):
        if part.numel() and part.data_ptr() != buf.data_ptr():
            part.copy_(buf)


def all_gather_ints(values: list[int], group: Group, device: torch.device, stats: CommStats | None) -> list[list[int]]:
    """All-gather a short list of ints from every rank; returns one list per rank (rank order)."""
    rank, size = group_rank_size(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    if not isinstance(group, RankGroup) and staging.stages(mine, group):
        mine = staging.to_host(mine)  # gathered on the host, where the ints are read: no copy back
    out = [torch.empty_like(mine) for _ in range(size)]
    if isinstance(group, RankGroup):
        out[rank] = mine
        exchange([mine] * size, out, group, tag=1)
    else:
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
