"""`tetris`: GetGroup, Algorithms 1-3 on worked examples, the improvement-rate table and its sliding window,
and the strategy in the core and the simulator."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from spindle_policy import RunPrefill, SchedulerConfig, SchedulerCore, create_strategy
from spindle_policy.latency import LatencyModel, PrefillLatencyModel
from spindle_policy.strategies.tetris.groups import GroupFinder
from spindle_policy.strategies.tetris.planner import CDSPConfig, CDSPPlanner
from spindle_policy.strategies.tetris.rate import ArrivalWindow, RateTable, load_table
from spindle_policy.testing import request_spec
from spindle_protocol.messages import InstanceInfo
from spindle_sim import SimConfig, Simulator
from spindle_sim.invariants import check_invariants
from spindle_sim.tune import tune_tetris
from spindle_sim.workloads import make_workload

# Tetris §2.4's numbers: Eq. 1 lines through Table 1's 16k and 32k cells at SP 8 and 16, through 32k for SP 1-4
TABLE1 = {
    1: (0.0, 3.22 / 32768, 0.0, 0.0), 2: (0.0, 1.67 / 32768, 0.0, 0.0), 4: (0.0, 0.92 / 32768, 0.0, 0.0),
    8: (0.04, 0.27 / 16384, 0.0, 0.0), 16: (0.39, 0.07 / 16384, 0.0, 0.0),
}  # fmt: skip
# a 4-instance example: SP s costs 0.05 s + 0.01/s s per token (SP 1: 0.1 s)
SMALL = {1: (0.1, 0.01, 0.0, 0.0), 2: (0.05, 0.005, 0.0, 0.0), 4: (0.05, 0.0025, 0.0, 0.0)}


def test_getgroup_keeps_groups_inside_nodes() -> None:
    # 12 instances in queue order; nodes a (0, 3, 4, 9), b (1, 2, 5, 6), c (7, 8, 10, 11)
    nodes = ["a", "b", "b", "a", "a", "b", "b", "c", "c", "a", "c", "c"]
    f = GroupFinder(range(12), nodes)
    assert f.get((), 2) == (1, 2)  # node b's 2nd shortest (2) beats a's (3) and c's (8)
    assert f.get((), 8) == (1, 2, 5, 6, 0, 3, 4, 9)  # whole nodes by their longest queue: b (6) then a (9)
    assert f.get((), 6) == (1, 2, 5, 6, 0, 3)  # node b whole, then the best 2 from one other node
    assert f.get((7,), 3) == (7, 8, 10)  # extend inside c first
    assert f.get((7, 8, 10, 11), 6) == (7, 8, 10, 11, 1, 2)  # c is full: the best 2 of one other node
    assert f.get((1, 2), 1) is None and f.get((), 13) is None
    sub = GroupFinder((0, 3, 7), nodes)
    assert sub.get((), 2) == (0, 3) and sub.get((0,), 3) == (0, 3, 7)


def test_getgroup_four_picks_the_node_whose_fourth_queue_is_shortest() -> None:
    nodes = ["a", "b", "b", "a", "a", "b", "b", "c", "c", "a", "c", "c"]
    # a: 0 3 4 9 (4th: 9); b: 1 2 5 6 (4th: 6); c: 7 8 10 11 (4th: 11) -> b
    assert GroupFinder(range(12), nodes).get((), 4) == (1, 2, 5, 6)


def planner(coeffs: dict, queues: list[float], nodes: list[str], **cfg: object) -> CDSPPlanner:
    return CDSPPlanner(CDSPConfig(tuple(sorted(coeffs)), **cfg), coeffs, queues, nodes)  # type: ignore[arg-type]


def test_section_2_4_greedy_vs_load_aware() -> None:
    """16 SP instances, each queued 1 s; a 32k request, then a 16k one. Without the improvement threshold the
    32k takes SP 16 (1 + 0.53 = 1.53 s) and the 16k waits for it (1.53 + 0.31 = 1.84 s); with a 5 % threshold,
    SP 16's 3 % gain over SP 8 is not worth it: 1.58 s and 1.31 s (Tetris §2.4)."""
    nodes = ["n0"] * 8 + ["n1"] * 8
    for rate, expect in ((0.0, (16, 1.53, 8, 1.84)), (0.05, (8, 1.58, 8, 1.31))):
        first = planner(TABLE1, [1.0] * 16, nodes, improvement_rate=rate).plan(32768)
        ((_, group),) = first.chunks
        busy = sorted([first.ttft_s if i in group else 1.0 for i in range(16)])
        second = planner(TABLE1, busy, sorted(nodes, key=lambda n: n), improvement_rate=rate).plan(16384)
        assert (len(group), round(first.ttft_s, 2)) == expect[:2]
        assert (len(second.chunks[-1][1]), round(second.ttft_s, 2)) == expect[2:]


def test_algorithm_3_grows_the_group_when_the_next_members_free_up() -> None:
    """Instances 0, 1 free now, 2, 3 in 2 s. Whole prompt (1000 tokens): SP 2 at 5.05 s, SP 4 at 4.55 s. CDSP:
    (2, 4) runs 390 tokens on 0-1 in the 2 s budget, then 610 on all four: 2.0 + 1.575 = 3.575 s."""
    p = planner(SMALL, [0.0, 0.0, 2.0, 2.0], ["n"] * 4, improvement_rate=0.05, min_chunk=10, align=10)
    plan = p.plan(1000)
    assert [(n, g) for n, g in plan.chunks] == [(390, (0, 1)), (610, (0, 1, 2, 3))]
    assert plan.ttft_s == pytest.approx(3.575)
    single = planner(SMALL, [0.0, 0.0, 2.0, 2.0], ["n"] * 4, improvement_rate=0.05, chunking=False).plan(1000)
    assert single.chunks == ((1000, (0, 1, 2, 3)),) and single.ttft_s == pytest.approx(4.55)
    # a budget too small for min_chunk tokens: no chunk
    tight = planner(SMALL, [0.0, 0.0, 2.0, 2.0], ["n"] * 4, improvement_rate=0.05, min_chunk=500, align=10)
    assert len(tight.plan(1000).chunks) == 1


def test_idle_cluster_never_chunks() -> None:
    plan = planner(SMALL, [0.0] * 4, ["n"] * 4, improvement_rate=0.0).plan(5000)
    assert len(plan.chunks) == 1 and len(plan.chunks[0][1]) == 4


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="improvement_rate"):
        CDSPConfig((1, 2), improvement_rate=1.0)
    with pytest.raises(ValueError, match="ascending"):
        CDSPConfig((2, 1))
    with pytest.raises(ValueError, match="coefficients"):
        CDSPPlanner(CDSPConfig((1, 8)), SMALL, [0.0], ["n"])


def test_rate_table_and_window(tmp_path: Path) -> None:
    table = RateTable(((0.5, 0.05), (1.0, 0.25), (2.0, 0.6)))
    assert [table.lookup(r) for r in (0.0, 0.7, 0.76, 1.4, 1.6, 9.0)] == [0.05, 0.05, 0.25, 0.25, 0.6, 0.6]
    with pytest.raises(ValueError):
        RateTable(((1.0, 0.2), (0.5, 0.1)))
    window = ArrivalWindow(30.0)
    for t in range(0, 60, 2):
        window.add(float(t))
    assert window.rate(60.0) == pytest.approx(14 / 30)  # 32, 34, ..., 58 in (30, 60]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"rows": [{"arrival_rate": 1, "improvement_rate": 0.4}]}))
    assert load_table(str(path)).lookup(3.0) == 0.4
    assert load_table("tetris-medium").rows  # shipped
    with pytest.raises(ValueError, match="no improvement-rate table"):
        load_table("nope.json")


def core_with(strategy: str, n: int, nodes: int = 1) -> SchedulerCore:
    latency = LatencyModel(prefill=PrefillLatencyModel(SMALL))
    core = SchedulerCore(create_strategy(strategy, latency), SchedulerConfig())
    roles = [(f"p{i}", "prefill", f"node{i * nodes // n}") for i in range(n)] + [("d", "decode", "node0")]
    for rank, (iid, role, node) in enumerate(roles):
        info = InstanceInfo(
            instance_id=iid, role=role, rank=1 + rank, pid=0, started_at=0.0, updated_at=0.0,
            kv_blocks_total=10**6, block_size=16, node=node,
        )  # fmt: skip
        core.on_heartbeat(info)
    return core


def test_strategy_plans_growing_groups_and_books_every_member() -> None:
    core = core_with("tetris:improvement_rate=0.05,min_chunk=10,align=10", 4)
    for iid in ("p2", "p3"):
        core.state.plan_work((iid,), f"earlier-{iid}", 2.0)
    actions = core.admit(request_spec("r", prompt=1000, out=4), 0.0)
    (run,) = [a for a in actions if isinstance(a, RunPrefill)]
    assert [(c.start, c.end, c.instances) for c in run.chunks] == [
        (0, 390, ("p0", "p1")),
        (390, 1000, ("p0", "p1", "p2", "p3")),
    ]
    assert all(len(a.instances) < len(b.instances) for a, b in itertools.pairwise(run.chunks))
    assert all(core.state.instances[i].busy_until(0.0) == pytest.approx(3.575) for i in ("p0", "p1", "p2", "p3"))


def test_strategy_options() -> None:
    latency = LatencyModel(prefill=PrefillLatencyModel(SMALL))
    assert create_strategy("tetris", latency).describe() == "tetris"
    for spec in ("tetris:improvement_rate=0,min_chunk=64,align=16", "tetris:chunking=0", "tetris:layout=contiguous"):
        assert create_strategy(spec, latency).describe() == spec  # the description recreates the strategy
    assert create_strategy("tetris:improvement_rate=0.4,max_sp=2", latency).sizes == (1, 2)
    for bad in ("tetris:chunking=2", "tetris:max_sp=-1", "tetris:layout=star", "tetris:table=missing.json"):
        with pytest.raises(ValueError):
            create_strategy(bad, latency)


def test_the_table_follows_the_arrival_rate(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    rows = [{"arrival_rate": 0.5, "improvement_rate": 0.05}, {"arrival_rate": 4.0, "improvement_rate": 0.7}]
    path.write_text(json.dumps({"rows": rows}))
    core = core_with(f"tetris:table={path},update_s=10,window_s=10", 4)
    strategy = core.strategy
    assert strategy.improvement_rate == 0.05  # the lightest load's row until the first update
    t = 0.0
    for i in range(80):  # 4 req/s for 20 s
        core.admit(request_spec(f"r{i}", prompt=200, out=2), t)
        t += 0.25
    assert strategy.improvement_rate == 0.7


def test_simulated_tetris_keeps_the_invariants_and_beats_single_chunk_under_load() -> None:
    from spindle_policy.calibration import load_paper_calibration

    latency = load_paper_calibration()
    config = SimConfig(num_prefill=16, num_decode=2, scheduler=SchedulerConfig(max_num_requests=400))
    trace = make_workload("tetris-medium", 300, 3.0, seed=1)
    runs = {}
    for spec in ("tetris:improvement_rate=0.3", "tetris:improvement_rate=0.3,chunking=0"):
        sim = Simulator(spec, latency, config)
        result = sim.run(trace)
        check_invariants(sim, result)
        assert all(r.ttft is not None for r in result.records)
        runs[spec] = sorted(r.ttft for r in result.records)  # type: ignore[misc]
    cdsp, single = runs.values()
    assert cdsp[len(cdsp) // 2] <= single[len(single) // 2]


def test_tune_picks_the_best_rate_per_load() -> None:
    from spindle_policy.calibration import load_paper_calibration

    config = SimConfig(num_prefill=16, num_decode=2, scheduler=SchedulerConfig(max_num_requests=200))
    table = tune_tetris("tetris-medium", [0.5, 3.0], load_paper_calibration(), config, [0.05, 0.6], 150)
    for row in table["rows"]:
        ttfts = row["ttft_mean_s"]
        assert ttfts[f"{row['improvement_rate']:g}"] == min(ttfts.values())
    assert RateTable.from_dict(table).rows[0][0] == 0.5


def test_a_returned_output_frees_its_slots_before_the_next_heartbeat() -> None:
    """Tetris §5.2: the decode statistics refresh on every returned output, not only on heartbeats."""
    from spindle_protocol.messages import DecodeStarted, PrefillDone, RequestFinished

    core = core_with("tetris:improvement_rate=0.3", 2)
    core.admit(request_spec("r", prompt=320, out=16), 0.0)
    decode = core.state.instances["d"]
    core.on_event(PrefillDone(request_id="r", instance_id="p0", seconds=1.0, finished=False), 1.0)
    core.on_event(DecodeStarted(request_id="r", instance_id="d"), 1.5)
    held = 10**6 - decode.free_blocks  # counted as planned until the next heartbeat
    assert held == 21  # 320 + 16 tokens in blocks of 16
    core.on_event(RequestFinished(request_id="r", instance_id="d", finish_reason="length", num_output_tokens=16), 2.0)
    assert decode.free_blocks == 10**6 and decode.released_running == 1
