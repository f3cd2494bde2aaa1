"""The simulator's elastic side: iterations a per-iteration strategy sends (`RunBatch`) on groups of colocated
instances, and KV migrations between them (`MigrateKV`).

An iteration takes its group's members until it ends; its prefill parts take, from its start, the KV their plan
retains on the members that keep it (LoongServe's proactive scale-down: nothing moves afterwards), and each
decode adds a token's KV on its master. When it ends: a part that ends the prompt samples the first token
(PrefillDone, then DecodeStarted), a decode whose last token it was finishes (RequestFinished, its KV freed on
every holder), and the group reports IterationDone, after which the strategy sends the next iteration.

Times (virtual): an iteration on one instance takes the price of what it holds (`prices.step`, prices.py:
the mixed-batch step, the batch in one pass; decodes alone, the decode step), the price every strategy's
single-instance iterations pay. On a group of s > 1 a prefill batch takes the Eq. 7 form at s
(`latency.batch_prefill`; parts after cached tokens, or sizes it lacks, take the Eq. 1 form per part); a decode
batch of b requests over K cached tokens on a group of k takes the decode step at (TP, KVP = k) (fitted to
multi-master decoding on a named elastic cluster; without that key, k masters each step b/k requests over K/k
tokens); both in one iteration add. A migration of n tokens takes the transfer model's time for their bytes. A group
or a migration over two nodes or more is priced on the link between nodes (the cross-node forms of a named
cluster's latency model), one inside a node on the node's link.

An iteration whose prefill parts name masters (Medha's KV parallelism: a group of replicas sharing requests) takes
the slowest member's time plus the exchange: each member runs its own chunks and decodes as one mixed batch over
the KV it holds of them, plus the attention of the other members' queries over the KV it holds of theirs (the
mixed-batch model's history and decode-KV terms: Eq. 5/6's attention split over the holders); the exchange sends
every such query token's q and partial output once (`query_bytes_per_token`, the transfer model).

On a sequence-pipeline instance (`colocated_spp` S > 1, Medha's SPP) an iteration's time T is split evenly over
its S stages (T / S each, after the previous stage and once the stage is free; the activations passed between
stages are not charged: a 2,048-token chunk of Llama-3-8B is 16 MB, ~0.1 ms over NVLink). An iteration that samples
nothing (prefill parts that do not end their prompts, no decodes) is done for the strategy when stage 0 is, so the
next one starts while the later stages still work; one that samples is done when its last stage is, unless the
strategy marks it `overlap` (it keeps the requests it samples out of the next S - 1 iterations): then it is done at
stage 0 too, its sampled tokens are timed when the last stage ends, and an iteration that names one of those
requests does not enter stage 0 before that.
"""

from __future__ import annotations

from spindle_policy.actions import DecodePart, MigrateKV, PrefillPart, RunBatch
from spindle_protocol.messages import (
    DecodeStarted,
    IterationDone,
    KVMigrated,
    PrefillDone,
    PrefillProgress,
    RequestFinished,
)

from .base import SimBase
from .cluster import SimColocated, SimInstance
from .events import EventKind
from .metrics import RequestRecord


class IterationSide(SimBase):
    _elastic_kv: dict[str, dict[str, int]]  # request id -> {instance: KV tokens it holds there}
    _in_batch: dict[str, int]  # instance -> batch id it runs now (or migrating: -1)
    _batch_of: dict[str, int]  # request id -> batch id of the iteration it is in now (migrating: -1)
    _migrations: dict[str, int]  # instance -> migrations off it in flight
    _stage_free: dict[str, list[float]]  # sequence-pipeline instance -> when each of its stages frees up
    _sampled_by: dict[str, float]  # request -> when its last sampled token leaves the pipeline (overlap only)

    def _member(self, iid: str) -> SimColocated:
        inst = self.instances[iid]
        assert isinstance(inst, SimColocated), f"{iid} is not an elastic instance"
        return inst

    def _hold(self, rid: str, iid: str, tokens: int) -> None:
        """`iid` holds `tokens` more KV tokens of `rid` (blocks taken as the token count crosses them)."""
        held = self._elastic_kv.setdefault(rid, {})
        before = held.get(iid, 0)
        held[iid] = before + tokens
        blocks = self.config.blocks(before + tokens) - self.config.blocks(before)
        if blocks:
            self._holder(iid).alloc(rid, blocks)

    def _holder(self, iid: str) -> SimInstance:
        """An elastic instance, or the kvstore whose host tier holds offloaded KV (tier_side.py)."""
        inst = self.instances[iid]
        assert isinstance(inst, SimColocated) or inst.role == "kvstore", f"{iid} holds no elastic KV"
        return inst

    def _spans_nodes(self, instance_ids: tuple[str, ...]) -> bool:
        return len({self.instances[i].node for i in instance_ids}) > 1

    def _free_elastic(self, rid: str) -> None:
        for iid in self._elastic_kv.pop(rid, {}):
            self._holder(iid).free(rid)

    # ---- iterations ----

    def _run_batch(self, a: RunBatch, now: float) -> None:
        busy = [i for i in a.instances if i in self._in_batch]
        assert not busy, f"batch {a.batch_id} sent to {busy}, which are still running batch(es) {busy}"
        live = lambda rid: self.records[rid].state == "pending"  # noqa: E731
        prefills = [p for p in a.prefills if live(p.request_id)]
        decodes = [d for d in a.decodes if live(d.request_id)]
        for p in prefills:
            rec = self.records[p.request_id]
            assert rec.request_id not in self._batch_of, f"{rec.request_id} in two iterations at once"
            if p.start == 0:
                rec.prefill_start = now
                rec.prefill_instance, rec.decode_instance = a.instances[0], p.retain[-1].instance
            if p.master:  # a KV-parallel chunk: its master decodes the request once the prompt is done
                rec.decode_instance = p.master
            rec.prefill_instances = tuple(dict.fromkeys((*rec.prefill_instances, *a.instances)))
            rec.max_sp = max(rec.max_sp, len(a.instances))
            for shard in p.retain:
                if shard.instance == a.offload:  # computed on the group's first member, swapped out as it is
                    self._hold(rec.request_id, a.instances[0], shard.end - shard.start)
                self._hold(rec.request_id, shard.instance, shard.end - shard.start)
        for d in decodes:
            assert d.request_id not in self._batch_of, f"{d.request_id} in two iterations at once"
            held = self._elastic_kv.get(d.request_id, {})
            assert held and self.records[d.request_id].token_times, f"{d.request_id} decodes before its prefill"
            assert set(held) <= set(a.instances), f"{d.request_id}'s KV on {sorted(held)} outside {a.instances}"
        seconds = self._iteration_seconds(a, prefills, decodes)
        sampled_s = seconds
        if self._member(a.instances[0]).spp > 1 and (len(a.instances) == 1 or a.kvp):
            samples = bool(decodes) or any(p.last for p in prefills)
            rids = [p.request_id for p in prefills] + [d.request_id for d in decodes]
            start = max([now, *(self._sampled_by.get(rid, now) for rid in rids)])
            # a KV-parallel group: every member a pipeline, its stages exchanging with their peers' (Medha's 3D)
            ends = [self._pipelined(i, start, seconds, samples and not a.overlap) for i in a.instances]
            done_at, sampled_at = max(e[0] for e in ends), max(e[1] for e in ends)
            seconds, sampled_s = done_at - now, sampled_at - now
            if a.overlap:
                for rid in [p.request_id for p in prefills if p.last] + [d.request_id for d in decodes]:
                    self._sampled_by[rid] = sampled_at
        for rid in [p.request_id for p in prefills] + [d.request_id for d in decodes]:
            self._batch_of[rid] = a.batch_id
        for iid in a.instances:
            self._in_batch[iid] = a.batch_id
            self._member(iid).busy_spans.append((now, now + seconds))
        if self._member(a.instances[0]).parallel:  # Fig. 12's breakdown: time the group gave to each kind of iteration
            kind = "mixed" if prefills and decodes else "prefill" if prefills else "decode"
            self._count(f"{kind}_busy_s", seconds)  # type: ignore[attr-defined]  # tier_side.py
        if a.offload:
            offloaded = [p for p in prefills if p.retain[0].instance == a.offload]
            self._offload(a.instances[0], a.offload, offloaded, now, sampled_s)  # type: ignore[attr-defined]
        kept = None
        if prefills or decodes:
            kept = RunBatch(a.batch_id, a.instances, tuple(prefills), tuple(decodes), kvp=a.kvp, offload=a.offload)
        self.queue.push(now + seconds, EventKind.ITERATION_DONE, (a, kept, seconds, now + sampled_s))

    def _pipelined(self, iid: str, start: float, seconds: float, wait: bool) -> tuple[float, float]:
        """(when the strategy sees an iteration of full-pass time `seconds`, entering pipeline `iid` at `start`, done,
        when its last stage ends): done at the last stage's end when `wait`, else at stage 0's."""
        spp = self._member(iid).spp
        free = self._stage_free.setdefault(iid, [0.0] * spp)
        end = first = start
        for stage in range(spp):
            end = max(end, free[stage]) + seconds / spp
            free[stage] = end
            if stage == 0:
                first = end
        return (end if wait else first), end

    def _kvp_iteration_seconds(self, a: RunBatch, prefills: list[PrefillPart], decodes: list[DecodePart]) -> float:
        tp = self.config.colocated_tp
        c_hist = self.prices.mixed_fit(tp).c_hist  # attention per (cached token x query token)
        held = {rid: self._elastic_kv.get(rid, {}) for rid in [p.request_id for p in prefills]}
        held |= {d.request_id: self._elastic_kv.get(d.request_id, {}) for d in decodes}
        # per member: the chunks and decodes it masters, and the attention it serves for the others over the KV it
        # holds of theirs (one pass over the parts: a group may join many members)
        chunks: dict[str, list[tuple[int, int]]] = {m: [] for m in a.instances}
        own: dict[str, list[int]] = {m: [] for m in a.instances}  # the KV tokens each mastered decode holds there
        served: dict[str, float] = dict.fromkeys(a.instances, 0.0)
        remote_tokens = 0
        for p in prefills:
            kv, n = held[p.request_id], p.num_tokens
            if p.master in chunks:
                chunks[p.master].append((kv.get(p.master, 0) - n, n))
            for m, h in kv.items():
                if m != p.master and h and m in served:
                    served[m] += c_hist * h * n
                    remote_tokens += n
        for d in decodes:
            kv = held[d.request_id]
            if d.master in own:
                own[d.master].append(kv.get(d.master, 0))
            for m, h in kv.items():
                if m != d.master and h and m in served:
                    served[m] += c_hist * h
                    remote_tokens += 1
        slowest = 0.0
        for m in a.instances:
            t = self.prices.step(tp, chunks[m], len(own[m]), sum(own[m]) + len(own[m]))
            t += served[m]
            slowest = max(slowest, t)
        if remote_tokens:
            per_token = self.config.query_bytes_per_token or 4 * self.config.kv_bytes_per_token
            slowest += self.prices.transfer(remote_tokens * per_token, self._spans_nodes(a.instances))
        return slowest

    def _iteration_seconds(self, a: RunBatch, prefills: list[PrefillPart], decodes: list[DecodePart]) -> float:
        s, tp = len(a.instances), self.config.colocated_tp
        if a.kvp:
            return self._kvp_iteration_seconds(a, prefills, decodes)
        if self._member(a.instances[0]).parallel:  # a re-sharding group (tier_side.py)
            return self._config_seconds(a, prefills, decodes)
        kv = sum(sum(self._elastic_kv[d.request_id].values()) for d in decodes) + len(decodes)  # with the new tokens
        if s == 1:  # one instance: the price of what it holds, as for every strategy (prices.py)
            return self.prices.step(tp, [(p.start, p.num_tokens) for p in prefills], len(decodes), kv)
        seconds, cross = 0.0, self._spans_nodes(a.instances)
        if prefills:
            seconds += self.prices.group_prefill(s, [(p.start, p.num_tokens) for p in prefills], cross)
        if decodes:
            seconds += self.prices.group_decode(tp, s, len(decodes), kv)
        return seconds

    def _on_iteration_done(self, now: float, payload: tuple[RunBatch, RunBatch | None, float, float]) -> None:
        sent, ran, seconds, at = payload  # `at`: when its sampled tokens leave the pipeline (now, but with overlap)
        for iid in sent.instances:
            del self._in_batch[iid]
        for p in ran.prefills if ran else ():
            rid = p.request_id
            del self._batch_of[rid]
            rec = self.records[rid]
            if rec.state != "pending":
                self._free_elastic(rid)
            elif not p.last:
                progress = PrefillProgress(
                    request_id=rid, instance_id=sent.instances[0], tokens_done=p.end,
                    tokens_total=rec.num_prefill_tokens, chunk_seconds=seconds,
                )  # fmt: skip
                self._emit(progress, now)
            else:
                self._first_token(rec, sent.instances[0], now, at)
        for d in ran.decodes if ran else ():
            rid = d.request_id
            del self._batch_of[rid]
            rec = self.records[rid]
            if rec.state != "pending":
                self._free_elastic(rid)
                continue
            self._hold(rid, d.master, 1)
            rec.token_times.append(at)
            if len(rec.token_times) >= rec.num_decode_tokens:
                self._finish_elastic(rec, d.master, now, at)
        self._emit(IterationDone(instance_id=sent.instances[0], batch_id=sent.batch_id, seconds=seconds), now)

    def _first_token(self, rec: RequestRecord, instance_id: str, now: float, at: float | None = None) -> None:
        """The first token, sampled at `at` (default now; later under overlap: the strategy hears of it now)."""
        rid = rec.request_id
        at = now if at is None else at
        rec.prefill_end = at
        rec.token_times.append(at)
        finished = rec.num_decode_tokens <= 1
        seconds = at - (rec.prefill_start or at)
        self._emit(PrefillDone(request_id=rid, instance_id=instance_id, seconds=seconds, finished=finished), now)
        if finished:
            self._free_elastic(rid)
            if rec.state == "pending":
                self._end(rec, "finished", at)
            return
        if rec.state != "pending":
            self._free_elastic(rid)
            return
        if self.instances[rec.decode_instance].role == "kvstore":  # offloaded: it decodes once onboarded
            return
        rec.transfer_end = rec.decode_start = at
        self._emit(DecodeStarted(request_id=rid, instance_id=rec.decode_instance), now)

    def _finish_elastic(self, rec: RequestRecord, master: str, now: float, at: float | None = None) -> None:
        self._free_elastic(rec.request_id)
        self._end(rec, "finished", now if at is None else at)
        self._sampled_by.pop(rec.request_id, None)
        done = RequestFinished(
            request_id=rec.request_id, instance_id=master, finish_reason="length",
            num_output_tokens=len(rec.token_times),
        )  # fmt: skip
        self._emit(done, now)

    def _fail_elastic(self, rec: RequestRecord) -> None:
        """An ended request's KV frees now, or when the iteration it is in ends."""
        if rec.request_id not in self._batch_of:
            self._free_elastic(rec.request_id)

    # ---- migrations ----

    def _migrate(self, a: MigrateKV, now: float) -> None:
        """The source runs nothing meanwhile; the destination may (the copy lands beside its iterations)."""
        if "kvstore" in (self.instances[a.src].role, self.instances[a.dst].role):
            self._host_move(a, now)  # type: ignore[attr-defined]  # tier_side.py
            return
        assert self._in_batch.get(a.src, -1) == -1, f"migrating {a.request_id} off {a.src}, which runs an iteration"
        assert a.request_id not in self._batch_of, f"migrating {a.request_id} while it runs an iteration"
        tokens = self._elastic_kv.get(a.request_id, {}).get(a.src, 0)
        seconds = 0.0
        if tokens:
            seconds = self.prices.transfer(tokens * self.config.kv_bytes_per_token, self._spans_nodes((a.src, a.dst)))
        if tokens:
            self._hold(a.request_id, a.dst, tokens)  # the destination's room is taken from the start
        self._in_batch[a.src] = -1
        self._migrations[a.src] = self._migrations.get(a.src, 0) + 1
        self._batch_of[a.request_id] = -1
        self.queue.push(now + seconds, EventKind.MIGRATE_DONE, (a, tokens, seconds))

    def _on_migrate_done(self, now: float, payload: tuple[MigrateKV, int, float]) -> None:
        a, tokens, seconds = payload
        self._migrations[a.src] -= 1
        if not self._migrations[a.src]:
            del self._in_batch[a.src], self._migrations[a.src]
        del self._batch_of[a.request_id]
        rec = self.records[a.request_id]
        held = self._elastic_kv.get(a.request_id, {})
        if a.src in held:
            self._holder(a.src).free(a.request_id)
            del held[a.src]
        if rec.state != "pending":
            self._free_elastic(a.request_id)
        moved = KVMigrated(request_id=a.request_id, instance_id=a.src, dst=a.dst, num_tokens=tokens, seconds=seconds)
        self._emit(moved, now)
        if self.instances[a.src].role == "kvstore":  # onboarded: it decodes from here
            self._onboarded(a.request_id)  # type: ignore[attr-defined]  # tier_side.py
            if rec.state == "pending":
                rec.decode_instance, rec.transfer_end, rec.decode_start = a.dst, now, now
                self._emit(DecodeStarted(request_id=a.request_id, instance_id=a.dst), now)
