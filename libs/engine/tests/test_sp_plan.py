"""SP prefill plans: parsing, validation, deterministic placement and re-balancing; KV part assembly."""

import pytest
import torch

from spindle_engine.sp import SPChunk, SPPlan, assemble_kv, rebalance_moves, retention_targets, split_for_decode


def test_parse_and_format_round_trip():
    plan = SPPlan.parse("0:300@0;300:900@0,1;900:@0,1,2,3", 1001)
    assert [(c.start, c.end, c.members, c.layout) for c in plan.chunks] == [
        (0, 300, (0,), "zigzag"),
        (300, 900, (0, 1), "zigzag"),
        (900, 1001, (0, 1, 2, 3), "zigzag"),
    ]
    assert SPPlan.parse(plan.format(), 1001) == plan
    mixed = SPPlan.parse("0:10@1,0/stripe;10:@1,0,2/all-to-all", 25, "contiguous")
    assert [c.layout for c in mixed.chunks] == ["stripe", "all-to-all"]
    assert mixed.chunks[1].attention == "ulysses" and mixed.chunks[1].shard_layout == "contiguous"
    assert mixed.members == (1, 0, 2)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("0:300@0;300:@1", "contain the previous"),
        ("0:300@0;301:@0,1", "tile"),
        ("5:@0", "start at token 0"),
        ("0:500@0", "covers 500 tokens"),
        ("0:300@0,0;300:@0,1", "distinct"),
        ("0:300@0/diagonal;300:@0,1", "unknown layout"),
        ("0-300@0", "cannot parse"),
        ("0:300@x", "cannot parse"),
        ("300:0@0", "empty"),
        ("", "at least one chunk"),
    ],
)
def test_bad_plans_are_value_errors(text, match):
    with pytest.raises(ValueError, match=match):
        SPPlan.parse(text, 1001)


@pytest.mark.parametrize(
    "text", ["0:300@0;300:900@0,1;900:@0,1,2,3", "0:500@0,1;500:@0,1,2", "0:7@0,1,2,3;7:@0,1,2,3,4", "0:1001@2"]
)
@pytest.mark.parametrize("layout", ["contiguous", "stripe", "zigzag", "all-to-all"])
def test_placement_covers_every_position_once_and_balances_history(text, layout):
    plan = SPPlan.parse(text, 1001, layout)
    for step in plan.steps():
        computed = torch.cat(list(step.shards.values()))
        assert torch.equal(torch.sort(computed).values, torch.arange(step.chunk.start, step.chunk.end))
        hist = torch.cat(list(step.history.values()))
        assert torch.equal(torch.sort(hist).values, torch.arange(step.chunk.start))
        if step.moves:  # the group grew: history is split evenly (sizes differ by at most one)
            sizes = [h.numel() for h in step.history.values()]
            assert max(sizes) - min(sizes) <= 1
    final = torch.cat(list(plan.final_placement().values()))
    assert torch.equal(torch.sort(final).values, torch.arange(1001))


def test_last_token_member():
    assert SPPlan.parse("0:10@2;10:@2,1", 25).last_token_member() == 2  # zigzag: member 0 of the group has the tail
    assert SPPlan.parse("0:10@2;10:@2,1", 25, "contiguous").last_token_member() == 1
    assert SPPlan.parse("0:@3", 5).last_token_member() == 3


def test_rebalance_moves_fill_new_members_from_surplus_in_order():
    moves = rebalance_moves({0: 300, 1: 0, 2: 0}, (0, 1, 2))
    assert [(m.src, m.dst, m.lo, m.hi) for m in moves] == [(0, 1, 100, 200), (0, 2, 200, 300)]
    moves = rebalance_moves({0: 150, 1: 151, 2: 0}, (0, 1, 2))  # 301 over 3 -> 101, 100, 100
    assert sum(m.count for m in moves) == 100 and {m.dst for m in moves} == {2}
    assert rebalance_moves({0: 5, 1: 5}, (0, 1)) == []


def test_retention_targets_split_contiguously():
    t = retention_targets(10, (2, 0))
    assert t[2].tolist() == [0, 1, 2, 3, 4] and t[0].tolist() == [5, 6, 7, 8, 9]


def test_chunk_validation():
    with pytest.raises(ValueError, match="no members"):
        SPChunk(0, 5, ())


def test_assemble_kv_places_parts_by_position_and_rejects_gaps_and_overlaps():
    kv = torch.randn(2, 3, 10, 4, 8)  # [2, L, N, H, D]
    parts = [
        (torch.tensor([9, 0, 4]), kv[:, :, [9, 0, 4]]),
        (torch.tensor([1, 2, 3, 5, 6, 7, 8]), kv[:, :, [1, 2, 3, 5, 6, 7, 8]]),
    ]
    assert torch.equal(assemble_kv(parts, 10), kv)
    with pytest.raises(ValueError, match="missing or repeated"):
        assemble_kv(parts[:1], 10)
    with pytest.raises(ValueError, match="missing or repeated"):
        assemble_kv([*parts, parts[0]], 10)
    with pytest.raises(ValueError, match="outside"):
        assemble_kv([(torch.tensor([10]), kv[:, :, :1])], 10)
    with pytest.raises(ValueError, match="does not fit"):
        assemble_kv([parts[0], (torch.tensor([1]), kv[:, :2, :1])], 10)


def test_split_for_decode_gives_each_tp_rank_its_heads():
    kv = torch.randn(2, 3, 5, 3, 8)
    a, b = split_for_decode(kv, [(0, 2), (2, 3)])
    assert torch.equal(torch.cat([a, b], dim=3), kv) and a.is_contiguous()
    with pytest.raises(ValueError, match="cover"):
        split_for_decode(kv, [(0, 2)])
