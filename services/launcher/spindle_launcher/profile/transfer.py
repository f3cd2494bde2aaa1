"""KV transfer times between two spawned ranks of a real gloo group, through `spindle_transfer.DataPlane`."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from .config import ProfileConfig
from .ranks import run_ranks


def _transfer_rank(rank: int, world: int, port: int, out_dir: str, sizes: list[int], steps: int, warmup: int) -> None:
    """One rank of the transfer benchmark (module level so spawned processes can import it)."""
    import torch
    import torch.distributed as dist

    from spindle_protocol import header_for
    from spindle_transfer import DataPlane

    torch.set_num_threads(1)
    plane = DataPlane.init(rank, world, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=60)
    rows = []
    try:
        tag = 0
        for size in sizes:
            header = header_for("uint8", [size])
            payload = torch.randint(0, 255, (size,), dtype=torch.uint8) if rank == 0 else None
            times = []
            for i in range(warmup + steps):
                tag += 1
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    plane.send(payload, 1, tag, header)
                else:
                    plane.recv(header, 0, tag)
                    if i >= warmup:
                        times.append(time.perf_counter() - t0)
            if rank == 1:
                rows.append([size, statistics.median(times)])
        if rank == 1:
            (Path(out_dir) / "transfer.json").write_text(json.dumps(rows))
    finally:
        plane.close()


def measure_transfer(cfg: ProfileConfig, timeout_s: float = 300.0) -> list[list[float]]:
    """[[bytes, median seconds], ...] from rank 0 to rank 1 of a spawned 2-rank gloo group (receiver's clock)."""
    from spindle_transfer.testing import free_port

    with tempfile.TemporaryDirectory() as d:
        args = (2, free_port(), d, list(cfg.transfer_bytes), cfg.decode_steps, cfg.warmup)
        run_ranks(_transfer_rank, 2, args, timeout_s, "the transfer benchmark")
        return json.loads((Path(d) / "transfer.json").read_text())
