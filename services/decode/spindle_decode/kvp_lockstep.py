"""The decode instance as the leader of a KV-parallel (KVP) group (`--kvp-size K`, `spindle up --decode-kvp K`).

The instance's engine is a `spindle_engine.kvp.lockstep.KVPLeaderEngine`: member 0 of K processes at ranks
R..R+K-1 (the others run `python -m spindle_decode.kvp_follower`). Only the leader talks NATS, but every member
registers as a decode instance of its own (`decode-0`, `decode-0-kvp1`, ...; `InstanceInfo.kvp_group` names the
leader), with its own blocks, so the scheduler core routes by each member's freeness and picks a long request's
KVP degree, members and master (placement.pick_decode_group) as the simulator does. The scheduler sends the
placement (`PlaceKVP`) before the prefill starts; the leader answers every member's subjects, receives the KV
whole (directly, in SP parts, or pulled from the kvstore), reserves it at that placement (or, when it does not fit
now, where the group's planner puts it) and streams every request's tokens, whichever member masters it. A
strategy's `ScaleDownKVP` moves a member's range of a decoding request to an adjacent holder. After a step the
leader tells the scheduler where a request's KV is when that changed (`KVPShards`: placed, scaled up or down), so
strategies see the group's placement, not only the one they asked for. Here:
building and connecting the group, the members' registry entries and stats, the scale-up / scale-down counters,
and failing the requests the group had to drop (for want of blocks, or because a follower died: the group then
goes on with the others, and the dead member's registry entry is withdrawn).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from nats.aio.msg import Msg

from spindle_engine.kvp import KVRange
from spindle_engine.kvp.lockstep import KVPLeaderEngine, leader_engine
from spindle_protocol import subjects
from spindle_protocol.messages import (
    InstanceInfo,
    InstanceStats,
    KVParked,
    KVPShards,
    KVShardSpec,
    MoveParked,
    PlaceKVP,
    PreemptDecode,
    ReserveKV,
    ScaleDownKVP,
    ScaleDownReply,
    StatsQuery,
)

if TYPE_CHECKING:
    from .instance import DecodeInstance

log = logging.getLogger("spindle.decode.kvp")


@dataclass(frozen=True)
class KVPOptions:
    size: int = 1  # member processes of the group (1 = a plain decode instance)
    tokens: int = 0  # per-member KV token limit of a new request's ranges; 0 = one member when one has room
    scale_down_tokens: int = 0  # non-master ranges shorter than this merge into a neighbour with room; 0 = never

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"kvp size must be a positive integer, got {self.size!r}")
        if not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"kvp tokens must be a non-negative integer, got {self.tokens!r}")
        if not isinstance(self.scale_down_tokens, int) or self.scale_down_tokens < 0:
            raise ValueError(f"kvp scale-down tokens must be a non-negative integer, got {self.scale_down_tokens!r}")


def make_engine(inst: DecodeInstance) -> KVPLeaderEngine:
    """On the engine thread, before the data plane is joined: the model and member 0's cache, no traffic yet."""
    cfg = inst.config
    if cfg.tp_size != 1:
        raise ValueError("a KV-parallel decode group runs without tensor parallelism (tp_size 1)")
    if cfg.rank + inst.kvp.size > cfg.world_size:
        raise ValueError(f"kvp size {inst.kvp.size} from rank {cfg.rank} does not fit a world of {cfg.world_size}")
    return leader_engine(
        cfg.engine, inst.kvp.size, cfg.rank, kvp_tokens=inst.kvp.tokens, scale_down_tokens=inst.kvp.scale_down_tokens
    )


async def connect(inst: DecodeInstance) -> None:
    """The first exchange with every follower (they load the model meanwhile); before the instance registers."""
    engine = inst.engine
    assert isinstance(engine, KVPLeaderEngine)
    await inst.call(lambda e: e.connect())
    log.info(
        "%s: KV-parallel group of %d members at ranks %d..%d, %d blocks each, kvp_tokens %d, scale-down below %d",
        inst.id, engine.kvp_size, inst.config.rank, inst.config.rank + engine.kvp_size - 1,
        engine.planner.config.blocks_per_member, inst.kvp.tokens, inst.kvp.scale_down_tokens,
    )  # fmt: skip


def member_id(group: str, member: int) -> str:
    """The registry id of `member` of the group led by instance `group` (the leader keeps the group's id)."""
    return group if member == 0 else f"{group}-kvp{member}"


def member_of(inst: DecodeInstance, instance_id: str) -> int | None:
    engine = inst.engine
    assert isinstance(engine, KVPLeaderEngine)
    for m in range(engine.kvp_size):
        if member_id(inst.id, m) == instance_id:
            return m
    return None


def registry_entries(inst: DecodeInstance) -> list[Callable[[], InstanceInfo | None]]:
    """One heartbeat per member; a dead member's entry is withdrawn (the scheduler stops routing to it; the leader
    fails the requests that had a part on it, and the scheduler leaves that to the leader)."""
    engine = inst.engine
    assert isinstance(engine, KVPLeaderEngine)
    return [lambda m=m: member_info(inst, engine, m) for m in range(engine.kvp_size)]


def member_info(inst: DecodeInstance, engine: KVPLeaderEngine, member: int) -> InstanceInfo | None:
    load = engine.member_loads.get(member)
    if load is None:
        return None  # gone
    base = inst.base_info()
    return msgspec.structs.replace(
        base,
        instance_id=member_id(inst.id, member),
        kv_blocks_total=load.total,
        kv_blocks_used=load.used,
        num_running=load.mastering,
        num_waiting=base.num_waiting if member == 0 else 0,  # parked requests wait at the leader
        queued_tokens=0,
        updated_at=time.time(),
        kvp_size=engine.kvp_size,
        kvp_group=inst.id,
        device=base.device if member == 0 else member_device(inst, member),
    )


def member_device(inst: DecodeInstance, member: int) -> str:
    """Where follower `member` runs, as its mesh join said ("" when not known: a fixed world, or not joined yet)."""
    mesh = inst.dp.mesh
    place = mesh.placement(inst.config.rank + member) if mesh is not None else None
    return place.device if place is not None else ""


def member_stats(inst: DecodeInstance, engine: KVPLeaderEngine, member: int) -> InstanceStats:
    """`kv_blocks_used` is what the member's allocator holds (its last ack; the leader's own for member 0);
    `requests` what the plan puts there, reservations included."""
    load = engine.member_loads.get(member)
    used = engine.member.blocks_used if member == 0 else engine.member_blocks_used.get(member, 0)
    return InstanceStats(
        instance_id=member_id(inst.id, member),
        role="decode",
        kv_blocks_total=load.total if load else 0,
        kv_blocks_used=used,
        requests=dict(load.requests) if load else {},
    )


async def subscribe(inst: DecodeInstance) -> None:
    """The placement subject, and the followers' subjects: a request placed on a member reaches the leader."""
    engine = inst.engine
    assert isinstance(engine, KVPLeaderEngine)
    await inst.bus.subscribe(subjects.decode_place(inst.id), PlaceKVP, lambda msg, raw: on_place(inst, msg))
    await inst.bus.subscribe(
        subjects.decode_scale_down(inst.id), ScaleDownKVP, lambda msg, raw: on_scale_down(inst, msg)
    )  # fmt: skip
    for m in range(1, engine.kvp_size):
        mid = member_id(inst.id, m)
        await inst.bus.subscribe(subjects.decode_reserve(mid), ReserveKV, inst._on_reserve)
        await inst.bus.subscribe(subjects.decode_parked(mid), KVParked, inst._on_parked)
        await inst.bus.subscribe(subjects.decode_preempt(mid), PreemptDecode, inst.on_preempt)
        await inst.bus.subscribe(subjects.decode_move(mid), MoveParked, inst._on_move)
        await inst.bus.subscribe(subjects.instance_stats(mid), StatsQuery, _stats_handler(inst, engine, m))


def _stats_handler(inst: DecodeInstance, engine: KVPLeaderEngine, member: int):
    async def handler(msg: StatsQuery, raw: Msg) -> InstanceStats:
        return member_stats(inst, engine, member)

    return handler


async def on_place(inst: DecodeInstance, msg: PlaceKVP) -> None:
    shards = []
    for s in msg.shards:
        m = member_of(inst, s.instance)
        if m is None:
            log.warning("%s: placement of %s names %s, not a member; the group places it", inst.id, msg.request_id,
                        s.instance)  # fmt: skip
            return
        shards.append((m, s.start, s.end))
    inst.kvp_shards[msg.request_id] = shards


async def on_scale_down(inst: DecodeInstance, msg: ScaleDownKVP) -> ScaleDownReply:
    """Applied to the group's plan now (on the engine thread); the KV moves in the group's next step."""
    member = member_of(inst, msg.instance)
    into = member_of(inst, msg.into) if msg.into else None
    if member is None or (msg.into and into is None):
        return ScaleDownReply(accepted=False, reason=f"{msg.instance} or {msg.into} is not a member of {inst.id}")
    rid = msg.request_id

    def apply(engine: KVPLeaderEngine) -> tuple[KVRange, ...] | None:
        if rid not in engine.requests:
            return None
        if not engine.request_scale_down(rid, member, into):
            return ()
        return engine.member.plan.requests[rid].ranges

    try:
        ranges = await inst.call(apply)
    except ValueError as e:  # the plan does not allow it (not adjacent, the last holder, ...)
        return ScaleDownReply(accepted=False, reason=str(e))
    if ranges is None:
        return ScaleDownReply(accepted=False, reason="unknown")
    if not ranges:
        return ScaleDownReply(accepted=False, reason="no_room")
    log.info("%s: %s leaves %s for %s at the scheduler's request (now %s)", inst.id, msg.instance, rid, msg.into,
             ranges)  # fmt: skip
    return ScaleDownReply(accepted=True, shards=shard_specs(inst, ranges))


def shard_specs(inst: DecodeInstance, ranges: Iterable[KVRange]) -> list[KVShardSpec]:
    """A request's ranges as the scheduler names them (members by their registry ids)."""
    return [KVShardSpec(instance=member_id(inst.id, r.member), start=r.start, end=r.end) for r in ranges]


def with_counters(stats: InstanceStats, engine: object) -> InstanceStats:
    if not isinstance(engine, KVPLeaderEngine):
        return stats
    counters = {
        "kvp_scale_ups": engine.scale_ups,
        "kvp_scale_downs": engine.scale_downs,
        "kvp_dropped": engine.dropped,
        "kvp_members_gone": len(engine.gone),
        "kvp_lost_requests": engine.lost_requests,
        "kvp_placed_as_given": engine.placed_as_given,
        "kvp_placed_by_group": engine.placed_by_group,
    }
    return msgspec.structs.replace(stats, counters={**stats.counters, **counters})


def report_placements(inst: DecodeInstance, engine: KVPLeaderEngine) -> None:
    """On the engine thread after a step: a `KVPShards` event per request placed, scaled up or scaled down."""
    for q in engine.placement_changes():
        master, shards = member_id(inst.id, q.master), shard_specs(inst, q.ranges)
        event = KVPShards(request_id=q.request_id, instance_id=inst.id, master=master, shards=shards)
        inst.from_thread(inst.bus.publish(subjects.EVENTS, event))


def fail_dropped(inst: DecodeInstance, engine: KVPLeaderEngine) -> None:
    """On the engine thread after a step: fail the requests the group dropped (no block for a next token, or a
    member that died holding or mastering them; the group goes on without that member)."""
    for rid, message in engine.take_failures():
        job = inst.jobs.get(rid)
        if job is not None:
            inst.from_thread(inst.fail(job, 503, message))
