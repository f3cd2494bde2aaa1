"""The device an instance process runs on: its flags, their check at start, and its KV pool's default size there.

`--device cpu | cuda | cuda:N` becomes `EngineConfig.device` (weights, KV cache and step inputs live there) and
the placement the process announces on the data plane. It is checked when the process builds its configuration
(torch.cuda at start, never at import): CUDA asked for where there is none, or an index past the devices the
process sees, is a usage error that names the problem.

The KV pool on CUDA: with neither --kv-cache-tokens nor --kv-cache-memory-gb it is sized from the device's
memory at start (`cuda_kv_cache_bytes`): --kv-memory-fraction of the device's total, at most what is free then
less a reserve for the weights, activations and CUDA context. `spindle up` divides the fraction between the
processes it puts on one GPU. On the CPU the role's --kv-cache-memory-gb default holds, as it always did.
"""

from __future__ import annotations

import argparse
import logging

import torch

from spindle_engine.config import check_device

__all__ = ["add_device_args", "check_device", "cuda_kv_cache_bytes", "kv_cache_memory_gb"]
log = logging.getLogger("spindle.worker.device")

DEFAULT_KV_MEMORY_FRACTION = 0.5  # of a GPU's memory, for the KV pool of the one process on it
CUDA_RESERVE_BYTES = 2 * 2**30  # of the free memory at start, kept for weights, activations and the CUDA context
GIB = 2**30


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_device_args(parser: argparse.ArgumentParser, cpu_kv_cache_memory_gb: float | None = None) -> None:
    """--device and --kv-memory-fraction; after `add_engine_args`. `cpu_kv_cache_memory_gb`: the role's KV size
    when --kv-cache-memory-gb is not given and the pool is not sized from a GPU's memory (default: the flag's)."""
    cpu_default = parser.get_default("kv_cache_memory_gb") if cpu_kv_cache_memory_gb is None else cpu_kv_cache_memory_gb
    assert cpu_default is not None and cpu_default > 0, "add_device_args comes after add_engine_args"
    g = parser.add_argument_group("device")
    g.add_argument(
        "--device",
        default="cpu",
        help="where the engine runs: cpu, cuda (device 0) or cuda:N, checked at start (default %(default)s)",
    )
    g.add_argument(
        "--kv-memory-fraction",
        type=_fraction,
        default=DEFAULT_KV_MEMORY_FRACTION,
        help="on CUDA, with neither --kv-cache-tokens nor --kv-cache-memory-gb: the KV pool's share of the device's "
        f"memory, at most what is free at start less {CUDA_RESERVE_BYTES // GIB} GiB (default %(default)s; `spindle "
        "up` divides it between the processes that share a GPU)",
    )
    # None marks "not given", which on CUDA sizes the pool from the device; elsewhere the role's default applies
    parser.set_defaults(kv_cache_memory_gb=None, cpu_kv_cache_memory_gb=cpu_default)


def cuda_kv_cache_bytes(
    free_bytes: int,
    total_bytes: int,
    fraction: float = DEFAULT_KV_MEMORY_FRACTION,
    reserve_bytes: int = CUDA_RESERVE_BYTES,
) -> int:
    """A CUDA KV pool's size from `torch.cuda.mem_get_info`'s (free, total): `fraction` of the total, at most the
    free memory less `reserve_bytes`. ValueError for inconsistent figures, or when nothing is left for a pool."""
    if not isinstance(total_bytes, int) or not isinstance(free_bytes, int) or not 0 <= free_bytes <= total_bytes:
        raise ValueError(f"free {free_bytes!r} and total {total_bytes!r} bytes are not 0 <= free <= total")
    if total_bytes == 0:
        raise ValueError("the device reports no memory")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
    room = min(int(total_bytes * fraction), free_bytes - reserve_bytes)
    if room <= 0:
        raise ValueError(
            f"{free_bytes / GIB:.2f} GiB of the device's {total_bytes / GIB:.2f} GiB are free, less than the "
            f"{reserve_bytes / GIB:.2f} GiB kept for weights and activations: no room for a KV pool (free the "
            "device, or size the pool with --kv-cache-tokens / --kv-cache-memory-gb)"
        )
    return room


def kv_cache_memory_gb(args: argparse.Namespace, device: torch.device) -> float:
    """The engine's `kv_cache_memory_gb` from the flags of `add_device_args`: as given; else on CUDA, unless
    --kv-cache-tokens sizes the pool, from the device's memory now; else the role's CPU default."""
    if args.kv_cache_memory_gb is not None:
        return args.kv_cache_memory_gb
    if device.type != "cuda" or args.kv_cache_tokens is not None:
        return args.cpu_kv_cache_memory_gb
    free, total = torch.cuda.mem_get_info(device)
    nbytes = cuda_kv_cache_bytes(free, total, args.kv_memory_fraction)
    log.info("%s: KV pool of %.2f GiB (%.2f of %.2f GiB, %.2f GiB free at start)", device, nbytes / GIB,
             args.kv_memory_fraction, total / GIB, free / GIB)  # fmt: skip
    return nbytes / GIB
