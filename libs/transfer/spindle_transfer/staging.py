"""Copies between a tensor's device and the device a transport carries it on (the wire's).

gloo carries host tensors: a GPU tensor sent over it is first copied into a host buffer, and a receiver on a GPU
gets the bytes in a host buffer and copies them onto its device. Those host buffers are pinned (page-locked),
which makes the copies to and from the GPU direct DMA, when this process can pin: pinning needs CUDA, so on a
machine without it they are ordinary host memory (and on the CPU nothing is copied at all). torch's caching host
allocator keeps freed pinned blocks for the next transfer.

Nothing here depends on which devices exist: the same code runs with `cpu` on both sides (no copy) and is tested
so; a GPU run of the same tests covers the copies.
"""

from __future__ import annotations

import torch

from spindle_attention.distributed.staging import to_host


def can_pin() -> bool:
    """Whether this process can allocate pinned host memory (it needs CUDA)."""
    return torch.cuda.is_available()


def host_buffer(shape: torch.Size | tuple[int, ...] | list[int], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor, pinned when `pin` and this process can pin."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin and can_pin())


def staged(tensor_device: torch.device, wire: torch.device) -> bool:
    """Whether a tensor on `tensor_device` crosses a wire on `wire` through a copy (any other device)."""
    return not _same(tensor_device, wire)


def to_wire(tensor: torch.Tensor, wire: torch.device) -> torch.Tensor:
    """`tensor`, contiguous, on the wire's device: itself when it is already there (no copy), a pinned host copy
    when the wire is the host, else a copy on the wire's device."""
    t = tensor.detach()
    if not staged(t.device, wire):
        return t.contiguous()
    if wire.type == "cpu":
        return to_host(t)  # the p2p ops' staging copy: pinned for a CUDA tensor, complete before gloo reads it
    return t.to(wire).contiguous()


def receive_buffer(
    shape: torch.Size | tuple[int, ...] | list[int], dtype: torch.dtype, wire: torch.device, landing: torch.device
) -> torch.Tensor:
    """Where a receive on `wire` puts the bytes of a tensor that is to end on `landing`: a host buffer (pinned
    when it goes on to a GPU) for a host wire, else a tensor on the wire's device."""
    if wire.type == "cpu":
        return host_buffer(shape, dtype, pin=landing.type == "cuda")
    return torch.empty(tuple(shape), dtype=dtype, device=wire)


def land(received: torch.Tensor, landing: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """The received tensor on `landing`: copied into `out` when given (its device is the landing one), else
    `received` itself when it is there already, else a copy there."""
    if out is not None:
        if out is not received:
            out.copy_(received)
        return out
    if not staged(received.device, landing):
        return received
    return received.to(landing)


def check_landing(device: torch.device | str) -> torch.device:
    """`device` as a torch.device a received tensor may land on; ValueError for a CUDA device this process does
    not have (before any transfer starts)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"a received tensor lands on the CPU or a CUDA device, not {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"cannot land a received tensor on {device!r}: CUDA is not available")
    if dev.index is not None and not 0 <= dev.index < torch.cuda.device_count():
        raise ValueError(f"cannot land a received tensor on {device!r}: {torch.cuda.device_count()} CUDA devices")
    return dev


def _same(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one (a CUDA device without an index is the current one)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
