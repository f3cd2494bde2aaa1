"""Host staging for point-to-point ops on groups that carry only host tensors (gloo).

gloo's send and recv take CPU tensors only, while NCCL takes CUDA tensors as they are. So when the group that
carries an op is a gloo group and the tensor lives on a GPU (any non-CPU device), `p2p` stages it through host
memory:

- send: the tensor is copied into a host buffer (blocking: the bytes are on the host before gloo reads them), and
  that buffer is sent;
- recv: gloo receives into a host buffer, and `StagedRecv` copies it into the caller's tensor when the receive
  completes, i.e. in the first `wait()` (gloo completes a recv only inside `wait()`). On a GPU the copy is
  enqueued on the stream that was current when the recv was posted: like NCCL's `wait()`, it orders that stream
  after the data, without blocking the host on the GPU.

The host buffers are pinned for a CUDA tensor (the copies are then direct DMA, and a non-blocking copy from them
is safe). They are allocated per op: torch's caching host allocator hands freed pinned blocks to the next op, so
no cache of our own is kept. CPU tensors on gloo, and CUDA tensors on NCCL, go as they are: no copy at all.

`FORCE_FOR_TESTS` stages every op, CPU tensors included: the tests exercise this code on real gloo groups on
machines without a GPU.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

FORCE_FOR_TESTS = False  # tests only: stage every op (CPU tensors too), as a GPU tensor on gloo would be


def needs_staging(device_type: str, backend: str) -> bool:
    """Whether a tensor on a `device_type` device crosses a group of `backend` through host memory.

    `backend` is `dist.get_backend`'s string: one backend ("gloo", "nccl") or one per device type
    ("cpu:gloo,cuda:nccl"), where the device's own one carries its tensors (and the CPU's one, when the device
    has none). Only gloo needs it, and only for tensors that are not on the CPU.
    """
    if device_type == "cpu":
        return False
    carrier = backend
    if ":" in backend:
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        carrier = per_device.get(device_type, per_device.get("cpu", ""))
    return carrier == "gloo"


def backend_of(group: dist.ProcessGroup | None) -> str:
    """The backend of the group that carries an op: a registered `ProcessGroup` (None: the default one), or a
    bare c10d backend such as the `ProcessGroupGloo` pair groups of spindle_transfer's `Mesh`, which are not in
    `torch.distributed`'s group map."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return str(dist.get_backend(group))
    return group.name()


def stages(tensor: Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether an op on `tensor` carried by `group` goes through host memory (for a CPU tensor: two attribute
    checks, no backend lookup)."""
    if FORCE_FOR_TESTS:
        return True
    return not tensor.is_cpu and needs_staging(tensor.device.type, backend_of(group))


def _host_like(tensor: Tensor) -> Tensor:
    """An uninitialised contiguous host tensor of `tensor`'s shape and dtype, pinned for a CUDA tensor."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)


def to_host(tensor: Tensor) -> Tensor:
    """A contiguous host copy of `tensor` (any layout), complete when this returns: what a staged send sends."""
    host = _host_like(tensor)
    host.copy_(tensor.detach())  # blocking: gloo reads the buffer as soon as the send is posted
    return host


def recv_buffer(tensor: Tensor) -> Tensor:
    """The host buffer a staged recv into `tensor` receives into."""
    return _host_like(tensor)


class StagedRecv(dist.Work):
    """The handle of a recv staged through `host`: `work`'s, plus the copy into `target` (the caller's tensor,
    any device and layout) once the receive completes.

    `wait()` waits for `work` and then lands the data in `target`; later waits return at once (a gloo recv's own
    second `wait()` would wait for another message). `is_completed()` is True from then on. Until then `target`
    is untouched.
    """

    def __init__(self, work: dist.Work, host: Tensor, target: Tensor) -> None:
        super().__init__()
        assert host.shape == target.shape and host.dtype == target.dtype and host.device.type == "cpu"
        self._work = work
        self._host: Tensor | None = host
        self._target = target
        # the caller's stream now: the copy is ordered on it, even when another thread waits
        self._stream = torch.cuda.current_stream(target.device) if target.is_cuda else None
        self._lock = threading.Lock()
        self._landed = False

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._landed:
            return True  # gloo would wait for another message: a recv completes once
        done = self._work.wait(timeout)  # raises when the peer is gone or the wait timed out
        if done:
            self._land()
        return done

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self._landed

    def exception(self) -> BaseException | None:
        return self._work.exception()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def _land(self) -> None:
        with self._lock:
            if self._landed:
                return
            assert self._host is not None
            if self._stream is not None:
                # pinned source: asynchronous on the caller's stream; the caching host allocator keeps the
                # buffer until the copy is done, so it can be dropped now
                with torch.cuda.stream(self._stream):
                    self._target.copy_(self._host, non_blocking=True)
            else:
                self._target.copy_(self._host)
            self._host = None
            self._landed = True
