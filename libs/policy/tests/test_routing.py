"""Decode routing (Tetris §5.2): freeness with virtual usage, in the pure core."""

from spindle_policy import SchedulerConfig
from spindle_policy.actions import Admit
from spindle_policy.core import SchedulerCore
from spindle_policy.strategy import create_strategy
from spindle_policy.testing import instance_info, request_spec
from spindle_protocol.messages import DecodeStarted, InstanceInfo, Preempted, RequestSpec


def _info(iid: str, role: str, rank: int, used: int = 0, running: int = 0) -> InstanceInfo:
    return instance_info(iid, role, rank, used=used, running=running)


_spec = request_spec


def _core(a_used: int, a_running: int, b_used: int, b_running: int) -> SchedulerCore:
    core = SchedulerCore(create_strategy("single"), SchedulerConfig(dead_after_s=1e9))
    for info in (
        _info("p", "prefill", 1),
        _info("a", "decode", 2, a_used, a_running),
        _info("b", "decode", 3, b_used, b_running),
    ):
        core.on_heartbeat(info)
    return core


def _decode_of(core: SchedulerCore, spec: RequestSpec) -> str:
    (admit,) = [a for a in core.admit(spec, 0.0) if isinstance(a, Admit)]
    return admit.decode_instance


def test_highest_freeness_wins_not_most_free_blocks():
    core = _core(a_used=0, a_running=4, b_used=30, b_running=0)  # freeness a: 100/5=20, b: 70/1=70
    assert _decode_of(core, _spec("r1")) == "b"


def test_virtual_usage_counts_requests_on_their_way_until_they_decode():
    core = _core(a_used=0, a_running=0, b_used=0, b_running=0)
    placed = [_decode_of(core, _spec(f"r{i}")) for i in range(4)]
    assert placed == ["a", "b", "a", "b"]  # each placement lowers that instance's freeness at once
    a, b = core.state.instances["a"], core.state.instances["b"]
    assert a.incoming == {"r0": 20, "r2": 20} and a.free_blocks == 60
    # a heartbeat that does not count them yet (they are still prefilling) does not reset virtual usage
    core.on_heartbeat(_info("a", "decode", 2))
    assert a.free_blocks == 60
    core.on_event(DecodeStarted(request_id="r0", instance_id="a"), 1.0)
    assert "r0" not in a.incoming  # from now on the instance's own count holds it
    core.on_abort("r2")
    assert a.incoming == {} and b.incoming == {"r1": 20, "r3": 20}
    core.on_event(Preempted(request_id="r0", instance_id="a", num_tokens=310, seconds=0.1), 2.0)
    assert a.incoming == {"r0": 20}  # swapped out: it needs its blocks back


def test_when_it_fits_nowhere_it_goes_where_most_blocks_are_free():
    core = _core(a_used=90, a_running=0, b_used=95, b_running=0)
    assert _decode_of(core, _spec("big", prompt=600, out=40)) == "a"  # 40 blocks: fits neither; it parks on a
