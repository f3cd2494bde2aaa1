"""`request-sp:grow=C`: chunkwise SP plans whose group grows as instances free up (Tetris CDSP, issue 5)."""

from __future__ import annotations

import itertools

import pytest

from spindle_policy import RunPrefill, SchedulerConfig, SchedulerCore, create_strategy
from spindle_policy.calibration import load_paper_calibration
from spindle_policy.latency import DecodeStepModel, LatencyModel, PrefillLatencyModel, TransferModel
from spindle_policy.strategies.request_sp import RequestSPStrategy
from spindle_policy.strategy import strategy_options
from spindle_protocol.messages import InstanceInfo, Prompt, RequestSpec, Sampling
from spindle_sim import SimConfig, Simulator, simulate
from spindle_sim.invariants import check_invariants
from spindle_sim.workloads import TraceRequest, make_workload

TETRIS = load_paper_calibration()  # Tetris Table 1: Llama-3-8B on A100, SP 1..16
LATENCY = LatencyModel(  # SP s: (0.01, 2e-4/s, 1e-8/s, 1e-8/s), as in test_strategies
    prefill=PrefillLatencyModel({s: (0.01, 2e-4 / s, 1e-8 / s, 1e-8 / s) for s in (1, 2, 4)}),
    decode=DecodeStepModel({(1, 1): (0.005, 1e-4, 1e-7)}),
    transfer=TransferModel(latency_s=0.001, bandwidth_bytes_per_s=1e9),
)


def spec(rid: str, n: int) -> RequestSpec:
    return RequestSpec(
        request_id=rid, prompt=Prompt(num_tokens=n), sampling=Sampling(max_tokens=4), arrival_time=0.0, deadline=1e9
    )


def core_with(strategy: str, num_prefill: int, latency: LatencyModel = TETRIS) -> SchedulerCore:
    core = SchedulerCore(create_strategy(strategy, latency), SchedulerConfig())
    for rank, (iid, role) in enumerate([(f"prefill-{i}", "prefill") for i in range(num_prefill)] + [("d", "decode")]):
        info = InstanceInfo(
            instance_id=iid, role=role, rank=1 + rank, pid=0, started_at=0.0, updated_at=0.0,
            kv_blocks_total=10**6, block_size=16,
        )  # fmt: skip
        core.on_heartbeat(info)
    return core


def busy(core: SchedulerCore, until: dict[str, float]) -> None:
    for iid, t in until.items():
        core.state.plan_work((iid,), f"earlier-{iid}", t)


def plan_of(actions) -> RunPrefill:
    (run,) = [a for a in actions if isinstance(a, RunPrefill)]
    return run


def check_growing(plan: RunPrefill, core: SchedulerCore, ready: dict[str, float], now: float, grow: int) -> float:
    """The plan tiles the prompt, its groups only grow, every chunk but the last is a multiple of `grow` tokens,
    no chunk waits for a member beyond the time it was predicted free, and every member is planned busy until
    the plan's predicted end (which it returns)."""
    chunks = plan.chunks
    assert chunks[0].start == 0 and chunks[-1].end == plan.spec.prompt.num_tokens
    assert all(a.end == b.start for a, b in itertools.pairwise(chunks))
    assert all(set(a.instances) < set(b.instances) for a, b in itertools.pairwise(chunks)), "groups must grow"
    assert all(c.num_tokens % grow == 0 for c in chunks[:-1])
    assert all(c.layout == ("contiguous" if c.sp == 1 else "zigzag") for c in chunks)
    t = now
    for c in chunks:
        t = max(t, *(ready.get(i, now) for i in c.instances)) + TETRIS.prefill.predict(c.sp, c.start, c.num_tokens)
    members = chunks[-1].instances
    assert {iid: core.state.instances[iid].planned[plan.spec.request_id] for iid in members} == {
        iid: pytest.approx(t) for iid in members
    }
    return t


# ---- the option ----


def test_grow_option_is_validated_and_described():
    assert strategy_options("request-sp")["grow"] == 0
    assert create_strategy("request-sp:grow=4096", TETRIS).describe() == "request-sp:max_sp=16,grow=4096"
    assert create_strategy("request-sp", TETRIS).describe() == "request-sp:max_sp=16"
    for bad in ("-1", "1.5", "lots"):
        with pytest.raises(ValueError, match="grow must be a whole number of tokens per chunk"):
            create_strategy(f"request-sp:grow={bad}", TETRIS)
    with pytest.raises(ValueError, match="grow must be"):
        RequestSPStrategy(TETRIS, grow=True)  # type: ignore[arg-type]


def test_grow_off_and_an_idle_pool_keep_the_whole_prompt_plan():
    for strategy in ("request-sp", "request-sp:grow=2048"):
        core = core_with(strategy, 16)
        busy(core, {"prefill-0": 0.4, "prefill-1": 0.9})
        run = plan_of(core.admit(spec("a", 4096), 0.0))  # 14 idle instances: SP 4 at once, nothing to grow into
        assert [(c.start, c.end, c.sp) for c in run.chunks] == [(0, 4096, 4)]
        assert run.chunks[0].instances == ("prefill-2", "prefill-3", "prefill-4", "prefill-5")
    core = core_with("request-sp", 8)
    busy(core, {f"prefill-{k}": 0.5 * k for k in range(8)})
    run = plan_of(core.admit(spec("c", 131_072), 0.0))
    assert len(run.chunks) == 1 and run.chunks[0].sp == 8  # without grow: waits 3.5 s for all eight


# ---- growing plans ----


def test_plan_starts_on_the_free_instances_and_grows_as_others_free():
    ready = {f"prefill-{k}": 0.5 * k for k in range(8)}  # prefill-0 free now, one more every 0.5 s
    core = core_with("request-sp:grow=2048", 8)
    busy(core, ready)
    run = plan_of(core.admit(spec("c", 131_072), 0.0))
    steps = [(0, 6144, 1), (6144, 24576, 2), (24576, 67584, 4), (67584, 131_072, 8)]
    assert [(c.start, c.end, c.sp) for c in run.chunks] == steps
    assert run.chunks[0].instances == ("prefill-0",)
    assert run.chunks[-1].instances == tuple(f"prefill-{k}" for k in range(8))  # newcomers appended in rank order
    finish = check_growing(run, core, ready, 0.0, 2048)
    plain = core_with("request-sp", 8)
    busy(plain, ready)
    plan_of(plain.admit(spec("c", 131_072), 0.0))
    assert finish < plain.state.instances["prefill-0"].planned["c"]  # predicted: 6.18 s vs 7.38 s


def test_newcomers_follow_the_queue_order_and_chunk_sizes_follow_grow():
    ready = {"prefill-3": 0.0, "prefill-1": 0.2, "prefill-2": 0.6, "prefill-0": 0.6, "prefill-4": 5.0}
    firsts = {}
    for grow in (512, 1000, 4096):
        core = core_with(f"request-sp:grow={grow},max_sp=4", 5)
        busy(core, ready)
        run = plan_of(core.admit(spec("r", 50_000), 0.0))
        check_growing(run, core, ready, 0.0, grow)
        assert run.chunks[-1].sp == 4 and "prefill-4" not in run.chunks[-1].instances
        assert run.chunks[-1].instances[-2:] == ("prefill-0", "prefill-2")  # the last to join, in rank order
        firsts[grow] = run.chunks[0]
    # 512 and 1000 tokens on SP 1 fit before prefill-1 frees at 0.2 s; 4096 do not, so the plan starts there
    assert [(c.end, c.instances) for c in firsts.values()] == [
        (2560, ("prefill-3",)),
        (2000, ("prefill-3",)),
        (8192, ("prefill-1", "prefill-3")),
    ]


def test_without_sp_1_the_plan_starts_when_the_smallest_group_is_free():
    latency = LatencyModel(prefill=PrefillLatencyModel({s: TETRIS.prefill.coeffs[s] for s in (2, 4, 8)}))
    ready = {"prefill-0": 0.0, "prefill-1": 0.3, "prefill-2": 1.0, "prefill-3": 1.1}
    core = core_with("request-sp:grow=1024,max_sp=4", 4, latency)
    busy(core, ready)
    run = plan_of(core.admit(spec("r", 100_000), 0.0))
    assert run.chunks[0].sp == 2 and set(run.chunks[0].instances) == {"prefill-0", "prefill-1"}
    assert [c.sp for c in run.chunks] == [2, 4]


def test_a_short_prompt_finishing_before_anyone_frees_stays_on_the_free_instances():
    core = core_with("request-sp:grow=256", 4)
    busy(core, {"prefill-1": 50.0, "prefill-2": 50.0, "prefill-3": 50.0})
    run = plan_of(core.admit(spec("r", 2000), 0.0))
    assert [(c.start, c.end, c.instances) for c in run.chunks] == [(0, 2000, ("prefill-0",))]


# ---- in the simulator ----


def sim_config(num_prefill: int, **kw) -> SimConfig:
    base = dict(
        num_prefill=num_prefill,
        num_decode=2,
        prefill_kv_blocks=4096,
        decode_kv_blocks=4096,
        kv_bytes_per_token=1024,
        scheduler=SchedulerConfig(max_num_requests=10_000),
    )
    return SimConfig(**(base | kw))


def test_a_request_starts_earlier_than_without_grow_when_part_of_the_pool_is_busy():
    # a: SP 2 on prefill-0/1 (both idle) until 1.51 s; b arrives at 0.5 s with only prefill-2 free
    trace = [TraceRequest(0.0, 10_000, 4), TraceRequest(0.5, 10_000, 4)]
    runs = {}
    for strategy in ("request-sp:max_sp=2", "request-sp:max_sp=2,grow=1000"):
        sim = Simulator(strategy, LATENCY, sim_config(3))
        result = sim.run(trace)
        check_invariants(sim, result)
        assert all(r.state == "finished" for r in result.records)
        runs[strategy] = sim, result.records[1]
    plain_sim, plain = runs["request-sp:max_sp=2"]
    grow_sim, grown = runs["request-sp:max_sp=2,grow=1000"]
    first = LATENCY.prefill.predict(2, 0, 10_000)
    assert plain.prefill_start == pytest.approx(first)
    assert [c.sp for c in plain_sim.plans[plain.request_id].chunks] == [2]
    assert grown.prefill_start == 0.5 < plain.prefill_start  # at once, on the free instance
    chunks = grow_sim.plans[grown.request_id].chunks
    assert [(c.start, c.end, c.instances) for c in chunks] == [
        (0, 4000, ("prefill-2",)),
        (4000, 10_000, ("prefill-2", "prefill-0")),
    ]
    # the simulated prefill ends when the plan predicted: the new member joined as soon as it was free
    assert grown.prefill_end == pytest.approx(first + LATENCY.prefill.predict(2, 4000, 6000))
    print(f"\nb's TTFT: request-sp {plain.ttft:.3f} s, grow=1000 {grown.ttft:.3f} s")


def test_simulated_workload_finishes_every_request_with_growing_plans():
    # Tetris Table 1 on 32 prefill instances: groups rarely free in step, so some plans grow
    trace = make_workload("tetris-medium", 200, 3.0, 0)
    strategy = "request-sp:grow=4096"
    config = sim_config(32, num_decode=4, prefill_kv_blocks=32768, decode_kv_blocks=32768)
    sim = Simulator(strategy, TETRIS, config)
    result = sim.run(trace)
    check_invariants(sim, result)
    assert all(r.state == "finished" for r in result.records)
    plans = list(sim.plans.values())
    grown = [p for p in plans if len(p.chunks) > 1]
    assert grown, "no request got a growing plan"
    for p in grown:
        assert all(set(a.instances) < set(b.instances) for a, b in itertools.pairwise(p.chunks))
    assert simulate(trace, strategy, TETRIS, config).records == result.records  # deterministic
    print(f"\n{len(grown)} of {len(plans)} plans grew")


def test_growing_groups_against_plain_request_sp():
    """Every request completes under every variant and only the `grow` variants grow a group; the TTFTs are printed
    (performance is measured by benchmarks, not asserted). Tetris Table 1 on 32 simulated prefill instances."""
    config = sim_config(32, num_decode=4, prefill_kv_blocks=32768, decode_kv_blocks=32768)
    print()
    for rate in (1.0, 3.0, 5.0):
        trace = make_workload("tetris-medium", 300, rate, 0)
        for strategy in ("request-sp", "request-sp:grow=4096", "request-sp:grow=16384"):
            sim = Simulator(strategy, TETRIS, config)
            result = sim.run(trace)
            check_invariants(sim, result)
            s = result.summary().ttft_s
            grew = sum(len(p.chunks) > 1 for p in sim.plans.values())
            assert len(result.records) == 300 and all(r.state == "finished" for r in result.records)
            assert (grew > 0) == ("grow" in strategy) or rate < 5.0, (strategy, rate, grew)
            print(
                f"tetris-medium {rate:g} req/s {strategy:24s} TTFT p50 {s.p50:.2f} p90 {s.p90:.2f} "
                f"p99 {s.p99:.2f} mean {s.mean:.2f} s; {grew} growing plans"
            )
