"""CSA (CSPS §3.2.4), the single-process reference: with nothing dropped it is dense causal attention (shapes that
do not divide evenly, GQA); with tokens dropped it equals dense attention under the same mask (the oracle); the
kept sets follow the per-level fractions, are nested across levels and never touch a query's own segment."""

import pytest
import torch

from spindle_attention import attention_fwd
from spindle_attention.csa import (
    CSALevels,
    CSAPrompt,
    csa_attention,
    dense_oracle,
    dropped_pairs,
    kept_tokens,
    key_importance,
    level_masks,
    place_by_proximity,
)


def _qkv(t: int, hq: int = 6, hkv: int = 2, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))


@pytest.mark.parametrize("t, members", [(53, 5), (40, 4), (17, 3), (9, 1), (64, 8)])
def test_nothing_dropped_is_dense_causal_attention_at_every_level_count(t: int, members: int) -> None:
    q, k, v = _qkv(t)
    want, want_lse = attention_fwd(q, k, v, return_lse=True)
    most = CSALevels.even(t, members).num_levels
    for num_levels in range(1, most + 1):
        levels = CSALevels.even(t, members, num_levels)
        out, lse = csa_attention(q, k, v, levels, kept_tokens(levels, None, 2))
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("drop", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("members, num_levels", [(5, 4), (4, 2), (8, 3)])
def test_dropping_equals_dense_attention_under_the_same_mask(drop: float, members: int, num_levels: int) -> None:
    q, k, v = _qkv(61, seed=1)
    levels = CSALevels.even(61, members, num_levels, drop)
    importance = torch.rand(2, 61, generator=torch.Generator().manual_seed(2))
    kept = kept_tokens(levels, importance, 2)
    out, lse = csa_attention(q, k, v, levels, kept)
    want, want_lse = dense_oracle(q, k, v, levels, kept)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    attended, dense = dropped_pairs(levels, kept)
    assert attended < dense


def test_drop_ratio_doubles_per_level_kept_sets_nest_and_spare_the_own_segment() -> None:
    levels = CSALevels.even(100, 4, 3, drop=0.2)  # segments of 25; level 2 keeps 80 %, level 3 60 %
    assert [levels.kept_fraction(lv) for lv in (1, 2, 3)] == pytest.approx([1.0, 0.8, 0.6])
    assert CSALevels.even(100, 8, 4, drop=0.3).kept_fraction(4) == 0.0  # 4 x 0.3 drops everything there
    importance = torch.arange(100, dtype=torch.float32).repeat(2, 1)  # later tokens more important
    kept = kept_tokens(levels, importance, 2)
    for s, e in levels.segments:
        assert kept[0, :, s:e].all()
        assert kept[1, 0, s:e].sum() == 20 and kept[2, 0, s:e].sum() == 15
        assert kept[2, 0, e - 15 : e].all()  # the most important stay
    assert (kept[2] <= kept[1]).all() and (kept[1] <= kept[0]).all()
    masks = level_masks(levels, kept)
    own = masks[0, 0]
    for s, e in levels.segments:  # level 1: every query attends its whole own segment's prefix
        block = own[s:e, s:e]
        assert torch.equal(block, torch.ones(e - s, e - s, dtype=torch.bool).tril())
    assert not (masks[0] & masks[1]).any() and not (masks[1] & masks[2]).any()  # the levels are disjoint


def test_the_printed_rule_keeps_more_of_farther_levels_and_still_equals_its_oracle() -> None:
    """§3.2.4's formula as printed, 1 - p = (1 - p') / 2^n with p, p' drop ratios: level 2+n keeps 2^n (1 - p)."""
    levels = CSALevels.even(100, 8, 4, drop=0.7, rule="printed")
    assert [levels.kept_fraction(lv) for lv in (1, 2, 3, 4)] == pytest.approx([1.0, 0.3, 0.6, 1.0])
    assert CSALevels.even(100, 8, 4, drop=0.3, rule="printed").kept_fraction(3) == 1.0  # p <= 1/2: level 2 only
    q, k, v = _qkv(61, seed=3)
    odd = CSALevels.even(61, 5, 4, 0.6, "printed")
    kept = kept_tokens(odd, torch.rand(2, 61, generator=torch.Generator().manual_seed(4)), 2)
    assert (kept[1] <= kept[2]).all()  # nested the other way: level 3's kept tokens include level 2's
    out, lse = csa_attention(q, k, v, odd, kept)
    want, want_lse = dense_oracle(q, k, v, odd, kept)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="level rule"):
        CSALevels.even(100, 4, 3, drop=0.2, rule="halving")


def test_levels_group_neighbours_and_end_with_the_whole_sequence() -> None:
    levels = CSALevels.even(50, 5)
    assert levels.num_levels == 4 and levels.segments[0] == (0, 10)
    assert [levels.group(2, m) for m in range(5)] == [(0, 2), (0, 2), (2, 4), (2, 4), (4, 5)]
    assert levels.group(3, 4) == (4, 5) and levels.group(4, 4) == (0, 5)
    assert CSALevels.even(50, 5, 2).group(2, 1) == (0, 5)  # two levels: own segment, then everything
    with pytest.raises(ValueError, match="take 1 to 4 levels"):
        CSALevels.even(50, 5, 5)
    with pytest.raises(ValueError, match="drop ratio"):
        CSALevels.even(50, 5, drop=1.0)
    with pytest.raises(ValueError, match="consecutive"):
        CSALevels(((0, 5), (6, 9)), 2)


def test_members_are_placed_by_gpu_proximity_and_importance_comes_from_received_attention() -> None:
    ids = ["1-0-1", "0-1-0", "0-0-1", "0-0-0", "1-0-0"]
    assert place_by_proximity(ids) == [3, 2, 1, 4, 0]
    with pytest.raises(ValueError, match="rack-server-gpu"):
        place_by_proximity(["0-0"])
    probs = torch.zeros(4, 3, 3)  # 4 query heads over 2 KV heads, 3 queries, 3 keys
    probs[:, :, 0] = 1.0  # every query attends key 0 only
    importance = key_importance(probs, 2, per_query=False)
    assert importance.shape == (2, 3) and importance[:, 0].tolist() == [3.0, 3.0] and importance[:, 1:].sum() == 0
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]])[None].expand(2, 2, 2)  # causal: key 1 seen by query 1 alone
    assert key_importance(probs, 1, per_query=False).tolist() == [[1.5, 0.5]]
    assert key_importance(probs, 1).tolist() == [[0.75, 0.5]]  # mean over the queries that attended it


@pytest.mark.parametrize("scope", ["own", "all", "all-sum"])
def test_a_prompt_measures_importance_block_by_block_as_from_the_whole_probabilities(scope: str) -> None:
    q, k, v = _qkv(45, seed=3)
    levels = CSALevels.even(45, 3, drop=0.4)
    ctx = CSAPrompt(levels, (0, 3), block=16, importance=scope)
    ctx.attention(0, q, k, v)  # a dense layer: what it measures, the next layer drops by
    mask = torch.ones(45, 45, dtype=torch.bool).tril()
    if scope == "own":  # each segment's queries over their own segment
        member = levels.member_of()
        mask &= member[:, None] == member[None, :]
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(3, dim=1)) / 4.0
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    torch.testing.assert_close(ctx.importance, key_importance(probs, 2, per_query=scope != "all-sum"))
    with pytest.raises(ValueError, match="importance is one of"):
        CSAPrompt(levels, (0, 3), importance="sum")
