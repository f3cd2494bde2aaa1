"""Preempting a decoding request to the kvstore (`PreemptDecode`) and resuming it here later.

The sequence leaves the batch between steps with its blocks kept; its KV (prompt and outputs so far, less
the last sampled token) goes to the kvstore (`KVPut`, then the tensor on the data plane); only then are its
blocks freed, so a refusal or a failed send just puts it back into the batch. It then waits with the
requests parked by prefill instances, FIFO, and is pulled back (`KVGet`, free_after) when blocks free. The
job, and with it the token stream's numbering, stays the same throughout: the client only sees a pause.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from spindle_engine import PreemptedSequence
from spindle_protocol import subjects
from spindle_protocol.messages import (
    KVFree,
    KVFreeReply,
    KVPut,
    PreemptDecode,
    Preempted,
    PreemptReply,
    ReserveReply,
)
from spindle_transfer import header_of

if TYPE_CHECKING:
    from .instance import DecodeInstance, DecodeJob

log = logging.getLogger("spindle.decode")

HANDSHAKE_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Resume:
    """What a preempted request needs, besides its KV, to continue where it stopped."""

    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int


async def on_preempt(inst: DecodeInstance, msg: PreemptDecode, raw: Msg) -> PreemptReply:
    from .instance import DecodeJob, Parked  # the instance module imports this one

    t0 = time.time()
    rid = msg.request_id
    job = inst.jobs.get(rid)
    if not isinstance(job, DecodeJob) or not job.decoding or rid in inst.parked or inst.is_aborted(rid):
        return PreemptReply(accepted=False, reason="unknown")
    if inst.config.tp_size > 1:  # the KV is head-sharded over the ranks; gathering it is not done yet
        return PreemptReply(accepted=False, reason="tp")
    job.decoding = False  # no second preemption (nor a resume) while this one runs
    try:
        out: PreemptedSequence = await inst.call(lambda e: e.preempt_out(rid, keep_blocks=True))
    except ValueError:  # finished in the step before, or not decoding in the engine (recomputing)
        job.decoding = inst.jobs.get(rid) is job
        return PreemptReply(accepted=False, reason="unknown")
    header = header_of(out.kv)
    try:
        put = await inst.bus.request(
            subjects.kvstore_put(msg.kvstore_instance),
            KVPut(request_id=rid, start=0, end=out.num_kv_tokens, src_rank=inst.dp.rank, kv=header),
            ReserveReply,
            timeout=HANDSHAKE_TIMEOUT_S,
        )
        if not put.accepted:
            reason = "kvstore_full" if put.reason == "no_space" else f"kvstore_refused: {put.reason}"
            return await _put_back(inst, job, reason)
        await inst.dp.send_async(out.kv, msg.kvstore_rank, put.tag, header, timeout_s=SEND_TIMEOUT_S)
    except Exception as e:
        log.warning("%s: preempting %s to %s failed: %s", inst.id, rid, msg.kvstore_instance, e)
        with contextlib.suppress(Exception):  # a partial entry must not stay behind
            await inst.bus.request(subjects.kvstore_free(msg.kvstore_instance), KVFree(request_id=rid), KVFreeReply)
        return await _put_back(inst, job, f"kvstore_failed: {e}")
    await inst.call(lambda e: e.release(rid))
    inst.blocks_freed.set()
    if inst.jobs.get(rid) is not job:  # aborted meanwhile: the abort freed the blocks; drop the copy too
        with contextlib.suppress(Exception):
            await inst.bus.request(subjects.kvstore_free(msg.kvstore_instance), KVFree(request_id=rid), KVFreeReply)
        return PreemptReply(accepted=False, reason="unknown")
    job.stats["preemptions"] = job.stats.get("preemptions", 0.0) + 1
    inst.parked[rid] = Parked(
        job,
        msg.kvstore_instance,
        msg.kvstore_rank,
        header,
        out.num_kv_tokens,
        resume=Resume(out.token_ids, out.num_prompt_tokens),
    )
    seconds = time.time() - t0
    await inst.bus.publish(
        subjects.EVENTS, Preempted(request_id=rid, instance_id=inst.id, num_tokens=out.num_kv_tokens, seconds=seconds)
    )
    log.info("%s: preempted %s (%d tokens of KV) in %.3fs", inst.id, rid, out.num_kv_tokens, seconds)
    return PreemptReply(accepted=True, num_tokens=out.num_kv_tokens)


async def _put_back(inst: DecodeInstance, job: DecodeJob, reason: str) -> PreemptReply:
    """The kvstore did not take the KV: the sequence (blocks kept) rejoins the batch, unless it was aborted."""
    rid = job.request_id
    try:
        await inst.call(lambda e: e.readmit(rid))
    except ValueError:  # aborted meanwhile; the abort released the blocks
        return PreemptReply(accepted=False, reason="unknown")
    job.decoding = inst.jobs.get(rid) is job
    return PreemptReply(accepted=False, reason=reason)
