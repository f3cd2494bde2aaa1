"""DataPlane: header-checked point-to-point tensor transfers between the data plane's ranks.

The ranks meet on a mesh (`mesh://`: one gloo group per pair of processes, so members may die, restart and join;
mesh.py) or in one fixed torch.distributed world (`tcp://` and torch's other init methods: the library tests).

The receiver picks the tag (`new_tag`) and tells the sender over the control plane; both sides then use
it for the four messages of wire.py. The header exchange, the one wait that may never end (the peer may
never post its side), has a deadline and a cancel event; after it both sides are committed and the rest
completes or fails with the peer's death. No timeout or cancel ever breaks the process group: see
`Pending` for why that waiting is done in Python, not by gloo.

In a fixed NCCL world, tags are ignored (ops between two ranks match in posting order), so transfers between the
same pair must be posted in the same order on both sides; gloo honours tags and allows concurrent transfers. On a
mesh's NCCL pair (pairs.py) the header, verdict and trailer go by the pair's gloo group, tags honoured, and only the
payload by NCCL: the receiver lets one payload at a time into each direction, so concurrent transfers stay matched.

Tensors cross on the wire's device (`self.device`: the host for gloo; on a mesh's NCCL pair, the GPU of that pair's
NCCL groups). A tensor on another device is staged (staging.py): `send` copies it to the wire first (a GPU tensor
into pinned host memory), and `recv(device=...)` or an `out` elsewhere lands it there after the transfer
committed. Each rank announces where it runs (its `Placement`) when it joins a mesh, and the transport of each pair
is chosen from both (paths.py, `paths()`).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from datetime import timedelta
from functools import partial
from typing import TypeVar
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from spindle_attention.distributed import p2p
from spindle_protocol import TensorHeader, check_header

from .errors import HeaderMismatchError, TransferError
from .mesh import Mesh
from .pairs import Pair
from .paths import Placement
from .staging import check_landing, land, receive_buffer, staged, to_wire
from .store import serve_store
from .waits import Pending, block, wait_for
from .wire import (
    ABORT,
    ACCEPT,
    CANCELLED,
    COMMIT,
    DTYPES,
    HEADER_WORDS,
    REJECT,
    decode_header,
    decode_signal,
    encode_header,
    encode_signal,
    header_of,
)

MAX_TAG = 2**31 - 1
# Tags new_tag hands out stay below this: 2**30 and up belong to the group collectives written with point-to-point
# ops on the same group (spindle_attention.distributed.comm.RANK_GROUP_TAG: SP rings, re-balancing, KVP decode).
HANDSHAKE_TAGS_END = 2**30
T = TypeVar("T")


class DataPlane:
    """This process's rank in the data-plane group and the transfers it makes."""

    def __init__(
        self, rank: int, world_size: int, backend: str, max_workers: int = 16, place: Placement | None = None
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r} must be 'gloo' or 'nccl'")
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._tag_lock = threading.Lock()
        self._tag_slots = (HANDSHAKE_TAGS_END - 1) // world_size
        self._next_tag = 0
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="spindle-transfer")
        self.mesh: Mesh | None = None  # set by init() for a mesh:// data plane
        self.place = place or Placement.here()  # where this rank's tensors live (its engine's device)

    @classmethod
    def init(
        cls,
        rank: int,
        world_size: int,
        init_method: str,
        backend: str | None = None,
        timeout_s: float = 60.0,
        max_workers: int = 16,
        device: str = "cpu",
    ) -> DataPlane:
        """Join the data plane at `init_method`, as a rank whose tensors live on `device` ("cpu", "cuda:N").

        `mesh://HOST:PORT`: the mesh at that rendezvous (spindle_transfer.rendezvous): one gloo group per pair of
        processes (and NCCL ones between two GPUs), formed as members join, so any member may die and come back;
        returns at once. `tcp://...` and torch's other init methods: one fixed world (blocks until all `world_size`
        ranks have joined or `timeout_s` passes); rank 0 hosts the store for a loopback `tcp://`.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        place = Placement.here(device)
        url = urlparse(init_method)
        if url.scheme == "mesh":
            if backend not in (None, "gloo"):
                raise ValueError(f"the mesh picks each pair's backend (gloo, NCCL between GPUs); got {backend!r}")
            if not url.hostname or not url.port:
                raise ValueError(f"{init_method!r} is not mesh://HOST:PORT")
            if sys.platform == "linux" and url.hostname in ("127.0.0.1", "localhost"):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            plane = cls(rank, world_size, "gloo", max_workers, place)
            plane.mesh = Mesh(url.hostname, url.port, rank, timeout_s, place=place)
            p2p.install(plane.mesh)
            return plane
        backend = backend or fixed_world_backend(place)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = timedelta(seconds=timeout_s)
        if url.scheme == "tcp" and url.hostname in ("127.0.0.1", "localhost") and url.port:
            # Loopback only: torch's own tcp:// store would listen on every interface, and gloo on the
            # hostname's address. Rank 0 hosts the store on a socket bound to 127.0.0.1 instead.
            if backend == "gloo" and sys.platform == "linux":
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            store = _loopback_store(url.port, rank, world_size, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
        return cls(rank, world_size, backend, max_workers, place)

    def paths(self) -> dict[int, str]:
        """peer rank -> the transport of its pair (paths.py): the mesh's per pair, or a fixed world's backend."""
        if self.mesh is not None:
            return self.mesh.paths()
        return {peer: self.backend for peer in range(self.world_size) if peer != self.rank}

    def new_tag(self) -> int:
        """A tag for a receive this process posts; tags of different ranks never collide."""
        with self._tag_lock:
            k = self._next_tag
            self._next_tag = (k + 1) % self._tag_slots
        return 1 + self.rank + k * self.world_size

    # ---- blocking API (call from worker threads) ----

    def send(
        self,
        tensor: torch.Tensor,
        dst: int,
        tag: int,
        header: TensorHeader,
        *,
        cancel: threading.Event | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        """Send `tensor` (described by `header`) to `dst`, whose matching `recv` uses the same tag.

        `cancel` and `timeout_s` bound the wait for the receiver to take the header; after that the payload
        goes (or the peer's death ends it) and a cancel seen meanwhile makes the receiver discard it.
        """
        self._check_peer(dst, tag)
        check_header(header)
        if header_of(tensor) != header:
            raise ValueError(f"tensor {tensor.dtype}{list(tensor.shape)} does not match its header {header}")
        what = f"send of {header.dtype}{header.shape} to rank {dst} (tag {tag})"
        deadline = time.monotonic() + timeout_s
        pair = self._nccl_pair(dst)
        payload = to_wire(tensor, pair.out.device if pair is not None else self.device).reshape(-1).view(torch.uint8)
        verdict_buf = torch.empty(2, dtype=torch.int64, device=self.device)
        head = self._post(p2p.isend, encode_header(header, self.device), dst, tag)
        verdict = self._post(p2p.irecv, verdict_buf, dst, tag)
        late = partial(self._finish_abandoned_send, verdict, verdict_buf, payload, dst, tag, pair)
        wait_for(self._watch(head, late), f"{what}: header", deadline, cancel)
        self._complete(verdict, f"{what}: verdict")
        answer = self._signal_value(verdict_buf, (ACCEPT, REJECT, CANCELLED), what)
        if answer == REJECT:
            raise HeaderMismatchError(f"{what}: the receiver refused the header {header}")
        if answer == CANCELLED:
            raise TransferError(f"{what}: the receiver cancelled")
        cancelled = cancel is not None and cancel.is_set()
        if header.nbytes:
            self._complete(self._post(self._payload_op(pair, True), payload, dst, tag), f"{what}: payload", payload)
        trailer = encode_signal(ABORT if cancelled else COMMIT, self.device)
        self._complete(self._post(p2p.isend, trailer, dst, tag), f"{what}: trailer")
        if cancelled:
            raise TransferError(f"{what} was cancelled")

    def recv(
        self,
        expect: TensorHeader,
        src: int,
        tag: int,
        *,
        out: torch.Tensor | None = None,
        cancel: threading.Event | None = None,
        timeout_s: float = 60.0,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Receive the tensor `src` sends under `tag`, after checking its header equals `expect` exactly.

        A different header is refused (HeaderMismatchError) before any payload buffer is posted, and the
        sender learns it. `cancel` and `timeout_s` bound the wait for the header (TransferError); once the
        header is accepted the payload lands in full (into `out` when given) unless the peer dies, and a
        cancel seen by then raises TransferError afterwards, so `out` is never written after we return.
        The tensor lands on `device` (default: the wire's), or on `out`'s device; off the wire's it is staged
        through a (pinned) host buffer and copied there once the sender committed it.
        """
        self._check_peer(src, tag)
        check_header(expect)
        dtype = DTYPES[expect.dtype]
        if out is not None and (out.dtype != dtype or list(out.shape) != expect.shape or not out.is_contiguous()):
            raise ValueError(f"out {out.dtype}{list(out.shape)} on {out.device} cannot hold {expect}")
        landing = check_landing(out.device if out is not None else (device or self.device))
        if out is not None and device is not None and staged(check_landing(device), landing):  # "cuda" is cuda:0
            raise ValueError(f"out is on {out.device}, not on device {device}")
        what = f"receive of {expect.dtype}{expect.shape} from rank {src} (tag {tag})"
        deadline = time.monotonic() + timeout_s
        pair = self._nccl_pair(src)
        wire = pair.into.device if pair is not None else self.device
        words = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
        head = self._post(p2p.irecv, words, src, tag)
        refuse_late = partial(self._send_signal, CANCELLED, src, tag, what)
        wait_for(self._watch(head, refuse_late), f"{what}: header", deadline, cancel)
        try:
            check_header(decode_header(words), expect)
        except ValueError as e:
            self._send_signal(REJECT, src, tag, what)
            raise HeaderMismatchError(f"{what}: {e}") from e
        if cancel is not None and cancel.is_set():
            self._send_signal(CANCELLED, src, tag, what)
            raise TransferError(f"{what} was cancelled")
        result = out if out is not None and out.device == wire else receive_buffer(expect.shape, dtype, wire, landing)
        # Post payload and trailer before accepting: gloo matches the ops of one tag in posting order.
        trailer_buf = torch.empty(2, dtype=torch.int64, device=self.device)
        with pair.receiving if pair is not None and expect.nbytes else nullcontext():  # NCCL: one payload at a time
            body = None
            if expect.nbytes:
                body = self._post(self._payload_op(pair, False), result.reshape(-1).view(torch.uint8), src, tag)
            trailer = self._post(p2p.irecv, trailer_buf, src, tag)
            self._send_signal(ACCEPT, src, tag, what)
            if body is not None:
                self._complete(body, f"{what}: payload", result)
        self._complete(trailer, f"{what}: trailer")
        if self._signal_value(trailer_buf, (COMMIT, ABORT), what) == ABORT:
            raise TransferError(f"{what}: the sender gave up")
        if cancel is not None and cancel.is_set():
            raise TransferError(f"{what} was cancelled")
        return land(result, landing, out)

    # ---- asyncio API: the blocking calls run on this DataPlane's own thread pool ----

    async def send_async(
        self,
        tensor: torch.Tensor,
        dst: int,
        tag: int,
        header: TensorHeader,
        *,
        cancel: threading.Event | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        cancel = cancel or threading.Event()
        await self._in_pool(partial(self.send, tensor, dst, tag, header, cancel=cancel, timeout_s=timeout_s), cancel)

    async def recv_async(
        self,
        expect: TensorHeader,
        src: int,
        tag: int,
        *,
        out: torch.Tensor | None = None,
        cancel: threading.Event | None = None,
        timeout_s: float = 60.0,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        cancel = cancel or threading.Event()
        fn = partial(self.recv, expect, src, tag, out=out, cancel=cancel, timeout_s=timeout_s, device=device)
        return await self._in_pool(fn, cancel)

    def close(self) -> None:
        """Leave the process group; waits still pending end with an error."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.mesh is not None:
            self.mesh.close()
            if p2p.installed() is self.mesh:
                p2p.install(None)
        elif dist.is_initialized():
            dist.destroy_process_group()

    # ---- internals ----

    async def _in_pool(self, fn: Callable[[], T], cancel: threading.Event) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        except asyncio.CancelledError:  # the awaiting task was cancelled: stop the transfer too
            cancel.set()
            raise

    def _check_peer(self, peer: int, tag: int) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"peer rank {peer} is not another rank of [0, {self.world_size})")
        if not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tag {tag} is not in [0, {MAX_TAG}]")

    def _post(self, op: Callable, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        try:
            return op(tensor, peer, tag=tag)
        except RuntimeError as e:  # gloo raises at once when the pair is already closed
            raise TransferError(f"rank {peer} is unreachable: {e}") from e

    def _nccl_pair(self, peer: int) -> Pair | None:
        """The mesh's pair with `peer` when it is an NCCL one (the payload goes by NCCL), else None."""
        if self.mesh is None:
            return None
        try:
            pair = self.mesh.pair(peer)  # waits for a pair still forming, as the header's post would
        except RuntimeError as e:
            raise TransferError(f"rank {peer} is unreachable: {e}") from e
        return pair if pair.nccl else None

    def _payload_op(self, pair: Pair | None, send: bool) -> Callable[..., dist.Work]:
        if pair is None:
            return p2p.isend if send else p2p.irecv
        payload_op = pair.send_payload if send else pair.recv_payload
        return lambda tensor, peer, tag: payload_op(tensor)

    def _watch(self, work: dist.Work, on_late: Callable[[], None] | None = None) -> Pending:
        return Pending(work, self.backend == "nccl", on_late)

    def _complete(self, work: dist.Work, what: str, tensor: torch.Tensor | None = None) -> None:
        """Wait for an op the peer is committed to match (it has posted or is about to post its side); `tensor`: the
        op's, when it may be on a GPU (an NCCL op's completion is polled)."""
        try:
            block(work, self.backend == "nccl" or (tensor is not None and tensor.is_cuda))
        except RuntimeError as e:
            raise TransferError(f"{what} failed: {e}") from e

    def _signal_value(self, words: torch.Tensor, allowed: tuple[int, ...], what: str) -> int:
        try:
            return decode_signal(words, allowed)
        except ValueError as e:
            raise TransferError(f"{what}: {e}") from e

    def _send_signal(self, value: int, peer: int, tag: int, what: str) -> None:
        self._complete(self._post(p2p.isend, encode_signal(value, self.device), peer, tag), f"{what}: signal")

    def _finish_abandoned_send(
        self,
        verdict: dist.Work,
        verdict_buf: torch.Tensor,
        payload: torch.Tensor,
        dst: int,
        tag: int,
        pair: Pair | None,
    ) -> None:
        """The receiver took a header we had given up on: finish the exchange with ABORT so it stops waiting."""
        block(verdict, self.backend == "nccl")
        if decode_signal(verdict_buf, (ACCEPT, REJECT, CANCELLED)) != ACCEPT:
            return
        if payload.numel():
            work = self._post(self._payload_op(pair, True), payload, dst, tag)
            block(work, self.backend == "nccl" or payload.is_cuda)
        block(self._post(p2p.isend, encode_signal(ABORT, self.device), dst, tag), self.backend == "nccl")


def fixed_world_backend(place: Placement) -> str:
    """A fixed world's backend when none is named: NCCL for a rank on a GPU, gloo for one whose tensors are in host
    memory (a kvstore) even on a machine with GPUs. Every rank of a fixed world must agree: a world that mixes
    devices uses a mesh:// plane (a backend per pair)."""
    return "nccl" if place.on_gpu else "gloo"


def _loopback_store(port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    return serve_store("127.0.0.1", port, timeout)
