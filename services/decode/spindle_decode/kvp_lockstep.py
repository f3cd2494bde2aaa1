"""The decode instance as the leader of a KV-parallel (KVP) group (`--kvp-size K`, `spindle up --decode-kvp K`).

The instance's engine is a `spindle_engine.kvp.lockstep.KVPLeaderEngine`: member 0 of K processes at ranks
R..R+K-1 (the others run `python -m spindle_decode.kvp_follower`). Everything NATS-facing stays as for one
engine: the scheduler sees one instance whose KV blocks are the members' together, KV arrives whole at the
leader (directly, in SP parts, or pulled from the kvstore), and the leader streams every request's tokens,
whichever member masters it. Here: building and connecting the group, per-member block counts and the
scale-up / scale-down counters in the instance's stats, and failing the requests the group had to drop (for want of
blocks, or because a follower died: the group then goes on with the others and registers only their blocks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from spindle_engine.kvp.lockstep import KVPLeaderEngine, leader_engine
from spindle_protocol.messages import InstanceInfo, InstanceStats

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


def member_blocks(engine: KVPLeaderEngine) -> dict[str, int]:
    """`kvp-member-M: blocks` for each follower that holds any (from its last ack: what it really holds)."""
    return {f"kvp-member-{m}": used for m, used in engine.member_blocks_used.items() if used}


def with_kvp_size(info: InstanceInfo, size: int) -> InstanceInfo:
    return info if size == 1 else msgspec.structs.replace(info, kvp_size=size)


def with_counters(stats: InstanceStats, engine: object) -> InstanceStats:
    if not isinstance(engine, KVPLeaderEngine):
        return stats
    counters = {
        "kvp_scale_ups": engine.scale_ups,
        "kvp_scale_downs": engine.scale_downs,
        "kvp_dropped": engine.dropped,
        "kvp_members_gone": len(engine.gone),
        "kvp_lost_requests": engine.lost_requests,
    }
    return msgspec.structs.replace(stats, counters={**stats.counters, **counters})


def fail_dropped(inst: DecodeInstance, engine: KVPLeaderEngine) -> None:
    """On the engine thread after a step: fail the requests the group dropped (no block for a next token, or a
    member that died holding or mastering them; the group goes on without that member)."""
    for rid, message in engine.take_failures():
        job = inst.jobs.get(rid)
        if job is not None:
            inst.from_thread(inst.fail(job, 503, message))
