"""Moving parked requests: a request waiting too long for blocks on a full decode instance is handed to another
decode instance that has room for it now (its KV stays in the kvstore until that instance pulls it).

A decode instance pulls parked requests FIFO, so the head of a full instance's queue can wait for requests that
decode for a long time while another instance sits half empty: placement was right when the request arrived,
not any more. Llumnix migrates such requests; here the KV is already in the kvstore, so moving one costs a
message. Pure function of the cluster state: the simulator and the services run it alike.
"""

from __future__ import annotations

from .actions import TransferKV
from .state import ClusterState


def move_parked(state: ClusterState, now: float, after_s: float) -> list[TransferKV]:
    decodes = state.live("decode")
    taken: set[str] = set()  # one move into each instance per call: its free blocks are not updated until then
    moves: list[TransferKV] = []
    for inst in decodes:
        free_here = inst.info.kv_blocks_total - inst.info.kv_blocks_used
        for req in state.parked_on(inst.id):
            assert req.parked_since is not None  # parked_on lists parked requests only
            if req.moving or req.decode_shards or now - req.parked_since < after_s:
                continue
            tokens = req.spec.prompt.num_tokens + req.spec.sampling.max_tokens
            if free_here >= inst.blocks_for(tokens):
                break  # the head fits: this instance pulls it (and FIFO keeps the rest behind it)
            room = [d for d in decodes if d is not inst and d.id not in taken and d.free_blocks >= d.blocks_for(tokens)]
            if room:
                dst = max(room, key=lambda d: (d.freeness, -d.info.rank))
                taken.add(dst.id)
                moves.append(TransferKV(req.request_id, inst.id, dst.id))
    return moves
