"""KVP placement plans, one member's shard store, and a one-member decoder group (in-process, fast)."""

from itertools import pairwise

import pytest
import torch

from spindle_attention import attention_fwd, merge_attn_states_many
from spindle_engine.kv_cache import BlockAllocator, KVCache, OutOfBlocksError
from spindle_engine.kvp import KVPPlan, KVPRequest, KVRange, KVShard, parse_bounds, proportional_bounds


def test_split_append_and_scale_up_keep_existing_ranges():
    req = KVPRequest.split("r", 0, [0, 1], [0, 413, 1001])
    assert req.holders == (0, 1) and req.tail == 1 and req.num_tokens == 1001
    req = req.append().append(2)
    assert req.ranges == (KVRange(0, 0, 413), KVRange(1, 413, 1004))
    up = req.scale_up(2)
    assert up.tail == 2 and up.holders == (0, 1) and up.ranges[:2] == req.ranges  # nothing moved
    up = up.append()
    assert up.holders == (0, 1, 2) and up.range_of(2) == KVRange(2, 1004, 1005) and up.num_tokens == 1005


@pytest.mark.parametrize(
    ("members", "bounds", "match"),
    [
        ([0, 1], [0, 10], "bounds"),
        ([0, 1], [1, 5, 10], "start at token 0"),
        ([0, 1], [0, 0, 5], "only the tail"),
        ([0, 0], [0, 5, 10], "distinct"),
        ([0, 1], [0, 6, 5], "negative"),
    ],
)
def test_bad_splits_are_value_errors(members, bounds, match):
    with pytest.raises(ValueError, match=match):
        KVPRequest.split("r", 0, members, bounds)


def test_scale_up_rules():
    req = KVPRequest.split("r", 0, [0, 1], [0, 5, 9])
    with pytest.raises(ValueError, match="already holds"):
        req.scale_up(0)
    with pytest.raises(ValueError, match="has not received"):
        req.scale_up(2).scale_up(3)
    with pytest.raises(ValueError, match="n >= 1"):
        req.append(0)


def test_plan_messages_follow_admission_order():
    plan = KVPPlan([0, 1, 2])
    plan.add(KVPRequest.split("a", 0, [0, 1, 2], [0, 3, 7, 9]))
    plan.add(KVPRequest.split("b", 2, [1, 0], [0, 4, 6]))
    plan.add(KVPRequest.split("c", 0, [1], [0, 5]))
    assert [r.request_id for r in plan.mastered_by(0)] == ["a", "c"]
    assert [r.request_id for r in plan.served(0, 1)] == ["a", "c"]
    assert [r.request_id for r in plan.served(2, 0)] == ["b"]
    assert plan.served(0, 2)[0].request_id == "a" and plan.served(2, 1)[0].request_id == "b"
    with pytest.raises(ValueError, match="already placed"):
        plan.add(KVPRequest.split("a", 0, [0], [0, 3]))
    with pytest.raises(ValueError, match="outside"):
        plan.add(KVPRequest.split("d", 5, [0], [0, 3]))
    with pytest.raises(ValueError, match="outside"):
        plan.scale_up("a", 7)
    with pytest.raises(ValueError, match="unknown"):
        plan.append("zzz")
    plan.finish("a")
    assert list(plan.requests) == ["b", "c"]


def test_bounds_helpers():
    b = proportional_bounds(1001, [1, 2, 3])
    assert b[0] == 0 and b[-1] == 1001 and all(x < y for x, y in pairwise(b))
    assert any(x % 16 for x in b[1:-1])  # not block-aligned
    assert proportional_bounds(3, [1, 1, 100]) == [0, 1, 2, 3]
    assert parse_bounds("0,413", 1001) == [0, 413, 1001]
    for bad in ("1,5", "0,5,5", "0,2000", "0,x"):
        with pytest.raises(ValueError):
            parse_bounds(bad, 1001)
    with pytest.raises(ValueError):
        proportional_bounds(2, [1, 1, 1])


def _shard(num_blocks: int = 8) -> KVShard:
    return KVShard(KVCache(2, num_blocks, 4, 2, 8, torch.float32), BlockAllocator(num_blocks, 4))


def test_shard_ranges_partial_attention_merge_and_block_accounting():
    torch.manual_seed(0)
    n, split = 11, 6  # neither range is block-aligned (block size 4)
    kv = torch.randn(2, 2, n + 1, 2, 8)
    a, b = _shard(), _shard()
    a.add_range("r", 0, kv[:, :, :split])
    b.add_range("r", split, kv[:, :, split:n])
    slot = b.grow("r")  # the tail receives the new token
    for layer in range(2):
        b.write(layer, slot, kv[0, layer, n:], kv[1, layer, n:])
    assert b.num_tokens("r") == n + 1 - split and torch.equal(b.read("r"), kv[:, :, split:])
    q = torch.randn(1, 4, 8)
    for layer in range(2):
        states = [s.attend(layer, ["r"], q) for s in (a, b)]
        out, _ = merge_attn_states_many([o for o, _ in states], [lse for _, lse in states])
        full, _ = attention_fwd(q, kv[0, layer], kv[1, layer], causal=False)
        torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)
    assert a.allocator.blocks_by_owner() == {"r": 2} and b.allocator.blocks_by_owner() == {"r": 2}
    for s in (a, b):
        assert s.free("r") and not s.free("r")
        s.allocator.check_invariants()
        assert s.allocator.num_used == 0


def test_shard_out_of_blocks_holds_nothing():
    s = _shard(num_blocks=2)
    with pytest.raises(OutOfBlocksError):
        s.add_range("big", 0, torch.zeros(2, 2, 9, 2, 8))
    assert s.allocator.num_used == 0 and "big" not in s
    s.add_range("r", 0)  # a scale-up's empty tail
    s.grow("r", 8)
    with pytest.raises(OutOfBlocksError):
        s.grow("r")
    s.free_all()
    s.allocator.check_invariants()


def test_one_member_group_decodes_like_the_engine_and_refuses_to_outgrow_its_blocks():
    """A one-member group needs no process group: the decoder, context and shard alone, against the engine."""
    from spindle_engine import Engine, EngineConfig, SamplingParams
    from spindle_engine.kvp import KVPMember
    from spindle_engine.kvp.testing import prompt_kv
    from spindle_model.testing import tiny_llama

    _, model = tiny_llama(seed=5)
    ids = list(range(3, 40))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(block_size=16, kv_cache_tokens=256, max_model_len=128), model=model)
    engine.add_request("r", ids, params)
    ref = []
    while engine.has_unfinished():
        ref += engine.step()[0].new_token_ids
    kv, logits = prompt_kv(model, ids)
    dec = KVPMember(model, 0, {0: 0}, num_blocks=3, max_model_len=128)  # 48 slots: 37 + 4 fit, 37 + 12 do not
    dec.add_request(
        KVPRequest.split("r", 0, [0], [0, len(ids)]), kv, token_ids=[*ids, int(logits.argmax())], params=params
    )
    tokens = [dec.seqs["r"].token_ids[-1]]
    while dec.has_unfinished():
        tokens += [o.token for o in dec.step()]
    assert tokens == ref and dec.blocks_used == 0
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    dec.add_request(KVPRequest.split("x", 0, [0], [0, len(ids)]), kv, token_ids=[*ids, 1], params=long)
    with pytest.raises(OutOfBlocksError):
        while dec.has_unfinished():
            dec.step()
    assert dec.plan.get("x").num_tokens == 48  # the refused step changed nothing
    dec.abort_all()
    dec.shard.allocator.check_invariants()
    assert dec.blocks_used == 0


def test_scale_down_merges_into_the_neighbour_before_else_after():
    req = KVPRequest.split("r", 2, [0, 1, 2], [0, 37, 101, 150])
    down = req.scale_down(1)  # a middle range: its predecessor's range grows at its end
    assert down.ranges == (KVRange(0, 0, 101), KVRange(2, 101, 150)) and down.master == 2
    assert req.scale_down(1, into=2).ranges == (KVRange(0, 0, 37), KVRange(2, 37, 150))
    first = req.scale_down(0)  # the first range: its successor takes it in front of its own
    assert first.ranges == (KVRange(1, 0, 101), KVRange(2, 101, 150))
    tail = req.scale_down(2)  # the tail (and master) leaves: the receiver becomes the tail, the master stays
    assert tail.ranges == (KVRange(0, 0, 37), KVRange(1, 37, 150)) and tail.tail == 1 and tail.master == 2
    fresh = req.scale_up(3).scale_down(3)  # an empty tail leaves: nothing moves
    assert fresh.ranges == req.ranges
    plan = KVPPlan([0, 1, 2])
    plan.add(req)
    assert plan.scale_down("r", 0).ranges == first.ranges and plan.get("r") == first


@pytest.mark.parametrize(
    ("member", "into", "match"),
    [(5, None, "holds no range"), (0, 2, "next to"), (1, 1, "next to")],
)
def test_scale_down_rules(member, into, match):
    req = KVPRequest.split("r", 0, [0, 1, 2], [0, 5, 9, 12])
    with pytest.raises(ValueError, match=match):
        req.scale_down(member, into)


def test_the_last_holder_cannot_leave():
    with pytest.raises(ValueError, match="only holder"):
        KVPRequest.split("r", 0, [1], [0, 5]).scale_down(1)


@pytest.mark.parametrize("front", [False, True])
def test_shard_merge_at_either_end_keeps_local_slot_zero(front):
    """A receiver takes an adjacent range (block size 4, neither range block-aligned); its partial attention then
    equals attention over the merged tokens, and the leaver's blocks are all free."""
    torch.manual_seed(1)
    kv = torch.randn(2, 2, 13, 2, 8)
    split = 6
    leaver, receiver = _shard(), _shard()
    mine, theirs = (slice(split, 13), slice(0, split)) if front else (slice(0, split), slice(split, 13))
    receiver.add_range("r", mine.start, kv[:, :, mine])
    leaver.add_range("r", theirs.start, kv[:, :, theirs])
    leaver.add_range("other", 0, torch.randn(2, 2, 3, 2, 8))  # its blocks come first: the merge is not a copy
    receiver.make_room("r", theirs.stop - theirs.start)
    moved = leaver.take("r")
    assert "r" not in leaver and leaver.allocator.blocks_by_owner() == {"other": 1}
    receiver.merge("r", moved, front=front)
    assert receiver.start("r") == 0 and receiver.num_tokens("r") == 13
    assert torch.equal(receiver.read("r"), kv)
    assert receiver.allocator.blocks_by_owner() == {"r": 4}
    q = torch.randn(1, 4, 8)
    for layer in range(2):
        out, _ = receiver.attend(layer, ["r"], q)
        full, _ = attention_fwd(q, kv[0, layer], kv[1, layer], causal=False)
        torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)
    slot = receiver.grow("r")  # the merged range still grows at its end
    assert int(slot) // 4 in receiver._ranges["r"].table and receiver.num_tokens("r") == 14


def test_shard_make_room_refuses_without_change():
    s = _shard(num_blocks=3)
    s.add_range("r", 0, torch.zeros(2, 2, 9, 2, 8))  # 3 blocks
    with pytest.raises(OutOfBlocksError):
        s.make_room("r", 4)
    assert s.num_tokens("r") == 9 and s.allocator.num_used == 3
    s.make_room("r", 3)  # fits the last block's free slots
    s.free_all()
    s.allocator.check_invariants()
