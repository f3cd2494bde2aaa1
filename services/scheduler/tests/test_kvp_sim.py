"""KV-parallel decode in the scheduler and the simulator: placement of shards, block accounting, step time."""

import pytest

from spindle_scheduler import SchedulerConfig
from spindle_scheduler.actions import KVShard, RunPrefill
from spindle_scheduler.latency import DecodeStepModel, LatencyModel, PrefillLatencyModel, TransferModel
from spindle_scheduler.sim import SimConfig, Simulator
from spindle_scheduler.sim.invariants import check_invariants
from spindle_scheduler.strategy import create_strategy
from spindle_scheduler.testing import instance_info, request_spec
from spindle_scheduler.workloads import TraceRequest

# attention-heavy decode: step time grows with the KV tokens of the batch
LATENCY = LatencyModel(
    prefill=PrefillLatencyModel({1: (0.01, 2e-4, 0.0, 1e-8)}),
    decode=DecodeStepModel({(1, 1): (0.005, 1e-4, 1e-5)}),
    transfer=TransferModel(latency_s=0.001, bandwidth_bytes_per_s=1e9),
)


def _config(**kw) -> SimConfig:
    base = dict(
        num_prefill=2, num_decode=3, block_size=16, prefill_kv_blocks=1024, decode_kv_blocks=256,
        kv_bytes_per_token=1024, scheduler=SchedulerConfig(max_num_requests=100),
    )  # fmt: skip
    return SimConfig(**(base | kw))


def _run(strategy: str, trace: list[TraceRequest]) -> tuple[Simulator, object]:
    sim = Simulator(strategy, LATENCY, _config())
    plans: list[RunPrefill] = []
    execute = sim._execute

    def record(actions, now):
        plans.extend(a for a in actions if isinstance(a, RunPrefill))
        execute(actions, now)

    sim._execute = record  # see the plans the strategy made
    result = sim.run(trace)
    check_invariants(sim, result)
    sim.plans_made = plans
    return sim, result


def test_long_prompts_split_over_the_freest_decode_instances():
    trace = [TraceRequest(0.0, 3000, 40), TraceRequest(0.05, 3000, 40), TraceRequest(0.1, 500, 40)]
    sim, result = _run("single:kvp_tokens=1024", trace)
    assert all(r.state == "finished" and len(r.token_times) == 40 for r in result.records)
    long_a, long_b, short = sim.plans_made
    assert long_a.decode_shards == (
        KVShard("decode-0", 0, 1000), KVShard("decode-1", 1000, 2000), KVShard("decode-2", 2000, 3000),
    )  # fmt: skip
    assert len(long_b.decode_shards) == 3 and long_b.decode_instance != long_a.decode_instance  # another master
    assert short.decode_shards == ()  # under the limit: one instance
    assert all(i.used_blocks == 0 for i in sim.instances.values())
    assert sim.core.state.requests == {} and all(not i.incoming for i in sim.core.state.instances.values())
    # every decode instance held a shard at once: 1000 prompt tokens (63 blocks), the tail 40 outputs more
    assert all(sim.instances[f"decode-{k}"].peak_blocks >= 63 for k in range(3))


def test_splitting_a_few_long_requests_shortens_their_decode_steps():
    trace = [TraceRequest(0.0, 3500, 100), TraceRequest(0.0, 3500, 100)]
    _, whole = _run("single", trace)
    _, split = _run("single:kvp_tokens=1200", trace)
    tpot = [r.summary().tpot_s.mean for r in (whole, split)]
    assert tpot[1] < tpot[0]  # each step attends over a third of the KV per instance, in parallel


def test_the_services_refuse_split_plans_for_now():
    strategy = create_strategy("single:kvp_tokens=1024")
    assert "KV-parallel" in strategy.real_stack_gap and strategy.describe() == "single:kvp_tokens=1024"
    with pytest.raises(ValueError, match="kvp_tokens must be >= 0"):
        create_strategy("single:kvp_tokens=-1")


def test_losing_any_holder_of_a_split_request_fails_it_and_only_it():
    from spindle_protocol.messages import DecodeStarted
    from spindle_scheduler.actions import FailRequest
    from spindle_scheduler.core import SchedulerCore

    core = SchedulerCore(create_strategy("single:kvp_tokens=1000"), SchedulerConfig(dead_after_s=1e9))
    for rank, (iid, role) in enumerate([("p", "prefill"), ("d0", "decode"), ("d1", "decode"), ("d2", "decode")]):
        core.on_heartbeat(instance_info(iid, role, rank, total=1000, max_model_len=16000))
    for rid, prompt in (("split", 1800), ("small", 200)):
        spec = request_spec(rid, prompt, 8)
        core.admit(spec, 0.0)
        core.on_event(DecodeStarted(request_id=rid, instance_id=core.state.requests[rid].decode_instance), 0.1)
    split = core.state.requests["split"]
    assert split.decode_instances() == ("d0", "d1") and "d1" not in core.state.requests["small"].decode_instances()
    actions = core.on_instance_left("d1", 1.0)  # a holder that is not the master
    assert actions == [FailRequest("split", 503, "decode instance d1 was lost")]
    assert "small" in core.state.requests and "split" not in core.state.requests
    assert all(not i.incoming and i.mastering <= {"small"} for i in core.state.instances.values())


def test_a_request_longer_than_one_decode_instance_needs_a_split_plan():
    # decode instances hold 4,096 tokens each, the model's context is 16k: a 10k-token prompt fits only split
    config = SimConfig(
        num_prefill=1, num_decode=3, block_size=16, decode_kv_blocks=256, kv_bytes_per_token=1024,
        max_model_len=16384,
    )  # fmt: skip
    trace = [TraceRequest(0.0, 10_000, 50), TraceRequest(0.1, 1000, 20)]
    whole = Simulator("single", LATENCY, config)
    result = whole.run(trace)
    check_invariants(whole, result)
    assert [r.state for r in result.records] == ["rejected", "finished"]
    assert result.records[0].reason.startswith("400: decode instance") and "kvp_tokens" in result.records[0].reason
    split = Simulator("single:kvp_tokens=4000", LATENCY, config)
    result = split.run(trace)
    check_invariants(split, result)
    assert [r.state for r in result.records] == ["finished", "finished"]
    assert len(result.records[0].token_times) == 50
    assert max(i.peak_blocks for i in split.instances.values() if i.role == "decode") <= 256
