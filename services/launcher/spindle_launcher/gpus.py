"""Which device each rank of a `spindle up` stack runs on (`--device cuda --gpus 0,1,...`): pure and deterministic.

Ranks take the listed GPUs round-robin in rank order, rank 1 the first (rank 0, the kvstore, holds host memory and
no model: it stays on the CPU). An instance's processes hold consecutive ranks (a TP, KVP or SPP group: its leader,
then its followers), so every member of a group gets a GPU of its own whenever the group has no more members than
there are GPUs; with fewer GPUs than ranks several processes share one (on a one-GPU machine, all of them), and
pairs on one GPU exchange tensors through host memory (spindle_transfer.paths). A GPU id is the index torch gives
it in the launcher's environment (CUDA_VISIBLE_DEVICES applies), which every child inherits.

A GPU's KV memory is split evenly between the processes on it: each gets `KV_MEMORY_FRACTION / sharers` of the
device (spindle_worker.device sizes the pool from that at start) unless the KV size is given.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

DEVICES = ("cpu", "cuda")
# the instances' own default (spindle_worker.device.DEFAULT_KV_MEMORY_FRACTION; the launcher imports no torch)
KV_MEMORY_FRACTION = 0.5
MAX_GPU_ID = 1023


def parse_gpus(text: str) -> tuple[int, ...]:
    """`--gpus 0,1,3` -> (0, 1, 3); ValueError for an empty list or item, a non-integer, a negative or repeated id."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ValueError(f"--gpus takes GPU ids separated by commas, e.g. 0,1, got {text!r}")
    try:
        ids = tuple(int(item) for item in items)
    except ValueError:
        raise ValueError(f"--gpus takes integer GPU ids, e.g. 0,1, got {text!r}") from None
    check_gpus(ids)
    return ids


def check_gpus(gpus: Sequence[int]) -> None:
    """ValueError unless `gpus` are distinct ids in 0..MAX_GPU_ID (whether they exist is checked at start)."""
    bad = [g for g in gpus if not isinstance(g, int) or isinstance(g, bool) or not 0 <= g <= MAX_GPU_ID]
    if bad:
        raise ValueError(f"GPU ids must be integers in 0..{MAX_GPU_ID}, got {bad}")
    repeated = sorted(g for g, n in Counter(gpus).items() if n > 1)
    if repeated:
        raise ValueError(f"GPU ids must be distinct, got {list(gpus)} ({repeated} repeated)")


def rank_devices(world_size: int, device: str, gpus: Sequence[int]) -> dict[int, str]:
    """rank -> "cpu" or "cuda:N" for ranks 0..world_size-1: all "cpu" for device "cpu"; for "cuda", rank 0 on the
    CPU and rank r >= 1 on gpus[(r - 1) % len(gpus)]."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if device == "cpu":
        if gpus:
            raise ValueError("GPU ids apply with device cuda")
        return dict.fromkeys(range(world_size), "cpu")
    if not gpus:
        raise ValueError("device cuda needs at least one GPU id")
    check_gpus(gpus)
    return {0: "cpu"} | {r: f"cuda:{gpus[(r - 1) % len(gpus)]}" for r in range(1, world_size)}


def sharers(devices: dict[int, str]) -> dict[int, int]:
    """rank -> how many ranks of `devices` run on its device (1 for a rank on the CPU: it shares no GPU memory)."""
    count = Counter(devices.values())
    return {r: 1 if d == "cpu" else count[d] for r, d in devices.items()}


def kv_memory_fraction(devices: dict[int, str], rank: int) -> float:
    """The share of its GPU's memory the KV pool of `rank` may take: KV_MEMORY_FRACTION split between the ranks
    on that GPU."""
    return KV_MEMORY_FRACTION / sharers(devices)[rank]


def gpu_map(devices: dict[int, str], names: dict[int, str]) -> list[str]:
    """The GPU map in words, a line per GPU in id order: `cuda:0: prefill-0 (rank 1), decode-0 (rank 3)`;
    `names`: rank -> process name (ranks without one are left out)."""
    by_device: dict[str, list[str]] = {}
    for rank in sorted(devices):
        if devices[rank] != "cpu" and rank in names:
            by_device.setdefault(devices[rank], []).append(f"{names[rank]} (rank {rank})")
    lines = []
    for device in sorted(by_device, key=lambda d: int(d.partition(":")[2])):
        procs = by_device[device]
        shared = f"; {len(procs)} processes share it, host-staged between them" if len(procs) > 1 else ""
        lines.append(f"{device}: {', '.join(procs)}{shared}")
    return lines


def check_visible(gpus: Sequence[int], count: int) -> None:
    """ValueError unless every id of `gpus` is one of the `count` GPUs torch sees here (0: no CUDA at all)."""
    if count < 1:
        raise ValueError("--device cuda: torch sees no CUDA device on this machine (a CPU build, or no GPU/driver)")
    missing = [g for g in gpus if g >= count]
    if missing:
        raise ValueError(f"GPU ids {missing} do not exist: torch sees {count} GPU(s) here, ids 0..{count - 1}")
