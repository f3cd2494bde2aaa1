"""CSPS §3.2.4's proximity-aware SPT allocation: a prompt's SP group packed onto as few servers as it can be among
the instances free when it starts, and its segments (SPTs) placed on the members in GPU-id order (rack, server,
GPU: here the node, in the order the nodes first appear by rank, then the rank), so that neighbouring segments sit
on the nearest GPUs and CSA's lower levels stay inside a server."""

from __future__ import annotations

from collections.abc import Sequence

from ...state import InstanceState


def node_order(instances: Sequence[InstanceState]) -> dict[str, int]:
    """Each node's place in GPU-id order: the order the nodes first appear among the instances by rank."""
    order: dict[str, int] = {}
    for inst in sorted(instances, key=lambda i: i.info.rank):
        order.setdefault(inst.info.node, len(order))
    return order


def proximity_group(free: Sequence[InstanceState], size: int, order: dict[str, int]) -> list[InstanceState]:
    """`size` of the `free` instances on the fewest nodes, in GPU-id order: one node that holds them all (the one
    with the fewest free, leaving larger ones for larger groups; ties in node order), else the nodes with the most
    free first; within a node the lowest ranks."""
    assert 1 <= size <= len(free), f"a group of {size} from {len(free)} free instances"
    by_node: dict[str, list[InstanceState]] = {}
    for inst in sorted(free, key=lambda i: i.info.rank):
        by_node.setdefault(inst.info.node, []).append(inst)
    fitting = [n for n, members in by_node.items() if len(members) >= size]
    if fitting:
        node = min(fitting, key=lambda n: (len(by_node[n]), order[n]))
        return by_node[node][:size]
    chosen: list[InstanceState] = []
    for node in sorted(by_node, key=lambda n: (-len(by_node[n]), order[n])):
        chosen += by_node[node][: size - len(chosen)]
        if len(chosen) == size:
            break
    return sorted(chosen, key=lambda i: (order[i.info.node], i.info.rank))
