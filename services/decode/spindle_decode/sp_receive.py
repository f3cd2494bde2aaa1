"""Receiving an SP-prefilled prompt's KV from several holders (Tetris §4.2 multi-source transfer).

The first part's `ReserveKV` decides for the whole request (first-handshake order: the request that asks first
gets the blocks), and every later part gets the same answer, so parts never end up half received, half parked:
- room for the whole prompt: the blocks are reserved and every part gets its own receive; when all parts are in,
  they are put in place by position and the request joins the batch;
- no room (`no_space`): every part parks in the kvstore, even if blocks free meanwhile. Each holder stores its
  part at its place in the tiled order (the holders' parts one after another, in member order; see `KVParked`)
  and says so with a `KVParked` carrying `part`. Once all parts have parked, the request waits FIFO with the
  other parked requests as one range [0, N); it is pulled with one `KVGet` and un-permuted by the plan.
Later parts that arrive while the first part's reservation is being made wait for its outcome. Each holder's
positions follow from the plan it names, so every part is checked against exactly the tokens that holder has.
On a tensor-parallel instance every rank receives each part's heads for itself (`DecodeInstance.receive_direct`):
the leader assembles its heads here, each follower its own at the mirrored resume.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from nats.aio.msg import Msg

from spindle_engine.sp import assemble_kv
from spindle_engine.tp import TPLeaderEngine
from spindle_protocol import subjects
from spindle_protocol.messages import DecodeStarted, KVParked, ReserveKV, ReserveReply, SPChunkSpec, TensorHeader
from spindle_protocol.prompts import load_prompt
from spindle_protocol.tensor_header import header_for
from spindle_transfer import dtype_name
from spindle_worker import sampling_params
from spindle_worker.sp_plan import tiling

if TYPE_CHECKING:
    from .instance import DecodeInstance, DecodeJob

RECEIVE_TIMEOUT_S = 120.0


@dataclass
class PartsInFlight:
    num_parts: int
    placement: dict[str, torch.Tensor]  # holder id -> positions it sends
    starts: dict[str, int]  # holder id -> where its part starts in the tiled order
    chunks: list[SPChunkSpec]
    job: DecodeJob | None = None  # set once the first part's reservation is decided
    parking: bool = False  # no room: every part parks in the kvstore
    decided: asyncio.Event = field(default_factory=asyncio.Event)
    parts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    senders: set[str] = field(default_factory=set)
    kvstore: tuple[str, int] | None = None  # parking: where the parts wait
    first_token: int = -1
    bytes: int = 0
    t0: float = field(default_factory=time.time)


async def on_reserve_part(inst: DecodeInstance, msg: ReserveKV, raw: Msg) -> ReserveReply:
    spec, part = msg.request, msg.part
    assert part is not None
    rid, n = spec.request_id, spec.prompt.num_tokens
    if inst.is_aborted(rid):
        return ReserveReply(accepted=False, reason="aborted or refused")
    entry = inst.sp_parts.get(rid)
    if entry is None:
        if rid in inst.jobs:
            return ReserveReply(accepted=False, reason="duplicate request")
        try:
            placement, starts = tiling(part.chunks, n)
            holders = sum(1 for pos in placement.values() if pos.numel())
            if part.num_parts != holders:
                raise ValueError(f"the plan has {holders} holders, the part says {part.num_parts}")
        except ValueError as e:
            inst.aborted[rid] = time.time()  # the other parts get the same answer
            return ReserveReply(accepted=False, reason=str(e))
        entry = PartsInFlight(part.num_parts, placement, starts, list(part.chunks))
        inst.sp_parts[rid] = entry  # before any await: parts arriving meanwhile wait for this decision
        try:
            refused = await _decide(inst, entry, msg, raw)
        finally:
            entry.decided.set()
        if refused is not None:
            return refused
    else:
        await entry.decided.wait()
        if inst.sp_parts.get(rid) is not entry or entry.job is None:
            return ReserveReply(accepted=False, reason="aborted or refused")
    if entry.parking:
        return ReserveReply(accepted=False, reason="no_space")
    positions = entry.placement.get(part.member)
    if positions is None or part.member in entry.senders:
        return ReserveReply(accepted=False, reason=f"unexpected or repeated part from {part.member}")
    expected = _part_header(inst, positions.numel())
    if msg.kv != expected:
        return ReserveReply(accepted=False, reason=f"bad_header: expected {expected}")
    entry.senders.add(part.member)
    if msg.first_token >= 0:
        entry.first_token = msg.first_token
    reply, header = ReserveReply(accepted=True, tag=inst.dp.new_tag()), msg.kv
    if isinstance(inst.engine, TPLeaderEngine):  # each rank receives this part's heads from the holder
        try:
            reply, header = await inst.receive_direct(rid, msg.src_rank, positions)
        except Exception as e:  # the request went away meanwhile
            job = entry.job
            assert job is not None
            job.cancel.set()  # the other parts' receives stop too
            inst.sp_parts.pop(rid, None)
            await inst.give_up(job, e)
            return ReserveReply(accepted=False, reason=f"aborted or refused: {e}")
    inst.spawn(_receive_part(inst, entry, positions, msg.src_rank, reply.tag, header, msg.kv.nbytes))
    return reply


async def _decide(inst: DecodeInstance, entry: PartsInFlight, msg: ReserveKV, raw: Msg) -> ReserveReply | None:
    """Reserve the whole prompt for the request's first part: direct (blocks reserved) or parking; a refusal
    for anything else (the request then fails: its holders fail it)."""
    rid, n = msg.request.request_id, msg.request.prompt.num_tokens
    try:
        ok = await inst.reserve_blocks(msg.request, n)
    except ValueError as e:
        inst.sp_parts.pop(rid, None)
        inst.aborted[rid] = time.time()
        return ReserveReply(accepted=False, reason=str(e))
    if inst.sp_parts.get(rid) is not entry:  # aborted while the blocks were reserved
        if ok:
            await inst.call(lambda e: e.cancel_reservation(rid))
        return ReserveReply(accepted=False, reason="aborted or refused")
    entry.job = inst._new_job(msg.request, raw.headers, msg)
    entry.parking = not ok
    return None


def _part_header(inst: DecodeInstance, num_tokens: int) -> TensorHeader:
    return header_for(dtype_name(inst.engine.cache.k.dtype), inst.import_kv_shape(num_tokens))


async def _receive_part(
    inst: DecodeInstance,
    entry: PartsInFlight,
    positions: torch.Tensor,
    src: int,
    tag: int,
    header: TensorHeader,
    nbytes: int,
) -> None:
    """Receive one part (on a TP instance, the leader's heads of it); `nbytes`: the part's bytes over every rank."""
    job = entry.job
    assert job is not None
    rid = job.request_id
    try:
        kv = await inst.dp.recv_async(header, src, tag, cancel=job.cancel, timeout_s=RECEIVE_TIMEOUT_S)
        entry.parts.append((positions, kv))
        entry.bytes += nbytes
        if len(entry.parts) < entry.num_parts:
            return
        inst.sp_parts.pop(rid, None)
        if entry.first_token < 0:
            raise RuntimeError("no part carried the first token")
        prompt = await load_prompt(inst.bus, job.spec.prompt)
        full = assemble_kv(entry.parts, len(prompt))
        job.stats["transfer_ms"] = (time.time() - entry.t0) * 1e3
        job.stats["kv_bytes"] = float(entry.bytes)
        if inst.jobs.get(rid) is not job:
            raise RuntimeError("aborted")
        params = sampling_params(job.spec.sampling)
        await inst.call(lambda e: e.add_prefilled(rid, prompt, entry.first_token, full, params))
    except Exception as e:
        job.cancel.set()  # the other parts' receives stop too
        inst.sp_parts.pop(rid, None)
        await inst.give_up(job, e)
        return
    job.decoding = True
    job.started = time.time()
    await inst.bus.publish(subjects.EVENTS, DecodeStarted(request_id=rid, instance_id=inst.id))


async def on_parked_part(inst: DecodeInstance, msg: KVParked, raw: Msg) -> None:
    """One holder's part waits in the kvstore; with the last one, the request queues as one parked range."""
    from .instance import Parked  # the instance module imports this one

    part = msg.part
    assert part is not None
    rid, n = msg.request.request_id, msg.request.prompt.num_tokens
    if inst.is_aborted(rid):
        return
    entry = inst.sp_parts.get(rid)
    job = entry.job if entry is not None else inst.jobs.get(rid)
    if entry is None or job is None or not entry.parking or inst.jobs.get(rid) is not job:
        if job is None:  # fail it anyway: the failure's abort frees the holders and the kvstore
            job = inst._new_job(msg.request, raw.headers, msg)
        await inst.fail(job, 503, f"a KV part of {rid} parked that this instance did not send to the kvstore")
        return
    positions = entry.placement.get(part.member)
    problem = None
    if positions is None or part.member in entry.senders:
        problem = f"unexpected or repeated part from {part.member}"
    elif msg.start != entry.starts[part.member] or msg.kv != _part_header(inst, positions.numel()):
        problem = f"part of {part.member} parked at {msg.start} as {msg.kv}, not where the plan puts it"
    elif entry.kvstore not in (None, (msg.kvstore_instance, msg.kvstore_rank)):
        problem = f"parts parked in different kvstores: {entry.kvstore[0]} and {msg.kvstore_instance}"
    if problem is not None:
        await inst.fail(job, 503, f"bad parked KV part: {problem}")
        return
    entry.senders.add(part.member)
    entry.kvstore = (msg.kvstore_instance, msg.kvstore_rank)
    if msg.first_token >= 0:
        entry.first_token = msg.first_token
    if len(entry.senders) < entry.num_parts:
        return
    inst.sp_parts.pop(rid, None)
    if entry.first_token < 0:
        await inst.fail(job, 503, "no part carried the first token")
        return
    header = _part_header(inst, n)
    kvstore, rank = entry.kvstore
    inst.parked[rid] = Parked(job, kvstore, rank, header, n, first_token=entry.first_token, tiled=tuple(entry.chunks))
    inst.blocks_freed.set()


def forget(inst: DecodeInstance, request_id: str) -> None:
    entry = inst.sp_parts.pop(request_id, None)
    if entry is not None and entry.job is not None:
        entry.job.cancel.set()
