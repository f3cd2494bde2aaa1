"""Moving parked requests to a decode instance with room (TransferKV): the policy, and the simulator."""

import numpy as np

from spindle_policy import SchedulerConfig
from spindle_policy.actions import TransferKV
from spindle_policy.core import SchedulerCore
from spindle_policy.latency import DecodeStepModel, LatencyModel, PrefillLatencyModel, TransferModel
from spindle_policy.strategy import create_strategy
from spindle_policy.testing import instance_info, request_spec
from spindle_protocol.messages import DecodeStarted, InstanceInfo, TransferDone
from spindle_sim import SimConfig, Simulator
from spindle_sim.invariants import check_invariants
from spindle_sim.workloads import TraceRequest

LATENCY = LatencyModel(
    prefill=PrefillLatencyModel({1: (0.01, 2e-4, 0.0, 1e-8)}),
    decode=DecodeStepModel({(1, 1): (0.005, 1e-4, 1e-7)}),
    transfer=TransferModel(latency_s=0.001, bandwidth_bytes_per_s=1e9),
)


def _info(iid: str, role: str, rank: int, used: int = 0, at: float = 0.0) -> InstanceInfo:
    return instance_info(iid, role, rank, used=used, at=at)


_spec = request_spec


def test_a_request_parked_too_long_moves_where_it_fits_now():
    core = SchedulerCore(create_strategy("single:move_parked_after_s=1"), SchedulerConfig(dead_after_s=1e9))
    for info in (_info("k", "kvstore", 0), _info("p", "prefill", 1), _info("a", "decode", 2), _info("b", "decode", 3)):
        core.on_heartbeat(info)
    core.admit(_spec("w"), 0.0)
    src = core.state.requests["w"].decode_instance
    dst = "b" if src == "a" else "a"
    # its instance filled up meanwhile: the KV parks there; the other one is (now) empty
    event = TransferDone(request_id="w", src_instance="p", dst_instance=src, nbytes=1, seconds=0.0, parked=True)
    core.on_event(event, 0.5)
    core.on_heartbeat(_info(src, "decode", 2 if src == "a" else 3, used=95, at=0.5))
    assert core.tick(1.0) == []  # parked for only 0.5 s
    assert core.tick(1.6) == [TransferKV("w", src, dst)]
    assert core.tick(1.7) == []  # in flight
    core.moved("w", dst)
    req = core.state.requests["w"]
    assert req.decode_instance == dst and not req.moving
    assert core.state.instances[dst].incoming == {"w": 20} and core.state.instances[src].incoming == {}
    core.on_event(DecodeStarted(request_id="w", instance_id=dst), 1.8)
    assert core.state.instances[dst].incoming == {}


def test_no_move_when_no_other_instance_has_room_or_the_head_fits_at_home():
    core = SchedulerCore(create_strategy("single:move_parked_after_s=1"), SchedulerConfig(dead_after_s=1e9))
    for info in (_info("k", "kvstore", 0), _info("p", "prefill", 1), _info("a", "decode", 2), _info("b", "decode", 3)):
        core.on_heartbeat(info)
    core.admit(_spec("w"), 0.0)
    src = core.state.requests["w"].decode_instance
    other = "b" if src == "a" else "a"
    core.on_event(TransferDone(request_id="w", src_instance="p", dst_instance=src, nbytes=1, seconds=0, parked=True), 0)
    core.on_heartbeat(_info(other, "decode", 2 if other == "a" else 3, used=90, at=0.1))  # 10 free: too few
    core.on_heartbeat(_info(src, "decode", 2 if src == "a" else 3, used=95, at=0.1))
    assert core.tick(5.0) == []
    core.on_heartbeat(_info(src, "decode", 2 if src == "a" else 3, used=50, at=0.2))  # it fits at home now
    core.on_heartbeat(_info(other, "decode", 2 if other == "a" else 3, used=0, at=0.2))
    assert core.tick(6.0) == []


def test_simulator_moves_parked_requests_off_a_busy_decode_instance():
    # two long decodes land on decode-0 and decode-1; short requests park behind them; when decode-1's long
    # request ends, the ones parked on decode-0 move there instead of waiting for decode-0's long request
    trace = [TraceRequest(0.0, 1500, 800), TraceRequest(0.0, 1500, 200)]
    trace += [TraceRequest(0.05 + 0.01 * i, 1500, 20) for i in range(6)]
    config = SimConfig(
        num_prefill=2, num_decode=2, block_size=16, prefill_kv_blocks=1024, decode_kv_blocks=200,
        kv_bytes_per_token=1024, scheduler=SchedulerConfig(max_num_requests=100),
    )  # fmt: skip
    results = {}
    for spec in ("single", "single:move_parked_after_s=0.5"):
        sim = Simulator(spec, LATENCY, config)
        result = sim.run(trace)
        check_invariants(sim, result)
        assert all(r.state == "finished" for r in result.records)
        assert all(i.used_blocks == 0 for i in sim.instances.values()) and sim.core.state.requests == {}
        assert all(not i.incoming for i in sim.core.state.instances.values())
        results[spec] = result
    base, moved = results.values()
    assert base.summary().moves == 0 and moved.summary().moves > 0

    # the short requests' second token comes much sooner
    def worst_stall(r):
        return max(float(np.diff(rec.token_times).max()) for rec in r.records[2:])

    assert worst_stall(moved) < worst_stall(base) / 2
