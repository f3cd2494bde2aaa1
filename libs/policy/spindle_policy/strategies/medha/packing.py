"""Medha's batch packer (§3.2, §4.2): the prefill chunks of one iteration on one replica, beside its decodes.

The queue comes in priority order. The head request gets the longest chunk that keeps the predicted iteration
time within the target (the TPOT SLO: the decodes batched with it must not wait longer), so its chunks start large
and shrink as the attention over its history grows (adaptive chunking), but never below `min_chunk` (the minimum
efficient chunk; the only case the target may be passed). Requests behind it fill what the target leaves, each
with the longest chunk that still fits. Prefill-prefill batching (`max_share` > 0): when the head cannot finish in
this iteration, it leaves the requests behind it a share of the iteration's prefill time proportional to the
head's remaining relative slack (§4.2: "the fraction of space allocated to short requests is proportional to their
remaining slack", read as the slack of the long request they share with: a long prompt far from its deadline can
afford to let short ones in, one about to miss it takes the whole iteration), capped at `max_share`. A request
that spans replicas (KVP) takes at most what this replica holds of its prompt (`Prefilling.room`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...mixed_batch import MixedBatchModel
from .slack import Prefilling


@dataclass(frozen=True)
class PackLimits:
    target_s: float  # the iteration time to stay within
    min_chunk: int
    max_chunk: int
    max_share: float  # 0: no prefill-prefill batching
    max_prefills: int  # prefill chunks per iteration


def pack(
    model: MixedBatchModel,
    tp: int,
    queue: list[Prefilling],
    num_decodes: int,
    decode_kv: int,
    limits: PackLimits,
    slack: Callable[[Prefilling], float],
) -> list[tuple[Prefilling, int]]:
    """[(request, tokens of its next chunk)] for one iteration; `queue` in priority order, `slack` its relative
    slack (Eq. 7)."""
    if not queue:
        return []
    chunks: list[tuple[int, int]] = []
    taken: list[tuple[Prefilling, int]] = []
    base = model.predict(tp, (), num_decodes, decode_kv)
    head = queue[0]
    budget = limits.target_s
    whole = model.largest_chunk(tp, head.done, min(head.room, limits.max_chunk), budget, (), num_decodes, decode_kv)
    if limits.max_share > 0 and whole < head.room and len(queue) > 1:
        share = limits.max_share * min(1.0, max(0.0, slack(head)))
        budget_head = base + (1.0 - share) * max(0.0, limits.target_s - base)
        whole = model.largest_chunk(tp, head.done, min(head.room, limits.max_chunk), budget_head, (), num_decodes,
                                    decode_kv)  # fmt: skip
    n = max(whole, min(limits.min_chunk, head.room))
    taken.append((head, n))
    chunks.append((head.done, n))
    if n < head.room and limits.max_share <= 0:
        return taken  # no space sharing: the head takes the iteration
    for p in queue[1:]:
        if len(taken) >= limits.max_prefills:
            break
        limit = min(p.room, limits.max_chunk)
        m = model.largest_chunk(tp, p.done, limit, limits.target_s, chunks, num_decodes, decode_kv)
        if m < min(limits.min_chunk, p.room):
            continue  # what is left is too small to be worth a chunk: a shorter request behind may still fit
        taken.append((p, m))
        chunks.append((p.done, m))
    return taken
