"""The simulator's invariants, checked after a run (tests call this; so can anyone debugging a strategy).

Each request reaches exactly one terminal state with consistent timestamps; no instance runs two prefill
chunks at once; KV capacity was never exceeded (``SimInstance.alloc`` also asserts it as it happens) and every
block was given back; the core forgot every request.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from .metrics import TERMINAL

if TYPE_CHECKING:
    from .executor import SimResult, Simulator


def check_invariants(sim: Simulator, result: SimResult) -> None:
    for r in result.records:
        assert r.state in TERMINAL, f"{r.request_id} ended in {r.state!r}"
        if r.state != "finished":
            assert r.finished_at is None, f"{r.request_id} {r.state} but has a finish time"
            continue
        assert len(r.token_times) == r.num_decode_tokens, f"{r.request_id} got {len(r.token_times)} tokens"
        assert r.finished_at == r.token_times[-1]
        times = [r.arrived_at, r.prefill_start, r.prefill_end]
        if r.num_decode_tokens > 1:
            times += [r.transfer_end, r.decode_start]
        assert None not in times and times == sorted(times), f"{r.request_id} times go backwards: {times}"
        assert r.token_times[0] == r.prefill_end
        assert r.token_times == sorted(r.token_times) and r.token_times[-1] <= result.end_time
    for inst in sim.instances.values():
        spans = sorted(inst.busy_spans)
        overlap = [(a, b) for a, b in itertools.pairwise(spans) if a[1] > b[0]]
        assert not overlap, f"{inst.id} ran two chunks at once: {overlap[:1]}"
        assert inst.peak_blocks <= inst.total_blocks, f"{inst.id} exceeded its KV capacity"
        assert inst.used_blocks == 0 and not inst.held, f"{inst.id} still holds KV of {sorted(inst.held)[:3]}"
    assert not sim.core.state.requests, f"the core still tracks {sorted(sim.core.state.requests)[:3]}"
    planned = {i.id: i.planned for i in sim.core.state.instances.values() if i.planned}
    assert not planned, f"predicted work left on {sorted(planned)[:3]}"
