"""The simulator's decode side: transfer arrival, FIFO joins when blocks fit (on every holder of a split
request; a split request's tail without room for its outputs scales up onto another member of its group),
continuous-batching steps (on colocated instances with pieces of prompts, colocated_side.py), and leaving."""

from __future__ import annotations

from spindle_policy.actions import KVShard, shard_specs
from spindle_protocol.messages import DecodeStarted, KVPShards, RequestFinished, TransferDone

from .base import SimBase
from .cluster import SimColocated, SimDecode
from .events import EventKind
from .metrics import RequestRecord


class DecodeSide(SimBase):
    def _on_transfer_done(self, now: float, rec: RequestRecord) -> None:
        self._release_prefill(rec, now)
        if rec.state != "pending":
            return
        d = self.instances[rec.decode_instance]
        assert isinstance(d, SimDecode)
        rec.transfer_end = now
        parked = bool(d.waiting) or not self._fits(rec)
        self._emit(
            TransferDone(
                request_id=rec.request_id,
                src_instance=rec.prefill_instance,
                dst_instance=d.id,
                nbytes=rec.num_prefill_tokens * self.config.kv_bytes_per_token,
                seconds=now - (rec.prefill_end or now),
                parked=parked,
            ),
            now,
        )
        if rec.state == "pending":
            d.waiting.append(rec)
            self._join_decode(d, now)
            self._start_step(d, now)

    def _decode_blocks(self, rec: RequestRecord) -> int:
        # blocks for the whole sequence are taken at join, so a running batch never needs preemption
        return self.config.blocks(rec.num_prefill_tokens + rec.num_decode_tokens)

    # ---- KV-parallel decode: a request's KV split over decode instances ----

    def _shards(self, rec: RequestRecord) -> list[tuple[SimDecode, int]]:
        """(instance, tokens it holds now) per decode holder, the master first; the tail holds the outputs (a
        member they scaled up to at join, when there is one)."""
        holders = self.plans[rec.request_id].decode_holders
        out = [(self.instances[h.instance], h.end - h.start) for h in holders]
        if (member := self._scaled_up.get(rec.request_id)) is not None:
            out.append((member, 0))
        tail, tokens = out[-1]
        out[-1] = (tail, tokens + len(rec.token_times))
        return out  # type: ignore[return-value]

    def _tail(self, rec: RequestRecord) -> SimDecode:
        """The holder that takes the request's new tokens."""
        tail = self._tails.get(rec.request_id)
        if tail is None:
            tail = self._tails[rec.request_id] = self._shards(rec)[-1][0]
        return tail

    def _shard_blocks(self, rec: RequestRecord) -> list[tuple[SimDecode, int]]:
        """Blocks each holder takes at join: its shard, and on the tail room for every output token too. A split
        request's tail without that room scales up at join: the outputs' blocks go to the group's member with
        the most free blocks that holds none of it (the services' group does this when the tail fills)."""
        holders = self._shards(rec)
        tail = len(holders) - 1
        left = rec.num_decode_tokens - len(rec.token_times)
        out = [
            (inst, self.config.blocks(tokens + (left if k == tail else 0))) for k, (inst, tokens) in enumerate(holders)
        ]
        tail_inst, tail_blocks = out[-1]
        if len(holders) > 1 and left > 0 and tail_blocks > tail_inst.free_blocks:
            held = {inst.id for inst, _ in holders}
            spare = [
                i for i in self.instances.values()
                if isinstance(i, SimDecode) and i.kvp_group == tail_inst.kvp_group and i.id not in held
            ]  # fmt: skip
            if spare:
                best = max(spare, key=lambda i: (i.free_blocks, -i.rank))
                out[-1] = (tail_inst, self.config.blocks(holders[-1][1]))
                out.append((best, self.config.blocks(left)))
        return out

    def _fits(self, rec: RequestRecord) -> bool:
        return all(inst.free_blocks >= blocks for inst, blocks in self._shard_blocks(rec))

    def _add_kv(self, rec: RequestRecord, sign: int) -> None:
        for inst, tokens in self._shards(rec):
            inst.kv_tokens += sign * tokens

    def _free_decode(self, rec: RequestRecord) -> None:
        for inst in self.instances.values():  # the holders, and a member its outputs scaled up to
            if isinstance(inst, SimDecode):
                if rec.request_id in inst.held and inst.waiting:
                    self._freed.add(inst)  # its queue may fit now, though none of its own requests ended
                inst.free(rec.request_id)
        self._scaled_up.pop(rec.request_id, None)
        self._tails.pop(rec.request_id, None)

    def _retry_split_joins(self, now: float) -> None:
        """A split request heading a master's queue may wait for blocks on another instance, and an instance's
        queue may wait for blocks a request mastered elsewhere held on it: retry them all."""
        for d in sorted(self._freed | self._split_masters, key=lambda d: d.rank):
            self._freed.discard(d)
            self._join_decode(d, now)
            self._start_step(d, now)

    def _join_decode(self, d: SimDecode, now: float) -> None:
        while d.waiting:
            head = d.waiting[0]
            if head.state != "pending":
                d.waiting.popleft()
                continue
            if not self._fits(head):
                if self.plans[head.request_id].decode_shards:
                    self._split_masters.add(d)
                return
            self._split_masters.discard(d)
            d.waiting.popleft()
            shard_blocks = self._shard_blocks(head)
            for inst, blocks in shard_blocks:
                inst.alloc(head.request_id, blocks)
            if len(shard_blocks) > len(self.plans[head.request_id].decode_holders):
                self._scale_up(head, shard_blocks[-1][0], now)
            if head.request_id in self._swapped:  # its KV comes back from the kvstore first
                self._swapped.discard(head.request_id)
                self.queue.push(now + self._kv_seconds(self._context(head)), EventKind.SWAP_IN_DONE, (d, head))
            else:
                self._start_decoding(d, head, now)

    def _scale_up(self, rec: RequestRecord, member: SimDecode, now: float) -> None:
        """`member` took the outputs of a split request at join: it is the request's tail now (a shard with no
        prompt token), and the core hears of it as from a group's leader (KVPShards)."""
        self._scaled_up[rec.request_id] = member
        self._tails.pop(rec.request_id, None)
        rec.scale_ups += 1
        plan = self.plans[rec.request_id]
        end = plan.decode_holders[-1].end
        shards = shard_specs([*plan.decode_holders, KVShard(member.id, end, end)])
        event = KVPShards(request_id=rec.request_id, instance_id=member.kvp_group, master=plan.decode_instance,
                          shards=shards)  # fmt: skip
        self._emit(event, now)

    def _start_decoding(self, d: SimDecode, rec: RequestRecord, now: float) -> None:
        d.running.append(rec)
        self._add_kv(rec, +1)
        rec.decode_start = now
        self._emit(DecodeStarted(request_id=rec.request_id, instance_id=d.id), now)

    def _start_step(self, d: SimDecode, now: float) -> None:
        if d.stepping:
            return
        if isinstance(d, SimColocated):
            seconds = self._colocated_step(d, now)  # type: ignore[attr-defined]  # colocated_side.py
            if seconds is None:
                return
        elif d.running:
            seconds = self._decode_step_seconds(d)
        else:
            return
        d.stepping = True
        self.queue.push(now + seconds, EventKind.DECODE_STEP, d)

    def _decode_step_seconds(self, d: SimDecode) -> float:
        """The step of `d`'s batch over its local KV; with split requests in the batch, the step also waits
        for the other holders' partial attention over their shards (run in parallel: the slowest counts)."""
        seconds = self.prices.decode(d.tp, len(d.running), d.kv_tokens)
        remote: dict[str, tuple[int, int]] = {}  # holder -> (split requests of this batch, their tokens there)
        for r in d.running:
            if self.plans[r.request_id].decode_shards:
                for inst, tokens in self._shards(r):
                    if inst is not d:
                        n, t = remote.get(inst.id, (0, 0))
                        remote[inst.id] = (n + 1, t + tokens)
        for n, tokens in remote.values():
            seconds = max(seconds, self.prices.decode(d.tp, n, tokens))
        return seconds

    def _on_step(self, now: float, d: SimDecode) -> None:
        d.stepping = False
        colocated = isinstance(d, SimColocated)
        batch = d.step_batch if colocated else d.running
        ended = []
        for r in batch:
            if r.state != "pending":  # failed during the step
                ended.append(r)
                continue
            times = r.token_times
            times.append(now)
            self._tail(r).kv_tokens += 1  # the new token's KV lands on the tail holder
            if len(times) >= r.num_decode_tokens:
                ended.append(r)
        finished = []
        for r in ended:
            if r.state == "pending":
                finished.append(r)
            self._leave_decode(d, r)
        for r in finished:
            self._end(r, "finished", now)
            self._emit(
                RequestFinished(
                    request_id=r.request_id,
                    instance_id=d.id,
                    finish_reason="length",
                    num_output_tokens=len(r.token_times),
                ),
                now,
            )
        if colocated:
            self._colocated_chunks_done(d, now)  # type: ignore[attr-defined]  # colocated_side.py
            d.step_batch = []
        else:
            for rid in d.preempt_after_step:
                r = self.records[rid]
                if r.state == "pending" and r in d.running:
                    self._swap_out(d, r, now)
                else:
                    self.core.preempt_refused(rid, "it ended before the step did")
            d.preempt_after_step.clear()
            self._join_decode(d, now)
        self._start_step(d, now)
        if ended and (self._split_masters or self._freed):
            self._retry_split_joins(now)

    def _leave_decode(self, d: SimDecode, rec: RequestRecord) -> None:
        if rec in d.running:
            d.running.remove(rec)
            self._add_kv(rec, -1)  # before the blocks go: a member its outputs scaled up to is forgotten then
        self._free_decode(rec)
