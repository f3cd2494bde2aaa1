"""Which transport carries tensors between two ranks of the data plane, from where each one runs.

    both on the CPU                              gloo
    one on the CPU, one on a GPU                 host-staged
    on different GPUs (another index or host)    nccl
    on the same GPU                              cuda-ipc, else host-staged

NCCL cannot run two ranks of one communicator on one device, so two processes sharing a GPU (the only layout a
one-GPU machine has) need CUDA IPC or a copy through host memory. `host-staged` is gloo carrying host copies: the
sender copies a GPU tensor into pinned host memory and the receiver copies it from there onto its device
(staging.py). A transport that is not available falls back to the next one in its row. The mesh carries gloo,
host-staged and nccl (`MESH_TRANSPORTS`; not cuda-ipc, so two processes on one GPU are host-staged), nccl only where
both members of the pair can (pairs.py), and the logs say which.

Everything here is pure (no torch.cuda): a placement is the host's name and a device string.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

GLOO, NCCL, CUDA_IPC, HOST_STAGED = "gloo", "nccl", "cuda-ipc", "host-staged"
TRANSPORTS = (GLOO, NCCL, CUDA_IPC, HOST_STAGED)
MESH_TRANSPORTS = frozenset({GLOO, NCCL, HOST_STAGED})  # what mesh.py's pairs carry

_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d{1,4}))?$")
_HOST_RE = re.compile(r"^[A-Za-z0-9._-]{1,253}$")


def normalize_device(spec: str) -> str:
    """ "cpu", "cuda" (device 0, as a process that sets none uses), "cuda:N" -> "cpu" or "cuda:N"; ValueError
    otherwise. Checks the spelling only: whether the device exists is the process's to check at start."""
    found = _DEVICE_RE.match(spec.strip().lower()) if isinstance(spec, str) else None
    if found is None or (found.group(1) == "cpu" and found.group(2) is not None):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {spec!r}")
    return "cpu" if found.group(1) == "cpu" else f"cuda:{int(found.group(2) or 0)}"


def host_name() -> str:
    """This machine's name as a placement carries it (characters other than [A-Za-z0-9._-] become '_')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:253] or "localhost"


@dataclass(frozen=True)
class Placement:
    """Where one rank runs: the host and the device (`cuda:N` as that host's processes number them)."""

    host: str
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not _HOST_RE.match(self.host):
            raise ValueError(f"host must be 1-253 characters of [A-Za-z0-9._-], got {self.host!r}")
        if normalize_device(self.device) != self.device:
            raise ValueError(f"device must be 'cpu' or 'cuda:N', got {self.device!r}")

    @classmethod
    def here(cls, device: str = "cpu") -> Placement:
        return cls(host_name(), normalize_device(device))

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"

    def encode(self) -> str:
        """ "HOST/DEVICE", as the mesh's join log carries it."""
        return f"{self.host}/{self.device}"

    @classmethod
    def decode(cls, text: str) -> Placement:
        host, sep, device = text.partition("/")
        if not sep:
            raise ValueError(f"placement {text!r} is not HOST/DEVICE")
        return cls(host, device)


def candidates(a: Placement, b: Placement) -> tuple[str, ...]:
    """The transports for a pair of ranks, best first (the table of the module docstring)."""
    if not a.on_gpu and not b.on_gpu:
        return (GLOO,)
    if not a.on_gpu or not b.on_gpu:
        return (HOST_STAGED,)
    if a == b:
        return (CUDA_IPC, HOST_STAGED)
    return (NCCL, HOST_STAGED)


def choose_path(a: Placement, b: Placement, available: frozenset[str] = MESH_TRANSPORTS) -> str:
    """The transport between ranks at `a` and `b`: the best of `candidates` in `available`. Symmetric, so both
    sides of a pair choose the same; ValueError when none is available."""
    if not available <= set(TRANSPORTS):
        raise ValueError(f"unknown transports {sorted(available - set(TRANSPORTS))}; known: {', '.join(TRANSPORTS)}")
    for transport in candidates(a, b):
        if transport in available:
            return transport
    raise ValueError(f"no available transport ({', '.join(sorted(available))}) connects {a.encode()} and {b.encode()}")


def describe(a: Placement, b: Placement, available: frozenset[str] = MESH_TRANSPORTS) -> str:
    """The choice in words, for the logs: `host-staged (cuda:0 and cuda:0 on one GPU; cuda-ipc not available)`."""
    path = choose_path(a, b, available)
    if a == b and a.on_gpu:
        where = f"{a.device} and {b.device} on one GPU"
    elif a.host == b.host:
        where = f"{a.device} and {b.device}"
    else:
        where = f"{a.encode()} and {b.encode()}"
    best = candidates(a, b)[0]
    return f"{path} ({where}{'' if best == path else f'; {best} not available'})"
