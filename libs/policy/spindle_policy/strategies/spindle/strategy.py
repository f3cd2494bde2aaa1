"""`spindle`: Spindle's own strategy for mixed traffic, on a prefill pool and a decode pool.

Every request is decided on its own, at arrival, from the cost model and the live queues (choice.py):

- Its prefill plan is chosen among the SP sizes the latency model knows, each as a whole-group plan (request-sp)
  and as a growing one (Tetris's CDSP: start on the instances free now, add members chunk by chunk): the cheapest
  one, in instance-seconds reserved, whose first token is predicted by the request's deadline; the fastest when
  none is. A chat turn thus runs on one instance, a long document on as few as its deadline allows, and under load
  the pool is not spent on speed-ups no deadline asked for (a fixed improvement-rate table tuned per workload, as
  Tetris ships, cannot follow a mix that drifts).
- The deadline: `ttft_factor` times the request's best standalone prefill time on the live pool, at least
  `ttft_min_s` (Medha's length-scaled deadline, §4). With `ttft_slo` (the service's TTFT objective: `ttft_slo` +
  `ttft_per_ktok` seconds per 1,000 prompt tokens, as `spindle sim --slo-ttft --slo-ttft-per-ktok` scores it)
  that objective comes first, and the length-scaled deadline is the fallback for a request no plan can serve
  within it (choice.py, rule 2): measured on the mixed workloads, chasing an objective a long document cannot
  meet with the fastest plan costs the chat turns behind it theirs.
- A late request waits: an interactive request that no plan (on the instances its SP rule allows) serves by any
  of its deadlines, because of the work queued before it, misses its objective whatever runs it, and run now it
  would take the pool from the requests behind it that can still meet theirs (one that misses on an idle pool runs
  at once: waiting cannot help it). It is admitted without a plan and placed, with its fastest plan, on the
  prefill instances interactive traffic leaves idle, or after `late_max_wait_s` whatever the load (deferred.py).
  Under overload this keeps the requests that can meet their objective meeting it (measured on `mixed-chat`,
  Llama-3-70B on 64 H100s at 64 req/s: SLO attainment 48 % without the rule, 98 % with it; the late ones are about
  2 % of the requests, mostly long documents); `defer_late=0` turns it off.
- Batch work (`service_class="batch"`) waits in a queue behind the late requests and is placed only on prefill
  instances interactive traffic leaves idle (deferred.py), so a batch job submitted midway does not take the
  first-token latency of online traffic with it.
- Decode: the freest decode instance (virtual usage counted), or a KV-parallel group for a prompt longer than
  `kvp_tokens` or longer than any instance holds (Medha's KVP, `placement.pick_decode_group`); the decode options
  every disaggregated strategy takes (preemption, moving parked requests, KVP merges) apply as usual.

Its pool: `spindle sim` on a named cluster gives it 4/5 of the GPUs as prefill instances (`prefill_share`), not
the half the other disaggregated strategies get. On the traffic it is for (chat turns and documents, outputs of a
few hundred tokens) a request spends about three times more GPU time in prefill than in decode on the cost model
(Llama-3-8B on A100: a 1.4K-token turn 0.1 GPU-s of prefill against ~0.1 GPU-s of decode at batch 50, and 2 % of
16K-256K documents add ~0.2 GPU-s of prefill per request), and an even split leaves the prefill pool the bottleneck
(measured on `mixed-chat`, Llama-3-8B on 32 A100s, 20-s windows: max load 60 req/s at 16 + 16, 88 at 24 + 8, 92
at 26 + 6, 80 at 28 + 4, where decode becomes the bottleneck). A split that follows the live mix (instances changing
role) is the step after this one. Its context is the pool's (`splits_context`): a prompt longer than one instance
holds gets an SP group whose members' shares fit (`_candidates`) and decodes with its KV split over the decode
instances' KV-parallel group (`pick_decode_group`).

What it does not use (yet), and why: sparse (CSA) prefill needs a per-request accuracy budget that requests do not
carry; elastic instances (LoongServe) and re-sharding (Seesaw) need a colocated pool, and this strategy keeps
prefill and decode apart (its TPOT never pays for a prefill).
"""

from __future__ import annotations

import math

from spindle_protocol.messages import RequestSpec, WorkerEvent

from ...actions import Action, Admit, Reject, RunPrefill
from ...latency import LatencyModel
from ...state import ClusterState, InstanceState
from ...strategy import register_strategy
from ..placement import kvstore_id, pick_decode_group
from ..request_sp import RequestSPStrategy
from .choice import Candidate, candidate, choose, most_held
from .deferred import DeferredQueue
from .load import InteractiveLoad


@register_strategy("spindle")
class SpindleStrategy(RequestSPStrategy):
    needs_latency = True
    prefill_share = 0.8
    tuning = {"prefill_share": (0.5, 0.625, 0.75, 0.8), "max_sp": (0, 8, 16)}  # noqa: RUF012
    from_paper = False  # Spindle's own: no paper configuration to run beside the tuned one
    splits_context = True

    def __init__(
        self,
        latency: LatencyModel | None = None,
        *,
        ttft_slo: float = 0.0,
        ttft_per_ktok: float = 0.0,
        ttft_factor: float = 3.0,
        ttft_min_s: float = 1.0,
        max_sp: int = 0,
        grow: int = 1024,
        layout: str = "zigzag",
        batch_reserve: int = 1,
        batch_max_wait_s: float = 0.0,
        defer_late: bool = True,
        late_max_wait_s: float = 30.0,
    ) -> None:
        if latency is None or latency.prefill is None:
            raise ValueError("strategy 'spindle' needs a latency model with prefill coefficients")
        sizes = latency.prefill.sp_sizes()
        super().__init__(latency, max_sp=max_sp or max(sizes), layout=layout, grow=grow)
        if grow < 1:
            raise ValueError(f"spindle: grow must be >= 1 token per chunk step, got {grow}")
        for key, value in (("ttft_slo", ttft_slo), ("ttft_per_ktok", ttft_per_ktok), ("ttft_min_s", ttft_min_s),
                           ("batch_max_wait_s", batch_max_wait_s), ("late_max_wait_s", late_max_wait_s)):  # fmt: skip
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"spindle: {key} must be a number >= 0, got {value!r}")
        if ttft_per_ktok and not ttft_slo:
            raise ValueError("spindle: ttft_per_ktok is part of the TTFT objective: give ttft_slo too")
        if not (isinstance(ttft_factor, int | float) and ttft_factor >= 1):
            raise ValueError(f"spindle: ttft_factor must be >= 1, got {ttft_factor!r}")
        if isinstance(batch_reserve, bool) or not isinstance(batch_reserve, int) or batch_reserve < 0:
            raise ValueError(f"spindle: batch_reserve must be a whole number >= 0, got {batch_reserve!r}")
        self.ttft_slo, self.ttft_per_ktok = float(ttft_slo), float(ttft_per_ktok)
        self.ttft_factor, self.ttft_min_s = float(ttft_factor), float(ttft_min_s)
        self.load = InteractiveLoad()
        if defer_late not in (0, 1):  # a bool, or 0/1 from a spec string
            raise ValueError(f"spindle: defer_late must be 0 or 1, got {defer_late!r}")
        self.defer_late = bool(defer_late)
        self.late = DeferredQueue(reserve=batch_reserve, max_wait_s=float(late_max_wait_s), load=self.load)
        self.batch = DeferredQueue(reserve=batch_reserve, max_wait_s=float(batch_max_wait_s), load=self.load)

    def options(self) -> dict[str, object]:
        return {
            "ttft_slo": self.ttft_slo, "ttft_per_ktok": self.ttft_per_ktok, "ttft_factor": self.ttft_factor,
            "ttft_min_s": self.ttft_min_s, "max_sp": self.max_sp, "grow": self.grow,
            "batch_reserve": self.batch.reserve, "batch_max_wait_s": self.batch.max_wait_s,
            "defer_late": int(self.defer_late), "late_max_wait_s": self.late.max_wait_s,
        }  # fmt: skip

    # ---- interactive requests: at arrival ----

    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        prefills = sorted(state.live("prefill"), key=lambda i: (i.busy_until(now), i.info.rank))
        if not prefills or not state.live("decode"):
            return [Reject(spec.request_id, 503, "no live prefill or decode instance")]
        if spec.service_class == "batch":
            return self._admit_batch(spec, state, now)
        placed = self._place(spec, state, prefills, self.deadlines(spec, prefills, now), now, self.defer_late)
        if placed is None:
            return [Reject(spec.request_id, 503, "no decode instance can take the request")]
        return placed

    def deadlines(self, spec: RequestSpec, prefills: list[InstanceState], now: float) -> list[float]:
        """When the request's first token is due: the service's objective (with `ttft_slo`), then the length-scaled
        deadline (module docstring)."""
        n = spec.prompt.num_tokens
        predict = self.latency.prefill.predict  # type: ignore[union-attr]
        alone = min((predict(s, 0, n) for s in self.sizes if s <= len(prefills)), default=0.0)
        scaled = now + max(self.ttft_min_s, self.ttft_factor * alone)
        if self.ttft_slo > 0:
            return [now + self.ttft_slo + self.ttft_per_ktok * n / 1000, scaled]
        return [scaled]

    def _candidates(self, ready: list[float], n: int, fits: int, limit: int) -> list[Candidate]:
        """Whole-group and growing plans for every SP size up to `limit` instances, those whose shares fit (`fits`:
        the most prompt tokens one prefill instance holds; 0: unknown; a growing plan's first member holds a share of
        every chunk); a prompt that fits no group that small gets the smallest that it fits."""
        sizes = [s for s in self.sizes if s <= len(ready)]
        fitting = [s for s in sizes if not fits or -(-n // s) <= fits] or sizes[-1:]
        fitting = [s for s in fitting if s <= limit] or fitting[:1]
        out: list[Candidate] = []
        for s in fitting:
            for finish, steps in (self._whole(ready, s, n), self._growing(ready, s, n)):
                if not fits or most_held(steps) <= fits or len(steps) == 1:
                    out.append(candidate(ready, finish, steps))
        return out

    def _place(
        self,
        spec: RequestSpec,
        state: ClusterState,
        prefills: list[InstanceState],
        deadlines: list[float],
        now: float,
        defer: bool = False,
    ) -> list[Action] | None:
        """The request's plan on `prefills` (ordered by when each is free), or None when no decode instance takes
        it. `defer`: a request no plan serves by its last deadline is queued as late instead (module docstring)."""
        placed = pick_decode_group(state, spec, self.kvp_tokens)
        if placed is None:
            return None
        decode, shards = placed
        ready = [i.busy_until(now) for i in prefills]
        tokens = [i.info.kv_blocks_total * i.info.block_size for i in prefills if i.info.kv_blocks_total]
        limit = len(prefills)
        if spec.service_class != "batch":  # the idle instances beyond what interactive arrivals need (load.py)
            idle = sum(t <= now for t in ready)
            limit = max(1, idle - round(self.load.observe(state, prefills, now)))
        best = choose(self._candidates(ready, spec.prompt.num_tokens, min(tokens, default=0), limit), deadlines)
        if defer and best.finish > deadlines[-1] and ready[best.size - 1] > now:  # late, and for queued work
            self.late.add(spec, now)
            return [Admit(spec.request_id, (), "")]
        chunks = self._chunks(best.steps, prefills, state)
        ids = chunks[-1].instances
        state.plan_work(ids, spec.request_id, best.finish)
        return [
            Admit(spec.request_id, ids, decode.id, predicted_ttft_s=best.finish - now),
            RunPrefill(spec, chunks, decode.id, kvstore_id(state), shards),
        ]

    # ---- late and batch requests: deferred to idle instances ----

    def _admit_batch(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        spare = self.batch.spare(state, sorted(state.live("prefill"), key=lambda i: i.info.rank), now)
        if spare and not self.late.waiting and not self.batch.waiting:
            placed = self._place(spec, state, spare, [math.inf], now)
            if placed is not None:
                return placed
        self.batch.add(spec, now)
        return [Admit(spec.request_id, (), "")]

    def _release(self, state: ClusterState, now: float) -> list[Action]:
        """Place deferred requests, late ones first (their fastest plan), then batch work (its cheapest)."""
        if not (self.late.waiting or self.batch.waiting) or not state.live("prefill") or not state.live("decode"):
            return []
        return self._release_queue(self.late, [], state, now) + self._release_queue(self.batch, [math.inf], state, now)

    def _release_queue(
        self, queue: DeferredQueue, deadlines: list[float], state: ClusterState, now: float
    ) -> list[Action]:
        """`queue`'s requests waiting past its max wait whatever the load, then its head while instances are spare."""
        actions: list[Action] = []
        for spec in queue.due(state, now):
            prefills = sorted(state.live("prefill"), key=lambda i: (i.busy_until(now), i.info.rank))
            if (placed := self._place(spec, state, prefills, deadlines, now)) is not None:
                queue.pop(spec.request_id)
                actions += [a for a in placed if not isinstance(a, Admit)]
        while queue.waiting:
            spare = queue.spare(state, sorted(state.live("prefill"), key=lambda i: i.info.rank), now)
            if not spare:
                break
            spec = queue.waiting[0][0]
            placed = self._place(spec, state, spare, deadlines, now)
            if placed is None:  # no decode instance has room now: try again later
                break
            queue.pop(spec.request_id)
            actions += [a for a in placed if not isinstance(a, Admit)]
        return actions

    def on_tick(self, state: ClusterState, now: float) -> list[Action]:
        return super().on_tick(state, now) + self._release(state, now)

    def on_event(self, event: WorkerEvent, state: ClusterState, now: float) -> list[Action]:
        return self._release(state, now)
