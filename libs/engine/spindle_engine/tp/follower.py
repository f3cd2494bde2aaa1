"""A follower rank of a tensor-parallel engine: replays the leader's calls (control.py) on its own `Engine` over its
shard of the model, steps with it, and answers each message with an ack the leader checks (lockstep.py)."""

from __future__ import annotations

import logging
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from torch import Tensor

from spindle_attention.distributed.comm import RankGroup

from ..config import EngineConfig
from ..engine import Engine
from ..reshard.host_kv import HostKV
from ..reshard.tier import Prefetcher, TierPut, open_kv, push_kv
from .control import (
    Abort,
    AddRequest,
    Call,
    CancelReservation,
    Park,
    Prefetch,
    ReceiveKV,
    Reserve,
    Resume,
    TPError,
    checksum,
    recv_control,
    send_ack,
)
from .direct import DirectReceives, Receiver
from .lockstep import (
    DIRECT_WAIT_S,
    LEADER_SILENCE_S,
    STARTUP_TIMEOUT_S,
    STEP_TIMEOUT_S,
    load_tp_model,
    tp_engine_config,
)

log = logging.getLogger("spindle.engine.tp")


class TPFollower:
    """Replays the leader's calls on this rank's engine and steps with it, until told to stop.

    `receiver` receives the KV parts the holders send this rank directly (`ReceiveKV`); without one, such a call
    is an error."""

    def __init__(
        self,
        engine: Engine,
        leader: int,
        *,
        timeout_s: float = LEADER_SILENCE_S,
        receiver: Receiver | None = None,
        direct_timeout_s: float = DIRECT_WAIT_S,
        tier: Path | None = None,
    ) -> None:
        """`tier`: the group's host-tier directory, for `Park` and tier `Resume` calls (Seesaw)."""
        self.engine = engine
        self.tier = tier
        self.prefetcher = None if tier is None else Prefetcher(tier, engine.model_config, engine.cache.k.dtype,
                                                               engine.model.shard.kv_heads)  # fmt: skip
        self.leader = leader
        self.timeout_s = timeout_s
        self.tp_rank = engine.model.shard.rank
        self.direct = None if receiver is None else DirectReceives(receiver, engine.kv_shape, engine.cache.k.dtype)
        self.direct_timeout_s = direct_timeout_s

    def serve(self) -> None:
        e = self.engine
        expected_seq = 0
        while True:
            timeout = self.timeout_s if expected_seq else STARTUP_TIMEOUT_S
            control, parts = recv_control(self.leader, e.kv_shape, e.cache.k.dtype, timeout)
            if control.stop:
                log.info("the leader stopped the group")
                if self.prefetcher is not None:
                    self.prefetcher.close()
                return
            if control.seq != expected_seq:
                raise TPError(f"control message {control.seq} arrived, expected {expected_seq}")
            expected_seq += 1
            self.apply(control.calls, parts)
            outputs = e.step() if control.step else []
            direct = 0 if self.direct is None else self.direct.bytes
            ack = [control.seq, e.allocator.num_used, e.allocator.num_blocks, checksum(outputs), direct]
            send_ack(ack, self.leader, STEP_TIMEOUT_S)

    def apply(self, calls: list[Call], parts: list[Tensor]) -> None:
        e, kv = self.engine, iter(parts)
        for call in calls:
            match call:
                case AddRequest():
                    e.add_request(call.request_id, call.prompt_token_ids, call.params, prefill_only=call.prefill_only)
                case Reserve():
                    if not e.reserve(call.request_id, call.num_tokens, call.choices):
                        raise TPError(f"reserve({call.request_id}) failed here but not on the leader")
                case CancelReservation():
                    e.cancel_reservation(call.request_id)
                    self._drop(call.request_id)
                case ReceiveKV():
                    if self.direct is None:
                        raise TPError("the leader sent a direct KV receive, but this follower cannot receive one")
                    self.direct.post(call.request_id, call.src, call.tags[self.tp_rank], call.runs)
                case Resume():
                    if call.tier is not None:
                        part = self._tier_share(call.request_id, call.tier)
                    else:
                        part = self._direct_kv(call) if call.direct else next(kv)
                    e.resume(call.request_id, call.token_ids, call.num_prompt_tokens, part, call.params)
                case Park():
                    out = e.preempt_out(call.request_id)
                    push_kv(self._tier_file(call.put), out.kv, e.model.shard.kv_heads)
                case Prefetch():
                    self._tier_file(call.put)  # a name this follower can open, or TPError
                    assert self.prefetcher is not None
                    self.prefetcher.start(call.request_id, call.put)
                case Abort():
                    e.abort(call.request_id)
                    self._drop(call.request_id)

    def _tier_file(self, put: TierPut) -> HostKV:
        if self.tier is None:
            raise TPError("the leader named a host-tier file, but this follower has no tier")
        try:
            return open_kv(self.tier, put.name, self.engine.model_config, put.capacity, self.engine.cache.k.dtype,
                           create=False)  # fmt: skip
        except (ValueError, OSError) as e:
            raise TPError(f"host-tier file {put.name!r}: {e}") from e

    def _tier_share(self, request_id: str, put: TierPut) -> Tensor:
        self._tier_file(put)  # a name this follower can open, or TPError
        assert self.prefetcher is not None
        try:
            return self.prefetcher.take(request_id, put, DIRECT_WAIT_S)
        except Exception as e:
            raise TPError(f"reading {request_id} from the host tier failed here: {e}") from e

    def _direct_kv(self, call: Resume) -> Tensor:
        if self.direct is None:
            raise TPError(f"a direct resume of {call.request_id} reached a follower that cannot receive one")
        try:
            return self.direct.take(call.request_id, len(call.token_ids) - 1, self.direct_timeout_s)
        except (FutureTimeout, TimeoutError) as e:
            raise TPError(f"the KV of {call.request_id} from its holders did not arrive here in time") from e
        except Exception as e:  # a holder's transfer failed after the leader's own part arrived: we cannot go on
            raise TPError(f"the KV of {call.request_id} from its holders failed here: {e}") from e

    def _drop(self, request_id: str) -> None:
        if self.direct is not None:
            self.direct.drop(request_id)
        if self.prefetcher is not None:
            self.prefetcher.drop(request_id)


def follower_engine(config: EngineConfig, group: RankGroup) -> Engine:
    """A follower rank's engine on the real model, sized like its leader's."""
    model = load_tp_model(config, group)
    return Engine(tp_engine_config(config, model.config, len(group.ranks)), model=model)
