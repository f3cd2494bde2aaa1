"""Receiving an SP-prefilled prompt's KV from several holders (Tetris §4.2 multi-source transfer).

The first part's `ReserveKV` reserves blocks for the whole prompt (first-handshake order: the request that
asks first gets the blocks); every part then gets its own receive. Each holder's positions follow from the
plan it names, so the header of a part is checked against exactly the tokens that holder must have. When
all parts are in, they are put in place by position and the request joins the batch. A request refused
for lack of room is remembered like an aborted one (its holders fail it), so no later part can reserve.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from nats.aio.msg import Msg

from spindle_engine.sp import assemble_kv
from spindle_protocol import subjects
from spindle_protocol.messages import DecodeStarted, ReserveKV, ReserveReply, TensorHeader
from spindle_protocol.prompts import load_prompt
from spindle_protocol.tensor_header import header_for
from spindle_transfer import dtype_name
from spindle_worker import sampling_params
from spindle_worker.sp_plan import plan_from_chunks

if TYPE_CHECKING:
    from .instance import DecodeInstance, DecodeJob

RECEIVE_TIMEOUT_S = 120.0


@dataclass
class PartsInFlight:
    job: DecodeJob
    num_parts: int
    placement: dict[str, torch.Tensor]  # holder id -> positions it sends
    parts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    senders: set[str] = field(default_factory=set)
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
            plan, ids = plan_from_chunks(part.chunks)
            if plan.num_tokens != n:
                raise ValueError(f"the plan covers {plan.num_tokens} tokens, the prompt has {n}")
            placement = {ids[m]: pos for m, pos in plan.final_placement().items()}
            ok = await inst.call(lambda e: e.reserve(rid, n))
        except ValueError as e:
            return ReserveReply(accepted=False, reason=str(e))
        if not ok:
            inst.aborted[rid] = time.time()
            return ReserveReply(accepted=False, reason="no_space")
        entry = PartsInFlight(inst._new_job(spec, raw.headers), part.num_parts, placement)
        inst.sp_parts[rid] = entry
    positions = entry.placement.get(part.member)
    if positions is None or part.member in entry.senders:
        return ReserveReply(accepted=False, reason=f"unexpected or repeated part from {part.member}")
    expected = header_for(dtype_name(inst.engine.cache.k.dtype), inst.import_kv_shape(positions.numel()))
    if msg.kv != expected:
        return ReserveReply(accepted=False, reason=f"bad_header: expected {expected}")
    entry.senders.add(part.member)
    if msg.first_token >= 0:
        entry.first_token = msg.first_token
    tag = inst.dp.new_tag()
    inst._spawn(_receive_part(inst, entry, positions, msg.src_rank, tag, msg.kv))
    return ReserveReply(accepted=True, tag=tag)


async def _receive_part(
    inst: DecodeInstance, entry: PartsInFlight, positions: torch.Tensor, src: int, tag: int, header: TensorHeader
) -> None:
    job, rid = entry.job, entry.job.request_id
    try:
        kv = await inst.dp.recv_async(header, src, tag, cancel=job.cancel, timeout_s=RECEIVE_TIMEOUT_S)
        entry.parts.append((positions, kv))
        entry.bytes += header.nbytes
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


def forget(inst: DecodeInstance, request_id: str) -> None:
    entry = inst.sp_parts.pop(request_id, None)
    if entry is not None:
        entry.job.cancel.set()
