"""`csps`: CSPS (seed 001) as a strategy: per-request SP prefill over all-to-all (SP-NTP) with CSA, and KV-parallel
decode that moves the query to the KV (§4: the KV-parallel decode groups and `kvp_tokens` every disaggregated
strategy takes; Table 3's volumes are measured by `spindle verify --kvp`).

Per request, as CSPS §3.2.2 with `spt_tokens` > 0: the GPU count is the prompt over the SPT length that fills a
GPU's KV (at least 1, at most the live prefill instances and `max_sp`), on the instances that free up first;
with `spt_tokens=0` (the default here, where the instances are small) the SP size with the lowest predicted TTFT,
as `request-sp`. Among the instances free when the group can start, §3.2.4's proximity-aware allocation packs it on
the fewest nodes and places the segments in GPU-id order (`placement.py`; predicted with the cross-node form where
the group spans nodes); `first_free=1` takes the instances that free first, in rank order.

SP-NTP or SP-TP: §3.2.2's byte rule (`architecture.sp_architecture`) weighs gathering the attention weights of a TP
deployment (SP-NTP) against all-gathering the hidden states (SP-TP). Here every SP member is a TP-1 instance that
holds all its weights, where the rule always picks SP-NTP, so every plan runs all-to-all (the layout the services
run). SP-TP is priced for a whole simulated run (`spindle sim --sp-kind sp-tp`), not chosen per request: the
services have no SP-TP layout (the library has `sp_tp_attention`).

CSA is off by default (`drop=0`). `drop=P` turns it on at a fixed ratio; `accuracy_loss=A` and/or `ttft_s=T` choose
the levels and P per request from the measured quality table (`configure.py`, §3.2.6). `levels=N` fixes the levels
(0: every level with a fixed drop; any measured level count with the objectives). A request placed on
one instance runs dense (CSA needs two segments). What the paper leaves open, chosen here: the drop ratio doubles
per level (see `spindle_attention.csa`; `level_rule=printed` takes §3.2.4's formula as printed, under which only
level 2 drops for p <= 1/2); importance is the attention a token received from its own segment's
queries in the previous layer, per query (measurable on each member alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from spindle_costmodel.csa import CSA_RULES, max_levels, pair_fraction
from spindle_protocol.messages import RequestSpec

from ...actions import Action, PrefillChunk, RunPrefill
from ...latency import LatencyModel
from ...state import ClusterState, InstanceState
from ...strategy import register_strategy
from ..request_sp import RequestSPStrategy, Steps
from .architecture import gpus_for
from .configure import QualityTable, choose
from .placement import node_order, proximity_group


@register_strategy("csps")
class CSPSStrategy(RequestSPStrategy):
    tuning = {"prefill_share": (0.5, 0.625, 0.75, 0.8), "max_sp": (4, 8, 16)}  # noqa: RUF012
    sp_kind = "ulysses"  # SP-NTP: all-to-all groups

    def __init__(
        self,
        latency: LatencyModel | None = None,
        *,
        max_sp: int = 16,
        spt_tokens: int = 0,
        drop: float = 0.0,
        levels: int = 0,
        accuracy_loss: float | None = None,
        ttft_s: float | None = None,
        level_rule: str = "doubling",
        first_free: int = 0,
    ) -> None:
        super().__init__(latency, max_sp=max_sp, layout="all-to-all")
        if level_rule not in CSA_RULES:
            raise ValueError(f"csps: level_rule must be one of {', '.join(CSA_RULES)}, got {level_rule!r}")
        if level_rule != "doubling" and (accuracy_loss is not None or ttft_s is not None):
            raise ValueError("csps: the quality table was measured with level_rule=doubling; give a fixed drop")
        if not 0.0 <= drop < 1.0:
            raise ValueError(f"csps: drop must be in [0, 1), got {drop}")
        if drop and (accuracy_loss is not None or ttft_s is not None):
            raise ValueError("csps: give a fixed drop or the objectives (accuracy_loss, ttft_s), not both")
        if accuracy_loss is not None and not 0.0 <= accuracy_loss <= 1.0:
            raise ValueError(f"csps: accuracy_loss is a share of answers in [0, 1], got {accuracy_loss}")
        if ttft_s is not None and not ttft_s > 0:
            raise ValueError(f"csps: ttft_s must be > 0, got {ttft_s}")
        if levels < 0 or spt_tokens < 0:
            raise ValueError(f"csps: levels and spt_tokens must be >= 0, got {levels} and {spt_tokens}")
        self.spt_tokens, self.drop, self.levels, self.level_rule = spt_tokens, drop, levels, level_rule
        if first_free not in (0, 1):
            raise ValueError(f"csps: first_free must be 0 or 1, got {first_free}")
        self.first_free = first_free
        self._groups: dict[int, list[InstanceState]] = {}  # this plan's group per SP size
        self.accuracy_loss, self.ttft_s = accuracy_loss, ttft_s
        self.quality = QualityTable.load() if accuracy_loss is not None or ttft_s is not None else None
        self._now = 0.0
        self._decided: dict[int, tuple[int | None, float]] = {}  # this plan's (levels, drop) per SP size

    def options(self) -> dict[str, object]:
        return {
            "max_sp": self.max_sp, "spt_tokens": self.spt_tokens, "drop": self.drop, "levels": self.levels,
            "accuracy_loss": self.accuracy_loss, "ttft_s": self.ttft_s,
            "level_rule": self.level_rule if self.level_rule != "doubling" else None,  # the default goes unsaid
            "first_free": self.first_free,
        }  # fmt: skip

    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        self._now, self._decided, self._groups = now, {}, {}
        actions = super().plan(spec, state, now)
        return [self._with_csa(a) if isinstance(a, RunPrefill) else a for a in actions]

    def candidate_sizes(self, spec: RequestSpec, live: int) -> list[int]:
        if not self.spt_tokens:
            return self.sizes
        # §3.2.2: as many GPUs as the prompt's SPTs (the nearest known SP size above), at most the live ones
        fits = [s for s in self.sizes if s <= live] or self.sizes[:1]
        want = gpus_for(spec.prompt.num_tokens, self.spt_tokens)
        return [next((s for s in fits if s >= want), fits[-1])]

    def _levels(self, sp: int, levels: int | None) -> int:
        """Levels over `sp` members: `levels` (None: every level), at most every level."""
        return min(levels, max_levels(sp)) if levels else max_levels(sp)

    def _decide(self, sp: int, n: int, ready_at: float) -> tuple[int | None, float]:
        """(levels, None: every level; drop ratio) for the prompt on `sp` members free at `ready_at`."""
        fixed = self.levels or None
        if sp < 2 or n < sp or self._levels(sp, fixed) < 2:
            return fixed, 0.0
        if self.quality is None:
            return fixed, self.drop
        predict = self.latency.prefill.predict  # type: ignore[union-attr]

        def ttft(levels: int | None, p: float) -> float:
            keep = pair_fraction(sp, self._levels(sp, levels), p)
            return ready_at - self._now + predict(sp, 0, n, keep)

        return choose(self.quality, sp, self.accuracy_loss, self.ttft_s, ttft, fixed if self.levels else "any")

    def _whole(self, ready: Sequence[float], s: int, n: int) -> tuple[float, Steps]:
        """The whole prompt on s instances free by when the s-th frees, with the CSA settings this plan gives s."""
        levels, drop = self._decided[s] = self._decide(s, n, ready[s - 1])
        keep = pair_fraction(s, self._levels(s, levels), drop, self.level_rule)
        group = self._groups[s] = self._group(s)
        cross = len({i.info.node for i in group}) > 1
        return ready[s - 1] + self.latency.prefill_seconds(s, 0, n, keep, cross), [(0, n, s)]  # type: ignore[union-attr]

    def _group(self, s: int) -> list[InstanceState]:
        """The s members: by proximity among those free as early as the s-th, or the first free (`first_free`)."""
        queue = self._queue
        if self.first_free or s == 1:
            return sorted(queue[:s], key=lambda i: i.info.rank)
        start = queue[s - 1].busy_until(self._now)
        free = [i for i in queue if i.busy_until(self._now) <= start]
        return proximity_group(free, s, node_order(queue))

    def _chunks(self, steps: Steps, prefills: Sequence, state: ClusterState) -> tuple[PrefillChunk, ...]:
        ((start, end, size),) = steps  # one chunk: the whole prompt
        ids = tuple(i.id for i in self._groups[size])
        return (PrefillChunk(start, end, ids, self.layout if size > 1 else "contiguous"),)

    def _with_csa(self, run: RunPrefill) -> RunPrefill:
        sp = run.chunks[0].sp
        levels, drop = self._decided.get(sp, (None, 0.0))
        if not drop:
            return run
        levels = self._levels(sp, levels) if levels else 0
        return dataclasses.replace(run, csa_drop=drop, csa_levels=levels, csa_rule=self.level_rule)
