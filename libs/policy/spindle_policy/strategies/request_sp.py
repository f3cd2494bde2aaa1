"""`request-sp`: per request, the SP size and instances that minimise its predicted TTFT given the queues, with
the whole prompt in one chunk (Tetris's "LoongServe Disaggregated" baseline: LoongServe's single-request
scheduling on a prefill pool).

For each candidate size s (the SP sizes the latency model knows, up to `max_sp`), the group is the s
instances that free up first; predicted TTFT = when the last of them is free + Eq. 1 at (s, 0, L). The
smallest s among the best wins ties. Greedy per request: it can hold many instances idle while the group
assembles, which is the cost Tetris §2.4 describes.

`grow=C` (tokens, 0 = off) adds Tetris's chunkwise dynamic SP (CDSP, §4-5) in a simple form: instead of
waiting for the whole group, the request starts at once on the instances free now (at least the smallest SP
size the model knows), and the group only grows. Each chunk is the most multiples of C tokens that the
current group is predicted to finish (Eq. 1, the tokens before the chunk as history) by the time the next
SP size's members are free (the work planned on them); the next chunk starts then and adds every member free
by then (the largest known SP size that fits). When not even C tokens fit, the group waits for them without
a chunk (a chunk never makes a joining member wait). Once the group is complete, or the prompt would end
before anyone joins, the chunk takes the rest; so a plan has at most one chunk per SP size. For each target
size s both plans are predicted, growing and whole-group; the earliest first token wins (on ties the smaller
s, then the whole-group plan). Every member of a growing group computes up to the last chunk, so each is
planned busy until the plan's end (a late member is busy with earlier work until it joins).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from spindle_protocol.messages import RequestSpec

from ..actions import LAYOUTS, Action, Admit, PrefillChunk, Reject, RunPrefill
from ..latency import LatencyModel
from ..state import ClusterState, InstanceState
from ..strategy import Strategy, register_strategy
from .placement import kvstore_id, pick_decode_group

Steps = list[tuple[int, int, int]]  # (start, end, group size) per chunk


@register_strategy("request-sp")
class RequestSPStrategy(Strategy):
    tuning = {"prefill_share": (0.5, 0.625, 0.75, 0.8), "max_sp": (4, 8, 16)}  # noqa: RUF012
    needs_latency = True

    def __init__(
        self,
        latency: LatencyModel | None = None,
        *,
        max_sp: int = 16,
        layout: str = "zigzag",
        grow: int = 0,
    ) -> None:
        super().__init__(latency)
        assert self.latency is not None and self.latency.prefill is not None
        self.sizes = [s for s in self.latency.prefill.sp_sizes() if s <= max_sp]
        if max_sp < 1 or not self.sizes:
            raise ValueError(f"request-sp: no SP size <= max_sp={max_sp} in {self.latency.prefill.sp_sizes()}")
        self.max_sp = max_sp
        if layout not in LAYOUTS:
            raise ValueError(f"{self.name}: unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
        self.layout = layout
        if isinstance(grow, bool) or not isinstance(grow, int) or grow < 0:
            raise ValueError(f"request-sp: grow must be a whole number of tokens per chunk >= 0 (0: off), not {grow!r}")
        self.grow = grow
        self._queue: list[InstanceState] = []  # the plan's prefill instances, the first free first (`plan`)

    def options(self) -> dict[str, object]:
        return {"max_sp": self.max_sp, "grow": self.grow}

    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        prefills = sorted(state.live("prefill"), key=lambda i: (i.busy_until(now), i.info.rank))
        placed = pick_decode_group(state, spec, self.kvp_tokens) if prefills else None
        if placed is None:
            return [Reject(spec.request_id, 503, "no live prefill or decode instance")]
        decode, shards = placed
        n = spec.prompt.num_tokens
        self._queue = prefills  # for a subclass choosing its group among them (csps)
        ready = [i.busy_until(now) for i in prefills]
        best: tuple[float, Steps] | None = None
        for s in self.candidate_sizes(spec, len(prefills)):
            if s > len(prefills):
                break
            plans = [self._whole(ready, s, n)] + ([self._growing(ready, s, n)] if self.grow else [])
            for candidate in plans:
                if best is None or candidate[0] < best[0]:
                    best = candidate
        assert best is not None  # sizes start at 1 when the model has SP 1; else the pool is too small
        finish, steps = best
        chunks = self._chunks(steps, prefills, state)
        ids = chunks[-1].instances
        state.plan_work(ids, spec.request_id, finish)
        return [
            Admit(spec.request_id, ids, decode.id, predicted_ttft_s=finish - now),
            RunPrefill(spec, chunks, decode.id, kvstore_id(state), shards),
        ]

    def candidate_sizes(self, spec: RequestSpec, live: int) -> list[int]:
        """The SP sizes a request's plan is chosen among (ascending; those above `live` instances are skipped)."""
        return self.sizes

    def _whole(self, ready: Sequence[float], s: int, n: int) -> tuple[float, Steps]:
        """The whole prompt on the s instances that free first, once the last of them is free."""
        return ready[s - 1] + self.latency.prefill.predict(s, 0, n), [(0, n, s)]  # type: ignore[union-attr]

    def _growing(self, ready: Sequence[float], s: int, n: int) -> tuple[float, Steps]:
        """The plan growing towards the s instances that free first (`ready`: when each is free, ascending)."""
        predict = self.latency.prefill.predict  # type: ignore[union-attr]
        sizes = [z for z in self.sizes if z <= s]
        t, start, steps = ready[sizes[0] - 1], 0, []
        while True:
            size = max(z for z in sizes if z <= bisect.bisect_right(ready, t, 0, s))  # the members free by t
            rest = n - start
            bigger = [z for z in sizes if z > size]
            joins = ready[bigger[0] - 1] if bigger else 0.0  # when the next SP size's last member is free
            if not bigger or t + predict(size, start, rest) <= joins:
                steps.append((start, n, size))  # the group is complete, or the prompt ends before anyone joins
                return t + predict(size, start, rest), steps
            lo, hi = 0, (rest - 1) // self.grow  # the most chunks of `grow` tokens that end by `joins`
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if t + predict(size, start, mid * self.grow) <= joins:
                    lo = mid
                else:
                    hi = mid - 1
            if lo:
                steps.append((start, start + lo * self.grow, size))
                start += lo * self.grow
            t = joins

    def _chunks(self, steps: Steps, prefills: Sequence, state: ClusterState) -> tuple[PrefillChunk, ...]:
        """Chunks on the first `size` instances of the queue order; each group keeps the previous one's order
        and appends the newcomers in rank order (the first group: in rank order)."""
        chunks: list[PrefillChunk] = []
        group: tuple[str, ...] = ()
        for start, end, size in steps:
            new = [i.id for i in prefills[:size] if i.id not in group]
            group += tuple(sorted(new, key=lambda iid: state.instances[iid].info.rank))
            chunks.append(PrefillChunk(start, end, group, self.layout if size > 1 else "contiguous"))
        return tuple(chunks)
