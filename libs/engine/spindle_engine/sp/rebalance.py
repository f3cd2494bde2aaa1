"""History re-balancing before a chunk whose group grew (Tetris §4.1, Fig. 5), overlapped layer by layer.

Every layer's moves are posted at once when the chunk starts (each send buffer is a copy, so the sender
can drop the moved entries at once); `land(layer)` waits only for that layer's incoming entries, just
before its attention needs them, so later layers' transfers run under earlier layers' compute.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from spindle_attention.distributed import p2p
from spindle_attention.distributed.comm import RANK_GROUP_TAG

from .held_kv import HeldKV
from .plan import Move

TAG_BASE = RANK_GROUP_TAG + 16  # above the tags ring / all-to-all use; one tag per layer


class Rebalance:
    def __init__(
        self,
        moves: tuple[Move, ...],
        member: int,
        ranks: dict[int, int],
        held: HeldKV,
        incoming: Tensor,
        num_layers: int,
    ) -> None:
        """`incoming`: positions of the entries moved to `member`, in move order (from the plan)."""
        self.bytes_sent = 0
        self.bytes_received = 0
        self.wait_s = 0.0
        self._sends: list[dist.Work] = []
        self._recvs: list[list[tuple[dist.Work, Tensor, Tensor]]] = [[] for _ in range(num_layers)]
        mine_in = [mv for mv in moves if mv.dst == member]
        mine_out = [mv for mv in moves if mv.src == member]
        assert incoming.numel() == sum(mv.count for mv in mine_in)
        hkv, d = held.cache.k.shape[-2:]
        dtype = held.cache.k.dtype
        in_slots = held.grow(incoming) if mine_in else None
        for layer in range(num_layers):
            tag = TAG_BASE + layer
            for mv in mine_out:
                k, v = held.read(layer, mv.lo, mv.hi)
                buf = torch.stack([k, v])  # [2, n, Hkv, D]
                self._sends.append(p2p.isend(buf, ranks[mv.dst], tag=tag))
                self.bytes_sent += buf.numel() * buf.element_size()
            offset = 0
            for mv in mine_in:
                buf = torch.empty(2, mv.count, hkv, d, dtype=dtype, device=held.cache.k.device)
                work = p2p.irecv(buf, ranks[mv.src], tag=tag)
                self._recvs[layer].append((work, buf, in_slots[offset : offset + mv.count]))
                self.bytes_received += buf.numel() * buf.element_size()
                offset += mv.count
        if mine_out:
            held.truncate(min(mv.lo for mv in mine_out))

    def land(self, layer: int, held: HeldKV) -> None:
        """Wait for `layer`'s incoming entries and write them into `held`."""
        t0 = time.perf_counter()
        for work, buf, slots in self._recvs[layer]:
            work.wait()
            held.write(layer, slots, buf[0], buf[1])
        self._recvs[layer] = []
        self.wait_s += time.perf_counter() - t0

    def finish(self) -> None:
        t0 = time.perf_counter()
        for work in self._sends:
            work.wait()
        self._sends = []
        self.wait_s += time.perf_counter() - t0
