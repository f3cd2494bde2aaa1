"""SP plans on the wire (`SPChunkSpec`, instance ids) <-> `spindle_engine.sp.SPPlan` (small member integers).

A member's integer is its index in the last (largest) chunk's group, so every instance of the plan and the
decode instance that receives its KV number the members the same way.
"""

from __future__ import annotations

from spindle_engine.sp import SPChunk, SPPlan
from spindle_protocol.messages import SPChunkSpec


def plan_from_chunks(chunks: list[SPChunkSpec]) -> tuple[SPPlan, list[str]]:
    """The plan and the instance id of each member integer; ValueError for a malformed plan."""
    if not chunks:
        raise ValueError("an SP plan needs at least one chunk")
    ids = list(chunks[-1].members)
    index = {m: i for i, m in enumerate(ids)}
    missing = {m for c in chunks for m in c.members} - index.keys()
    if missing:
        raise ValueError(f"instances {sorted(missing)} are in a chunk but not in the last (largest) group")
    return SPPlan(tuple(SPChunk(c.start, c.end, tuple(index[m] for m in c.members), c.layout) for c in chunks)), ids
