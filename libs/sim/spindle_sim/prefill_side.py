"""The simulator's prefill side: chunks queued FCFS on SP groups, a chunk runs when its whole group is free
and has blocks for its shares; the last chunk yields the first token and starts the KV transfer.

A chunk is charged its SP group's prefill (prices.py), over the link between nodes when its members sit on
different nodes; each holder's KV moves on the link between it and the decode instance."""

from __future__ import annotations

from spindle_costmodel.csa import max_levels
from spindle_protocol.messages import PrefillDone, PrefillProgress

from .base import SimBase
from .cluster import ChunkJob, SimPrefill
from .events import EventKind
from .metrics import RequestRecord


class PrefillSide(SimBase):
    def _pump(self, p: SimPrefill, now: float) -> None:
        """Start the head chunk of `p` if its whole group is ready; drop chunks of ended requests."""
        while p.running is None and p.queue:
            job = p.queue[0]
            if job.rec.state != "pending":
                p.queue.popleft()
                k = job.chunk.instances.index(p.id)
                p.queued_tokens -= job.chunk.share(k)
                continue
            if self._startable(job):
                self._start_chunk(job, now)
            return

    def _startable(self, job: ChunkJob) -> bool:
        rid, chunk = job.rec.request_id, job.chunk
        if self._next_chunk[rid] != job.index or rid in self._running:
            return False
        for k, iid in enumerate(chunk.instances):
            m = self.instances[iid]
            assert isinstance(m, SimPrefill)
            if m.running is not None or not m.queue or m.queue[0] is not job:
                return False
            if m.free_blocks < self.config.blocks(chunk.share(k)):
                return False  # earlier prompts' KV is still being transferred out
        return True

    def _start_chunk(self, job: ChunkJob, now: float) -> None:
        rec, chunk = job.rec, job.chunk
        keep = job.plan.attention_kept
        cross = len({self.instances[i].node for i in chunk.instances}) > 1  # a group over two nodes or more
        plan = job.plan
        csa = (plan.csa_levels or max_levels(chunk.sp), plan.csa_drop, plan.csa_rule) if plan.csa_drop else None
        seconds = self.prices.sp_prefill(chunk.sp, chunk.start, chunk.num_tokens, keep, cross, csa)
        for k, iid in enumerate(chunk.instances):
            m = self.instances[iid]
            assert isinstance(m, SimPrefill)
            m.queue.popleft()
            m.running = job
            m.alloc(rec.request_id, self.config.blocks(chunk.share(k)))
            m.busy_spans.append((now, now + seconds))
        self._running.add(rec.request_id)
        if job.index == 0:
            rec.prefill_start = now
        self.queue.push(now + seconds, EventKind.CHUNK_DONE, job)

    def _on_chunk_done(self, now: float, job: ChunkJob) -> None:
        rec, chunk, rid = job.rec, job.chunk, job.rec.request_id
        for k, iid in enumerate(chunk.instances):
            m = self.instances[iid]
            assert isinstance(m, SimPrefill) and m.running is job
            m.running = None
            m.queued_tokens -= chunk.share(k)
        self._running.discard(rid)
        self._next_chunk[rid] = job.index + 1
        if rec.state != "pending":
            self._release_prefill(rec, now)
        elif not job.is_last:
            self._chunk_progress(rec, chunk.instances[0], chunk.end, now)
        else:
            self._prefill_finished(rec, chunk.instances[0], now)
            if rec.state == "pending":
                self.queue.push(now + self._transfer_seconds(rec), EventKind.TRANSFER_DONE, rec)
            else:
                self._release_prefill(rec, now)
        nxt = self.plans[rid].chunks[job.index + 1].instances if not job.is_last else ()
        for iid in dict.fromkeys((*chunk.instances, *nxt)):
            self._pump(self.instances[iid], now)  # type: ignore[arg-type]

    def _chunk_progress(self, rec: RequestRecord, instance_id: str, tokens_done: int, now: float) -> None:
        progress = PrefillProgress(
            request_id=rec.request_id,
            instance_id=instance_id,
            tokens_done=tokens_done,
            tokens_total=rec.num_prefill_tokens,
            chunk_seconds=now - (rec.prefill_start or now),
        )
        self._emit(progress, now)

    def _prefill_finished(self, rec: RequestRecord, instance_id: str, now: float) -> None:
        """The last chunk produced the first token."""
        rec.prefill_end = now
        rec.token_times.append(now)
        finished = rec.num_decode_tokens <= 1
        seconds = now - (rec.prefill_start or now)
        self._emit(
            PrefillDone(request_id=rec.request_id, instance_id=instance_id, seconds=seconds, finished=finished), now
        )
        if finished and rec.state == "pending":
            self._end(rec, "finished", now)

    def _transfer_seconds(self, rec: RequestRecord) -> float:
        """Every holder sends its share to the decode instance at once, each on the link between them (inside a
        node, or between nodes); the slowest sets the time."""
        if self.latency.transfer is None:
            return 0.0
        holders: dict[str, int] = {}
        for chunk in self.plans[rec.request_id].chunks:
            for k, iid in enumerate(chunk.instances):
                holders[iid] = holders.get(iid, 0) + chunk.share(k)
        per_token, dst = self.config.kv_bytes_per_token, self.instances[rec.decode_instance].node
        return max(self.prices.transfer(n * per_token, self.instances[iid].node != dst) for iid, n in holders.items())

    def _release_prefill(self, rec: RequestRecord, now: float) -> None:
        """Free the prompt KV `rec` holds on prefill instances (after its transfer, or when it ended)."""
        for iid in self.plans[rec.request_id].prefill_instances:
            p = self.instances[iid]
            p.free(rec.request_id)
            self._pump(p, now)  # type: ignore[arg-type]
