"""The simulator's decode moves: a parked request handed to another decode instance (TransferKV), a decoding
request swapped out to the kvstore and back (Preempt), and a KV-parallel shard merged into its neighbour
(ScaleDownKVP; its KV moves at once here, within the group's next step in the services)."""

from __future__ import annotations

import dataclasses

from spindle_policy.actions import Preempt, ScaleDownKVP, TransferKV
from spindle_policy.merging import merged
from spindle_protocol.messages import Preempted

from .base import SimBase
from .cluster import SimColocated, SimDecode
from .events import EventKind
from .metrics import RequestRecord


class Swaps(SimBase):
    # ---- moving a parked request to another decode instance ----

    def _move_parked(self, a: TransferKV, now: float) -> None:
        rec, src, dst = self.records[a.request_id], self.instances.get(a.src), self.instances.get(a.dst)
        plan = self.plans.get(a.request_id)
        movable = (
            rec.state == "pending"
            and plan is not None
            and not plan.decode_shards
            and all(isinstance(d, SimDecode) and not isinstance(d, SimColocated) for d in (src, dst))
            and rec in src.waiting  # type: ignore[union-attr]
        )
        if not movable:
            self.core.move_refused(a.request_id, "not parked there")
            return
        assert isinstance(src, SimDecode) and isinstance(dst, SimDecode) and plan is not None
        src.waiting.remove(rec)
        self.plans[a.request_id] = dataclasses.replace(plan, decode_instance=dst.id)
        self._tails.pop(a.request_id, None)
        rec.decode_instance = dst.id
        rec.moves += 1
        self.core.moved(a.request_id, dst.id)
        dst.waiting.append(rec)
        for d in (src, dst):
            self._join_decode(d, now)
            self._start_step(d, now)

    # ---- scale-down of a KV-parallel request ----

    def _scale_down(self, a: ScaleDownKVP, now: float) -> None:
        rec, plan = self.records[a.request_id], self.plans.get(a.request_id)
        master = self.instances.get(rec.decode_instance)
        leaving, receiver = self.instances.get(a.instance), self.instances.get(a.into)
        decoding = rec.state == "pending" and isinstance(master, SimDecode) and rec in master.running
        if not decoding or plan is None or not isinstance(leaving, SimDecode) or not isinstance(receiver, SimDecode):
            self.core.scale_down_refused(a.request_id, "unknown", now)
            return
        scaled_up = self._scaled_up.get(a.request_id) is leaving  # a tail its outputs went to at join
        try:
            if scaled_up and a.into != plan.decode_holders[-1].instance:
                raise ValueError(f"{a.into} does not hold the shard before {a.instance}'s")
            shards = None if scaled_up else merged(plan.decode_shards, a.instance, a.into, plan.decode_instance)
        except ValueError as e:
            self.core.scale_down_refused(a.request_id, str(e), now)
            return
        blocks = leaving.held.get(a.request_id, 0)
        if receiver.free_blocks < blocks:
            self.core.scale_down_refused(a.request_id, "no_room", now)
            return
        self._add_kv(rec, -1)
        leaving.free(a.request_id)
        receiver.alloc(a.request_id, blocks)
        if shards is None:  # the scaled-up tail goes back: the plan's shards stay
            del self._scaled_up[a.request_id]
        else:
            self.plans[a.request_id] = dataclasses.replace(plan, decode_shards=shards)
        self._tails.pop(a.request_id, None)
        self._add_kv(rec, +1)
        rec.scale_downs += 1
        self.core.scaled_down(a.request_id, a.instance, a.into)
        self._retry_split_joins(now)
        for d in (leaving, receiver):
            self._join_decode(d, now)
            self._start_step(d, now)

    # ---- preemption (swap to the kvstore) ----

    @staticmethod
    def _context(rec: RequestRecord) -> int:
        """KV tokens of a decoding request: the prompt and every output but the last (not fed back yet)."""
        return rec.num_prefill_tokens + len(rec.token_times) - 1

    def _kv_seconds(self, tokens: int) -> float:
        return self.prices.transfer(tokens * self.config.kv_bytes_per_token)  # to or from the kvstore

    def _preempt(self, a: Preempt, now: float) -> None:
        rec, d = self.records[a.request_id], self.instances.get(a.instance)
        decoding = isinstance(d, SimDecode) and not isinstance(d, SimColocated) and rec in d.running
        if rec.state != "pending" or not decoding:
            self.core.preempt_refused(a.request_id, "not decoding there")
            return
        assert isinstance(d, SimDecode)
        if d.stepping:
            d.preempt_after_step.add(rec.request_id)
        else:
            self._swap_out(d, rec, now)

    def _swap_out(self, d: SimDecode, rec: RequestRecord, now: float) -> None:
        """Out of the batch now; its blocks free once the KV is in the kvstore."""
        d.running.remove(rec)
        self._add_kv(rec, -1)
        rec.preemptions += 1
        self.queue.push(now + self._kv_seconds(self._context(rec)), EventKind.SWAP_OUT_DONE, (d, rec, now))

    def _on_swap_out_done(self, now: float, payload: tuple[SimDecode, RequestRecord, float]) -> None:
        d, rec, started = payload
        self._free_decode(rec)
        if rec.state == "pending":
            event = Preempted(
                request_id=rec.request_id, instance_id=d.id, num_tokens=self._context(rec), seconds=now - started
            )
            self._emit(event, now)
        if rec.state == "pending":
            self._swapped.add(rec.request_id)
            d.waiting.append(rec)
        self._join_decode(d, now)
        self._start_step(d, now)
        self._retry_split_joins(now)

    def _on_swap_in_done(self, now: float, payload: tuple[SimDecode, RequestRecord]) -> None:
        d, rec = payload
        if rec.state == "pending":
            self._start_decoding(d, rec, now)
        else:
            self._free_decode(rec)
            self._join_decode(d, now)
            self._retry_split_joins(now)
        self._start_step(d, now)
