"""Point-to-point ops on global ranks, carried by whichever process group connects this process with the peer.

Every Spindle collective is written with point-to-point ops on global ranks (`RankGroup`), so the data plane
needs no world-wide group: a `Router` (spindle_transfer's `Mesh`: one gloo group per pair of processes, formed
and re-formed as processes come and go) can carry the traffic instead. Without a router installed, the ops go
to the default group exactly as `torch.distributed`'s do (a fixed world: the library tests, `spindle verify`).

The functions take `torch.distributed`'s arguments; an explicit `group` (a real `ProcessGroup`) always goes to
`torch.distributed` itself.

They are device-aware: a tensor that is not on the CPU, carried by a gloo group (which takes host tensors only),
is staged through host memory (`staging`); a receive's handle copies the data into the caller's tensor at
`wait()`. CPU tensors on gloo and CUDA tensors on NCCL go as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from . import staging


class PeerUnreachable(RuntimeError):
    """No group connects this process with the peer (it never joined, or its group could not be formed). A
    RuntimeError, as gloo's own error for a closed pair is, so callers treat both alike."""


class Router(Protocol):
    """Where the traffic to a global rank goes."""

    @property
    def rank(self) -> int: ...

    def route(self, peer: int) -> tuple[dist.ProcessGroup, int]:
        """(the group that connects us with `peer`, `peer`'s rank in it); PeerUnreachable when there is none."""
        ...


_router: Router | None = None


def install(router: Router | None) -> None:
    """Route this process's point-to-point ops through `router` (None: back to the default group)."""
    global _router
    _router = router


def installed() -> Router | None:
    return _router


def rank() -> int:
    """This process's global rank."""
    return _router.rank if _router is not None else dist.get_rank()


def _routed(group: dist.ProcessGroup | None) -> bool:
    return _router is not None and (group is None or group is dist.group.WORLD)


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> dist.Work:
    if not _routed(group):
        if staging.stages(tensor, group):
            tensor = staging.to_host(tensor)
        return dist.isend(tensor, dst, group=group, tag=tag)
    pg, peer = _router.route(dst)  # type: ignore[union-attr]
    if staging.stages(tensor, pg):
        tensor = staging.to_host(tensor)
    return pg.send([tensor], peer, tag)


def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> dist.Work:
    if not _routed(group):
        if not staging.stages(tensor, group):
            return dist.irecv(tensor, src, group=group, tag=tag)
        buf = staging.recv_buffer(tensor)
        return staging.StagedRecv(dist.irecv(buf, src, group=group, tag=tag), buf, tensor)
    pg, peer = _router.route(src)  # type: ignore[union-attr]
    if not staging.stages(tensor, pg):
        return pg.recv([tensor], peer, tag)
    buf = staging.recv_buffer(tensor)
    return staging.StagedRecv(pg.recv([buf], peer, tag), buf, tensor)


@dataclass(frozen=True)
class Op:
    """One op of a batch: `dist.P2POp`'s fields (which needs the default group even to be built)."""

    op: Callable[..., dist.Work]  # isend or irecv (this module's)
    tensor: torch.Tensor
    peer: int
    group: dist.ProcessGroup | None = None
    tag: int = 0


def batch_isend_irecv(ops: list[Op]) -> list[dist.Work]:
    """`dist.batch_isend_irecv`; routed or staged ops are posted one by one in order (what gloo does with a batch
    too)."""
    if ops and not all(_routed(o.group) for o in ops) and not any(staging.stages(o.tensor, o.group) for o in ops):
        as_dist = {isend: dist.isend, irecv: dist.irecv}
        return dist.batch_isend_irecv([dist.P2POp(as_dist[o.op], o.tensor, o.peer, o.group, o.tag) for o in ops])
    return [o.op(o.tensor, o.peer, o.group, o.tag) for o in ops]
