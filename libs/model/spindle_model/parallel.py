"""Tensor-parallel sharding: which slice of each weight a rank holds, and the all-reduce after row shards.

Heads are sharded by KV-head groups so GQA groups never straddle ranks; counts that do not divide evenly
are split as evenly as possible (SmolLM2's 3 KV heads over 2 ranks: 2 + 1).

The group is a `dist.ProcessGroup` or a `RankGroup` (global ranks talking point-to-point on the default group,
so a serving instance needs no `new_group`). A RankGroup all-reduce gives bitwise the same sum on every rank
(so every rank samples the same tokens): with 2 ranks each adds the other's part (a + b == b + a); with more, a
ring reduce-scatter computes each chunk's sum once and an all-gather copies it. Its tags are
`RANK_GROUP_TAG + ALL_REDUCE_TAG + [0, 2 * size)`, above KVP's (`RANK_GROUP_TAG + 4096 + ...`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from spindle_attention.distributed import p2p
from spindle_attention.distributed.comm import RANK_GROUP_TAG, RankGroup, group_rank_size

from .config import ModelConfig

ALL_REDUCE_TAG = 8192  # offset above RANK_GROUP_TAG of the RankGroup all-reduce's tags
# How long a RankGroup all-reduce waits for its peers. A gloo wait that times out breaks the process's group,
# which is fine here: a tensor-parallel rank whose peer is gone cannot go on and exits (set_all_reduce_timeout).
_timeout = timedelta(seconds=60)


def set_all_reduce_timeout(seconds: float) -> None:
    global _timeout
    if not seconds > 0:
        raise ValueError(f"the all-reduce timeout must be positive, got {seconds}")
    _timeout = timedelta(seconds=seconds)


def shard_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous [start, end) of n items for `rank` of `world`, the first n % world ranks taking one more."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class TPShard:
    """The slice of a model one tensor-parallel rank holds."""

    rank: int
    world: int
    kv_heads: tuple[int, int]  # [start, end) of KV heads
    q_heads: tuple[int, int]
    ffn: tuple[int, int]  # [start, end) of intermediate features

    @classmethod
    def create(cls, config: ModelConfig, rank: int = 0, world: int = 1) -> TPShard:
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"invalid tensor-parallel rank {rank} of {world}")
        if world > config.num_kv_heads:
            raise ValueError(
                f"tensor-parallel size {world} exceeds the model's {config.num_kv_heads} KV heads "
                "(KV-head replication is not supported)"
            )
        kv = shard_range(config.num_kv_heads, world, rank)
        g = config.group_size
        return cls(rank, world, kv, (kv[0] * g, kv[1] * g), shard_range(config.intermediate_size, world, rank))

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]


def tp_rank_world(group: dist.ProcessGroup | RankGroup | None) -> tuple[int, int]:
    """(rank in the group, group size); (0, 1) without a group."""
    return group_rank_size(group) if group is not None else (0, 1)


def all_reduce_(x: Tensor, group: dist.ProcessGroup | RankGroup | None) -> Tensor:
    """Sum partial row-parallel outputs across the tensor-parallel group, in place."""
    if group is None:
        return x
    if isinstance(group, RankGroup):
        if len(group.ranks) > 1:
            flat = x.contiguous()
            _rank_group_sum(flat.view(-1), group)
            if flat.data_ptr() != x.data_ptr():
                x.copy_(flat)
        return x
    if dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def _p2p(pairs: list[tuple[Tensor, int, int]], recvs: list[tuple[Tensor, int, int]]) -> None:
    """Post the sends `(tensor, peer, tag)` and receives together, then wait for all of them."""
    ops = [p2p.Op(p2p.isend, t, peer, None, RANK_GROUP_TAG + ALL_REDUCE_TAG + tag) for t, peer, tag in pairs]
    ops += [p2p.Op(p2p.irecv, t, peer, None, RANK_GROUP_TAG + ALL_REDUCE_TAG + tag) for t, peer, tag in recvs]
    for work in p2p.batch_isend_irecv(ops):
        work.wait(_timeout)


def _rank_group_sum(x: Tensor, group: RankGroup) -> None:
    rank, size = group_rank_size(group)
    if size == 2:
        peer = group.ranks[1 - rank]
        other = torch.empty_like(x)
        _p2p([(x, peer, 0)], [(other, peer, 0)])
        x.add_(other)  # commutative: both ranks get bitwise the same sum
        return
    chunks = [x[slice(*shard_range(x.numel(), size, c))] for c in range(size)]
    nxt, prev = group.ranks[(rank + 1) % size], group.ranks[(rank - 1) % size]
    buf = torch.empty_like(chunks[0])
    for s in range(size - 1):  # reduce-scatter: afterwards this rank holds the full sum of chunk rank + 1
        send, recv = chunks[(rank - s) % size], chunks[(rank - s - 1) % size]
        _p2p([(send, nxt, 1 + s)], [(buf[: recv.numel()], prev, 1 + s)])
        recv.add_(buf[: recv.numel()])
    for s in range(size - 1):  # all-gather: the sums travel on unchanged
        send, recv = chunks[(rank + 1 - s) % size], chunks[(rank - s) % size]
        _p2p([(send, nxt, size + s)], [(recv, prev, size + s)])
