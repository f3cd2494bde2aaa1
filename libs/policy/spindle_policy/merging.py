"""Scale-down of KV-parallel requests, asked by the strategy (`kvp_merge_tokens`): a decoding request split over
members of a group, one of whose shards holds fewer than `kvp_merge_tokens` prompt tokens, gives that shard to the
holder before it once that holder has room for it (and, for the tail, for every output token too).

Such fragments come from placements cut by free space (a busy group when the request arrived, room again now) and
from a `kvp_tokens` limit that leaves a short tail. Each costs its member a query and a partial state per layer
and step, and the master one more merge, for little KV: merging it is the one time a group moves KV (LoongServe's
scale-down). The first shard never leaves, nor the master's (the group's leader reports where a request's KV is
after placing and after each scale-up: `KVPShards`, so these are the shards the group holds, not only those the
strategy asked for). Pure function of the cluster state: the simulator and the services run it alike; the group's
leader checks room again and may refuse.
"""

from __future__ import annotations

from .actions import KVShard, ScaleDownKVP
from .state import ClusterState, Phase

RETRY_AFTER_S = 2.0  # a refused merge is not asked again for this long


def kvp_merges(state: ClusterState, now: float, merge_tokens: int) -> list[ScaleDownKVP]:
    taken: set[str] = set()  # one merge into each instance per call: its free blocks are not updated until then
    out: list[ScaleDownKVP] = []
    for req in state.requests.values():
        shards = req.decode_shards
        if req.phase is not Phase.DECODE or len(shards) < 2 or req.merging or req.preempting:
            continue
        if req.merge_refused_at is not None and now - req.merge_refused_at < RETRY_AFTER_S:
            continue
        for k in sorted(range(1, len(shards)), key=lambda k: shards[k].end - shards[k].start):
            leaving, into = shards[k], shards[k - 1]
            tokens = leaving.end - leaving.start
            if tokens >= merge_tokens:
                break
            if leaving.instance == req.decode_instance:
                continue
            receiver = state.instances.get(into.instance)
            if receiver is None or not receiver.alive or receiver.id in taken:
                continue
            if k == len(shards) - 1:  # the tail: the receiver takes every new token from now on
                tokens += req.spec.sampling.max_tokens
            if receiver.free_blocks >= receiver.blocks_for(tokens):
                taken.add(receiver.id)
                out.append(ScaleDownKVP(req.request_id, leaving.instance, into.instance))
                break
    return out


def merged(shards: tuple[KVShard, ...], leaving: str, into: str, master: str) -> tuple[KVShard, ...]:
    """The shards after `leaving`'s range joined `into`'s (adjacent); () when only the master's is left."""
    k = next((i for i, s in enumerate(shards) if s.instance == leaving), None)
    j = next((i for i, s in enumerate(shards) if s.instance == into), None)
    if k is None or j is None or abs(j - k) != 1:
        raise ValueError(f"{into} does not hold a shard next to {leaving}'s in {shards}")
    a, b = sorted((shards[k], shards[j]), key=lambda s: s.start)
    out = [*shards[: min(j, k)], KVShard(into, a.start, b.end), *shards[max(j, k) + 1 :]]
    return () if len(out) == 1 and out[0].instance == master else tuple(out)
