"""`tetris`: CDSP prefill scheduling (Algorithms 1-3) on a prefill pool, decode routing by freeness (§5.2).

Per request, at arrival: the prefill instances' queues (seconds until the work planned on each is done, the
strategy's own predictions from Eq. 1) and nodes go to the planner (planner.py); its chunks become a
`RunPrefill` whose SP groups only grow, and every member is planned busy until the last chunk ends (a member
computes every chunk from the one it joins). The decode instance is the freest where the request fits, KV of
requests still on their way counted as used (Llumnix's virtual usage, `placement.pick_decode_group`); the core
refreshes each decode instance's slots from every heartbeat and every returned output.

The improvement rate (Algorithm 2's threshold against over-expansion): fixed with `improvement_rate=X`, else
from a table of the best rate per arrival rate (`table=`: a shipped name or a `spindle tune tetris` JSON),
looked up every `update_s` seconds with the arrival rate over the last `window_s` (the paper: 30 s and 30 s).
The paper does not say how serving starts: here the lightest load's row applies until 5 requests have arrived,
then, until a whole window has passed, the rate is re-estimated at every arrival (a cluster started under heavy
load would otherwise over-expand for its first 30 s).

Options the paper leaves open: `min_chunk` (1024 tokens) and `align` (128) for chunk lengths (planner.py);
`max_sp` caps the SP sizes (default: every size the latency model knows); `chunking=0` is the paper's
single-chunk ablation (Algorithm 2 alone).
"""

from __future__ import annotations

from spindle_protocol.messages import RequestSpec

from ...actions import LAYOUTS, Action, Admit, PrefillChunk, Reject, RunPrefill
from ...latency import LatencyModel
from ...state import ClusterState, InstanceState
from ...strategy import Strategy, register_strategy
from ..placement import kvstore_id, pick_decode_group
from .planner import CDSPConfig, CDSPPlan, CDSPPlanner
from .rate import DEFAULT_TABLE, ArrivalWindow, RateTable, load_table

WARMUP_ARRIVALS = 5
DEFAULTS: dict[str, object] = {
    "improvement_rate": None, "table": DEFAULT_TABLE, "window_s": 30.0, "update_s": 30.0, "max_sp": 0,
    "chunking": 1, "min_chunk": 1024, "align": 128, "layout": "zigzag",
}  # fmt: skip


@register_strategy("tetris")
class TetrisStrategy(Strategy):
    tuning = {"prefill_share": (0.5, 0.625, 0.75, 0.8), "max_sp": (0, 8, 16)}  # noqa: RUF012
    needs_latency = True

    def __init__(
        self,
        latency: LatencyModel | None = None,
        *,
        improvement_rate: float | None = None,
        table: str = DEFAULT_TABLE,
        window_s: float = 30.0,
        update_s: float = 30.0,
        max_sp: int = 0,
        chunking: int = 1,
        min_chunk: int = 1024,
        align: int = 128,
        layout: str = "zigzag",
    ) -> None:
        super().__init__(latency)
        assert self.latency is not None and self.latency.prefill is not None
        known = self.latency.prefill.sp_sizes()
        self.sizes = tuple(s for s in known if not max_sp or s <= max_sp)
        if max_sp < 0 or not self.sizes:
            raise ValueError(f"tetris: no SP size <= max_sp={max_sp} in the latency model's {known}")
        if layout not in LAYOUTS:
            raise ValueError(f"tetris: unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
        if chunking not in (0, 1):
            raise ValueError(f"tetris: chunking is 1 (CDSP) or 0 (single chunk), got {chunking!r}")
        if not update_s > 0:
            raise ValueError(f"tetris: update_s must be > 0, got {update_s}")
        self.table: RateTable | None = None if improvement_rate is not None else load_table(table)
        self.table_name = "" if improvement_rate is not None else table
        rate = improvement_rate if improvement_rate is not None else self.table.rows[0][1]  # type: ignore[union-attr]
        self.config = CDSPConfig(self.sizes, float(rate), min_chunk, align, bool(chunking))
        self.window, self.update_s, self.next_update = ArrivalWindow(window_s), update_s, None
        self.max_sp, self.layout = max_sp, layout
        self.last_plan: CDSPPlan | None = None  # for tests and the plan-time benchmark
        given = {
            "improvement_rate": improvement_rate, "table": table, "window_s": window_s, "update_s": update_s,
            "max_sp": max_sp, "chunking": chunking, "min_chunk": min_chunk, "align": align, "layout": layout,
        }  # fmt: skip
        self.given = {k: v for k, v in given.items() if v != DEFAULTS[k]}

    @property
    def improvement_rate(self) -> float:
        return self.config.improvement_rate

    def options(self) -> dict[str, object]:
        """The options given that differ from the defaults (so `describe()` recreates this strategy)."""
        return dict(self.given)

    def describe(self) -> str:
        decode = super().describe().partition(":")[2]  # the common decode options that are on
        own = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.given.items())
        text = ",".join(
            t for t in (own, ",".join(p for p in decode.split(",") if p.split("=")[0] not in self.given)) if t
        )
        return f"{self.name}:{text}" if text else self.name

    def _track_load(self, now: float) -> None:
        self.window.add(now)
        if self.table is None:
            return
        if self.window.warming_up(now):
            due = len(self.window.times) >= WARMUP_ARRIVALS
        else:
            due = self.next_update is None or now >= self.next_update
        if due:
            rate = self.table.lookup(self.window.rate(now))
            self.config = CDSPConfig(self.sizes, rate, self.config.min_chunk, self.config.align, self.config.chunking)
            self.next_update = now + self.update_s

    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        self._track_load(now)
        ready = sorted((i.busy_until(now), i.info.rank, i) for i in state.live("prefill"))
        placed = pick_decode_group(state, spec, self.kvp_tokens) if ready else None
        if placed is None:
            return [Reject(spec.request_id, 503, "no live prefill or decode instance")]
        decode, shards = placed
        prefills = [i for _, _, i in ready]
        queues = [t - now for t, _, _ in ready]
        nodes = [i.info.node or i.id for i in prefills]
        planner = CDSPPlanner(self.config, self.latency.prefill.coeffs, queues, nodes)  # type: ignore[union-attr]
        plan = planner.plan(spec.prompt.num_tokens)
        self.last_plan = plan
        chunks = self._chunks(plan, prefills)
        state.plan_work(chunks[-1].instances, spec.request_id, now + plan.ttft_s)
        return [
            Admit(spec.request_id, chunks[-1].instances, decode.id, predicted_ttft_s=plan.ttft_s),
            RunPrefill(spec, chunks, decode.id, kvstore_id(state), shards),
        ]

    def _chunks(self, plan: CDSPPlan, prefills: list[InstanceState]) -> tuple[PrefillChunk, ...]:
        """Each chunk's group: the previous group, then its newcomers in rank order."""
        chunks: list[PrefillChunk] = []
        ids: tuple[str, ...] = ()
        start = 0
        for tokens, group in plan.chunks:
            new = sorted((prefills[i] for i in group[len(ids) :]), key=lambda inst: inst.info.rank)
            ids += tuple(inst.id for inst in new)
            layout = self.layout if len(ids) > 1 else "contiguous"
            chunks.append(PrefillChunk(start, start + tokens, ids, layout))
            start += tokens
        return tuple(chunks)
