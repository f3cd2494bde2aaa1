"""Placement helpers shared by the built-in strategies (pure functions of the cluster state)."""

from __future__ import annotations

from spindle_protocol.messages import RequestSpec

from ..actions import KVShard
from ..state import ClusterState, InstanceState


def pick_decode(state: ClusterState, spec: RequestSpec) -> InstanceState | None:
    """Tetris §5.2 routing: of the live decode instances where the request's blocks fit (virtual usage
    excluded), the one with the highest freeness; when it fits nowhere, the one with the most free blocks (it
    parks there until blocks free). The core then counts the request as virtual usage there."""
    decodes = state.live("decode")
    if not decodes:
        return None
    need = spec.prompt.num_tokens + spec.sampling.max_tokens
    fits = [i for i in decodes if i.free_blocks >= i.blocks_for(need)]
    if fits:
        return max(fits, key=lambda i: (i.freeness, -i.info.rank))
    return max(decodes, key=lambda i: (i.free_blocks, -i.info.rank))


def pick_decode_group(
    state: ClusterState, spec: RequestSpec, kvp_tokens: int
) -> tuple[InstanceState, tuple[KVShard, ...]] | None:
    """Decode placement with Medha-style KV parallelism: a prompt longer than `kvp_tokens` (0: never, unless no
    decode instance could hold it whole) is split into shards of at most `kvp_tokens` over that many members of
    one KV-parallel group (instances that step in lockstep: `InstanceInfo.kvp_group`), its freest ones. The
    group is the one whose chosen members have the most free blocks. The master (first shard) is the member
    leading the fewest requests, so masters spread out (LoongServe's multi-master); the last member, the tail,
    also takes the new tokens. A group smaller than the degree: the shards grow to cover the prompt. Returns
    the master and the shards (empty: the whole KV on the master)."""
    n = spec.prompt.num_tokens
    decodes = state.live("decode")
    groups: dict[str, list[InstanceState]] = {}
    for inst in decodes:
        if inst.info.kvp_group:
            groups.setdefault(inst.info.kvp_group, []).append(inst)
    groups = {g: members for g, members in groups.items() if len(members) > 1}
    degree = -(-n // kvp_tokens) if kvp_tokens else 1
    if degree <= 1 and groups and decodes:
        need = n + spec.sampling.max_tokens
        largest = max(i.info.kv_blocks_total for i in decodes)
        if largest and decodes[0].blocks_for(need) > largest:  # fits no instance whole: split by capacity
            degree = -(-decodes[0].blocks_for(need) // largest)
    if degree <= 1 or not groups:
        decode = pick_decode(state, spec)
        return None if decode is None else (decode, ())

    def freest(members: list[InstanceState]) -> list[InstanceState]:
        return sorted(members, key=lambda i: (-i.freeness, i.info.rank, i.id))[:degree]

    group = max((freest(m) for m in groups.values()), key=lambda g: (sum(i.free_blocks for i in g), -g[0].info.rank))
    group.sort(key=lambda i: (len(i.mastering), -i.freeness, i.info.rank, i.id))
    # ranges of kvp_tokens each (the tail, which grows, takes the rest), or even ones when the shards must grow
    size = kvp_tokens if kvp_tokens and kvp_tokens * len(group) >= n else -(-n // len(group))
    shards = tuple(KVShard(inst.id, k * size, min(n, (k + 1) * size)) for k, inst in enumerate(group) if k * size < n)
    return group[0], shards


def reserve_blocks(inst: InstanceState, spec: RequestSpec) -> None:
    if inst.info.block_size:
        tokens = spec.prompt.num_tokens + spec.sampling.max_tokens
        inst.planned_blocks += -(-tokens // inst.info.block_size)


def kvstore_id(state: ClusterState) -> str:
    kvstores = state.live("kvstore")
    return kvstores[0].id if kvstores else ""


def group_ready_at(group: list[InstanceState], now: float) -> float:
    """When every member of an SP group is free of the prefill work planned onto it."""
    return max(i.busy_until(now) for i in group)
