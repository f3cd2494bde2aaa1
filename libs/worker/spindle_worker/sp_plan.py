"""SP plans on the wire (`SPChunkSpec`, instance ids) <-> `spindle_engine.sp.SPPlan` (small member integers).

A member's integer is its index in the last (largest) chunk's group, so every instance of the plan and the
decode instance that receives its KV number the members the same way.

The tiled order of a prompt's KV parks an SP prompt in the kvstore: the holders' parts one after another, in
member order, each in the order its holder keeps it; holders and the decode instance derive it from the plan.
"""

from __future__ import annotations

import torch

from spindle_engine.sp import SPChunk, SPPlan
from spindle_engine.sp.kv_parts import assemble_kv
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


def tiling(chunks: list[SPChunkSpec], num_tokens: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Each holder's positions (in the order it holds them) and where its part starts in the tiled order;
    ValueError for a malformed plan or one that does not cover `num_tokens` tokens."""
    plan, ids = plan_from_chunks(chunks)
    if plan.num_tokens != num_tokens:
        raise ValueError(f"the plan covers {plan.num_tokens} tokens, the prompt has {num_tokens}")
    placement = {ids[m]: pos for m, pos in plan.final_placement().items()}  # member order
    starts, offset = {}, 0
    for member, pos in placement.items():
        starts[member] = offset
        offset += pos.numel()
    return placement, starts


def untile(kv: torch.Tensor, chunks: list[SPChunkSpec] | tuple[SPChunkSpec, ...]) -> torch.Tensor:
    """The tiled KV [2, L, N, H, D] of an SP prompt (holders' parts in member order) in prompt order."""
    placement, _ = tiling(list(chunks), kv.shape[2])
    return assemble_kv([(torch.cat(list(placement.values())), kv)], kv.shape[2])
