"""KV-parallel decode in the scheduler and the simulator: placement of shards, block accounting, step time."""

import msgspec
import pytest

from spindle_policy import SchedulerConfig
from spindle_policy.actions import KVShard, RunPrefill
from spindle_policy.core import SchedulerCore
from spindle_policy.latency import DecodeStepModel, LatencyModel, PrefillLatencyModel, TransferModel
from spindle_policy.strategy import create_strategy
from spindle_policy.testing import instance_info, request_spec
from spindle_sim import SimConfig, Simulator
from spindle_sim.invariants import check_invariants
from spindle_sim.workloads import TraceRequest

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
        KVShard("decode-0", 0, 1024), KVShard("decode-1", 1024, 2048), KVShard("decode-2", 2048, 3000),
    )  # fmt: skip
    assert len(long_b.decode_shards) == 3 and long_b.decode_instance != long_a.decode_instance  # another master
    assert short.decode_shards == ()  # under the limit: one instance
    assert all(i.used_blocks == 0 for i in sim.instances.values())
    assert sim.core.state.requests == {} and all(not i.incoming for i in sim.core.state.instances.values())
    # every decode instance held a shard at once: 952 prompt tokens (60 blocks) or more
    assert all(sim.instances[f"decode-{k}"].peak_blocks >= 60 for k in range(3))


def test_splitting_a_few_long_requests_shortens_their_decode_steps():
    trace = [TraceRequest(0.0, 3500, 100), TraceRequest(0.0, 3500, 100)]
    _, whole = _run("single", trace)
    _, split = _run("single:kvp_tokens=1200", trace)
    tpot = [r.summary().tpot_s.mean for r in (whole, split)]
    assert tpot[1] < tpot[0]  # each step attends over a third of the KV per instance, in parallel


def test_kvp_tokens_is_an_option_the_services_run():
    strategy = create_strategy("single:kvp_tokens=1024")
    assert strategy.real_stack_gap == "" and strategy.describe() == "single:kvp_tokens=1024"
    with pytest.raises(ValueError, match="kvp_tokens must be >= 0"):
        create_strategy("single:kvp_tokens=-1")


def _core(strategy: str, decodes: list[tuple[str, str]], total: int = 1000) -> SchedulerCore:
    """A core with one prefill instance and decode instances `(id, kvp_group)` of `total` blocks each."""
    core = SchedulerCore(create_strategy(strategy), SchedulerConfig(dead_after_s=1e9))
    core.on_heartbeat(instance_info("p", "prefill", 0, total=4000, max_model_len=64000))
    for rank, (iid, group) in enumerate(decodes, start=1):
        core.on_heartbeat(instance_info(iid, "decode", rank, total=total, max_model_len=64000, kvp_group=group))
    return core


def _plan(core: SchedulerCore, rid: str, prompt: int, out: int = 8) -> RunPrefill:
    actions = core.admit(request_spec(rid, prompt, out), 0.0)
    plans = [a for a in actions if isinstance(a, RunPrefill)]
    assert plans, actions
    return plans[0]


def test_a_split_stays_inside_one_kvp_group():
    # group a (3 members) is busier than group b (2 members): a 3-way split takes a's members, the freest
    # 3 of any one group; a 2-way split goes to b, whose two members are freer
    core = _core("single:kvp_tokens=1000", [("a", "a"), ("a-kvp1", "a"), ("a-kvp2", "a"), ("b", "b"), ("b-kvp1", "b")])
    core.on_heartbeat(instance_info("a", "decode", 1, total=1000, used=100, max_model_len=64000, kvp_group="a"))
    three = _plan(core, "three", 2500)
    assert {s.instance for s in three.decode_shards} == {"a", "a-kvp1", "a-kvp2"}
    assert [(s.start, s.end) for s in three.decode_shards] == [(0, 1000), (1000, 2000), (2000, 2500)]
    two = _plan(core, "two", 1500)
    assert {s.instance for s in two.decode_shards} == {"b", "b-kvp1"}
    assert two.decode_instance == two.decode_shards[0].instance


def test_instances_outside_a_group_never_share_a_request():
    core = _core("single:kvp_tokens=1000", [("d0", ""), ("d1", ""), ("d2", "")])
    plan = _plan(core, "long", 2500)
    assert plan.decode_shards == () and plan.decode_instance in {"d0", "d1", "d2"}


def test_without_kvp_tokens_a_request_too_long_for_any_member_splits_by_capacity():
    # members of 100 blocks (1,600 tokens): 3,000 + 8 tokens need 188 blocks, so two members
    core = _core("single", [("g", "g"), ("g-kvp1", "g"), ("g-kvp2", "g")], total=100)
    assert _plan(core, "fits", 1000).decode_shards == ()
    assert len(_plan(core, "big", 3000).decode_shards) == 2
    plain = _core("single", [("d0", ""), ("d1", "")], total=100)
    actions = plain.admit(request_spec("big", 3000, 8), 0.0)
    assert actions[0].status == 400 and "kvp_tokens" in actions[0].reason


def test_losing_any_holder_of_a_split_request_fails_it_and_only_it():
    from spindle_policy.actions import FailRequest
    from spindle_protocol.messages import DecodeStarted

    core = SchedulerCore(create_strategy("single:kvp_tokens=1000"), SchedulerConfig(dead_after_s=1e9))
    for rank, (iid, role) in enumerate([("p", "prefill"), ("d0", "decode"), ("d1", "decode"), ("d2", "decode")]):
        group = "g" if role == "decode" else ""
        core.on_heartbeat(instance_info(iid, role, rank, total=1000, max_model_len=16000, kvp_group=group))
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


def test_a_dead_member_of_a_live_leaders_group_is_left_to_the_leader_and_a_dead_leader_fails_the_group():
    from spindle_policy.actions import FailRequest
    from spindle_protocol.messages import DecodeStarted

    core = SchedulerCore(create_strategy("single:kvp_tokens=1000"), SchedulerConfig(dead_after_s=1e9))
    ids = [("p", "prefill", ""), ("d0", "decode", "d0"), ("d0-kvp1", "decode", "d0"), ("d0-kvp2", "decode", "d0")]
    for rank, (iid, role, group) in enumerate([*ids, ("e", "decode", "")]):
        core.on_heartbeat(instance_info(iid, role, rank, total=1000, max_model_len=16000, kvp_group=group))

    def admit(rid: str, prompt: int, used: int) -> tuple[str, ...]:
        core.admit(request_spec(rid, prompt, 8), 0.0)
        req = core.state.requests[rid]
        core.on_event(DecodeStarted(request_id=rid, instance_id=req.decode_instance), 0.1)
        for iid in req.decode_instances():  # its holders report its blocks
            inst = core.state.instances[iid].info
            core.on_heartbeat(instance_info(iid, "decode", inst.rank, total=1000, used=used, max_model_len=16000,
                                            kvp_group=inst.kvp_group))  # fmt: skip
        return req.decode_instances()

    assert admit("split", 1800, 900) == ("d0", "d0-kvp1")
    assert admit("member", 200, 500) == ("d0-kvp2",)  # in the group, not on its leader
    assert admit("other", 200, 500) == ("e",)
    assert core.on_instance_left("d0-kvp1", 1.0) == []  # the leader knows where the group put each request now
    assert set(core.state.requests) == {"split", "member", "other"} and "d0-kvp1" in core.state.dead
    assert admit("next", 100, 100) == ("d0-kvp2",)  # the freest live one; never d0-kvp1 again
    actions = core.on_instance_left("d0", 2.0)  # a dead leader: every request with a part in its group fails
    assert sorted(a.request_id for a in actions if isinstance(a, FailRequest)) == ["member", "next", "split"]
    assert set(core.state.requests) == {"other"}


def test_the_strategy_merges_a_short_shard_into_its_neighbour_once_it_has_room():
    from spindle_policy.actions import ScaleDownKVP
    from spindle_protocol.messages import DecodeStarted

    core = _core("single:kvp_tokens=1000,kvp_merge_tokens=64", [("g", "g"), ("g-kvp1", "g")], total=100)
    plan = _plan(core, "r", 1010, out=20)
    head, tail = plan.decode_shards
    assert (head.end - head.start, tail.end - tail.start) == (1000, 10)
    assert core.tick(0.1) == []  # not decoding yet
    core.on_event(DecodeStarted(request_id="r", instance_id=plan.decode_instance), 0.2)
    core.on_heartbeat(instance_info(head.instance, "decode", 1, total=100, used=99, kvp_group="g"))
    assert core.tick(0.3) == []  # the receiver has 1 block free: the tail's 10 tokens and 20 outputs need 2
    core.on_heartbeat(instance_info(head.instance, "decode", 1, total=100, used=63, kvp_group="g"))
    merge = ScaleDownKVP("r", tail.instance, head.instance)
    assert core.tick(0.4) == [merge]
    assert core.tick(0.5) == []  # asked already
    core.scale_down_refused("r", "no_room", 0.6)
    assert core.tick(1.0) == []  # not asked again for a while
    assert core.tick(2.7) == [merge]
    core.scaled_down("r", tail.instance, head.instance)
    req = core.state.requests["r"]
    assert req.decode_shards == () and req.decode_instances() == (head.instance,) == (plan.decode_instance,)
    assert core.tick(3.0) == []
    with pytest.raises(ValueError, match="kvp_merge_tokens must be >= 0"):
        create_strategy("single:kvp_merge_tokens=-1")
    assert create_strategy("single:kvp_tokens=1000,kvp_merge_tokens=64").describe() == (
        "single:kvp_tokens=1000,kvp_merge_tokens=64"
    )


def test_the_leaders_report_of_where_the_kv_is_replaces_the_strategys_placement():
    from spindle_policy.actions import ScaleDownKVP
    from spindle_protocol.messages import DecodeStarted, KVPShards, KVShardSpec

    groups = [("g", "g"), ("g-kvp1", "g"), ("g-kvp2", "g")]
    core = _core("single:kvp_tokens=1000,kvp_merge_tokens=64", groups, total=100)
    plan = _plan(core, "r", 1500, out=20)
    asked = [s.instance for s in plan.decode_shards]
    assert len(asked) == 2 and plan.decode_instance == asked[0]
    assert all(core.state.instances[i].incoming for i in asked)  # virtual usage until the KV is in the group
    spare = next(i for i, _ in groups if i not in asked)
    # the group placed it otherwise (the placement did not fit when the KV came), mastered by the spare member,
    # and the tail filled: a scale-up onto the spare member, which holds no prompt token
    report = KVPShards(
        request_id="r", instance_id="g", master=spare,
        shards=[KVShardSpec(instance=asked[1], start=0, end=990), KVShardSpec(instance=asked[0], start=990, end=1512),
                KVShardSpec(instance=spare, start=1512, end=1513)],
    )  # fmt: skip
    core.on_event(report, 0.1)
    core.on_event(DecodeStarted(request_id="r", instance_id="g"), 0.2)  # may come after the first report
    req = core.state.requests["r"]
    assert req.decode_instances() == (asked[1], asked[0], spare) and req.decode_instance == spare
    assert core.state.instances[spare].mastering == {"r"} and not core.state.instances[asked[0]].mastering
    assert not any(i.incoming for i in core.state.instances.values())
    # the strategy merges the 1-token tail back (not the master's own shard: the scaled-up tail is the master's)
    assert core.tick(0.3) == []
    report = msgspec.structs.replace(report, master=asked[1])
    core.on_event(report, 0.4)
    assert core.tick(0.5) == [ScaleDownKVP("r", spare, asked[0])]
    merged = [report.shards[0], KVShardSpec(instance=asked[0], start=990, end=1515)]
    core.on_event(msgspec.structs.replace(report, shards=merged), 0.6)  # the leader's report before its reply
    core.scaled_down("r", spare, asked[0])
    assert [(s.instance, s.start, s.end) for s in req.decode_shards] == [(asked[1], 0, 990), (asked[0], 990, 1515)]
    assert not req.merging


def test_the_simulator_merges_short_shards_and_still_finishes_every_request():
    # members of 256 blocks (4,096 tokens); kvp_tokens 4,000: a 4,040-token prompt leaves a 40-token tail shard,
    # which merges into the first holder (room for it and its 30 outputs)
    config = SimConfig(
        num_prefill=1, num_decode=3, block_size=16, decode_kv_blocks=300, kv_bytes_per_token=1024,
        max_model_len=16384,
    )  # fmt: skip
    trace = [TraceRequest(0.0, 4040, 30), TraceRequest(0.05, 900, 30), TraceRequest(0.1, 8100, 30)]
    runs = {}
    for strategy in ("single:kvp_tokens=4000", "single:kvp_tokens=4000,kvp_merge_tokens=128"):
        sim = Simulator(strategy, LATENCY, config)
        result = sim.run(trace)
        check_invariants(sim, result)
        assert [r.state for r in result.records] == ["finished"] * 3
        assert all(len(r.token_times) == 30 for r in result.records)
        runs[strategy] = result
    assert runs["single:kvp_tokens=4000"].summary().scale_downs == 0
    merged = runs["single:kvp_tokens=4000,kvp_merge_tokens=128"]
    assert [r.scale_downs for r in merged.records] == [1, 0, 1]  # 4,000 + 40 and 4,000 + 4,000 + 100


def test_a_request_longer_than_one_decode_instance_needs_a_split_plan():
    # decode instances hold 4,096 tokens each, the model's context is 16k: a 10k-token prompt fits only split
    # (the simulated decode instances form one KVP group: without kvp_tokens it splits by capacity)
    config = SimConfig(
        num_prefill=1, num_decode=3, block_size=16, decode_kv_blocks=256, kv_bytes_per_token=1024,
        max_model_len=16384,
    )  # fmt: skip
    trace = [TraceRequest(0.0, 10_000, 50), TraceRequest(0.1, 1000, 20)]
    for strategy in ("single", "single:kvp_tokens=4000"):
        split = Simulator(strategy, LATENCY, config)
        result = split.run(trace)
        check_invariants(split, result)
        assert [r.state for r in result.records] == ["finished", "finished"]
        assert len(result.records[0].token_times) == 50
        assert max(i.peak_blocks for i in split.instances.values() if i.role == "decode") <= 256


def _kvp_reports(sim: Simulator) -> list:
    """The KVPShards events the simulator's core gets, from now on."""
    from spindle_protocol.messages import KVPShards

    reports = []
    on_event = sim.core.on_event

    def record(event, now: float):
        if isinstance(event, KVPShards):
            reports.append(event)
        return on_event(event, now)

    sim.core.on_event = record
    return reports


def test_a_split_requests_outputs_scale_up_to_another_member_when_its_tail_has_no_room():
    # 1,024-token decode instances; 2,000 prompt tokens in two shards of 1,000 (63 blocks each): the tail has no
    # room for 200 outputs more, so they go to the third instance (a scale-up; the services' group does it when
    # the tail fills). Without a KVP group the same request could not be placed at all.
    config = SimConfig(
        num_prefill=1, num_decode=3, block_size=16, decode_kv_blocks=64, kv_bytes_per_token=1024,
        max_model_len=4096,
    )  # fmt: skip
    for strategy in ("single:kvp_tokens=1000", "single:kvp_tokens=1000,kvp_merge_tokens=64"):
        sim = Simulator(strategy, LATENCY, config)
        reports = _kvp_reports(sim)
        result = sim.run([TraceRequest(0.0, 2000, 200)])
        check_invariants(sim, result)
        assert result.records[0].state == "finished" and len(result.records[0].token_times) == 200
        peaks = sorted(i.peak_blocks for i in sim.instances.values() if i.role == "decode")
        assert peaks == [13, 63, 63] and all(i.used_blocks == 0 for i in sim.instances.values())
        assert result.records[0].scale_ups == 1 and result.summary().scale_ups == 1
        # the core hears of it as from a group's leader: the third instance is the tail, with no prompt token
        (report,) = reports
        assert [(s.start, s.end) for s in report.shards] == [(0, 1000), (1000, 2000), (2000, 2000)]
        assert len({s.instance for s in report.shards}) == 3
        assert result.summary().scale_downs == 0  # merging the new tail back needs 13 blocks its neighbour lacks


def test_n_choices_are_refused_on_a_kvp_group_and_count_n_copies_elsewhere():
    core = SchedulerCore(create_strategy("single"), SchedulerConfig(dead_after_s=1e9))
    for rank, (iid, role, group) in enumerate([("p", "prefill", ""), ("d0", "decode", "d0"), ("d1", "decode", "d0")]):
        core.on_heartbeat(instance_info(iid, role, rank, total=1000, max_model_len=16000, kvp_group=group))
    spec = request_spec("n3", 300, 20)
    three = msgspec.structs.replace(spec, sampling=msgspec.structs.replace(spec.sampling, n=3))
    (reject,) = core.admit(three, 0.0)
    assert reject.status == 400 and "n = 3" in reject.reason and not core.state.requests
    assert all(not i.planned for i in core.state.instances.values())

    plain = SchedulerCore(create_strategy("single"), SchedulerConfig(dead_after_s=1e9))
    for rank, (iid, role) in enumerate([("p", "prefill"), ("d", "decode")]):
        plain.on_heartbeat(instance_info(iid, role, rank, total=1000, max_model_len=16000))
    plain.admit(three, 0.0)
    assert plain.state.instances["d"].incoming == {"n3": 3 * 20}  # 3 x (300 + 20 tokens) = 3 x 20 blocks


def test_a_queue_waiting_for_blocks_a_request_mastered_elsewhere_held_starts_when_it_ends():
    """The blocks a split request's shard held on a member free when it ends on its master: a request queued on that
    member (nothing of its own running, so no step of its own ends) must start then, not wait forever."""
    sim = Simulator("single:kvp_tokens=3500", LATENCY, _config(num_decode=2, max_model_len=8192))
    plans: list[RunPrefill] = []
    execute = sim._execute

    def record(actions, now):
        plans.extend(a for a in actions if isinstance(a, RunPrefill))
        execute(actions, now)

    sim._execute = record
    result = sim.run([TraceRequest(0.0, 6000, 200), TraceRequest(3.0, 2500, 10)])
    check_invariants(sim, result)
    split, short = plans
    holders = {s.instance for s in split.decode_shards}
    assert holders == {"decode-0", "decode-1"} and short.decode_instance in holders - {split.decode_instance}
    assert all(r.state == "finished" for r in result.records)
    a, b = result.records
    assert b.decode_start >= a.finished_at  # it waited for the split request's blocks, then ran
    assert all(i.used_blocks == 0 for i in sim.instances.values())


def test_a_stalled_simulation_names_its_stuck_requests():
    sim = Simulator("single", LATENCY, _config())
    sim._on_transfer_done = lambda now, rec: None  # a KV transfer that never lands anywhere
    with pytest.raises(RuntimeError, match=r"stalled.*req-0"):
        sim.run([TraceRequest(0.0, 100, 4)])
