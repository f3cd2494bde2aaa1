"""`csps` (CSPS, issue 24): the SP-NTP/SP-TP rule, the objective-oriented drop ratio from measured quality, and
the strategy's plans (all-to-all SP with CSA settings) in the core and the simulator."""

from __future__ import annotations

import pytest

from spindle_policy import RunPrefill, SchedulerConfig, SchedulerCore, create_strategy
from spindle_policy.latency import DecodeStepModel, LatencyModel, PrefillLatencyModel, TransferModel
from spindle_policy.strategies.csps.architecture import NTP, TP, gpus_for, sp_architecture
from spindle_policy.strategies.csps.configure import QualityTable, choose
from spindle_protocol.messages import InstanceInfo, Prompt, RequestSpec, Sampling
from spindle_sim import SimConfig, Simulator
from spindle_sim.invariants import check_invariants
from spindle_sim.workloads import TraceRequest

LATENCY = LatencyModel(
    prefill=PrefillLatencyModel({s: (0.01, 2e-4 / s, 1e-8 / s, 1e-7 / s) for s in (1, 2, 4)}),
    decode=DecodeStepModel({(1, 1): (0.005, 1e-4, 1e-7)}),
    transfer=TransferModel(latency_s=0.001, bandwidth_bytes_per_s=1e9),
)


def _spec(rid: str, n: int) -> RequestSpec:
    return RequestSpec(
        request_id=rid, prompt=Prompt(num_tokens=n), sampling=Sampling(max_tokens=4), arrival_time=0.0, deadline=1e9
    )


def _core(strategy: str, num_prefill: int = 4) -> SchedulerCore:
    core = SchedulerCore(create_strategy(strategy, LATENCY), SchedulerConfig())
    for rank, (iid, role) in enumerate([(f"prefill-{i}", "prefill") for i in range(num_prefill)] + [("d", "decode")]):
        core.on_heartbeat(InstanceInfo(instance_id=iid, role=role, rank=1 + rank, pid=0, started_at=0.0,
                                       updated_at=0.0, kv_blocks_total=10**6, block_size=16))  # fmt: skip
    return core


def _plan(core: SchedulerCore, rid: str, n: int) -> RunPrefill:
    (run,) = [a for a in core.admit(_spec(rid, n), 0.0) if isinstance(a, RunPrefill)]
    return run


def test_gpus_and_the_sp_architecture_follow_the_papers_byte_rule() -> None:
    assert gpus_for(1_000_000, 65_536) == 16 and gpus_for(10, 65_536) == 1
    assert sp_architecture(10_000, 4096, 8, tp=1) == NTP  # no TP: no parameters to gather
    assert sp_architecture(10**6, 4096, 2, tp=8) == TP  # N = 2: SP-TP by the inequality (module docstring)
    # N > 2 with TP: SP-NTP once L > 2 d N / (N - 2): 10,923 tokens for d = 4,096 on 8, 98,304 for 16K on 3
    assert sp_architecture(10_000, 4096, 8, tp=8) == TP and sp_architecture(12_000, 4096, 8, tp=8) == NTP
    assert sp_architecture(90_000, 16_384, 3, tp=8) == TP and sp_architecture(100_000, 16_384, 3, tp=8) == NTP
    with pytest.raises(ValueError, match="must be >= 1"):
        gpus_for(0, 10)


TABLE = QualityTable.from_dict({
    "dense": {"accuracy": 0.95},
    "points": [
        {"sp": 4, "drop": 0.0, "accuracy": 0.95, "mcnemar_p": 1.0},
        {"sp": 4, "drop": 0.1, "accuracy": 0.95, "mcnemar_p": 1.0},
        {"sp": 4, "drop": 0.2, "accuracy": 0.90, "mcnemar_p": 0.5},  # lost a little, not significantly
        {"sp": 4, "drop": 0.3, "accuracy": 0.70, "mcnemar_p": 0.001},
        {"sp": 4, "drop": 0.5, "accuracy": 0.94, "mcnemar_p": 1.0},  # a lucky point after a loss: never reached
        {"sp": 8, "drop": 0.1, "accuracy": 0.50, "mcnemar_p": 0.001},
    ],
})  # fmt: skip


def test_the_drop_ratio_never_goes_past_what_the_measurement_supports() -> None:
    assert TABLE.allowed(4, None, 0.0) == [0.0, 0.1]  # 0.2 lost 0.05: not within a budget of 0
    assert TABLE.allowed(3, None, 0.05) == [0.0, 0.1, 0.2]  # 3 members: the 4-member points stand in
    assert TABLE.allowed(2, None, 0.5) == [0.0, 0.1, 0.2, 0.3, 0.5]
    assert TABLE.allowed(8, None, 0.0) == [0.0]
    assert TABLE.allowed(16, None, 1.0) == [0.0]  # larger than anything measured: no drops
    assert TABLE.allowed(4, 2, 1.0) == [0.0]  # levels never measured
    ttft = {0.0: 10.0, 0.1: 8.0, 0.2: 6.0, 0.3: 5.0, 0.5: 4.0}  # predicted TTFT falls with the ratio

    def predict(levels: int | None, p: float) -> float:
        return ttft[p]

    assert choose(TABLE, 4, 0.0, None, predict) == (None, 0.1)  # the budget alone: the fastest allowed
    assert choose(TABLE, 4, None, None, predict) == (None, 0.0)  # no objective: dense
    # a TTFT objective: the least dropping allowed ratio that meets it; none meets it: the fastest allowed
    assert choose(TABLE, 4, 0.05, 7.0, predict) == (None, 0.2)
    assert choose(TABLE, 4, 0.0, 7.0, predict) == (None, 0.1)
    assert choose(TABLE, 4, None, 12.0, predict) == (None, 0.0)
    # two measured level counts: the search takes the pair that meets the objective with the least dropped
    two = QualityTable(TABLE.points + QualityTable.from_dict({
        "dense": {"accuracy": 0.95}, "levels": 2,
        "points": [{"sp": 4, "drop": 0.3, "accuracy": 0.95, "mcnemar_p": 1.0}],
    }).points)  # fmt: skip
    faster = {(None, 0.0): 10.0, (None, 0.1): 8.0, (2, 0.0): 10.0, (2, 0.3): 6.5}
    assert two.level_options() == [2, None]
    assert choose(two, 4, 0.0, None, lambda lv, p: faster[(lv, p)]) == (2, 0.3)
    assert choose(two, 4, 0.0, 9.0, lambda lv, p: faster[(lv, p)]) == (None, 0.1)
    assert choose(two, 4, 0.0, None, lambda lv, p: faster[(lv, p)], levels=None) == (None, 0.1)


def test_plans_run_all_to_all_with_csa_only_where_asked_and_possible() -> None:
    dense = _plan(_core("csps"), "a", 40_000)
    assert dense.chunks[0].layout == "all-to-all" and dense.chunks[0].sp == 4 and dense.csa_drop == 0.0
    sparse = _plan(_core("csps:drop=0.25"), "a", 40_000)
    assert sparse.csa_drop == 0.25 and sparse.csa_levels == 0 and sparse.attention_kept < 1.0
    two = _plan(_core("csps:drop=0.25,levels=2"), "a", 40_000)
    assert two.csa_levels == 2 and two.attention_kept > sparse.attention_kept  # fewer far levels to drop in
    alone = _plan(_core("csps:drop=0.25", num_prefill=1), "b", 40_000)
    assert alone.chunks[0].sp == 1 and alone.csa_drop == 0.0  # one instance: nothing to drop
    printed = _plan(_core("csps:drop=0.25,level_rule=printed"), "a", 40_000)
    assert printed.csa_rule == "printed" and sparse.csa_rule == "doubling"
    assert sparse.attention_kept < printed.attention_kept < 1.0  # the printed rule drops at level 2 only
    fixed = _plan(_core("csps:spt_tokens=16000"), "c", 20_000)
    assert fixed.chunks[0].sp == 2  # two SPTs' worth of prompt
    for bad, why in (("drop=1.0", "drop must be in"), ("drop=0.2,accuracy_loss=0", "not both"),
                     ("accuracy_loss=2", "share of answers"), ("ttft_s=0", "must be > 0"),
                     ("level_rule=halving", "level_rule must be one of"),
                     ("level_rule=printed,accuracy_loss=0", "give a fixed drop")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            create_strategy(f"csps:{bad}", LATENCY)


def test_accuracy_budget_zero_uses_the_shipped_measurement() -> None:
    shipped = QualityTable.load()
    run = _plan(_core("csps:accuracy_loss=0"), "a", 40_000)
    allowed = {p for lv in shipped.level_options() for p in shipped.allowed(4, lv, 0.0)}
    assert run.csa_drop in allowed


def test_csa_shortens_simulated_prefill_and_keeps_the_invariants() -> None:
    trace = [TraceRequest(i * 2.0, 30_000 + 1000 * i, 8) for i in range(6)]
    config = SimConfig(num_prefill=4, num_decode=1, prefill_kv_blocks=8192, decode_kv_blocks=32768,
                       kv_bytes_per_token=1024, scheduler=SchedulerConfig(max_num_requests=100))  # fmt: skip
    ttft = {}
    for spec in ("csps", "csps:drop=0.3"):
        sim = Simulator(spec, LATENCY, config)
        result = sim.run(trace)
        check_invariants(sim, result)
        assert all(r.state == "finished" for r in result.records)
        ttft[spec] = result.summary().ttft_s.mean
    assert ttft["csps:drop=0.3"] < ttft["csps"]


def _two_nodes(strategy: str) -> SchedulerCore:
    """8 prefill instances, ranks 0-3 on node a and 4-7 on node b, and one decode instance."""
    core = SchedulerCore(create_strategy(strategy, LATENCY), SchedulerConfig())
    for rank in range(8):
        core.on_heartbeat(InstanceInfo(instance_id=f"p{rank}", role="prefill", rank=rank, pid=0, started_at=0.0,
                                       updated_at=0.0, kv_blocks_total=10**6, block_size=16,
                                       node="a" if rank < 4 else "b"))  # fmt: skip
    core.on_heartbeat(InstanceInfo(instance_id="d", role="decode", rank=8, pid=0, started_at=0.0, updated_at=0.0,
                                   kv_blocks_total=10**6, block_size=16, node="b"))  # fmt: skip
    return core


def test_groups_pack_onto_the_fewest_nodes_in_gpu_id_order() -> None:
    """§3.2.4's proximity-aware allocation: with p1 busy, a group of 4 takes node b whole (one node), where the
    first free in rank order (p0, p2, p3, p4) would span both; a group of 8 places its segments node by node."""
    near = _core_busy("csps:max_sp=4", "p1")
    run = _plan(near, "a", 40_000)
    assert run.chunks[0].instances == ("p4", "p5", "p6", "p7")
    far = _core_busy("csps:max_sp=4,first_free=1", "p1")
    assert _plan(far, "a", 40_000).chunks[0].instances == ("p0", "p2", "p3", "p4")
    assert create_strategy("csps:first_free=1", LATENCY).describe() == "csps:max_sp=16,first_free=1"

    from spindle_policy.strategies.csps.placement import node_order, proximity_group

    insts = list(_two_nodes("csps").state.live("prefill"))
    order = node_order(insts)
    mixed = [insts[k] for k in (6, 1, 7, 0, 2, 5)]  # 3 free on a, 3 on b
    assert [i.id for i in proximity_group(mixed, 3, order)] == ["p0", "p1", "p2"]  # one node; the first on ties
    assert [i.id for i in proximity_group(mixed, 4, order)] == ["p0", "p1", "p2", "p5"]  # a's segments first
    assert [i.id for i in proximity_group([insts[k] for k in (0, 4, 5, 6)], 1, order)] == ["p0"]


def _core_busy(strategy: str, busy: str) -> SchedulerCore:
    core = _two_nodes(strategy)
    core.state.plan_work((busy,), "earlier", until=1e6)
    return core
