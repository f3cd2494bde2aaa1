"""The KV hand-off from a prefill instance (Tetris §4.2 handshake).

1. Ask the decode instance to reserve blocks (`ReserveKV`); it posts a receive and answers with a tag.
2. Send the KV tensor on the data plane under that tag. A tensor-parallel decode instance answers with its ranks,
   their KV-head ranges and one tag per rank instead: each rank gets only its heads, straight from here, so the
   sequence-sharded prefill layout becomes the head-sharded decode layout in that one transfer. The followers'
   slices go first and the leader's last: once the leader has its part, every rank has its own.
If the decode instance has no room, the KV parks in the kvstore (`KVPut`, then the tensor) and the decode
instance is told where it waits (`KVParked`); it pulls the KV when blocks free.

One holder's share of an SP prefill (`part`) parks the same way, as tokens [tile_start, tile_start + its tokens)
of the request's tiled entry (see `KVParked`); the decode instance answers every part of a request alike
(all received, or all parked), and pulls the whole prompt once every part has parked.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import torch
from opentelemetry import trace

from spindle_engine.sp import split_for_decode
from spindle_protocol import subjects
from spindle_protocol.messages import KVParked, KVPart, KVPut, ReserveKV, ReserveReply, TransferDone
from spindle_transfer import header_of

if TYPE_CHECKING:
    from .instance import PrefillInstance, PrefillJob

HANDSHAKE_TIMEOUT_S = 10.0


class HandOffError(RuntimeError):
    pass


async def hand_off(
    inst: PrefillInstance,
    job: PrefillJob,
    first_token: int,
    kv: torch.Tensor,
    part: KVPart | None = None,
    tile_start: int = 0,
) -> None:
    cmd = job.command
    assert cmd is not None
    spec = cmd.request
    header = header_of(kv)
    ctx = trace.set_span_in_context(job.span)
    with inst.tracer.start_as_current_span("kv.transfer", context=ctx) as span:
        span.set_attribute("spindle.bytes", header.nbytes)
        span.set_attribute("spindle.dst", cmd.decode_instance)
        t0 = time.time()
        reply = await inst.bus.request(
            subjects.decode_reserve(cmd.decode_instance),
            ReserveKV(
                request=spec,
                first_token=first_token,
                src_rank=inst.dp.rank,
                kv=header,
                part=part,
                prefill_ms=job.stats.get("prefill_ms"),
                csa_dropped_tokens=int(job.stats.get("csa_dropped_tokens", 0)),
            ),
            ReserveReply,
            timeout=HANDSHAKE_TIMEOUT_S,
        )
        if reply.accepted and reply.tp_ranks:
            span.set_attribute("spindle.tp_ranks", list(reply.tp_ranks))
            await send_heads(inst, kv, reply)
            parked = False
        elif reply.accepted:
            await inst.dp.send_async(kv, cmd.decode_rank, reply.tag, header)
            parked = False
        elif reply.reason == "no_space" and cmd.kvstore_instance:
            span.set_attribute("spindle.parked", cmd.kvstore_instance)
            start, end = tile_start, tile_start + kv.shape[2]
            put = await inst.bus.request(
                subjects.kvstore_put(cmd.kvstore_instance),
                KVPut(request_id=spec.request_id, start=start, end=end, src_rank=inst.dp.rank, kv=header),
                ReserveReply,
                timeout=HANDSHAKE_TIMEOUT_S,
            )
            if not put.accepted:
                raise HandOffError(f"decode instance is full and the kvstore refused: {put.reason}")
            await inst.dp.send_async(kv, cmd.kvstore_rank, put.tag, header)
            await inst.bus.publish(
                subjects.decode_parked(cmd.decode_instance),
                KVParked(
                    request=spec,
                    first_token=first_token,
                    kvstore_instance=cmd.kvstore_instance,
                    kvstore_rank=cmd.kvstore_rank,
                    kv=header,
                    part=part,
                    start=start,
                    prefill_ms=job.stats.get("prefill_ms"),
                    csa_dropped_tokens=int(job.stats.get("csa_dropped_tokens", 0)),
                ),
            )
            parked = True
        else:
            raise HandOffError(f"decode instance {cmd.decode_instance} refused the KV: {reply.reason}")
        seconds = time.time() - t0
    await inst.bus.publish(
        subjects.EVENTS,
        TransferDone(
            request_id=spec.request_id,
            src_instance=inst.id,
            dst_instance=cmd.kvstore_instance if parked else cmd.decode_instance,
            nbytes=header.nbytes,
            seconds=seconds,
            parked=parked,
        ),
    )


def head_slices(kv: torch.Tensor, reply: ReserveReply) -> list[tuple[torch.Tensor, int, int]]:
    """`(slice, rank, tag)` per rank of a tensor-parallel decode instance: its KV heads of `kv`."""
    ranks, tags, heads = reply.tp_ranks, reply.tp_tags, reply.tp_heads
    if not len(ranks) == len(tags) == len(heads) or any(len(h) != 2 for h in heads):
        raise HandOffError(f"a bad tensor-parallel layout: ranks {ranks}, tags {tags}, heads {heads}")
    try:
        parts = split_for_decode(kv, [(lo, hi) for lo, hi in heads])
    except ValueError as e:
        raise HandOffError(f"the decode instance's heads {heads} do not fit the KV: {e}") from e
    return list(zip(parts, ranks, tags, strict=True))


async def send_heads(inst: PrefillInstance, kv: torch.Tensor, reply: ReserveReply) -> None:
    """Send each decode rank its heads: the followers together, then the leader (`tp_ranks[0]`)."""
    (lead, *follow) = head_slices(kv, reply)
    await asyncio.gather(*(inst.dp.send_async(part, rank, tag, header_of(part)) for part, rank, tag in follow))
    part, rank, tag = lead
    await inst.dp.send_async(part, rank, tag, header_of(part))
