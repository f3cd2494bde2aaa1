"""The groups of one mesh pair: a gloo group always, and NCCL where both members are on different GPUs and can.

Which transport a pair wants follows from both placements (paths.choose_path, symmetric: both members see the
same). A pair that wants NCCL is three 2-process groups under the pair's store prefix:

- the gloo group every pair has: host tensors (the data plane's header, verdict and trailer words, p2p ops on CPU
  tensors);
- two NCCL groups, one per direction, whose rank 0 only sends and rank 1 only receives: the CUDA tensors. One
  communicator runs its point-to-point ops in posting order on one stream, so two members that each posted a send
  before a receive on one communicator would wait on each other for good; a communicator per direction cannot.

Whether it gets NCCL is agreed in the pair's store, in rounds: each member writes a flag and reads the other's.
`can`: this process has an NCCL factory (by default: it runs on a GPU, `torch.distributed.is_nccl_available()`
and `torch.cuda.is_available()`; only a process placed on a GPU asks). `formed`: it built both groups (NCCL builds
its communicators lazily, so this needs nothing of the peer). `warm`: one byte went each way, which creates the
communicators now, not on a request's path. The pair is NCCL only when every flag of both reads 1; a member that
drops out writes 0 for the rounds left, and a flag that does not come within the timeout counts as 0. Anything else
leaves the pair on its gloo group, host-staged (logged), as before NCCL pairs existed.

On an NCCL pair, p2p ops on CUDA tensors take the NCCL groups and match in posting order per direction, as on any
NCCL group (tags are ignored): both members must post them in the same order, as the collectives do. The data
plane's payloads also take them, one at a time per direction (`Pair.receiving`); they are not ordered against p2p
ops of other threads on the same pair and direction.

The factories are injectable per transport (`Mesh(factories=...)`): the CPU tests form a pair through a fake NCCL
factory that builds a gloo group.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .paths import GLOO, MESH_TRANSPORTS, NCCL, Placement, choose_path
from .waits import block

log = logging.getLogger("spindle.transfer.mesh")
# the agreement's rounds, and what a 0 in each means
ROUNDS = {
    "can": "NCCL is not available",
    "formed": "forming the NCCL groups failed",
    "warm": "the first NCCL transfer failed",
}
HOST = torch.device("cpu")


@dataclass(frozen=True)
class Channel:
    """One 2-process group and the device of the tensors it carries."""

    group: Any  # a c10d backend: ProcessGroupGloo, ProcessGroupNCCL (or a test's stand-in)
    device: torch.device


# (the pair's store, this process's rank in the group, the timeout, this process's device) -> the group
GroupFactory = Callable[[dist.Store, int, timedelta, torch.device], Channel]


def gloo_group(store: dist.Store, rank: int, timeout: timedelta, device: torch.device) -> Channel:
    return Channel(dist.ProcessGroupGloo(store, rank, 2, timeout), HOST)


def nccl_group(store: dist.Store, rank: int, timeout: timedelta, device: torch.device) -> Channel:
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=False)
    options._timeout = timeout
    options.global_ranks_in_group = [0, 1]
    return Channel(dist.ProcessGroupNCCL(store, rank, 2, options), device)


def nccl_available() -> bool:
    """Whether this process can form NCCL groups (asked only by a process placed on a GPU)."""
    return dist.is_nccl_available() and torch.cuda.is_available()


def default_factories(place: Placement) -> dict[str, GroupFactory]:
    """gloo always; NCCL for a process on a GPU that has it."""
    factories: dict[str, GroupFactory] = {GLOO: gloo_group}
    if place.on_gpu and nccl_available():
        # a timed-out NCCL op aborts its communicator only (torch's default ends the process): a dead peer must
        # fail its own pair, as on gloo. Set here, before any formation thread: NCCL reads it in each group's
        # constructor, and setenv racing getenv on another thread is unsafe.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        factories[NCCL] = nccl_group
    return factories


def carried(nccl: bool) -> frozenset[str]:
    """What a mesh pair can carry, with or without an agreed NCCL pair."""
    return MESH_TRANSPORTS if nccl else MESH_TRANSPORTS - {NCCL}


def pair_transport(a: Placement, b: Placement, nccl: bool) -> str:
    """The transport of a pair at `a` and `b`, with or without an agreed NCCL pair."""
    return choose_path(a, b, carried(nccl))


class Pair:
    """A formed pair. For p2p (`route`) an NCCL pair is itself the group: CUDA tensors take the NCCL channels, host
    tensors the gloo group; a host-staged or gloo pair routes to its gloo group as it is."""

    def __init__(self, transport: str, gloo: Channel, out: Channel | None = None, into: Channel | None = None) -> None:
        self.transport = transport
        self.gloo, self.out, self.into = gloo, out, into
        # the data plane lets one payload at a time into a direction: NCCL matches them in posting order
        self.receiving = threading.Lock()

    @property
    def nccl(self) -> bool:
        return self.out is not None

    @property
    def group(self) -> Any:
        return self if self.nccl else self.gloo.group

    # ---- the c10d calls p2p makes (peer: the other's rank in the gloo group) ----

    def name(self) -> str:
        return "cpu:gloo,cuda:nccl"  # read by p2p's staging: CUDA tensors here are not staged

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> dist.Work:
        if self.out is not None and tensors[0].is_cuda:
            return self.out.group.send(tensors, 1, 0)
        return self.gloo.group.send(tensors, peer, tag)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> dist.Work:
        if self.into is not None and tensors[0].is_cuda:
            return self.into.group.recv(tensors, 0, 0)
        return self.gloo.group.recv(tensors, peer, tag)

    # ---- the data plane's payloads on an NCCL pair ----

    def send_payload(self, tensor: torch.Tensor) -> dist.Work:
        assert self.out is not None
        return self.out.group.send([tensor], 1, 0)

    def recv_payload(self, tensor: torch.Tensor) -> dist.Work:
        assert self.into is not None
        return self.into.group.recv([tensor], 0, 0)

    def abort(self) -> None:
        """End the NCCL groups (their pending ops fail); a gloo-only pair is left to be dropped, as ever."""
        for channel in (self.out, self.into):
            if channel is not None:
                _abort(channel)


def form_pair(
    store: dist.Store,
    prefix: str,
    rank: int,
    here: Placement,
    there: Placement,
    factories: Mapping[str, GroupFactory],
    timeout: timedelta,
) -> tuple[Pair, str | None]:
    """Form the pair's groups under `prefix` (`rank`: 0 for the lower global rank). Returns the pair and, for a pair
    that wanted NCCL and did not get it, why."""
    device = torch.device(here.device)
    gloo = factories[GLOO](dist.PrefixStore(prefix, store), rank, timeout, device)
    if pair_transport(here, there, nccl=True) != NCCL:
        return Pair(pair_transport(here, there, nccl=False), gloo), None
    flags = dist.PrefixStore(f"{prefix}/nccl", store)
    channels: list[Channel] = []
    for step in ROUNDS:
        error = None
        try:
            if step == "can" and NCCL not in factories:
                error = ""
            elif step == "formed":  # both sides in the same order: a factory may wait for the peer (gloo's does)
                channels.append(factories[NCCL](dist.PrefixStore(f"{prefix}/nccl-up", store), rank, timeout, device))
                down = dist.PrefixStore(f"{prefix}/nccl-down", store)
                channels.append(factories[NCCL](down, 1 - rank, timeout, device))
            elif step == "warm":
                _warm(*(channels if rank == 0 else channels[::-1]))
        except Exception as e:
            error = _first_line(e)
        if not _agree(flags, step, rank, error is None):
            for later in list(ROUNDS)[list(ROUNDS).index(step) + 1 :]:
                flags.set(f"{later}/{rank}", "0")  # the peer need not wait for flags that will never be 1
            for channel in channels:
                _abort(channel)
            why = "on the peer" if error is None else f"here: {error}" if error else "here"
            return Pair(pair_transport(here, there, nccl=False), gloo), f"{ROUNDS[step]} {why}"
    out, into = channels if rank == 0 else channels[::-1]
    return Pair(NCCL, gloo, out, into), None


def _agree(flags: dist.Store, step: str, rank: int, ok: bool) -> bool:
    flags.set(f"{step}/{rank}", "1" if ok else "0")
    if not ok:
        return False
    try:
        return flags.get(f"{step}/{1 - rank}") == b"1"
    except Exception:  # not within the store's timeout
        return False


def _warm(out: Channel, into: Channel) -> None:
    sent = torch.ones(1, dtype=torch.uint8, device=out.device)
    got = torch.zeros(1, dtype=torch.uint8, device=into.device)
    works = [(out.group.send([sent], 1, 0), out), (into.group.recv([got], 0, 0), into)]
    for work, channel in works:
        block(work, channel.device.type == "cuda")
    if int(got.item()) != 1:
        raise RuntimeError("the first byte arrived wrong")


def _abort(channel: Channel) -> None:
    try:
        channel.group.abort()
    except Exception as e:
        log.debug("aborting an NCCL channel: %s", e)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
