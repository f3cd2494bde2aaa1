"""Time-sliced decode: the `preempt_after_s` policy (pure), and Preempt carried out by the simulator."""

import numpy as np
import pytest

from spindle_policy import SchedulerConfig
from spindle_policy.actions import Preempt
from spindle_policy.core import SchedulerCore
from spindle_policy.latency import DecodeStepModel, LatencyModel, PrefillLatencyModel, TransferModel
from spindle_policy.strategy import create_strategy
from spindle_policy.testing import instance_info, request_spec
from spindle_protocol.messages import (
    DecodeStarted,
    InstanceInfo,
    Preempted,
    TransferDone,
)
from spindle_sim import SimConfig, Simulator
from spindle_sim.invariants import check_invariants
from spindle_sim.workloads import TraceRequest

LATENCY = LatencyModel(
    prefill=PrefillLatencyModel({1: (0.01, 2e-4, 0.0, 1e-8)}),
    decode=DecodeStepModel({(1, 1): (0.005, 1e-4, 1e-7)}),
    transfer=TransferModel(latency_s=0.001, bandwidth_bytes_per_s=1e9),
)


def _info(iid: str, role: str, rank: int, total: int = 100, used: int = 0, at: float = 0.0) -> InstanceInfo:
    return instance_info(iid, role, rank, total=total, used=used, at=at)


_spec = request_spec


def _core(after_s: float, used: int) -> SchedulerCore:
    core = SchedulerCore(create_strategy(f"single:preempt_after_s={after_s}"), SchedulerConfig(dead_after_s=1e9))
    for info in (_info("kvstore-0", "kvstore", 0), _info("p", "prefill", 1), _info("d", "decode", 2, used=used)):
        core.on_heartbeat(info)
    return core


def _beat(core: SchedulerCore, used: int, at: float) -> None:
    """The decode instance's heartbeat: it now counts the blocks the placement planned."""
    core.on_heartbeat(_info("d", "decode", 2, used=used, at=at))


def _decoding(core: SchedulerCore, rid: str, prompt: int, out: int, at: float) -> None:
    assert core.admit(_spec(rid, prompt, out), at)
    core.on_event(DecodeStarted(request_id=rid, instance_id="d"), at)


def _parked(core: SchedulerCore, rid: str, prompt: int, out: int, at: float) -> None:
    assert core.admit(_spec(rid, prompt, out), at)
    event = TransferDone(request_id=rid, src_instance="p", dst_instance="d", nbytes=1, seconds=0.0, parked=True)
    core.on_event(event, at)


def test_policy_swaps_out_the_longest_running_until_the_parked_head_fits():
    core = _core(after_s=1.0, used=90)  # 10 blocks free of 100
    _decoding(core, "a", 300, 20, at=0.0)  # 20 blocks each
    _decoding(core, "b", 300, 20, at=0.5)
    _decoding(core, "c", 300, 20, at=2.5)  # has not had its slice by t=3
    _parked(core, "w", 460, 20, at=1.0)  # needs 30 blocks: 10 free + a's 20
    _beat(core, used=90, at=1.0)
    assert core.tick(1.5) == []  # w has waited only 0.5 s
    assert core.tick(3.0) == [Preempt("a", "d", "kvstore-0")]
    assert core.tick(3.1) == []  # a's swap-out is in flight: nothing more until it lands
    core.on_event(Preempted(request_id="a", instance_id="d", num_tokens=305, seconds=0.1), 3.2)
    req = core.state.requests["a"]
    assert (req.parked_since, req.num_preemptions, req.preempting) == (3.2, 1, False)
    assert req.kv_location() == [(0, 300, ("d",))] and req.holders() == {"d"}
    core.on_event(DecodeStarted(request_id="w", instance_id="d"), 3.3)
    _beat(core, used=100, at=3.3)
    # a waits now; b and w run. Before a has waited a slice nothing happens; then b (longest running) goes.
    assert core.tick(3.5) == []
    assert core.tick(4.3) == [Preempt("b", "d", "kvstore-0")]


def test_policy_leaves_running_requests_when_swapping_all_would_not_make_room():
    core = _core(after_s=1.0, used=90)
    _decoding(core, "a", 300, 20, at=0.0)
    _parked(core, "big", 1500, 20, at=0.0)  # 96 blocks: more than a's 20 + 10 free
    _beat(core, used=90, at=0.0)
    assert core.tick(5.0) == []


def test_policy_is_off_by_default_and_validated():
    core = SchedulerCore(create_strategy("single"))
    assert core.strategy.preempt_after_s == 0.0
    with pytest.raises(ValueError, match="preempt_after_s"):
        create_strategy("single:preempt_after_s=-1")
    with pytest.raises(ValueError, match="no option preempt_after_s"):
        create_strategy("chunked:preempt_after_s=1")


def _long_outputs_trace() -> list[TraceRequest]:
    # long outputs fill the one decode instance; later requests park behind them
    return [TraceRequest(0.1 * i, 400, 300) for i in range(12)]


def _run(strategy: str) -> tuple[Simulator, object]:
    config = SimConfig(
        num_prefill=2, num_decode=1, block_size=16, prefill_kv_blocks=1024, decode_kv_blocks=200,
        kv_bytes_per_token=1024, scheduler=SchedulerConfig(max_num_requests=100),
    )  # fmt: skip
    sim = Simulator(strategy, LATENCY, config)
    return sim, sim.run(_long_outputs_trace())


def test_simulator_time_slices_a_full_decode_instance():
    base_sim, base = _run("single")
    sim, sliced = _run("single:preempt_after_s=0.5")
    for s, r in ((base_sim, base), (sim, sliced)):
        check_invariants(s, r)
        assert all(rec.state == "finished" for rec in r.records)
        assert all(len(rec.token_times) == 300 for rec in r.records)
        assert s.core.state.requests == {}
        assert all(i.used_blocks == 0 for i in s.instances.values())  # every block freed, swapped ones too
    assert base.summary().preemptions == 0
    assert sliced.summary().preemptions > 0

    # the longest stall any stream sees shrinks: requests take turns instead of waiting for whole outputs
    def worst_gap(r):
        return max(float(np.diff(rec.token_times).max()) for rec in r.records)

    def worst_second_token(r):
        return max(rec.token_times[1] - rec.token_times[0] for rec in r.records)

    assert worst_second_token(sliced) < worst_second_token(base)
    assert worst_gap(sliced) < worst_gap(base)


def test_a_request_failed_while_swapped_out_frees_its_blocks():
    config = SimConfig(num_prefill=1, num_decode=1, decode_kv_blocks=200, kv_bytes_per_token=1 << 20)
    sim = Simulator("single:preempt_after_s=0.2", LATENCY, config)
    result = sim.run([TraceRequest(0.0, 1500, 400), TraceRequest(0.0, 1500, 400)])
    check_invariants(sim, result)
    assert all(r.state == "finished" for r in result.records)
    assert result.summary().preemptions >= 1
    assert all(i.used_blocks == 0 for i in sim.instances.values())


def test_strategies_answer_worker_events_in_both_executors():
    from spindle_policy.actions import FailRequest
    from spindle_policy.strategies.single import SingleInstanceStrategy
    from spindle_protocol.messages import PrefillDone

    class GiveUpAfterPrefill(SingleInstanceStrategy):
        """Ends every request with more than 5 output tokens once its prefill is done (a completion event)."""

        def on_event(self, event, state, now):
            req = state.requests.get(event.request_id)
            if isinstance(event, PrefillDone) and req is not None and req.spec.sampling.max_tokens > 5:
                return [FailRequest(event.request_id, 503, "given up")]
            return []

    config = SimConfig(num_prefill=1, num_decode=1, decode_kv_blocks=200, kv_bytes_per_token=1024)
    sim = Simulator(GiveUpAfterPrefill(), LATENCY, config)
    result = sim.run([TraceRequest(0.0, 300, 20), TraceRequest(0.1, 300, 3)])
    check_invariants(sim, result)
    assert [(r.state, r.reason) for r in result.records] == [("failed", "503: given up"), ("finished", "")]
    assert all(i.used_blocks == 0 for i in sim.instances.values()) and sim.core.state.requests == {}


def test_policy_leaves_tensor_parallel_instances_alone():
    core = _core(after_s=1.0, used=90)
    _decoding(core, "a", 300, 20, at=0.0)
    _parked(core, "w", 460, 20, at=0.0)
    tp = instance_info("d", "decode", 2, used=90, at=0.5, tp_size=2)
    core.on_heartbeat(tp)
    assert core.tick(5.0) == []  # the same situation preempts `a` on a TP-1 instance (test above)
