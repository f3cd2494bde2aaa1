"""`fixed-sp`: prefill instances split once into fixed SP groups of size `sp` (Tetris §7.1, "Fixed-SP").

Groups are consecutive live prefill instances in rank order (so a group stays on one node where ranks are
packed by node); instances left over when the count is not a multiple of `sp` stay idle. Each request goes,
whole, to the group with the lowest predicted queueing delay (Tetris Eq. 1 over the work planned on it);
decode goes to the TP decode instance with the most free KV.
"""

from __future__ import annotations

from spindle_protocol.messages import RequestSpec

from ..actions import LAYOUTS, Action, Admit, Reject, RunPrefill, whole_prompt
from ..latency import LatencyModel
from ..state import ClusterState
from ..strategy import Strategy, register_strategy
from .placement import group_ready_at, kvstore_id, pick_decode_group


@register_strategy("fixed-sp")
class FixedSPStrategy(Strategy):
    tuning = {"prefill_share": (0.5, 0.625, 0.75), "sp": (2, 4, 8)}  # noqa: RUF012
    needs_latency = True

    def __init__(
        self,
        latency: LatencyModel | None = None,
        *,
        sp: int = 8,
        layout: str = "zigzag",
    ) -> None:
        super().__init__(latency)
        assert self.latency is not None and self.latency.prefill is not None
        if sp not in self.latency.prefill.coeffs:
            raise ValueError(f"fixed-sp: sp={sp} has no prefill latency model (have {self.latency.prefill.sp_sizes()})")
        self.sp = sp
        if layout not in LAYOUTS:
            raise ValueError(f"{self.name}: unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
        self.layout = layout

    def options(self) -> dict[str, object]:
        return {"sp": self.sp}

    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        prefills = state.live("prefill")
        groups = [prefills[i : i + self.sp] for i in range(0, len(prefills) - self.sp + 1, self.sp)]
        if not groups:
            return [Reject(spec.request_id, 503, f"fewer than sp={self.sp} live prefill instances")]
        placed = pick_decode_group(state, spec, self.kvp_tokens)
        if placed is None:
            return [Reject(spec.request_id, 503, "no live decode instance")]
        decode, shards = placed
        group = min(groups, key=lambda g: group_ready_at(g, now))
        start = group_ready_at(group, now)
        seconds = self.latency.prefill.predict(self.sp, 0, spec.prompt.num_tokens)  # type: ignore[union-attr]
        ids = tuple(i.id for i in group)
        state.plan_work(ids, spec.request_id, start + seconds)
        layout = self.layout if self.sp > 1 else "contiguous"
        return [
            Admit(spec.request_id, ids, decode.id),
            RunPrefill(spec, whole_prompt(spec, ids, layout), decode.id, kvstore_id(state), shards),
        ]
