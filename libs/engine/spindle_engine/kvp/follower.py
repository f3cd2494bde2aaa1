"""The follower side of a KVP decode group: a member that replays the leader's placement calls and steps with
the group (lockstep.py has the leader and the protocol between them)."""

from __future__ import annotations

import logging

from torch import Tensor

from ..config import EngineConfig
from .decoder import KVPMember
from .lockstep import LEADER_SILENCE_S, STARTUP_TIMEOUT_S, STEP_TIMEOUT_S, load_member
from .wire import (
    Call,
    Drop,
    Gone,
    KVPError,
    Place,
    ScaleDown,
    ScaleUp,
    checksum,
    lost_mask,
    recv_control,
    send_ack,
)

log = logging.getLogger("spindle.engine.kvp")


class KVPFollower:
    """Replays the leader's placement calls on this member and steps with the group, until told to stop."""

    def __init__(self, member: KVPMember, leader: int, *, timeout_s: float = LEADER_SILENCE_S) -> None:
        self.member = member
        self.leader = leader
        self.timeout_s = timeout_s

    def kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        hkv, d = self.member.shard.cache.k.shape[3:]
        return (2, len(self.member.model.layers), num_tokens, hkv, d)

    def serve(self) -> None:
        m = self.member
        dtype = m.shard.cache.k.dtype
        expected_seq = 0
        while True:
            timeout = self.timeout_s if expected_seq else STARTUP_TIMEOUT_S
            control, parts = recv_control(self.leader, m.me, self.kv_shape, dtype, timeout)
            if control.stop:
                log.info("member %d: the leader stopped the group", m.me)
                return
            if control.seq != expected_seq:
                raise KVPError(f"control message {control.seq} arrived, expected {expected_seq}")
            expected_seq += 1
            self.apply(control.calls, parts)
            if control.step:
                m.step()
            tokens = m.last_tokens if control.step else []
            if 0 in m.lost:
                raise KVPError(f"member {m.me} lost the leader (rank {self.leader})")
            send_ack([control.seq, m.blocks_used, checksum(tokens), lost_mask(m.lost)], self.leader, STEP_TIMEOUT_S)

    def apply(self, calls: list[Call], parts: list[Tensor]) -> None:
        m, kv = self.member, iter(parts)
        for call in calls:
            match call:
                case Place():
                    req = call.request()
                    mine = req.range_of(m.me)
                    part = next(kv) if mine is not None and mine.num_tokens else None
                    tokens = call.token_ids if req.master == m.me else None
                    m.add_request(
                        req, part, token_ids=tokens, num_prompt_tokens=call.num_prompt_tokens, params=call.params
                    )  # fmt: skip
                case ScaleUp():
                    m.scale_up(call.request_id, call.member)
                case ScaleDown():
                    m.scale_down(call.request_id, call.member, call.into)
                case Drop():
                    m.abort(call.request_id)
                case Gone():
                    dropped = m.remove_member(call.member)
                    log.warning("member %d: member %d is gone; dropped %s", m.me, call.member, dropped)


def follower(config: EngineConfig, kvp_size: int, first_rank: int, member: int) -> KVPFollower:
    ranks = {m: first_rank + m for m in range(kvp_size)}
    return KVPFollower(load_member(config, member, ranks, STEP_TIMEOUT_S), first_rank)
