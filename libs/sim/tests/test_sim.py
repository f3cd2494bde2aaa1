"""The discrete-event simulator: the real core + `single` strategy on simulated instances; invariants."""

import json
import math

import pytest

from spindle_policy import FailRequest, SchedulerConfig
from spindle_policy.calibration import load_paper_calibration
from spindle_policy.latency import DecodeStepModel, LatencyModel, PrefillLatencyModel, TransferModel
from spindle_policy.strategies.single import SingleInstanceStrategy
from spindle_sim import SimConfig, Simulator, simulate, summarize
from spindle_sim.events import EventKind, EventQueue
from spindle_sim.invariants import check_invariants
from spindle_sim.workloads import TraceRequest, make_workload

LATENCY = LatencyModel(
    prefill=PrefillLatencyModel({1: (0.01, 2e-4, 0.0, 1e-8)}),
    decode=DecodeStepModel({(1, 1): (0.005, 1e-4, 1e-7)}),
    transfer=TransferModel(latency_s=0.001, bandwidth_bytes_per_s=1e9),
)


def small_config(**kw) -> SimConfig:
    base = dict(
        num_prefill=4,
        num_decode=2,
        block_size=16,
        prefill_kv_blocks=512,
        decode_kv_blocks=256,
        kv_bytes_per_token=1024,
        scheduler=SchedulerConfig(max_num_requests=10_000),
    )
    return SimConfig(**(base | kw))


def trace(n: int = 300, rate: float = 40.0, seed: int = 1) -> list[TraceRequest]:
    return make_workload("loongserve-sharegpt", n, rate, seed)


def test_invariants_with_kv_pressure():
    sim = Simulator("single", LATENCY, small_config())
    result = sim.run(trace())
    check_invariants(sim, result)
    assert all(r.state == "finished" for r in result.records)
    assert sim.core.state.requests == {}  # the core saw every request end
    parked = [r for r in result.records if r.decode_start is not None and r.decode_start > r.transfer_end]
    assert parked, "the workload should exhaust decode KV so requests wait for blocks"
    assert max(peak / total for peak, total in result.peak_kv_blocks.values() if total) > 0.9
    assert len({r.prefill_instance for r in result.records}) == 4  # the strategy saw the queues
    assert len({r.decode_instance for r in result.records}) == 2
    # heartbeats carry virtual time: the core still considers every instance alive
    assert all(i.alive for i in sim.core.state.instances.values())


def test_same_seed_same_result():
    a = simulate(trace(seed=7), "single", LATENCY, small_config())
    b = simulate(trace(seed=7), "single", LATENCY, small_config())
    c = simulate(trace(seed=8), "single", LATENCY, small_config())
    assert a.records == b.records and a.events == b.events
    assert a.summary("w", 40.0) == b.summary("w", 40.0)  # plan_us, a wall time, is left out of equality
    ja, jb = (json.loads(r.summary("w", 40.0).to_json()) for r in (a, b))
    assert set(ja.pop("plan_us")) == set(jb.pop("plan_us")) == {"mean", "p99", "max"}
    assert ja == jb
    assert a.records != c.records


def test_plan_time_per_request():
    """plan_us: the wall time of each call of the strategy's plan(), one per request that reached it."""
    result = simulate([TraceRequest(0.1 * i, 100, 5) for i in range(20)], "single", LATENCY, small_config())
    assert all(r.state == "finished" for r in result.records)
    assert len(result.plan_ns) == 20 and all(ns > 0 for ns in result.plan_ns)
    p = result.summary().plan_us
    assert 0 < p.mean <= p.max and p.p99 <= p.max == max(result.plan_ns) / 1e3
    rejected = simulate([TraceRequest(0.0, 100, 5)] * 6, "single", LATENCY,
                        small_config(scheduler=SchedulerConfig(max_num_requests=2)))  # fmt: skip
    assert len(rejected.plan_ns) == 2  # the 429s never reached the strategy
    empty = summarize([], plan_ns=[]).plan_us
    assert math.isnan(empty.mean)
    assert json.loads(summarize([]).to_json())["plan_us"] == dict.fromkeys(("mean", "p99", "max"))  # null: no call


def test_rejections_are_terminal():
    reqs = [TraceRequest(0.0, 100, 10) for _ in range(20)] + [TraceRequest(0.5, 5000, 10)]
    sim = Simulator("single", LATENCY, small_config(scheduler=SchedulerConfig(max_num_requests=8)))
    result = sim.run(reqs)
    check_invariants(sim, result)
    states = [r.state for r in result.records]
    assert states.count("finished") == 8 and states.count("rejected") == 13
    assert result.records[8].reason.startswith("429")
    assert result.records[-1].reason.startswith("400")  # 5010 tokens > the 4096-token decode capacity
    s = result.summary()
    assert (s.completed, s.rejected, s.failed, s.num_requests) == (8, 13, 0, 21)


def test_first_token_from_prefill_and_decode_fallback():
    reqs = [TraceRequest(0.0, 1000, 1), TraceRequest(0.0, 1000, 5)]
    config = SimConfig(num_prefill=1, num_decode=1, decode_step_s=0.05)
    result = simulate(reqs, "single", load_paper_calibration(), config)  # no decode model: constant step
    one, five = result.records
    assert one.state == five.state == "finished"
    assert one.transfer_end is None and one.finished_at == one.prefill_end  # ended with its first token
    assert five.prefill_start == one.prefill_end  # FCFS on the one prefill instance
    assert [round(b - a, 9) for a, b in zip(five.token_times[1:], five.token_times[2:], strict=False)] == [0.05] * 3
    assert five.decode_start >= five.transfer_end > five.prefill_end


def test_failed_requests_free_everything():
    class FailEveryThird(SingleInstanceStrategy):
        def plan(self, spec, state, now):
            actions = super().plan(spec, state, now)
            if int(spec.request_id.split("-")[1]) % 3 == 0:
                actions.append(FailRequest(spec.request_id, 503, "injected"))
            return actions

    sim = Simulator(FailEveryThird(), LATENCY, small_config())
    result = sim.run(trace(60))
    check_invariants(sim, result)
    assert [r.state == "failed" for r in result.records] == [i % 3 == 0 for i in range(60)]


def test_summary_json():
    result = simulate(trace(50), "single", LATENCY, small_config())
    data = json.loads(result.summary("loongserve-sharegpt", 40.0).to_json())
    for key in ("strategy", "workload", "rate", "completed", "throughput_tok_s"):
        assert key in data
    for key in ("ttft_s", "tbt_s", "tpot_s", "e2e_s"):
        assert set(data[key]) >= {"mean", "p50", "p90", "p99"}
        assert data[key]["p50"] <= data[key]["p99"]
    assert data["strategy"] == "single" and data["completed"] == 50 and data["throughput_tok_s"] > 0
    empty = json.loads(summarize([]).to_json())
    assert empty["ttft_s"]["mean"] is None and empty["completed"] == 0


def test_event_queue_ties_and_clock():
    q = EventQueue()
    q.push(1.0, EventKind.DECODE_STEP, "b")
    q.push(1.0, EventKind.ARRIVAL, "c")
    q.push(0.5, EventKind.TICK, "a")
    assert [q.pop()[2] for _ in range(3)] == ["a", "b", "c"]  # equal times: insertion order
    with pytest.raises(AssertionError):
        q.push(0.9, EventKind.TICK)


def test_config_validation():
    with pytest.raises(ValueError):
        SimConfig(num_prefill=0)
    with pytest.raises(ValueError):
        SimConfig(decode_step_s=0)
    with pytest.raises(ValueError):
        SimConfig(heartbeat_s=10.0)
    with pytest.raises(ValueError):
        Simulator("single", LatencyModel(decode=LATENCY.decode))
    with pytest.raises(ValueError):
        Simulator("nope", LATENCY)
    assert math.isclose(small_config().capacity_tokens(), 256 * 16)
