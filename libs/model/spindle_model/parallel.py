"""Tensor-parallel sharding: which slice of each weight a rank holds, and the all-reduce after row shards.

Heads are sharded by KV-head groups so GQA groups never straddle ranks; counts that do not divide evenly
are split as evenly as possible (SmolLM2's 3 KV heads over 2 ranks: 2 + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from .config import ModelConfig


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


def all_reduce_(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sum partial row-parallel outputs across the tensor-parallel group, in place."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x
