"""One member of the NCCL-pair tests (a separate process): `python nccl_member.py RANK PORT DIR MODE`.

Rank 0 claims cuda:0 and rank 1 cuda:1 on this host, so the pair wants NCCL. MODE:
- `fake`: both form the NCCL groups through `fake_nccl`, a gloo group standing in for NCCL (this machine has no
  GPU), which notes that it was asked for NCCL and counts the bytes each group carries;
- `fails`: rank 1's NCCL factory raises, as a failed NCCL formation does;
- `without`: rank 1 has no NCCL factory, as a process without NCCL;
- `real`: the default factories on real GPUs (cuda:RANK), through `DataPlane.init`.
Both then send tensors through the data plane (two at once from rank 0, one back from rank 1) and through p2p, and
write what they saw to DIR/RANK.json.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spindle_attention.distributed import p2p
from spindle_protocol import header_for
from spindle_transfer import DataPlane, dataplane
from spindle_transfer.mesh import Mesh
from spindle_transfer.pairs import Channel, GroupFactory, gloo_group
from spindle_transfer.paths import GLOO, NCCL, Placement, host_name
from spindle_transfer.testing import bitwise_equal, make_tensor

A, B, C = ("float32", (64, 33)), ("bfloat16", (3, 50)), ("int64", (40,))  # 8448, 300 and 320 bytes
TIMEOUT_S = 3.0


class Counted:
    """A c10d group that notes the size of every message it carries (for p2p and the data plane alike)."""

    def __init__(self, group: Any, sizes: list[int]) -> None:
        self.group, self.sizes = group, sizes

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> dist.Work:
        self.sizes.append(tensors[0].numel() * tensors[0].element_size())
        return self.group.send(tensors, peer, tag)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> dist.Work:
        self.sizes.append(tensors[0].numel() * tensors[0].element_size())
        return self.group.recv(tensors, peer, tag)

    def name(self) -> str:
        return self.group.name()

    def abort(self) -> None:
        self.group.abort()


def counted_gloo(sizes: list[int]) -> GroupFactory:
    def factory(store: dist.Store, rank: int, timeout: timedelta, device: torch.device) -> Channel:
        channel = gloo_group(store, rank, timeout, device)
        return Channel(Counted(channel.group, sizes), channel.device)

    return factory


def fake_nccl(asked: list[str], sizes: list[int]) -> GroupFactory:
    """A fake standing in for NCCL, because this machine has no GPU: a gloo group on the host, which notes the
    device it was asked to bind NCCL to and counts what it carries."""

    def factory(store: dist.Store, rank: int, timeout: timedelta, device: torch.device) -> Channel:
        asked.append(str(device))
        return counted_gloo(sizes)(store, rank, timeout, device)

    return factory


def failing_nccl(asked: list[str]) -> GroupFactory:
    def factory(store: dist.Store, rank: int, timeout: timedelta, device: torch.device) -> Channel:
        asked.append(str(device))
        raise RuntimeError("fake NCCL init failure")

    return factory


def count_staging(copies: list[str]) -> None:
    """Note every copy the data plane's staging makes (a tensor crossing to or from another device than the wire's)."""
    to_wire, land = dataplane.to_wire, dataplane.land

    def counted_to_wire(tensor: torch.Tensor, wire: torch.device) -> torch.Tensor:
        out = to_wire(tensor, wire)
        if out.device != tensor.device or out.data_ptr() != tensor.data_ptr():
            copies.append(f"send {tensor.device} -> {wire}")
        return out

    def counted_land(received: torch.Tensor, landing: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
        got = land(received, landing, out)
        if got is not received:
            copies.append(f"recv {received.device} -> {landing}")
        return got

    dataplane.to_wire, dataplane.land = counted_to_wire, counted_land


def join(rank: int, port: int, mode: str, notes: dict[str, Any]) -> DataPlane:
    url = f"mesh://127.0.0.1:{port}"
    if mode == "real":
        return DataPlane.init(rank, 2, url, timeout_s=30, device=f"cuda:{rank}")
    place = Placement(host_name(), f"cuda:{rank}")
    factories: dict[str, GroupFactory] = {GLOO: counted_gloo(notes["gloo"])}
    if mode == "fake" or rank == 0:
        factories[NCCL] = fake_nccl(notes["asked"], notes["nccl"])
    elif mode == "fails":
        factories[NCCL] = failing_nccl(notes["asked"])
    plane = DataPlane(rank, 2, "gloo", place=place)  # what DataPlane.init does for mesh://, with our factories
    plane.mesh = Mesh("127.0.0.1", port, rank, TIMEOUT_S, place=place, factories=factories)
    p2p.install(plane.mesh)
    return plane


async def exchange(plane: DataPlane, device: torch.device) -> dict[str, bool]:
    def t(spec: tuple[str, tuple[int, ...]], seed: int) -> torch.Tensor:
        return make_tensor(*spec, seed).to(device)

    if plane.rank == 0:
        sends = [plane.send_async(t(A, 1), 1, 11, header_for(*A)), plane.send_async(t(B, 2), 1, 12, header_for(*B))]
        _, _, got = await asyncio.gather(*sends, plane.recv_async(header_for(*C), 1, 21, device=device))
        return {"C": bitwise_equal(got.cpu(), t(C, 3).cpu()) and got.device == device}
    got_b, got_a, _ = await asyncio.gather(
        plane.recv_async(header_for(*B), 0, 12, device=device),
        plane.recv_async(header_for(*A), 0, 11, device=device),
        plane.send_async(t(C, 3), 0, 21, header_for(*C)),
    )
    same = {"A": bitwise_equal(got_a.cpu(), t(A, 1).cpu()), "B": bitwise_equal(got_b.cpu(), t(B, 2).cpu())}
    return {**same, "on_device": got_a.device == device == got_b.device}


def p2p_exchange(plane: DataPlane, device: torch.device) -> bool:
    """A host tensor and one on the device, each way, through p2p (as the collectives send them)."""
    peer = 1 - plane.rank
    ok = True
    for tensor in (torch.arange(3.0), torch.arange(5.0, device=device)):
        mine, theirs = tensor + 100 * plane.rank, torch.empty_like(tensor)
        works = [p2p.isend(mine, peer, tag=31), p2p.irecv(theirs, peer, tag=31)]
        for w in works:
            w.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ok = ok and bool(torch.equal(theirs.cpu(), (tensor + 100 * peer).cpu()))
    return ok


def main() -> None:
    rank, port, folder, mode = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    logging.basicConfig(filename=folder / f"log-{rank}", level=logging.INFO)
    notes: dict[str, Any] = {"gloo": [], "nccl": [], "asked": [], "staging_copies": []}
    count_staging(notes["staging_copies"])
    plane = join(rank, port, mode, notes)
    assert plane.mesh is not None
    deadline = time.monotonic() + 30
    while 1 - rank not in plane.mesh.peers() and time.monotonic() < deadline:
        time.sleep(0.05)  # the peer may start after us
    notes["not_ready"] = {str(k): v for k, v in plane.mesh.wait_formed(30).items()}
    device = torch.device(f"cuda:{rank}" if mode == "real" else "cpu")
    notes["paths"] = {str(k): v for k, v in plane.paths().items()}
    notes["fallbacks"] = plane.mesh.stats.nccl_fallbacks
    notes["dataplane"] = asyncio.run(exchange(plane, device))
    notes["p2p"] = p2p_exchange(plane, device)
    (folder / f"{rank}.json").write_text(json.dumps(notes))
    deadline = time.monotonic() + 30
    while not (folder / f"{1 - rank}.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the peer may still be using the pair
    plane.close()
    os._exit(0)


if __name__ == "__main__":
    main()
