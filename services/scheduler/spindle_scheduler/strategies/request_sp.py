"""`request-sp`: per request, the SP size and instances that minimise its predicted TTFT given the queues, with
the whole prompt in one chunk (Tetris's "LoongServe Disaggregated" baseline: LoongServe's single-request
scheduling on a prefill pool).

For each candidate size s (the SP sizes the latency model knows, up to `max_sp`), the group is the s
instances that free up first; predicted TTFT = when the last of them is free + Eq. 1 at (s, 0, L). The
smallest s among the best wins ties. Greedy per request: it can hold many instances idle while the group
assembles, which is the cost Tetris §2.4 describes.
"""

from __future__ import annotations

from spindle_protocol.messages import RequestSpec

from ..actions import LAYOUTS, Action, Admit, Reject, RunPrefill, whole_prompt
from ..latency import LatencyModel
from ..state import ClusterState
from ..strategy import Strategy, register_strategy
from .placement import kvstore_id, pick_decode_group


@register_strategy("request-sp")
class RequestSPStrategy(Strategy):
    needs_latency = True

    def __init__(
        self,
        latency: LatencyModel | None = None,
        *,
        max_sp: int = 16,
        layout: str = "zigzag",
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

    def options(self) -> dict[str, object]:
        return {"max_sp": self.max_sp}

    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        prefills = sorted(state.live("prefill"), key=lambda i: (i.busy_until(now), i.info.rank))
        placed = pick_decode_group(state, spec, self.kvp_tokens) if prefills else None
        if placed is None:
            return [Reject(spec.request_id, 503, "no live prefill or decode instance")]
        decode, shards = placed
        n = spec.prompt.num_tokens
        best: tuple[float, int] | None = None
        for s in self.sizes:
            if s > len(prefills):
                break
            ttft = prefills[s - 1].busy_until(now) + self.latency.prefill.predict(s, 0, n)  # type: ignore[union-attr]
            if best is None or ttft < best[0]:
                best = (ttft, s)
        assert best is not None  # sizes start at 1 when the model has SP 1; else the pool is too small
        finish, s = best
        ids = tuple(sorted((i.id for i in prefills[:s]), key=lambda iid: state.instances[iid].info.rank))
        state.plan_work(ids, spec.request_id, finish)
        layout = self.layout if s > 1 else "contiguous"
        return [
            Admit(spec.request_id, ids, decode.id),
            RunPrefill(spec, whole_prompt(spec, ids, layout), decode.id, kvstore_id(state), shards),
        ]
