"""Medha (issue 23): the mixed-batch predictor, ILRS order, adaptive chunks and prefill-prefill batching, the
replica scheduler through the core, and the strategy in the simulator at paper scale with every invariant."""

from __future__ import annotations

import pytest

from spindle_policy import SchedulerConfig, SchedulerCore, create_strategy
from spindle_policy.actions import RunBatch
from spindle_policy.latency import DecodeStepModel, LatencyModel, PrefillLatencyModel
from spindle_policy.mixed_batch import MixedBatchModel, MixedFit
from spindle_policy.strategies.medha.packing import PackLimits, pack
from spindle_policy.strategies.medha.slack import Prefilling, priority, relative_slack
from spindle_policy.testing import instance_info, request_spec
from spindle_protocol.messages import IterationDone, RequestFinished
from spindle_sim import Simulator
from spindle_sim.invariants import check_invariants
from spindle_sim.named_cluster import ClusterSpec, named_cluster
from spindle_sim.workloads import make_workload

# 10 ms fixed, 0.1 ms per token, attention 2e-10 per (history x chunk) token pair, 1e-10 per chunk token squared
FIT = MixedFit((1.0, 1e6), (0.01 + 1e-4, 0.01 + 1e-4 * 1e6), 2e-10, 1e-10, 1e-8)
MODEL = MixedBatchModel({1: FIT})


def latency() -> LatencyModel:
    prefill = PrefillLatencyModel({1: (0.01, 1e-4, 2e-10, 1e-10)})
    decode = DecodeStepModel({(1, 1): (0.01, 1e-4, 1e-8)})
    return LatencyModel(prefill=prefill, decode=decode, mixed=MODEL)


def medha_core(n: int = 2, blocks: int = 1000, spec: str = "medha:tpot_slo=0.1") -> SchedulerCore:
    core = SchedulerCore(create_strategy(spec, latency()), SchedulerConfig())
    for k in range(n):
        core.on_heartbeat(instance_info(f"e{k}", "elastic", k, total=blocks, max_model_len=10**6))
    return core


def batches(actions: list) -> list[RunBatch]:  # type: ignore[type-arg]
    return [a for a in actions if isinstance(a, RunBatch)]


def done(core: SchedulerCore, b: RunBatch, now: float) -> list[RunBatch]:
    return batches(core.on_event(IterationDone(instance_id=b.instances[0], batch_id=b.batch_id, seconds=0.1), now))


# ---- the predictor ----


def test_mixed_batch_model_adds_dense_attention_and_decode_terms() -> None:
    t = MODEL.predict(1, [(1000, 200), (0, 50)], num_decodes=4, decode_kv=8000)
    want = 0.01 + 1e-4 * 254 + 2e-10 * 1000 * 200 + 1e-10 * (200**2 + 50**2) + 1e-8 * 8000
    assert t == pytest.approx(want)
    assert MODEL.predict(1, ()) == 0.0
    n = MODEL.largest_chunk(1, history=50_000, limit=10_000, budget_s=0.05, num_decodes=4, decode_kv=8000)
    assert MODEL.predict(1, [(50_000, n)], 4, 8000) <= 0.05 < MODEL.predict(1, [(50_000, n + 1)], 4, 8000)
    later = MODEL.largest_chunk(1, history=500_000, limit=10_000, budget_s=0.05, num_decodes=4, decode_kv=8000)
    assert later < n  # adaptive chunking: the same budget buys fewer tokens as the history grows
    assert MODEL.largest_chunk(1, 0, 10, budget_s=0.001) == 0


def test_mixed_batch_model_round_trips_through_the_latency_json() -> None:
    back = LatencyModel.from_json(latency().to_json())
    assert back.mixed == MODEL
    with pytest.raises(ValueError, match="ascend"):
        MixedFit((4.0, 2.0), (1.0, 2.0), 0, 0, 0)


def test_a_tp_the_fitted_mixed_model_lacks_is_built_from_eq1() -> None:
    """A 2D pipeline's stages run at a TP its profile did not measure: the predictor there comes from Eq. 1 (and the
    decode step when the profile has it at that TP), the fitted TP keeps its fit."""
    model = latency().mixed_model({1, 2})
    assert model.fits[1] is FIT and set(model.fits) == {1, 2}
    assert model.predict(2, [(0, 1000)]) == pytest.approx(0.01 + 1e-4 * 1000 + 1e-10 * 1000**2)


def test_cost_model_fit_of_the_mixed_step_is_within_a_few_percent() -> None:
    setup = named_cluster(ClusterSpec("a100-80g", model="llama3-8b", nodes=2, decode_tp=8), True, elastic=True)
    mixed = setup.latency.mixed
    assert mixed is not None and 8 in mixed.fits
    assert mixed.errors[8] < 0.05, mixed.errors  # measured 1.5 %


# ---- ordering and packing ----


def test_ilrs_puts_the_request_closest_to_its_deadline_first_and_edf_fcfs_differ() -> None:
    long = Prefilling(request_spec("long", prompt=100_000, out=4), arrived=0.0, deadline_s=100.0)
    short = Prefilling(request_spec("short", prompt=500, out=4), arrived=40.0, deadline_s=2.0)
    remaining = {"long": 30.0, "short": 0.06}
    now = 41.0
    slack = {p.rid: relative_slack(p, now, remaining[p.rid]) for p in (long, short)}
    assert slack["long"] == pytest.approx((100 - 41 - 30) / 100) and slack["short"] == pytest.approx(0.47)

    def order(policy: str) -> list[str]:
        return [p.rid for p in sorted((long, short), key=lambda p: priority(policy, p, now, remaining[p.rid]))]

    assert order("ilrs") == ["long", "short"]  # 29 % of its deadline left against 47 %
    assert order("edf") == ["short", "long"]  # 42 s against 100 s
    assert order("fcfs") == ["long", "short"]


def test_adaptive_chunks_shrink_with_history_and_never_go_below_the_minimum() -> None:
    limits = PackLimits(target_s=0.05, min_chunk=64, max_chunk=8192, max_share=0.0, max_prefills=8)
    p = Prefilling(request_spec("a", prompt=4_000_000, out=1), 0.0, 100.0)
    sizes = []
    for history in (0, 50_000, 200_000, 3_999_000):
        p.done = history
        ((_, n),) = pack(MODEL, 1, [p], 8, 8 * 4096, limits, lambda q: 0.0)
        sizes.append(n)
    assert sizes[0] > sizes[1] > sizes[2] >= 64 and sizes[3] == 64  # the floor, even past the target
    assert MODEL.predict(1, [(200_000, sizes[2])], 8, 8 * 4096) <= 0.05


def test_prefill_prefill_batching_lets_short_requests_share_while_the_long_one_has_slack() -> None:
    long = Prefilling(request_spec("long", prompt=400_000, out=1), 0.0, 100.0, done=100_000)
    short = Prefilling(request_spec("short", prompt=300, out=1), 1.0, 2.0)
    alone = PackLimits(target_s=0.1, min_chunk=32, max_chunk=8192, max_share=0.0, max_prefills=8)
    shared = PackLimits(target_s=0.1, min_chunk=32, max_chunk=8192, max_share=0.5, max_prefills=8)
    (only,) = pack(MODEL, 1, [long, short], 0, 0, alone, lambda q: 1.0)
    assert only[0] is long  # without space sharing the head takes the iteration
    both = pack(MODEL, 1, [long, short], 0, 0, shared, lambda q: 1.0)
    assert [p.rid for p, _ in both] == ["long", "short"] and both[1][1] == 300  # the short prompt whole
    assert both[0][1] < only[1]
    assert MODEL.predict(1, [(p.done, n) for p, n in both]) <= 0.1 + 1e-12
    late = pack(MODEL, 1, [long, short], 0, 0, shared, lambda q: 0.0)  # the long one is out of slack: it takes all
    assert late[0][1] == only[1]


# ---- the strategy through the core ----


def test_replicas_run_decodes_every_iteration_and_short_prompts_overtake_a_long_one() -> None:
    core = medha_core(n=1, blocks=40_000)
    (b1,) = batches(core.admit(request_spec("long", prompt=200_000, out=2), 0.0))
    assert [p.request_id for p in b1.prefills] == ["long"] and b1.prefills[0].start == 0
    assert not batches(core.admit(request_spec("short", prompt=200, out=3), 0.05))  # the replica is busy
    (b2,) = done(core, b1, 0.1)
    ids = [p.request_id for p in b2.prefills]
    assert "short" in ids and b2.prefills[ids.index("long")].start == b1.prefills[0].end  # the next chunk
    (b3,) = done(core, b2, 0.2)
    assert [d.request_id for d in b3.decodes] == ["short"] and b3.prefills[0].request_id == "long"
    core.on_event(RequestFinished(request_id="short", instance_id="e0", finish_reason="length",
                                  num_output_tokens=3), 0.25)  # fmt: skip
    (b4,) = done(core, b3, 0.3)
    assert not b4.decodes  # a finished request leaves the decode batch


def test_kvp_load_balancer_spreads_by_pending_work_and_waits_for_room() -> None:
    core = medha_core(n=2, blocks=100)  # 1,600 KV tokens per replica
    a = batches(core.admit(request_spec("a", prompt=1000, out=100), 0.0))
    b = batches(core.admit(request_spec("b", prompt=1000, out=100), 0.0))
    assert {a[0].instances, b[0].instances} == {("e0",), ("e1",)}
    assert not batches(core.admit(request_spec("c", prompt=1000, out=100), 0.0))  # no room: it waits
    assert core.admit(request_spec("d", prompt=3300, out=10), 0.0)[0].status == 400  # type: ignore[attr-defined]
    strategy = core.strategy
    assert strategy.replicas["e0"].reserved["a"] == 1104  # 1,100 tokens reserve whole blocks of 16 (69)
    assert [p.rid for p in strategy.waiting] == ["c"]
    core.admit(request_spec("e", prompt=400, out=97), 0.0)  # 497 tokens need 32 blocks: 31 are free on each
    assert [p.rid for p in strategy.waiting] == ["c", "e"]


@pytest.mark.parametrize("spec", ["medha", "medha:policy=lrs", "medha:policy=edf", "medha:policy=fcfs"])
def test_paper_cluster_keeps_every_invariant(spec: str) -> None:
    setup = named_cluster(ClusterSpec("a100-80g", model="llama3-8b", nodes=2, decode_tp=8), True, elastic=True)
    trace = make_workload("medha-mix:0.05", 120, 1.0, seed=2)
    sim = Simulator(spec, setup.latency, setup.config)
    result = sim.run(trace)
    check_invariants(sim, result)
    summary = result.summary("medha-mix")
    assert summary.completed + summary.rejected == 120 and summary.failed == 0


def test_a_sequence_pipeline_replica_overlaps_a_prompts_chunks_and_waits_for_the_ones_that_sample() -> None:
    """SPP in the simulator: one prompt alone on a 2-stage replica takes about half the iterations' full-pass time
    (chunk i+1 in stage 0 while chunk i is in stage 1); a replica that must sample every iteration (decodes beside
    the prompt) gains nothing."""
    from dataclasses import replace

    from spindle_sim import SimConfig
    from spindle_sim.workloads import TraceRequest

    def ttft(spp: int, trace: list[TraceRequest], spec: str = "medha:tpot_slo=0.1") -> list[float]:
        config = SimConfig(num_prefill=0, num_decode=0, num_colocated=1, colocated_spp=spp, decode_kv_blocks=40_000)
        sim = Simulator(spec, latency(), replace(config, max_model_len=600_000))
        result = sim.run(trace)
        check_invariants(sim, result)
        return [r.ttft for r in sorted(result.records, key=lambda r: r.arrived_at)]

    alone = [TraceRequest(0.0, 100_000, 2)]
    (one,), (two,) = ttft(1, alone), ttft(2, alone)
    assert 0.45 < two / one < 0.6, (one, two)
    # a short request decoding through the long prefill: every iteration samples, so none overlaps
    beside = [TraceRequest(0.0, 50, 4000), TraceRequest(0.01, 100_000, 2)]
    assert 0.95 < ttft(2, beside)[1] / ttft(1, beside)[1] < 1.05
    # spp_overlap: the decode takes every other iteration, so the prompt's chunks overlap again
    overlapped = ttft(2, beside, "medha:tpot_slo=0.1,spp_overlap=1")[1] / ttft(1, beside)[1]
    assert overlapped < 0.75, overlapped

    with pytest.raises(ValueError, match="spp_overlap must be 0 or 1"):
        create_strategy("medha:spp_overlap=2", latency())


def test_kvp_spans_place_a_request_no_replica_holds_over_several() -> None:
    from spindle_policy.strategies.medha.kvp import Room, Span, place

    rooms = [Room("a", 1600, 16, 0.0), Room("b", 800, 16, 1.0), Room("c", 1600, 16, 2.0)]
    assert place(rooms, 1000, 100, 0, 0) == [Span("a", 0, 1000, 1104)]  # one replica when one can
    # 3000 + 10 tokens: a's 1,600, b's 800, the rest (600 prompt + 10 decoded) on c, which masters the decodes
    assert place(rooms, 3000, 10, 0, 0) == [Span("a", 0, 1600, 1600), Span("b", 1600, 2400, 800),
                                            Span("c", 2400, 3000, 624)]  # fmt: skip
    assert place(rooms, 3000, 10, 2, 0) is None  # at most two replicas
    assert place(rooms, 1000, 100, 1, 0) == [Span("a", 0, 1000, 1104)]
    # kvp_tokens: at most 500 tokens of one request on one replica, so 1,100 take three
    spans = place(rooms, 1000, 100, 0, 500)
    assert spans is not None and [(s.id, s.start, s.end) for s in spans] == [("a", 0, 500), ("b", 500, 999),
                                                                            ("c", 999, 1000)]  # fmt: skip
    # the last replica keeps at least one prompt token: it computes the last chunk and samples the first token
    assert place([Room("a", 1600, 16, 0.0), Room("b", 64, 16, 1.0)], 1600, 10, 0, 0) == [
        Span("a", 0, 1599, 1600), Span("b", 1599, 1600, 16)]  # fmt: skip


def test_a_request_larger_than_a_replica_spans_two_and_decodes_on_the_second() -> None:
    """KVP in the simulator: a 30,000-token prompt on replicas of 20,000 tokens: its first chunks fill one, the next
    run on the other as a group iteration (each member masters its own work), it decodes there, every short request
    still finishes, and every block comes back."""
    from dataclasses import replace

    from spindle_sim import SimConfig
    from spindle_sim.workloads import TraceRequest

    config = SimConfig(num_prefill=0, num_decode=0, num_colocated=2, decode_kv_blocks=1250)  # 20,000 tokens each
    trace = [TraceRequest(0.0, 30_000, 8)] + [TraceRequest(0.05 * i, 300, 20) for i in range(1, 30)]
    sim = Simulator("medha:tpot_slo=0.1", latency(), replace(config, max_model_len=60_000))
    result = sim.run(trace)
    check_invariants(sim, result)
    summary = result.summary("kvp")
    assert summary.completed == 30 and summary.failed == 0 and summary.rejected == 0
    big = next(r for r in result.records if r.num_prefill_tokens == 30_000)
    assert len(big.prefill_instances) == 2 and big.decode_instance == big.prefill_instances[1]
    assert len(big.token_times) == 8
    # with kvp=1 it is refused (400): no one replica holds it
    one = Simulator("medha:tpot_slo=0.1,kvp=1", latency(), replace(config, max_model_len=60_000)).run(trace)
    assert one.summary("kvp").rejected == 1


def test_short_requests_pass_one_waiting_for_kv_within_the_backfill_share() -> None:
    core = medha_core(n=1, blocks=100)  # 1,600 KV tokens; the bypass share is 1/8: 200
    core.admit(request_spec("a", prompt=1000, out=100), 0.0)
    core.admit(request_spec("b", prompt=1000, out=100), 0.0)  # 1,104 do not fit beside a: b waits
    strategy = core.strategy
    for rid, prompt in (("c", 50), ("d", 100), ("e", 50)):
        core.admit(request_spec(rid, prompt=prompt, out=10), 0.0)
    assert [p.rid for p in strategy.waiting] == ["b", "e"]  # c (64 tokens) and d (128) passed b; e would exceed 200
    assert strategy.bypassers == {"c", "d"}
    strict = medha_core(n=1, blocks=100, spec="medha:tpot_slo=0.1,backfill=0")
    for rid, prompt, out in (("a", 1000, 100), ("b", 1000, 100), ("c", 50, 10)):
        strict.admit(request_spec(rid, prompt=prompt, out=out), 0.0)
    assert [p.rid for p in strict.strategy.waiting] == ["b", "c"]
    with pytest.raises(ValueError, match="backfill must be in"):
        create_strategy("medha:backfill=1", latency())
