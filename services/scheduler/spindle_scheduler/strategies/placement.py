"""Placement helpers shared by the built-in strategies (pure functions of the cluster state)."""

from __future__ import annotations

from spindle_protocol.messages import RequestSpec

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
