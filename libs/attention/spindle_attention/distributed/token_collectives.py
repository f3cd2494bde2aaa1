"""Token collectives for SP-TP: uneven all-gather and reduce-scatter of token shards, flat or hierarchical.

Flat: one `all_to_all` with per-rank split sizes (uneven shards; gloo and NCCL alike, or point-to-point for a
`RankGroup`). Hierarchical (CSPS §3.2.1): a group's members packed on nodes of `gpus_per_node`
(member i on node i // gpus_per_node, local index i % gpus_per_node), so that only a node's share of the data
crosses the slow link between nodes.

- all-gather: first across nodes among the members of the same local index (each gets its column: the shards of
  that local index on every node, over the inter-node link), then within the node (each gets the other columns
  over NVLink). Per member, (nodes - 1) shards cross nodes instead of (nodes - 1) x gpus_per_node.
- reduce-scatter, the same steps reversed: within the node first (each member keeps its column's rows, summed
  over the node), then across nodes (each keeps its own rows, summed over the nodes).

Both run over `RankGroup`s of the group's global ranks (point-to-point ops, no `new_group`). A group that does not
fill whole nodes is refused: the members of a partial node would miss the columns it lacks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from . import p2p
from .comm import (
    RANK_GROUP_TAG,
    CommStats,
    Group,
    RankGroup,
    Timer,
    all_gather_ints,
    all_to_all_bytes,
    group_rank_size,
    pack,
    unpack,
)


def all_gather_tokens(
    x: Tensor, positions: Tensor, group: Group = None, stats: CommStats | None = None
) -> tuple[Tensor, Tensor, list[int]]:
    """Uneven all-gather of token shards: returns `(x_all [N, ...], positions [N], per-rank lengths)`."""
    if positions.dim() != 1 or positions.shape[0] != x.shape[0]:
        raise ValueError(f"positions must be 1-D with {x.shape[0]} entries, got {tuple(positions.shape)}")
    rank, sp = group_rank_size(group)
    tail = tuple(x.shape[1:])
    meta = all_gather_ints([x.shape[0], *tail], group, x.device, stats)
    if any(tuple(m[1:]) != tail for m in meta):
        raise ValueError(f"ranks disagree on token shapes: {[m[1:] for m in meta]}")
    lengths = [m[0] for m in meta]
    per_token = 8 + math.prod(tail) * x.element_size()
    mine = pack([positions.to(torch.int64), x])
    recv_sizes = [n * per_token for n in lengths]
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=x.device)
    with Timer(stats, "wait_s"):
        all_to_all_bytes(recv, mine.repeat(sp), recv_sizes, [mine.numel()] * sp, group)
    if stats is not None:
        stats.record(mine.numel() * (sp - 1), sum(recv_sizes) - recv_sizes[rank], mine.numel() * (sp - 1))
    xs, ps = [], []
    for n, chunk in zip(lengths, torch.split(recv, recv_sizes), strict=True):
        p, t = unpack(chunk, [(torch.int64, (n,)), (x.dtype, (n, *tail))])
        ps.append(p), xs.append(t)
    return torch.cat(xs), torch.cat(ps), lengths


def reduce_scatter_tokens(y: Tensor, lengths: list[int], group: Group = None, stats: CommStats | None = None) -> Tensor:
    """Sum every rank's partial `y [N, ...]` and return this rank's rows (rank r owns the r-th run of
    `lengths`), accumulated in fp32 and returned in y's dtype."""
    rank, sp = group_rank_size(group)
    if len(lengths) != sp or sum(lengths) != y.shape[0]:
        raise ValueError(f"lengths {lengths} do not split {y.shape[0]} tokens over {sp} ranks")
    row = math.prod(y.shape[1:]) * y.element_size()
    send_sizes = [n * row for n in lengths]
    recv_sizes = [lengths[rank] * row] * sp
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=y.device)
    with Timer(stats, "wait_s"):
        all_to_all_bytes(recv, pack([y]), recv_sizes, send_sizes, group)
    if stats is not None:
        remote = sum(send_sizes) - send_sizes[rank]
        stats.record(remote, sum(recv_sizes) - recv_sizes[rank], remote)
    parts = recv.view(y.dtype).view(sp, lengths[rank], *y.shape[1:])
    return parts.float().sum(dim=0).to(y.dtype)


def node_layout(ranks: list[int], me: int, gpus_per_node: int) -> tuple[list[int], list[int]]:
    """(across, within): the global ranks of `me`'s column (same local index on every node, node order) and of
    its node (local order), for the group `ranks` (global ranks in member order) packed `gpus_per_node` a node."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    if me not in ranks:
        raise ValueError(f"rank {me} is not a member of {ranks}")
    if len(ranks) % gpus_per_node and len(ranks) > gpus_per_node:
        raise ValueError(
            f"a hierarchical collective needs whole nodes: {len(ranks)} members do not fill nodes of {gpus_per_node}"
        )
    i = ranks.index(me)
    local, node = i % gpus_per_node, i // gpus_per_node
    across = ranks[local::gpus_per_node]
    within = ranks[node * gpus_per_node : (node + 1) * gpus_per_node]
    return across, within


def _group_ranks(group: Group) -> list[int]:
    if isinstance(group, RankGroup):
        return list(group.ranks)
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _subgroups(group: Group, gpus_per_node: int) -> tuple[RankGroup, RankGroup]:
    across, within = node_layout(_group_ranks(group), p2p.rank(), gpus_per_node)
    # a pair of members is in one of the two at most, so both may share the parent's tags
    tag = group.tag_base if isinstance(group, RankGroup) else RANK_GROUP_TAG
    return RankGroup(tuple(across), tag), RankGroup(tuple(within), tag)


def _column_order(lengths: list[int], gpus_per_node: int) -> list[tuple[int, int]]:
    """(member, its length) in the order the two-step all-gather leaves the shards: column by column (local index
    j), node by node within a column."""
    nodes = len(lengths) // gpus_per_node
    return [(n * gpus_per_node + j, lengths[n * gpus_per_node + j]) for j in range(gpus_per_node) for n in range(nodes)]


def _phase(stats: CommStats | None, name: str, before: int) -> None:
    if stats is not None:
        stats.bytes_by_phase[name] = stats.bytes_by_phase.get(name, 0) + stats.bytes_sent - before


def all_gather_tokens_hierarchical(
    x: Tensor, positions: Tensor, group: Group, gpus_per_node: int | None, stats: CommStats | None = None
) -> tuple[Tensor, Tensor, list[int]]:
    """`all_gather_tokens` in two steps (module docstring): `(x_all [N, ...], positions [N], lengths)` in member
    order, the same as the flat one's. `stats.bytes_by_phase` gets "across" and "within". One node (or None):
    the flat one."""
    _, size = group_rank_size(group)
    if gpus_per_node is None or gpus_per_node >= size:
        return all_gather_tokens(x, positions, group, stats)
    across, within = _subgroups(group, gpus_per_node)
    lengths = [m[0] for m in all_gather_ints([x.shape[0]], group, x.device, stats)]
    before = stats.bytes_sent if stats is not None else 0
    col_x, col_pos, _ = all_gather_tokens(x, positions, across, stats)
    _phase(stats, "across", before)
    before = stats.bytes_sent if stats is not None else 0
    all_x, all_pos, _ = all_gather_tokens(col_x, col_pos, within, stats)
    _phase(stats, "within", before)
    order = _column_order(lengths, gpus_per_node)
    starts, at = {}, 0
    for member, n in order:
        starts[member], at = at, at + n
    index = torch.cat([torch.arange(starts[m], starts[m] + lengths[m]) for m in range(size)]).to(x.device)
    return all_x.index_select(0, index), all_pos.index_select(0, index), lengths


def reduce_scatter_tokens_hierarchical(
    y: Tensor, lengths: list[int], group: Group, gpus_per_node: int | None, stats: CommStats | None = None
) -> Tensor:
    """`reduce_scatter_tokens` in two steps (module docstring): this member's rows of the sum of every member's
    `y [N, ...]` (member order, `lengths` per member). `stats.bytes_by_phase` gets "within" and "across". One
    node (or None): the flat one."""
    rank, size = group_rank_size(group)
    if gpus_per_node is None or gpus_per_node >= size:
        return reduce_scatter_tokens(y, lengths, group, stats)
    if len(lengths) != size or sum(lengths) != y.shape[0]:
        raise ValueError(f"lengths {lengths} do not split {y.shape[0]} tokens over {size} ranks")
    across, within = _subgroups(group, gpus_per_node)
    order = _column_order(lengths, gpus_per_node)
    offsets = [sum(lengths[:m]) for m in range(size)]
    index = torch.cat([torch.arange(offsets[m], offsets[m] + n) for m, n in order]).to(y.device)
    nodes = size // gpus_per_node
    columns = [sum(lengths[n * gpus_per_node + j] for n in range(nodes)) for j in range(gpus_per_node)]
    before = stats.bytes_sent if stats is not None else 0
    column = reduce_scatter_tokens(y.index_select(0, index), columns, within, stats)  # summed over the node
    _phase(stats, "within", before)
    local = rank % gpus_per_node
    before = stats.bytes_sent if stats is not None else 0
    mine = reduce_scatter_tokens(column, [lengths[n * gpus_per_node + local] for n in range(nodes)], across, stats)
    _phase(stats, "across", before)
    return mine
