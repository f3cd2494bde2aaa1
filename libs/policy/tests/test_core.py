"""The scheduler core on CPU, no NATS: admission limits, the `single` strategy, events, dead instances."""

import msgspec
import pytest

from spindle_policy import (
    Admit,
    FailRequest,
    Phase,
    Reject,
    RunPrefill,
    SchedulerConfig,
    SchedulerCore,
    available_strategies,
    create_strategy,
)
from spindle_protocol.messages import (
    DecodeStarted,
    InstanceInfo,
    PrefillDone,
    Prompt,
    RequestFinished,
    RequestSpec,
    Sampling,
)


def info(iid: str, role: str, rank: int, now: float, used: int = 0, queued: int = 0) -> InstanceInfo:
    return InstanceInfo(
        instance_id=iid,
        role=role,
        rank=rank,
        pid=1,
        started_at=0.0,
        updated_at=now,
        kv_blocks_total=100,
        kv_blocks_used=used,
        block_size=16,
        queued_tokens=queued,
        max_model_len=1000,
    )


def spec(rid: str, n: int = 100, max_tokens: int = 10, deadline: float = 1e9) -> RequestSpec:
    return RequestSpec(
        request_id=rid,
        prompt=Prompt(num_tokens=n, token_ids=[1] * n),
        sampling=Sampling(max_tokens=max_tokens),
        arrival_time=0.0,
        deadline=deadline,
    )


def create_scheduler(now: float = 100.0, **config) -> SchedulerCore:
    core = SchedulerCore(create_strategy("single"), SchedulerConfig(**config))
    core.on_heartbeat(info("prefill-0", "prefill", 1, now, queued=500))
    core.on_heartbeat(info("prefill-1", "prefill", 2, now))
    core.on_heartbeat(info("decode-0", "decode", 3, now, used=90))
    core.on_heartbeat(info("decode-1", "decode", 4, now, used=10))
    core.on_heartbeat(info("kvstore-0", "kvstore", 0, now))
    return core


def test_registry_and_unknown_strategy():
    assert "single" in available_strategies()
    with pytest.raises(ValueError, match="unknown strategy"):
        create_strategy("nope")
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_requests=0)
    with pytest.raises(ValueError, match="dead_after_s"):
        SchedulerConfig(dead_after_s=0)


def test_single_picks_least_queue_and_most_free_kv():
    core = create_scheduler()
    actions = core.admit(spec("a"), 100.0)
    assert actions[0] == Admit("a", ("prefill-1",), "decode-1")
    assert isinstance(actions[1], RunPrefill) and actions[1].kvstore_instance == "kvstore-0"
    # what was planned counts until the next heartbeat: a 1000-token prompt makes prefill-1 the longer queue
    core.admit(spec("b", n=600), 100.0)
    third = core.admit(spec("c"), 100.0)[0]
    assert third.prefill_instance == "prefill-0"


def test_admission_rejections():
    core = create_scheduler(max_num_requests=1)
    assert core.admit(spec("a", n=995, max_tokens=10), 100.0) == [
        Reject("a", 400, "prompt (995 tokens) plus max_tokens (10) exceeds the context of 1000 tokens")
    ]
    assert isinstance(core.admit(spec("b"), 100.0)[0], Admit)
    over = core.admit(spec("c"), 100.0)[0]
    assert isinstance(over, Reject) and over.status == 429 and over.retry_after_s > 0
    empty = SchedulerCore(create_strategy("single"))
    assert empty.admit(spec("d"), 0.0)[0].status == 503


def test_batch_requests_take_at_most_their_share_and_leave_the_rest_to_interactive_ones():
    core = create_scheduler(max_num_requests=4, batch_share=0.5)
    batch = [core.admit(msgspec.structs.replace(spec(f"b{i}"), service_class="batch"), 100.0)[0] for i in range(3)]
    assert [type(a) for a in batch] == [Admit, Admit, Reject] and batch[2].status == 429 and batch[2].retry_after_s
    assert "batch requests in flight" in batch[2].reason
    assert all(isinstance(core.admit(spec(f"i{i}"), 100.0)[0], Admit) for i in range(2))  # interactive: the rest
    assert core.admit(spec("i2"), 100.0)[0].status == 429  # and then the cluster is full
    with pytest.raises(ValueError, match="batch_share"):
        SchedulerConfig(batch_share=0.0)


def test_events_move_phases_and_finish_frees_the_slot():
    core = create_scheduler()
    core.admit(spec("a"), 100.0)
    core.on_event(PrefillDone(request_id="a", instance_id="prefill-1", seconds=0.1, finished=False), 100.1)
    assert core.state.requests["a"].phase is Phase.TRANSFER
    core.on_event(DecodeStarted(request_id="a", instance_id="decode-1"), 100.2)
    assert core.state.num_running() == 1
    core.on_event(
        RequestFinished(request_id="a", instance_id="decode-1", finish_reason="stop", num_output_tokens=3), 101
    )
    assert not core.state.requests


def test_dead_instance_fails_its_requests_and_is_not_planned_onto():
    core = create_scheduler()
    core.admit(spec("a"), 100.0)  # prefill-1 -> decode-1
    for iid, role, rank in [("prefill-0", "prefill", 1), ("prefill-1", "prefill", 2), ("decode-0", "decode", 3)]:
        core.on_heartbeat(info(iid, role, rank, 103.0))
    actions = core.tick(103.5)  # decode-1's last heartbeat is 3.5 s old
    assert actions == [FailRequest("a", 503, "decode instance decode-1 was lost")]
    assert "decode-1" in core.state.dead
    assert core.admit(spec("b"), 103.5)[0].decode_instance == "decode-0"
    core.on_heartbeat(info("decode-1", "decode", 4, 104.0))  # it came back
    assert core.state.dead == {"kvstore-0"}  # it did not beat either


def test_a_new_process_under_a_live_id_loses_the_old_ones_requests_at_once():
    # prefill-1 restarted faster than dead_after_s: its new pid's first heartbeat is the only sign
    core = create_scheduler()
    core.admit(spec("a"), 100.0)  # prefill-1 (prefill-0 is busy) -> decode-1
    assert core.state.requests["a"].prefill_instances == ("prefill-1",)
    restarted = msgspec.structs.replace(info("prefill-1", "prefill", 2, 100.6), pid=2, started_at=100.5)
    actions = core.on_heartbeat(restarted, 100.6)
    rerun = [a for a in actions if isinstance(a, RunPrefill)]
    assert [a.spec.request_id for a in rerun] == ["a"] and rerun[0].prefill_instances == ("prefill-0",)
    assert core.state.instances["prefill-1"].alive and core.state.instances["prefill-1"].info.pid == 2
    # a late heartbeat of the replaced process changes nothing; the new one's next heartbeat neither
    assert core.on_heartbeat(info("prefill-1", "prefill", 2, 100.7), 100.7) == []
    assert core.state.instances["prefill-1"].info.pid == 2
    assert core.on_heartbeat(msgspec.structs.replace(restarted, updated_at=101.0), 101.0) == []


def test_a_prefill_lost_before_its_hand_off_runs_again_elsewhere():
    core = create_scheduler()
    core.admit(spec("a"), 100.0)  # prefill-1 (prefill-0 is busy) -> decode-1
    core.admit(spec("b"), 100.0)
    assert core.state.requests["a"].prefill_instances == ("prefill-1",)
    core.on_event(PrefillDone(request_id="b", instance_id="prefill-1", seconds=0.1, finished=False), 100.5)
    for iid, role, rank in [("prefill-0", "prefill", 1), ("decode-0", "decode", 3), ("decode-1", "decode", 4)]:
        core.on_heartbeat(info(iid, role, rank, 103.0))
    actions = core.tick(103.5)  # prefill-1's heartbeat stopped
    rerun = [a for a in actions if isinstance(a, RunPrefill)]
    assert [a.spec.request_id for a in rerun] == ["a"] and rerun[0].prefill_instances == ("prefill-0",)
    assert core.state.requests["a"].phase is Phase.PREFILL and core.state.requests["a"].reruns == 1
    # b's KV was on its way from the lost instance (its first token streamed): it fails, it does not run again
    assert FailRequest("b", 503, "prefill instance prefill-1 was lost") in actions and "b" not in core.state.requests
    # no prefill instance left: the lost prefill cannot run again, so it fails, once
    core.on_heartbeat(info("decode-0", "decode", 3, 106.0))
    core.on_heartbeat(info("decode-1", "decode", 4, 106.0))
    actions = core.tick(106.5)
    why = "prefill instance prefill-0 was lost; running it again failed: no live prefill or decode instance"
    assert [a for a in actions if isinstance(a, FailRequest)] == [FailRequest("a", 503, why)]
    assert "a" not in core.state.requests
