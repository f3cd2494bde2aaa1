"""What the strategy decided, for people: each action as a `Decision` (service.py publishes them on
`subjects.DECISIONS` for the gateway's /dashboard; the simulator's timeline lists the same texts)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from spindle_protocol.messages import Decision, SPChunkSpec

from .actions import (
    Action,
    FailRequest,
    MigrateKV,
    Preempt,
    Reject,
    Reshard,
    RunBatch,
    RunPrefill,
    ScaleDownKVP,
    TransferKV,
)

MAX_LISTED = 6  # chunks or parts spelled out in one text; the rest are counted
_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def compact_ids(ids: Sequence[str]) -> str:
    """["prefill-0", "prefill-1", "prefill-2"] -> "prefill-0..2"; other lists joined by commas."""
    if len(ids) < 3:
        return ",".join(ids)
    matches = [_NUMBERED.match(i) for i in ids]
    if all(matches) and len({m.group(1) for m in matches}) == 1:  # type: ignore[union-attr]
        numbers = [int(m.group(2)) for m in matches]  # type: ignore[union-attr]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            return f"{ids[0]}..{numbers[-1]}"
    return ",".join(ids)


def _listed(items: list[str]) -> str:
    more = len(items) - MAX_LISTED
    return ", ".join(items[:MAX_LISTED]) + (f", ... ({len(items)} in all)" if more > 0 else "")


def plan_text(a: RunPrefill) -> str:
    n = a.spec.prompt.num_tokens
    if a.is_colocated:
        size = max(c.num_tokens for c in a.chunks)
        chunks = f"in {len(a.chunks)} chunks of <= {size} tokens" if len(a.chunks) > 1 else "whole"
        return f"colocated on {a.decode_instance}: {n} prompt tokens {chunks}"
    if a.is_single:
        return f"whole prompt ({n} tokens) on {a.chunks[0].instances[0]}, decode {a.decode_instance}"
    sp = max(c.sp for c in a.chunks)
    chunks = _listed([f"{c.start}-{c.end}@{c.sp}" for c in a.chunks])
    text = f"SP {sp} on {compact_ids(a.prefill_instances)}, chunks {chunks}, decode {a.decode_instance}"
    if a.decode_shards:
        text += f" (KV over {compact_ids([s.instance for s in a.decode_shards])})"
    if a.csa_drop:
        text += f", CSA drop {a.csa_drop:g}"
    return text


def batch_text(a: RunBatch) -> str:
    parts = _listed([f"{p.request_id} {p.start}-{p.end}" for p in a.prefills])
    text = f"iteration {a.batch_id} on {compact_ids(a.instances)}"
    if a.prefills:
        text += f": prefill {parts}"
    if a.decodes:
        text += f"{';' if a.prefills else ':'} {len(a.decodes)} decodes"
    return text


def decision(action: Action, strategy: str, now: float) -> Decision | None:
    """The Decision an action makes (None for Admit: the plan that follows carries the placement)."""
    d = {"t": now, "strategy": strategy}
    match action:
        case RunPrefill():
            chunks = [SPChunkSpec(start=c.start, end=c.end, members=list(c.instances), layout=c.layout)
                      for c in action.chunks]  # fmt: skip
            return Decision(**d, kind="plan", request_id=action.spec.request_id, text=plan_text(action),
                            instances=list(action.prefill_instances), chunks=chunks,
                            decode_instance=action.decode_instance)  # fmt: skip
        case RunBatch():
            new = [p.request_id for p in action.prefills if p.start == 0]
            masters: dict[str, int] = {}
            for part in action.decodes:
                masters[part.master] = masters.get(part.master, 0) + 1
            first = (new or [p.request_id for p in action.prefills] or [""])[0]
            return Decision(**d, kind="iteration", request_id=first, text=batch_text(action),
                            instances=list(action.instances), batch_id=action.batch_id,
                            prefill_requests=[p.request_id for p in action.prefills], new_requests=new,
                            decode_masters=masters)  # fmt: skip
        case Reject():
            return Decision(**d, kind="reject", request_id=action.request_id,
                            text=f"rejected ({action.status}): {action.reason}")  # fmt: skip
        case FailRequest():
            return Decision(**d, kind="fail", request_id=action.request_id,
                            text=f"failed ({action.status}): {action.message}")  # fmt: skip
        case Preempt():
            return Decision(**d, kind="preempt", request_id=action.request_id, instances=[action.instance],
                            text=f"preempted on {action.instance}, its KV to {action.kvstore_instance}")  # fmt: skip
        case TransferKV():
            return Decision(**d, kind="move", request_id=action.request_id, instances=[action.src, action.dst],
                            text=f"parked KV waits on {action.dst} instead of {action.src}")  # fmt: skip
        case MigrateKV():
            return Decision(**d, kind="migrate", request_id=action.request_id, instances=[action.src, action.dst],
                            text=f"KV migrates {action.src} -> {action.dst}")  # fmt: skip
        case ScaleDownKVP():
            return Decision(**d, kind="scale_down", request_id=action.request_id, instances=[action.instance],
                            text=f"{action.instance} leaves the request: its KV shard to {action.into}")  # fmt: skip
        case Reshard():
            return Decision(**d, kind="reshard", instances=[action.instance],
                            text=f"{action.instance} re-shards to {action.to}")  # fmt: skip
    return None
