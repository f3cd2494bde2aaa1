"""The simulator's decode moves: a parked request handed to another decode instance (TransferKV), and a
decoding request swapped out to the kvstore and back (Preempt)."""

from __future__ import annotations

import dataclasses

from spindle_protocol.messages import Preempted

from ..actions import Preempt, TransferKV
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

    # ---- preemption (swap to the kvstore) ----

    @staticmethod
    def _context(rec: RequestRecord) -> int:
        """KV tokens of a decoding request: the prompt and every output but the last (not fed back yet)."""
        return rec.num_prefill_tokens + len(rec.token_times) - 1

    def _kv_seconds(self, tokens: int) -> float:
        transfer = self.latency.transfer
        return 0.0 if transfer is None else transfer.predict(tokens * self.config.kv_bytes_per_token)

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
