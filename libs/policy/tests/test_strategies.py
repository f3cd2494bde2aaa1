"""Baseline strategies (fixed-sp, request-sp, chunked) through the core and the simulator; strategy specs."""

import msgspec
import pytest

from spindle_policy import Admit, FailRequest, Reject, RunPrefill, SchedulerConfig, SchedulerCore, create_strategy
from spindle_policy.actions import PrefillChunk
from spindle_policy.calibration import load_paper_calibration
from spindle_policy.latency import DecodeStepModel, LatencyModel, PrefillLatencyModel, TransferModel
from spindle_policy.strategies.single import SingleInstanceStrategy
from spindle_policy.strategy import Strategy, parse_strategy_spec, strategy_options
from spindle_protocol.messages import InstanceInfo, Prompt, RequestSpec, Sampling
from spindle_sim import SimConfig, Simulator, simulate
from spindle_sim.invariants import check_invariants
from spindle_sim.workloads import TraceRequest, make_workload

TETRIS = load_paper_calibration()  # Tetris Table 1: Llama-3-8B on A100, SP 1..16
LATENCY = LatencyModel(
    prefill=PrefillLatencyModel({s: (0.01, 2e-4 / s, 1e-8 / s, 1e-8 / s) for s in (1, 2, 4)}),
    decode=DecodeStepModel({(1, 1): (0.005, 1e-4, 1e-7), (2, 1): (0.004, 6e-5, 6e-8)}),
    transfer=TransferModel(latency_s=0.001, bandwidth_bytes_per_s=1e9),
)


def spec(rid: str, n: int, max_tokens: int = 10) -> RequestSpec:
    return RequestSpec(
        request_id=rid,
        prompt=Prompt(num_tokens=n),
        sampling=Sampling(max_tokens=max_tokens),
        arrival_time=0.0,
        deadline=1e9,
    )


def instance(iid: str, role: str, rank: int, blocks: int = 10**6, now: float = 0.0) -> InstanceInfo:
    return InstanceInfo(
        instance_id=iid,
        role=role,
        rank=rank,
        pid=0,
        started_at=0.0,
        updated_at=now,
        kv_blocks_total=blocks,
        block_size=16,
    )


def core_with(strategy: str, num_prefill: int, latency: LatencyModel = TETRIS, now: float = 0.0) -> SchedulerCore:
    core = SchedulerCore(create_strategy(strategy, latency), SchedulerConfig())
    for i in range(num_prefill):
        core.on_heartbeat(instance(f"prefill-{i}", "prefill", 1 + i, now=now))
    core.on_heartbeat(instance("decode-0", "decode", 1 + num_prefill, now=now))
    return core


def plan_of(actions) -> RunPrefill:
    (run,) = [a for a in actions if isinstance(a, RunPrefill)]
    return run


def small_config(**kw) -> SimConfig:
    base = dict(
        num_prefill=8,
        num_decode=2,
        block_size=16,
        prefill_kv_blocks=1024,
        decode_kv_blocks=512,
        kv_bytes_per_token=1024,
        scheduler=SchedulerConfig(max_num_requests=10_000),
    )
    return SimConfig(**(base | kw))


# ---- specs and the registry ----


def test_strategy_specs():
    assert parse_strategy_spec("fixed-sp:sp=8,layout=stripe") == ("fixed-sp", {"sp": 8, "layout": "stripe"})
    with pytest.raises(ValueError, match="unknown layout 'striped'"):
        create_strategy("request-sp:layout=striped", TETRIS)
    assert parse_strategy_spec(" single ") == ("single", {})
    assert strategy_options("fixed-sp") == {
        "sp": 8,
        "layout": "zigzag",
        "preempt_after_s": 0.0,
        "move_parked_after_s": 0.0,
        "kvp_tokens": 0,
        "kvp_merge_tokens": 0,
    }
    assert create_strategy("single:preempt_after_s=1.5").describe() == "single:preempt_after_s=1.5"
    assert create_strategy("fixed-sp:sp=4", TETRIS).describe() == "fixed-sp:sp=4"
    assert create_strategy("chunked:chunk-size=256").describe() == "chunked:chunk_size=256"
    with pytest.raises(ValueError, match="no option bogus"):
        create_strategy("fixed-sp:bogus=1", TETRIS)
    with pytest.raises(ValueError, match="not key=value"):
        create_strategy("fixed-sp:8", TETRIS)
    with pytest.raises(ValueError, match="needs a latency model"):
        create_strategy("request-sp")
    with pytest.raises(ValueError, match="sp=3 has no prefill latency model"):
        create_strategy("fixed-sp:sp=3", TETRIS)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        create_strategy("chunked:chunk_size=0")


# ---- placement decisions in the core ----


def test_fixed_sp_groups_and_least_delay():
    core = core_with("fixed-sp:sp=4", num_prefill=10)  # 2 groups of 4; prefill-8 and -9 stay idle
    groups = [plan_of(core.admit(spec(f"r{i}", 32_000), 0.0)).chunks[0].instances for i in range(4)]
    first, second = tuple(f"prefill-{i}" for i in range(4)), tuple(f"prefill-{i}" for i in range(4, 8))
    assert groups == [first, second, first, second]  # each goes to the group that frees up first
    inst = core.state.instances
    assert inst["prefill-0"].busy_until(0.0) == pytest.approx(2 * TETRIS.prefill.predict(4, 0, 32_000))
    assert not inst["prefill-8"].planned and not inst["prefill-9"].planned
    run = plan_of(core.admit(spec("short", 4000), 0.0))
    assert run.chunks == (PrefillChunk(0, 4000, first, "zigzag"),)
    assert core.state.requests["short"].prefill_instances == first
    core.on_abort("r0")  # the core forgets the prediction of work that will not run
    assert "r0" not in inst["prefill-0"].planned


def test_request_sp_picks_fastest_size_given_queues():
    core = core_with("request-sp", num_prefill=16)
    # idle cluster: Tetris Table 1 optimum per length (4k: SP4, 128k: SP16)
    assert plan_of(core.admit(spec("a", 4096), 0.0)).chunks[0].sp == 4
    big = plan_of(core.admit(spec("b", 131_072), 0.0))
    assert big.chunks[0].sp == 16  # waits for the SP4 group: 0.13 s + 2.31 s beats SP8 on the 12 idle ones
    assert set(big.chunks[0].instances) == {f"prefill-{i}" for i in range(16)}
    # everything busy until ~2.4 s: the next request still takes the size that finishes first
    c = plan_of(core.admit(spec("c", 8192), 0.0))
    assert c.chunks[0].sp in (2, 4, 8)
    with pytest.raises(ValueError, match="no SP size"):
        create_strategy("request-sp:max_sp=0", TETRIS)


def test_chunked_plans_fixed_chunks_on_elastic_instances():
    core = SchedulerCore(create_strategy("chunked:chunk_size=300"), SchedulerConfig())
    for i in range(2):
        core.on_heartbeat(instance(f"elastic-{i}", "elastic", 1 + i, blocks=1000))
    actions = core.admit(spec("a", 700), 0.0)
    assert actions[0] == Admit("a", ("elastic-0",), "elastic-0")
    assert [(c.start, c.end) for c in plan_of(actions).chunks] == [(0, 300), (300, 600), (600, 700)]
    assert plan_of(actions).is_colocated and not plan_of(actions).is_single
    assert plan_of(core.admit(spec("b", 10), 0.0)).decode_instance == "elastic-1"  # fewer queued tokens


def test_colocated_plans_take_prompt_logprobs_and_sp_plans_do_not():
    core = SchedulerCore(create_strategy("chunked:chunk_size=300"), SchedulerConfig())
    core.on_heartbeat(instance("elastic-0", "elastic", 1, blocks=1000))
    asked = spec("a", 700)
    asked = msgspec.structs.replace(asked, sampling=msgspec.structs.replace(asked.sampling, prompt_logprobs=1))
    assert isinstance(core.admit(asked, 0.0)[0], Admit)
    sp = core_with("fixed-sp:sp=2", num_prefill=2)
    assert isinstance(sp.admit(msgspec.structs.replace(asked, request_id="b"), 0.0)[0], Reject)


# ---- the simulator running them ----


@pytest.mark.parametrize(
    "strategy", ["fixed-sp:sp=2", "fixed-sp:sp=4", "request-sp:max_sp=4", "chunked:chunk_size=256"]
)
def test_simulated_invariants(strategy):
    trace = make_workload("loongserve-sharegpt", 300, 30.0, 3)
    config = small_config(num_prefill=0, num_decode=0, num_colocated=3) if strategy.startswith("chunked") else None
    sim = Simulator(strategy, LATENCY, config or small_config())
    result = sim.run(trace)
    check_invariants(sim, result)
    assert all(r.state == "finished" for r in result.records)
    again = simulate(trace, strategy, LATENCY, config or small_config())
    assert again.records == result.records  # deterministic


def test_sp_group_runs_together_and_splits_kv():
    reqs = [TraceRequest(0.0, 1001, 4), TraceRequest(0.0, 50, 4)]
    sim = Simulator("fixed-sp:sp=4", LATENCY, small_config(num_prefill=4))
    result = sim.run(reqs)
    check_invariants(sim, result)
    big, small = result.records
    assert big.prefill_instances == tuple(f"prefill-{i}" for i in range(4)) and big.max_sp == 4
    assert big.prefill_end - big.prefill_start == pytest.approx(LATENCY.prefill.predict(4, 0, 1001))
    assert small.prefill_start == big.prefill_end  # the whole group is busy until the chunk ends
    spans = {tuple(sim.instances[f"prefill-{i}"].busy_spans) for i in range(4)}
    assert len(spans) == 1  # every member ran the same chunks at the same times
    # each member held its quarter of the prompt (251 or 250 tokens: 16 blocks) and, while that was still
    # being transferred out, its quarter of the next one (13 tokens: 1 block)
    assert {sim.instances[f"prefill-{i}"].peak_blocks for i in range(4)} == {17}


def test_multi_chunk_plan_grows_its_group():
    """A Tetris-shaped plan: the first chunk on one instance, the rest on a group of two (history counted)."""

    class Growing(SingleInstanceStrategy):
        def plan(self, spec, state, now):
            n = spec.prompt.num_tokens
            chunks = (PrefillChunk(0, n // 2, ("prefill-0",)), PrefillChunk(n // 2, n, ("prefill-1", "prefill-2")))
            return [
                Admit(spec.request_id, ("prefill-0", "prefill-1", "prefill-2"), "decode-0"),
                RunPrefill(spec, chunks, "decode-0"),
            ]

    sim = Simulator(Growing(), LATENCY, small_config(num_prefill=3))
    result = sim.run([TraceRequest(0.0, 2000, 3), TraceRequest(0.0, 2000, 3)])
    check_invariants(sim, result)
    a, b = result.records
    first = LATENCY.prefill.predict(1, 0, 1000)
    second = LATENCY.prefill.predict(2, 1000, 1000)
    assert a.prefill_end - a.prefill_start == pytest.approx(first + second)
    assert b.prefill_start == pytest.approx(first)  # b's first chunk runs while a's second chunk does
    assert b.prefill_end == pytest.approx(2 * first + second)


def test_chunked_mixes_prefill_into_decode_steps():
    reqs = [TraceRequest(0.0, 100, 50), TraceRequest(0.05, 4000, 5)]
    config = small_config(num_prefill=0, num_decode=0, num_colocated=1)
    sim = Simulator("chunked:chunk_size=1000", LATENCY, config)
    result = sim.run(reqs)
    check_invariants(sim, result)
    short, long = result.records
    gaps = [b - a for a, b in zip(short.token_times, short.token_times[1:], strict=False)]
    plain = LATENCY.decode.predict(1, 101)
    assert min(gaps) == pytest.approx(plain, rel=0.05)
    assert max(gaps) > plain + LATENCY.prefill.predict(1, 0, 1000) * 0.9  # steps that carried a chunk
    # the 4000-token prompt took 5 mixed steps: the budget of 1000 counts the running decode, 999 prompt tokens each
    assert sum(g > 2 * plain for g in gaps) == 5
    assert long.transfer_end == long.prefill_end  # no KV transfer on a colocated instance


def test_failures_free_sp_and_colocated_work():
    class Failing(Strategy):
        """Wraps a strategy and fails every third request right after placing it."""

        def __init__(self, inner: Strategy) -> None:
            super().__init__()
            self.inner = inner

        def plan(self, spec, state, now):
            actions = self.inner.plan(spec, state, now)
            if int(spec.request_id.split("-")[1]) % 3 == 0:
                actions.append(FailRequest(spec.request_id, 503, "injected"))
            return actions

    trace = make_workload("loongserve-sharegpt", 90, 30.0, 5)
    for base, config in [
        ("fixed-sp:sp=4", small_config()),
        ("request-sp:max_sp=4", small_config()),
        ("chunked", small_config(num_prefill=0, num_colocated=2)),
    ]:
        sim = Simulator(Failing(create_strategy(base, LATENCY)), LATENCY, config)
        result = sim.run(trace)
        check_invariants(sim, result)
        assert [r.state == "failed" for r in result.records] == [i % 3 == 0 for i in range(90)]


def test_tetris_section_7_2_ordering():
    """Tetris §7.2 qualitatively, on 32 simulated A100 prefill instances at a loaded rate: fixed SP=16 has the
    worst TTFT, fixed SP=8 the best, request-level SP in between."""
    trace = make_workload("tetris-medium", 300, 5.0, 0)
    config = SimConfig(num_prefill=32, num_decode=4, scheduler=SchedulerConfig(max_num_requests=10_000))
    p50 = {
        s: simulate(trace, s, TETRIS, config).summary().ttft_s.p50
        for s in ("fixed-sp:sp=16", "fixed-sp:sp=8", "request-sp")
    }
    assert p50["fixed-sp:sp=16"] > p50["request-sp"] > p50["fixed-sp:sp=8"], p50


def test_core_tracks_chunk_progress_and_kv_location():
    from spindle_policy.state import Phase
    from spindle_protocol.messages import DecodeStarted, PrefillDone, PrefillProgress

    class TwoChunks(SingleInstanceStrategy):
        def plan(self, spec, state, now):
            chunks = (PrefillChunk(0, 600, ("prefill-0",)), PrefillChunk(600, 1000, ("prefill-0", "prefill-1")))
            return [
                Admit(spec.request_id, ("prefill-0", "prefill-1"), "decode-0"),
                RunPrefill(spec, chunks, "decode-0"),
            ]

    core = core_with("single", num_prefill=2)
    core.strategy = TwoChunks()
    core.admit(spec("r", 1000), 0.0)
    req = core.state.requests["r"]
    assert req.kv_location() == []
    core.on_event(
        PrefillProgress(request_id="r", instance_id="prefill-0", tokens_done=600, tokens_total=1000, chunk_seconds=0.1),
        0.1,
    )
    assert req.kv_location() == [(0, 600, ("prefill-0",))]
    core.on_event(PrefillDone(request_id="r", instance_id="prefill-0", seconds=0.2, finished=False), 0.2)
    assert req.phase is Phase.TRANSFER
    assert req.kv_location() == [(0, 600, ("prefill-0",)), (600, 1000, ("prefill-0", "prefill-1"))]
    core.on_event(DecodeStarted(request_id="r", instance_id="decode-0"), 0.3)
    assert req.kv_location() == [(0, 1000, ("decode-0",))]


def test_prompt_logprobs_need_a_single_instance_prefill():
    import msgspec

    from spindle_policy.actions import Reject
    from spindle_policy.testing import request_spec

    spec = request_spec("r", 2000, 8)
    asked = msgspec.structs.replace(spec, sampling=msgspec.structs.replace(spec.sampling, prompt_logprobs=1))
    sp = core_with("fixed-sp:sp=2", 2)
    (reject,) = sp.admit(asked, 0.0)
    assert isinstance(reject, Reject) and reject.status == 400 and "prompt logprobs" in reject.reason
    assert not sp.state.requests and all(not i.planned for i in sp.state.instances.values())
    assert any(isinstance(a, RunPrefill) for a in core_with("single", 2).admit(asked, 0.0))


def test_stack_traits_are_what_the_launcher_reads_of_a_strategy() -> None:
    from spindle_policy.strategy import StackTraits, stack_traits

    assert stack_traits("no-such-strategy") == StackTraits()
    split = stack_traits("tetris")
    assert not split.colocated and split.needs_latency and not split.reshards
    loong = stack_traits("loongserve")
    assert loong.colocated and loong.per_iteration and loong.spreads_kv and loong.needs_latency
    assert stack_traits("medha").spreads_kv and not stack_traits("medha:kvp=1").spreads_kv
    assert stack_traits("chunked").keeps_kv_in_place and not stack_traits("chunked").spreads_kv
    assert stack_traits("seesaw").reshards and stack_traits("seesaw").colocated
    assert not stack_traits("single").colocated and stack_traits("single").stack_gap == ""
