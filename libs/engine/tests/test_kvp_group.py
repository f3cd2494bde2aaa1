"""KVP group placement (pure): Medha-style splits by a per-member token limit, multi-master, reservations,
scale-up of a tail that runs out of blocks; and a whole group driven as one engine on gloo processes."""

import json
import random
import time

import pytest
import torch

from spindle_engine import Engine, EngineConfig, SamplingParams
from spindle_engine.kvp import KVPPlan, KVPRequest, KVRange
from spindle_engine.kvp.group import GroupConfig, GroupPlanner


def _planner(members: int = 3, blocks: int = 33, kvp_tokens: int = 500, block_size: int = 16) -> GroupPlanner:
    return GroupPlanner(GroupConfig(members, blocks, block_size, kvp_tokens), KVPPlan(list(range(members))))


def _admit(p: GroupPlanner, rid: str, n: int):
    assert p.reserve(rid, n)
    req = p.take_reservation(rid, n)
    p.plan.add(req)
    return req


def test_a_long_prompt_splits_by_the_token_limit_off_block_boundaries():
    p = _planner()
    req = _admit(p, "a", 1000)
    assert req.ranges == (KVRange(0, 0, 500), KVRange(1, 500, 1000))  # 500 is not a multiple of 16
    assert req.tail == 1 and req.master == 1  # nobody masters anything yet: the tail does
    assert [p.placed_blocks(m) for m in range(3)] == [32, 32, 0] and p.num_used == 64
    assert p.request_blocks("a") == 64


def test_no_limit_fits_one_member_when_possible_then_spills():
    p = _planner(kvp_tokens=0)
    assert _admit(p, "a", 300).ranges == (KVRange(0, 0, 300),)
    assert _admit(p, "b", 520).ranges == (KVRange(1, 0, 520),)  # the member with the most free blocks
    big = _admit(p, "c", 700)  # no member has room for all of it
    assert big.ranges == (KVRange(2, 0, 528), KVRange(0, 528, 700))
    assert p.free_blocks(2) == 0


def test_the_tail_goes_where_the_most_blocks_stay_free():
    p = _planner(members=3, blocks=24, kvp_tokens=256)
    _admit(p, "a", 350)  # [0, 256) on 0, [256, 350) on 1
    req = _admit(p, "b", 600)  # cut 256 on 2 (8 blocks left), 256 on 1 (2 left), 88 on 0 (2 left)
    assert [(r.member, r.num_tokens) for r in req.ranges] == [(1, 256), (0, 88), (2, 256)]  # tail: 2


def test_masters_spread_over_members():
    p = _planner(members=3, blocks=100, kvp_tokens=0)
    masters = [_admit(p, f"r{i}", 40).master for i in range(6)]
    assert sorted(masters) == [0, 0, 1, 1, 2, 2]


def test_the_schedulers_placement_is_taken_when_it_fits():
    p = _planner(kvp_tokens=0)
    req = p.place_given("a", 700, [(2, 0, 350), (0, 350, 700)])  # master 2 holds the first range
    assert req is not None and req.master == 2 and req.ranges == (KVRange(2, 0, 350), KVRange(0, 350, 700))
    assert p.reserve("a", 700, req) and p.reserved["a"] == req
    loads = p.member_loads()
    assert (loads[2].used, loads[2].mastering, loads[2].requests) == (22, 1, {"a": 22})
    assert (loads[0].used, loads[0].mastering, loads[1].used) == (22, 0, 0)
    _admit(p, "b", 500)  # member 1, the freest: 32 blocks
    assert p.place_given("c", 40, [(1, 0, 40)]) is None  # member 1 has one block left: does not fit now
    with pytest.raises(ValueError, match="not live"):
        p.place_given("c", 40, [(3, 0, 40)])
    with pytest.raises(ValueError, match="do not cover"):
        p.place_given("c", 40, [(0, 0, 30)])
    with pytest.raises(ValueError, match="tile"):
        p.place_given("c", 40, [(0, 0, 10), (2, 20, 40)])
    p.mark_dead(2)
    assert set(p.member_loads()) == {0, 1}  # a dead member has no entry (its registry entry is withdrawn)


def test_more_ranges_than_members_fill_by_free_space():
    p = _planner(members=2, blocks=40, kvp_tokens=200)
    req = _admit(p, "a", 1000)  # ceil(1000 / 200) = 5 ranges, but only two members
    assert [r.num_tokens for r in req.ranges] == [640, 360]


def test_reservations_hold_blocks_and_no_room_is_refused():
    p = _planner(members=2, blocks=10, kvp_tokens=0)
    assert p.reserve("a", 300)  # 19 of 20 blocks
    assert p.free_blocks(0) + p.free_blocks(1) == 1
    assert not p.reserve("b", 40)
    with pytest.raises(ValueError, match="reserved 300 tokens"):
        p.take_reservation("a", 299)
    assert p.cancel("a") and not p.cancel("a")
    assert p.num_used == 0 and p.reserve("b", 40)
    with pytest.raises(ValueError, match="already in use"):
        p.reserve("b", 10)


def test_the_next_token_needs_room_somewhere():
    p = _planner(members=1, blocks=4, kvp_tokens=0)
    assert not p.reserve("a", 64)  # fills every block; the first decoded token would have nowhere to go
    assert p.reserve("a", 63)


def test_committed_growth_of_placed_requests_holds_back_new_reservations():
    p = _planner(members=2, blocks=10, kvp_tokens=0)  # 20 blocks
    _admit(p, "a", 100)  # 7 blocks on member 0
    p.commit("a", 100 + 170)  # may grow by 170 tokens: 10 blocks, +1 for a scale-up's new range
    assert not p.reserve("b", 40)  # 3 blocks would leave 10 free for a's 11
    assert p.reserve("c", 16)  # 1 block leaves 12
    p.cancel("c")
    p.plan.finish("a")
    p.forget("a")
    assert p.growth_blocks() == 0 and p.reserve("b", 40)


def test_growth_demands_are_met_only_by_members_a_request_can_reach():
    from spindle_engine.kvp.growth import demands_fit

    assert demands_fit([], {0: 0})
    assert demands_fit([(3, [0, 1])], {0: 1, 1: 2})  # split over both
    assert not demands_fit([(3, [1])], {0: 5, 1: 2})  # member 0's room is out of its reach
    # a takes 0 or 1, b only 1: a must give 1 up (an augmenting path through a's use of member 1)
    assert demands_fit([(2, [0, 1]), (2, [1])], {0: 2, 1: 2})
    assert not demands_fit([(3, [0, 1]), (2, [1])], {0: 2, 1: 2})
    assert not demands_fit([(1, [0])], {0: -1, 1: 5})  # an overfull member gives nothing


def test_a_reservation_that_would_leave_a_request_no_reachable_room_waits():
    # 3 members of 10 blocks of 4 tokens. a: [0, 16) on 0 and [16, 56) on 1, whose 10 blocks it fills; it may
    # grow by 8 tokens, which only member 2 (holding none of it) can take: 2 blocks, +1 for the new range
    p = _planner(members=3, blocks=10, kvp_tokens=0, block_size=4)
    a = p.place_given("a", 56, [(0, 0, 16), (1, 16, 56)])
    assert a is not None and p.reserve("a", 56, a, final_tokens=64)
    p.plan.add(p.take_reservation("a", 56))
    assert p.growth_fits()
    b = p.place_given("b", 36, [(2, 0, 36)])  # 9 of member 2's blocks: 6 stay free on member 0 only
    assert b is not None
    free_after = p.num_blocks - p.num_used - 9
    assert free_after >= p.growth_blocks()  # the group-wide count alone would take it
    assert not p.reserve("b", 36, b)  # but a would get stuck on member 2's last block
    assert "b" not in p.reserved and p.growth_fits()
    c = p.place_given("c", 20, [(2, 0, 20)])  # 5 blocks on 2 leave 5 there: a's 3 fit
    assert c is not None and p.reserve("c", 20, c, final_tokens=24)
    assert p.reserve("d", 16, p.place_given("d", 16, [(0, 0, 16)]), final_tokens=20)  # d's growth: member 0
    p.plan.add(p.take_reservation("c", 20))
    p.commit("c", 24)
    for _ in range(8):
        _step(p)  # never stuck: a scales up onto member 2 and finishes its 8 tokens there
    assert p.plan.get("a").tail == 2


def test_a_request_that_could_not_grow_even_alone_is_still_taken():
    p = _planner(members=2, blocks=4, kvp_tokens=0, block_size=4)  # 32 tokens
    q = p.place_given("q", 28, [(0, 0, 14), (1, 14, 28)])  # holds both members: nowhere to scale up to
    assert q is not None
    p.final_tokens["q"] = 40
    assert not p.growth_fits(only=q)  # 12 more tokens: 2 slots left on its tail, no member to scale up to
    p.final_tokens.clear()
    assert p.reserve("q", 28, q, final_tokens=40)  # refusing would make it wait forever: only the count applies


def _step(p: GroupPlanner) -> list[tuple[str, int]]:
    ups = p.scale_ups()
    assert not ups.stuck
    for rid, m in ups.moves:
        p.plan.scale_up(rid, m)
    for rid in list(p.plan.requests):
        p.plan.append(rid)
    return ups.moves


def test_a_full_tail_scales_up_to_a_free_member_and_nothing_moves():
    p = _planner()
    _admit(p, "a", 1000)  # tail member 1: 500 tokens in 32 blocks, 1 block free
    moves = [(i, mv) for i in range(40) for mv in _step(p)]
    assert moves == [(28, ("a", 2))]  # 12 slots left in its last block, 16 in the free one; then member 2
    req = p.plan.get("a")
    assert req.ranges == (KVRange(0, 0, 500), KVRange(1, 500, 1028), KVRange(2, 1028, 1040))
    assert p.placed_blocks(1) == 33 and p.placed_blocks(2) == 1


def test_a_scale_up_leaves_the_room_another_request_depends_on():
    # 4 members of 10 blocks of 4 tokens. b holds members 2 (7 blocks), 3 (full) and 1 (5 blocks, its tail) and
    # may grow by 16 tokens: only member 1 can take them (member 0 is full with a). a fills member 0 and may grow
    # by 8 tokens: member 1 has the most free blocks, but taking them would leave b stuck; member 2 fits a
    p = _planner(members=4, blocks=10, kvp_tokens=0, block_size=4)
    p.plan.add(KVPRequest.split("b", 2, [2, 3, 1], [0, 28, 68, 88]))
    p.plan.add(KVPRequest.split("a", 0, [0], [0, 40]))
    p.commit("b", 104)
    p.commit("a", 48)
    assert p.growth_fits() and [p.free_blocks(m) for m in range(4)] == [0, 5, 3, 0]
    assert p.scale_ups().moves == [("a", 2)]
    for i in range(16):
        _step(p)  # b's 16 tokens on member 1, a's 8 on member 2: nobody is stuck
        if i == 7:
            p.plan.finish("a")
            p.forget("a")
    assert p.plan.get("b").ranges[-1] == KVRange(1, 68, 104) and p.free_blocks(1) == 1


def test_no_member_to_scale_up_to_is_stuck():
    p = _planner(members=2, blocks=2, kvp_tokens=20, block_size=4)
    _admit(p, "a", 15)  # [0, 8) on 0 and [8, 15) on 1: every member holds some; 1 slot left at the tail
    _step(p)
    ups = p.scale_ups()
    assert ups.stuck == ["a"] and not ups.moves


def _fragment_planner(scale_down_tokens: int = 8) -> GroupPlanner:
    """Member 0 holds b and a's first 30 tokens (full); a's tail, 4 tokens, went to member 1 (a scale-up)."""
    p = GroupPlanner(GroupConfig(3, 10, 4, 0, scale_down_tokens), KVPPlan([0, 1, 2]))
    p.plan.add(KVPRequest.split("a", 0, [0, 1], [0, 30, 34]))  # 8 blocks on 0, 1 on 1
    p.plan.add(KVPRequest.split("b", 2, [0], [0, 8]))  # 2 blocks on 0: member 0 is full
    p.commit("a", 40)
    p.commit("b", 8)
    return p


def test_a_fragment_merges_back_once_its_neighbour_has_room():
    p = _fragment_planner()
    assert p.free_blocks(0) == 0 and p.scale_downs() == []  # no room before it
    assert not p.scale_down_fits("a", 1)
    p.plan.finish("b")
    p.forget("b")
    assert p.scale_downs() == [("a", 1, 0)]  # 2 blocks free: 1 for the 4 tokens, 1 for a's last 6
    assert p.scale_down_fits("a", 1) and p.scale_down_fits("a", 0)  # explicit: room for the range is enough
    p.plan.scale_down("a", 1)
    assert p.plan.get("a").ranges == (KVRange(0, 0, 34),) and p.placed_blocks(0) == 9 and p.placed_blocks(1) == 0
    assert all(not moves for _ in range(6) for moves in [_step(p)])  # its growth fits: it never scales up again
    assert p.plan.get("a").num_tokens == 40 and p.scale_downs() == []


def test_scale_downs_skip_masters_long_ranges_and_tight_neighbours():
    assert _fragment_planner(scale_down_tokens=0).scale_downs() == []  # off
    p = _fragment_planner(scale_down_tokens=4)  # the 4-token tail is not shorter than 4
    p.plan.finish("b")
    assert p.scale_downs() == []
    p = _fragment_planner()
    p.plan.finish("b")
    p.commit("a", 48)  # a's growth after a merge (14 tokens on 0) would need 3 blocks there, only 1 would be left
    assert p.scale_downs() == []
    p = GroupPlanner(GroupConfig(2, 10, 4, 0, 8), KVPPlan([0, 1]))
    p.plan.add(KVPRequest.split("m", 1, [0, 1], [0, 20, 23]))  # the fragment is on the master: it stays
    assert p.scale_downs() == []
    with pytest.raises(ValueError, match="only holder"):
        p.plan.add(KVPRequest.split("one", 0, [0], [0, 3])) or p.scale_down_fits("one", 0)


def test_config_is_validated():
    with pytest.raises(ValueError):
        GroupConfig(0, 10)
    with pytest.raises(ValueError):
        GroupConfig(2, 10, kvp_tokens=-1)
    with pytest.raises(ValueError, match="scale_down_tokens"):
        GroupConfig(2, 10, scale_down_tokens=-1)
    with pytest.raises(ValueError, match="members"):
        GroupPlanner(GroupConfig(2, 10), KVPPlan([0, 1, 2]))


# ---- the group as one engine, on gloo processes ----


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from spindle_model.testing import tiny_llama

    hf, _ = tiny_llama(seed=3)
    with torch.no_grad():
        for name, prm in hf.named_parameters():
            if "norm" not in name:
                prm.mul_(8.0)  # sharper logits: greedy tokens differ step to step
    path = tmp_path_factory.mktemp("tiny-llama-kvp-group")
    hf.save_pretrained(path, safe_serialization=True)
    return str(path)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 301) for _ in range(n)]


def test_group_engine_gives_the_single_engine_tokens(tiny_dir, tmp_path):
    from spindle_engine.kvp.group_testing import group_engine_worker
    from spindle_model.testing import run_gloo

    greedy = {"max_tokens": 14, "temperature": 0, "ignore_eos": True}
    # logprobs and penalties on requests mastered by followers (long: 1, short: 2) and by the leader (seeded)
    long = {**greedy, "max_tokens": 20, "logprobs": 2, "presence_penalty": 0.5}
    short = {**greedy, "max_tokens": 8, "logprobs": 0, "repetition_penalty": 1.2}
    seeded = {"max_tokens": 6, "temperature": 0.8, "seed": 5, "ignore_eos": True, "frequency_penalty": 0.3}
    script = [
        {"step": 0, "op": "resume", "id": "long", "prompt": _ids(40, 1), "params": long},
        {"step": 1, "op": "resume", "id": "short", "prompt": _ids(9, 2), "params": short},
        {"step": 1, "op": "resume", "id": "gone", "prompt": _ids(5, 4), "params": greedy},
        {"step": 3, "op": "abort", "id": "gone"},
        {"step": 3, "op": "resume", "id": "seeded", "prompt": _ids(6, 3), "params": {**seeded, "logprobs": 1}},
    ]
    config = {"model": tiny_dir, "block_size": 4, "kv_cache_tokens": 32, "max_model_len": 128}
    results = run_gloo(group_engine_worker, 3, tmp_path, json.dumps(config), 21, json.dumps(script), timeout=120)
    leader = results[0]
    got = {k.removeprefix("tokens:"): v.tolist() for k, v in leader.items() if k.startswith("tokens:")}
    engine = Engine(EngineConfig(model=tiny_dir, block_size=4, kv_cache_tokens=4096, max_model_len=128))
    for e in script:
        if e["op"] == "resume" and e["id"] != "gone":
            engine.add_request(e["id"], e["prompt"], SamplingParams(**e["params"]))
    ref: dict[str, list[int]] = {}
    ref_logprobs: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            ref.setdefault(o.request_id, []).extend(o.new_token_ids)
            ref_logprobs.setdefault(o.request_id, []).extend(lp.logprob for lp in o.logprobs or [])
    assert len(got.pop("gone")) < 14
    assert got == ref
    for rid in ("long", "short", "seeded"):  # the first token was sampled by the prefill: its logprob is not here
        torch.testing.assert_close(leader[f"logprobs:{rid}"].tolist(), ref_logprobs[rid][1:], rtol=0, atol=1e-4)
    assert len(set(ref["long"])) > 1
    # long: [0, 21) on 0 and [21, 40) on 1, mastered by 1; short on 2 mastered by 2; gone and seeded on 2
    # mastered by 0 (which holds none of them); long's tail fills member 1 and moves to 2 at step 13
    assert int(leader["scale_ups"]) == 1
    # what the scheduler is told: each request once when placed, long again after its scale-up
    assert {k.removeprefix("reports:"): int(v) for k, v in leader.items() if k.startswith("reports:")} == {
        "long": 2, "short": 1, "gone": 1, "seeded": 1
    }  # fmt: skip
    assert leader["placement:long"].tolist()[:8] == [1, 0, 0, 21, 1, 21, 53, 2]  # member 1 filled at token 53
    assert leader["blocks_used"].tolist() == [0, 0]
    assert leader["member_blocks_used"].tolist() == [0, 0]
    assert [int(r["blocks_used"]) for r in results[1:]] == [0, 0]


def test_group_engine_scale_downs_move_kv_once_and_keep_the_engine_tokens(tiny_dir, tmp_path, caplog):
    """Scale-downs in a running group: by the policy (a range below 16 tokens merges into a neighbour with room: two
    front merges) and asked for (`request_scale_down`: a's tail and master leaves, its range goes to the end of
    its predecessor's, which becomes the tail while the master keeps mastering without KV); greedy
    tokens stay the single engine's, each move sends its range's KV once and every block is freed."""
    from spindle_engine.kvp.group_testing import group_engine_worker
    from spindle_model.testing import run_gloo

    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    script = [
        # [0, 15) on 0, [15, 30) on 1, [30, 40) on 2, mastered by 2; the policy merges 0's range into 1's front
        {"step": 0, "op": "resume", "id": "a", "prompt": _ids(40, 1), "params": greedy},
        {"step": 1, "op": "resume", "id": "b", "prompt": _ids(9, 2), "params": {**greedy, "max_tokens": 8}},
        # [0, 15) on 0 and a 5-token tail on 2, mastered by 1: the policy merges 0's range into 2's front
        {"step": 2, "op": "resume", "id": "c", "prompt": _ids(20, 3), "params": {**greedy, "max_tokens": 9}},
        {"step": 4, "op": "scale_down", "id": "a", "member": 2},  # a's tail and master: 1 becomes the tail
    ]
    config = {"model": tiny_dir, "block_size": 4, "kv_cache_tokens": 64, "max_model_len": 128}
    results = run_gloo(group_engine_worker, 3, tmp_path, json.dumps(config), 15, json.dumps(script), 16, timeout=120)
    leader = results[0]
    got = {k.removeprefix("tokens:"): v.tolist() for k, v in leader.items() if k.startswith("tokens:")}
    engine = Engine(EngineConfig(model=tiny_dir, block_size=4, kv_cache_tokens=4096, max_model_len=128))
    for e in script:
        if e["op"] == "resume":
            engine.add_request(e["id"], e["prompt"], SamplingParams(**e["params"]))
    ref: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            ref.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert got == ref
    assert int(leader["scale_downs"]) == 3 and int(leader["scale_ups"]) == 0
    moved = [r["moved"].tolist() for r in results]  # per member: [bytes, tokens]
    assert [t for _, t in moved] == [15 + 15, 0, 14]  # a's and c's [0, 15); a's [30, 44) after 4 steps
    per_token = 3 * 2 * 3 * 8 * 4  # layers x (K, V) x KV heads x head dim x fp32
    assert all(b == t * per_token for b, t in moved)
    assert leader["blocks_used"].tolist() == [0, 0] and leader["member_blocks_used"].tolist() == [0, 0]
    assert [int(r["blocks_used"]) for r in results[1:]] == [0, 0]
    print(f"\n[kvp scale-down] moved {sum(b for b, _ in moved)} B for {sum(t for _, t in moved)} tokens")


def test_a_tail_scaled_up_for_want_of_room_moves_back_when_the_room_returns(tiny_dir, tmp_path):
    """10 blocks of 4 per member: "first" ([0, 8) on 0, [8, 16) on 1, [16, 20) on 2) leaves member 0 room for 8
    blocks, which "long" (32 tokens, no range split possible) fills; its next token scales it up onto member 1.
    Once "first" finishes, member 0 has room again and the policy merges long's 2-token tail back into its range."""
    from spindle_engine.kvp.group_testing import group_engine_worker
    from spindle_model.testing import run_gloo

    greedy = {"temperature": 0, "ignore_eos": True}
    script = [
        {"step": 0, "op": "resume", "id": "first", "prompt": _ids(20, 5), "params": {**greedy, "max_tokens": 4}},
        {"step": 1, "op": "resume", "id": "long", "prompt": _ids(32, 6), "params": {**greedy, "max_tokens": 6}},
    ]
    config = {"model": tiny_dir, "block_size": 4, "kv_cache_tokens": 40, "max_model_len": 128}
    results = run_gloo(group_engine_worker, 3, tmp_path, json.dumps(config), 8, json.dumps(script), 8, timeout=120)
    leader = results[0]
    got = {k.removeprefix("tokens:"): v.tolist() for k, v in leader.items() if k.startswith("tokens:")}
    engine = Engine(EngineConfig(model=tiny_dir, block_size=4, kv_cache_tokens=4096, max_model_len=128))
    for e in script:
        engine.add_request(e["id"], e["prompt"], SamplingParams(**e["params"]))
    ref: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            ref.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert got == ref
    assert int(leader["scale_ups"]) == 1 and int(leader["scale_downs"]) == 1
    assert [r["moved"].tolist() for r in results] == [[0, 0], [2 * 3 * 2 * 3 * 8 * 4, 2], [0, 0]]
    assert leader["blocks_used"].tolist() == [0, 0] and leader["member_blocks_used"].tolist() == [0, 0]
    assert [int(r["blocks_used"]) for r in results[1:]] == [0, 0]


def test_a_member_killed_mid_decode_fails_only_its_requests(tiny_dir, tmp_path):
    """Member 1 dies inside a step: the requests it mastered or held KV of fail, the others finish with the single
    engine's tokens, the survivors free every block and the group never places on member 1 again."""
    from spindle_engine.kvp.group_testing import group_kill_worker, run_survivors

    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    script = [
        {"step": 0, "op": "resume", "id": "long", "prompt": _ids(40, 1), "params": greedy},  # on 0 and 1
        {"step": 0, "op": "resume", "id": "short", "prompt": _ids(9, 2), "params": {**greedy, "max_tokens": 14}},
        {"step": 1, "op": "resume", "id": "mid", "prompt": _ids(5, 4), "params": greedy},
        {"step": 1, "op": "resume", "id": "four", "prompt": _ids(7, 5), "params": greedy},
        {"step": 7, "op": "resume", "id": "late", "prompt": _ids(11, 6), "params": {**greedy, "max_tokens": 5}},
    ]
    config = {"model": tiny_dir, "block_size": 4, "kv_cache_tokens": 64, "max_model_len": 128}
    t0 = time.monotonic()
    results = run_survivors(group_kill_worker, 3, tmp_path, json.dumps(config), 21, json.dumps(script), 1, 4)
    elapsed = time.monotonic() - t0
    leader = results[0]
    assert leader, "the leader did not survive"
    assert results[1] == {}  # the victim
    placed = {k.removeprefix("placed:"): v.tolist() for k, v in leader.items() if k.startswith("placed:")}
    failed = {k.removeprefix("failed:") for k in leader if k.startswith("failed:")}
    got = {k.removeprefix("tokens:"): v.tolist() for k, v in leader.items() if k.startswith("tokens:")}
    involved = {rid for rid, members in placed.items() if 1 in members}
    assert failed == involved and {"long", "four"} <= failed, (placed, failed)  # long: KV on 1; four: all on 1
    assert placed["mid"] == [0, 2]  # mastered by 0, KV on 2: its q and partial states cross the survivors' link
    assert 1 not in placed["late"]  # placed after the death: never on the dead member
    survivors = [e for e in script if e["id"] not in failed]
    assert survivors
    engine = Engine(EngineConfig(model=tiny_dir, block_size=4, kv_cache_tokens=4096, max_model_len=128))
    for e in survivors:
        engine.add_request(e["id"], e["prompt"], SamplingParams(**e["params"]))
    ref: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            ref.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert {rid: got[rid] for rid in ref} == ref
    assert all(len(got[rid]) < 12 for rid in failed)
    assert leader["gone"].tolist() == [1]
    assert int(leader["num_blocks"]) == 2 * 16  # the group's capacity shrank by the dead member's blocks
    assert leader["blocks_used"].tolist() == [0, 0]
    assert leader["member_blocks_used"].tolist() == [[2, 0]]
    assert int(results[2]["blocks_used"]) == 0
    print(f"\n[kvp kill] 3 members, member 1 killed at step 4: {len(failed)} failed, {len(ref)} exact, {elapsed:.1f}s")


def test_a_leaver_killed_before_its_kv_arrives_fails_only_that_request(tiny_dir, tmp_path):
    """Member 1 leaves a's holders (its [15, 30) goes to the leader's end) and dies before sending it: a fails (the
    plan no longer names member 1 as a holder; the move in flight does), b goes on exact, every block is freed."""
    from spindle_engine.kvp.group_testing import group_kill_worker, run_survivors

    greedy = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    script = [
        {"step": 0, "op": "resume", "id": "a", "prompt": _ids(40, 1), "params": greedy},  # 0, 1, 2; mastered by 2
        {"step": 0, "op": "resume", "id": "b", "prompt": _ids(9, 2), "params": greedy},  # on 2, mastered by 0
        {"step": 2, "op": "scale_down", "id": "a", "member": 1},
    ]
    config = {"model": tiny_dir, "block_size": 4, "kv_cache_tokens": 64, "max_model_len": 128}
    args = (json.dumps(config), 15, json.dumps(script), 1, 3, True)  # dies in its third step, before moving
    results = run_survivors(group_kill_worker, 3, tmp_path, *args)
    leader = results[0]
    assert leader and results[1] == {}
    placed = {k.removeprefix("placed:"): v.tolist() for k, v in leader.items() if k.startswith("placed:")}
    assert placed == {"a": [2, 0, 1, 2], "b": [0, 2]}
    failed = {k.removeprefix("failed:") for k in leader if k.startswith("failed:")}
    assert failed == {"a"}
    engine = Engine(EngineConfig(model=tiny_dir, block_size=4, kv_cache_tokens=4096, max_model_len=128))
    engine.add_request("b", script[1]["prompt"], SamplingParams(**greedy))
    ref: list[int] = []
    while engine.has_unfinished():
        ref += [t for o in engine.step() for t in o.new_token_ids]
    assert leader["tokens:b"].tolist() == ref
    assert leader["gone"].tolist() == [1]
    assert leader["blocks_used"].tolist() == [0, 0] and leader["member_blocks_used"].tolist() == [[2, 0]]
    assert int(results[2]["blocks_used"]) == 0
