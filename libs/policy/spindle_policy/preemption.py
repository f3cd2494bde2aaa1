"""Time-sliced decode: when a request has waited too long for blocks on a full decode instance, requests that
have decoded there for at least one time slice are swapped out to the kvstore to make room for it.

A decode instance admits parked requests FIFO as blocks free, so without preemption the head of its queue
waits for running requests to finish, which for long outputs is unbounded. With a slice of `after_s`, no
request's stream pauses for much longer than a slice while others hold its blocks; the price is the swap-out
and swap-in of the victims' KV. Pure function of the cluster state: the simulator and the services run it
alike.
"""

from __future__ import annotations

from .actions import Preempt
from .state import ClusterState, InstanceState, RequestState


def _blocks(inst: InstanceState, req: RequestState) -> int:
    """Blocks the request holds once decoding (prompt plus all outputs, as placement reserves them)."""
    return inst.blocks_for(req.spec.prompt.num_tokens + req.spec.sampling.max_tokens)


def _since(t: float | None, now: float) -> float:
    return now if t is None else t


def time_slice_preemptions(state: ClusterState, now: float, after_s: float) -> list[Preempt]:
    kvstores = state.live("kvstore")
    if not kvstores:
        return []
    actions: list[Preempt] = []
    for inst in state.live("decode"):
        if inst.info.tp_size > 1:
            continue  # a tensor-parallel instance cannot swap a request out yet (its KV is head-sharded)
        parked = state.parked_on(inst.id)
        if not parked or now - _since(parked[0].parked_since, now) < after_s:
            continue
        running = state.decoding_on(inst.id)
        if any(r.preempting for r in running):
            continue  # the last swap-out has not landed: the heartbeat's free blocks are stale
        need = _blocks(inst, parked[0]) - (inst.info.kv_blocks_total - inst.info.kv_blocks_used)
        if need <= 0:
            continue  # it fits: the instance pulls it in by itself
        # longest-running first: they have had the most of their slice
        victims = sorted(
            (r for r in running if now - _since(r.decoding_since, now) >= after_s),
            key=lambda r: _since(r.decoding_since, now),
        )
        chosen: list[RequestState] = []
        for r in victims:
            if need <= 0:
                break
            chosen.append(r)
            need -= _blocks(inst, r)
        if need > 0:
            continue  # swapping out every eligible request would not make room: leave them running
        actions += [Preempt(r.request_id, inst.id, kvstores[0].id) for r in chosen]
    return actions
