"""The simulator's re-sharding side (Seesaw): groups that switch parallel configuration (`Reshard`), KV that
iterations offload to the kvstore's host tier (`RunBatch.offload`), and onboarding back (`MigrateKV` from the
kvstore), all timed by the latency model's `ReshardModel`.

- An iteration on a group takes its configuration's full-pass time, split over the configuration's PP stages
  (iteration_side.py pipelines it).
- An offloaded prompt holds blocks on the group while it is computed and swapped out: the swap starts with the
  iteration (layer by layer, overlapped with compute, §5.2) once the group's host links are free, and the blocks
  free when both have ended (TransferDone, parked: the KV is in the tier). Swaps in and out share the group's
  host links (one transfer at a time, in order).
- Onboarding takes the destination's blocks from its start; the destination may run iterations meanwhile (the
  prefetcher), not a switch.
- A switch waits for the pipeline to drain, then takes `ReshardModel.switch_s` (weights and the KV kept). A group's
  first load, before it has run anything, is the start-up every system pays and is not charged.

`tier_stats` counts what moved and how much of the swapping its iterations hid (overlap with their busy spans).
"""

from __future__ import annotations

from spindle_policy.actions import DecodePart, MigrateKV, PrefillPart, RunBatch
from spindle_policy.reshard_model import ReshardModel
from spindle_protocol.messages import Resharded, TransferDone

from .base import SimBase
from .cluster import SimColocated
from .events import EventKind

RESHARDING = -2  # `_in_batch` mark of a group switching configuration


class TierSide(SimBase):
    _host_free: dict[str, float]  # group -> when its host links are free
    tier_stats: dict[str, float]

    def _reshard_model(self) -> ReshardModel:
        model = self.latency.reshard
        assert model is not None, "re-sharding groups need a latency model with a ReshardModel"
        return model

    def _group(self, iid: str) -> SimColocated:
        inst = self.instances[iid]
        assert isinstance(inst, SimColocated), f"{iid} is not a colocated instance"
        return inst

    def _config_seconds(self, a: RunBatch, prefills: list[PrefillPart], decodes: list[DecodePart]) -> float:
        assert len(a.instances) == 1, f"a re-sharding group runs its iterations alone: {a.instances}"
        config = self._reshard_model().config(self._group(a.instances[0]).parallel)
        kv = sum(sum(self._elastic_kv[d.request_id].values()) for d in decodes)
        return config.iteration_s([(p.start, p.num_tokens) for p in prefills], len(decodes), kv)

    def _host_transfer(self, iid: str, tokens: int, now: float) -> tuple[float, float]:
        """(start, end) of moving `tokens` of KV over the group's host links, after what is queued on them."""
        model = self._reshard_model()
        start = max(now, self._host_free.get(iid, 0.0))
        end = start + model.host_s(tokens * self.config.kv_bytes_per_token)
        self._host_free[iid] = end
        return start, end

    def _hidden(self, iid: str, start: float, end: float) -> float:
        """Seconds of [start, end] that `iid`'s iterations overlapped."""
        hidden = 0.0
        for s, e in reversed(self._group(iid).busy_spans):
            if e <= start:
                break
            hidden += max(0.0, min(e, end) - max(s, start))
        return min(hidden, end - start)

    def _count(self, key: str, value: float) -> None:
        self.tier_stats[key] = self.tier_stats.get(key, 0.0) + value

    # ---- swap-out (offload) ----

    def _offload(self, iid: str, kvstore: str, parts: list[PrefillPart], now: float, compute_s: float) -> None:
        """`parts` computed on group `iid` for `compute_s` go to `kvstore`'s tier over the group's host links."""
        tokens = sum(p.num_tokens for p in parts)
        if not tokens:
            return
        start, end = self._host_transfer(iid, tokens, now)
        rids = [p.request_id for p in parts]
        self.queue.push(max(end, now + compute_s), EventKind.OFFLOAD_DONE, (iid, kvstore, rids, start, end, tokens))

    def _on_offload_done(self, now: float, payload: tuple[str, str, list[str], float, float, int]) -> None:
        iid, kvstore, rids, start, end, tokens = payload
        inst = self._group(iid)
        for rid in rids:
            held = self._elastic_kv.get(rid)
            if held is not None and iid in held:  # the copy on the group frees; the tier keeps the KV
                inst.free(rid)
                n = held.pop(iid)
                if self.records[rid].state == "pending":
                    nbytes = n * self.config.kv_bytes_per_token
                    parked = TransferDone(request_id=rid, src_instance=iid, dst_instance=kvstore, nbytes=nbytes,
                                          seconds=end - start, parked=True)  # fmt: skip
                    self._emit(parked, now)
        self._count("swap_out_tokens", tokens)
        self._count("swap_out_s", end - start)
        self._count("swap_out_hidden_s", self._hidden(iid, start, end))

    # ---- onboarding, and decodes going back to the tier ----

    def _host_move(self, a: MigrateKV, now: float) -> None:
        """A MigrateKV from the kvstore (onboarding: the destination may run iterations meanwhile) or to it (the
        source runs nothing meanwhile), over the group's host links."""
        onboard = self.instances[a.src].role == "kvstore"
        group = a.dst if onboard else a.src
        assert self._in_batch.get(group) != RESHARDING, f"moving {a.request_id}'s KV on {group} while it re-shards"
        assert onboard or self._in_batch.get(group, -1) == -1, f"moving {a.request_id} off {group} mid-iteration"
        assert a.request_id not in self._batch_of, f"moving {a.request_id}'s KV while it runs an iteration"
        tokens = self._elastic_kv.get(a.request_id, {}).get(a.src, 0)
        ready = max(now, self._sampled_by.get(a.request_id, now))  # a pipeline's last token of it is out first
        start, end = self._host_transfer(group, tokens, ready) if tokens else (now, now)
        if tokens:
            self._hold(a.request_id, a.dst, tokens)
        self._in_batch[a.src] = -1
        self._migrations[a.src] = self._migrations.get(a.src, 0) + 1
        self._batch_of[a.request_id] = -1
        way = "swap_in" if onboard else "swap_out"
        self._count(f"{way}_tokens", tokens)
        self._count(f"{way}_s", end - start)
        if onboard:
            self._onboarding[a.request_id] = (a.dst, start, end)
        self.queue.push(end, EventKind.MIGRATE_DONE, (a, tokens, end - now))

    def _onboarded(self, request_id: str) -> None:
        """Count how much of an onboarding the destination's iterations hid (when it ends)."""
        if (o := self._onboarding.pop(request_id, None)) is not None:
            self._count("swap_in_hidden_s", self._hidden(*o))

    # ---- switches ----

    def _reshard(self, iid: str, to: str, now: float) -> None:
        assert iid not in self._in_batch, f"re-sharding {iid} while it runs an iteration or a migration"
        model, inst = self._reshard_model(), self._group(iid)
        config = model.config(to)
        start = max([now, *self._stage_free.get(iid, ())])  # the pipeline drains first
        kept = sum(held.get(iid, 0) for held in self._elastic_kv.values())
        first = not inst.busy_spans
        seconds = 0.0 if first else model.switch_s(kept)
        self._in_batch[iid] = RESHARDING
        moved = Resharded(
            instance_id=iid, config=config.label, seconds=start + seconds - now,
            weight_bytes=0 if first else int(model.weight_bytes),
            kv_bytes=0 if first else 2 * kept * self.config.kv_bytes_per_token,
        )  # fmt: skip
        if not first:
            self._count("reshards", 1)
            self._count("reshard_s", seconds)
            self._count("reshard_weight_bytes", moved.weight_bytes)
        self.queue.push(start + seconds, EventKind.RESHARD_DONE, (moved, config.pp))

    def _on_reshard_done(self, now: float, payload: tuple[Resharded, int]) -> None:
        done, pp = payload
        inst = self._group(done.instance_id)
        del self._in_batch[inst.id]
        inst.parallel, inst.spp = done.config, pp
        self._stage_free.pop(inst.id, None)
        self._emit(done, now)
