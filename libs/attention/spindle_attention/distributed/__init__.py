"""Sequence-parallel attention over `torch.distributed` (gloo on CPU, NCCL on GPU, same code).

- `layouts`: how a chunk's tokens are split over a group (contiguous, stripe, zigzag) and their positions.
- `ring`: ring attention with KV rotation, history KV and KV retention (LoongServe scale-down).
- `ulysses`: all-to-all sequence <-> head resharding with uneven heads and tokens.
- `sp_tp`: CSPS SP-TP (all-gather tokens, head-parallel attention, reduce-scatter); `token_collectives`: those
  collectives, flat or hierarchical (across nodes, then within).
- `csa_all_to_all`: CSPS's sparse attention (CSA) over all-to-all SP, level by level, pipelined.
Every function records its bytes in an optional `CommStats`. A group is a `ProcessGroup`, None (the world) or a
`RankGroup` (any set of global ranks, point-to-point over the world group, no `new_group` needed).
"""

from .comm import CommStats, RankGroup
from .layouts import LAYOUTS, Layout, shard, shard_indices, shard_positions, unshard
from .ring import KVRetention, ring_attention
from .sp_tp import sp_tp_attention
from .token_collectives import (
    all_gather_tokens,
    all_gather_tokens_hierarchical,
    reduce_scatter_tokens,
    reduce_scatter_tokens_hierarchical,
)
from .ulysses import head_split, ulysses_attention

__all__ = [
    "LAYOUTS",
    "CommStats",
    "KVRetention",
    "Layout",
    "RankGroup",
    "all_gather_tokens",
    "all_gather_tokens_hierarchical",
    "head_split",
    "reduce_scatter_tokens",
    "reduce_scatter_tokens_hierarchical",
    "ring_attention",
    "shard",
    "shard_indices",
    "shard_positions",
    "sp_tp_attention",
    "ulysses_attention",
    "unshard",
]
