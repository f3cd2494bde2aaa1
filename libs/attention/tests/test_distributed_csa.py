"""CSA over all-to-all SP on real gloo groups: with nothing dropped it is dense causal attention; with tokens dropped
it equals the single-process reference (`csa_attention`) on the same kept sets; the importance each member measures
alone equals the reference's "own" scope; a row travels at most once over the levels, dropping sends fewer bytes."""

import pytest
import torch
import torch.distributed as dist

from spindle_attention import attention_fwd
from spindle_attention.csa import CSALevels, csa_attention, kept_tokens, key_importance
from spindle_attention.distributed import CommStats, RankGroup
from spindle_attention.distributed.csa_all_to_all import csa_all_to_all_attention, forward_rows
from spindle_attention.distributed.testing import run_group


def _qkv(t: int, hq: int, hkv: int, seed: int, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def _case(
    me: int,
    group,
    t: int,
    members: int,
    num_levels: int,
    drop: float,
    hq: int,
    hkv: int,
    partitions: str = "member",
    rule: str = "doubling",
) -> int:
    q, k, v = _qkv(t, hq, hkv, seed=t + members)
    levels = CSALevels.even(t, members, num_levels, drop, rule)
    importance = torch.rand(hkv, t, generator=torch.Generator().manual_seed(t))
    s, e = levels.segments[me]
    stats = CommStats()
    out, lse, measured = csa_all_to_all_attention(
        q[s:e], k[s:e], v[s:e], levels, group, importance=importance[:, s:e], measure=True, stats=stats,
        partitions=partitions,
    )  # fmt: skip
    if drop == 0.0:
        want, want_lse = attention_fwd(q, k, v)
    else:
        want, want_lse = csa_attention(q, k, v, levels, kept_tokens(levels, importance, hkv))
    _close(out, want[s:e])
    _close(lse, want_lse[:, s:e])
    scores = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e].repeat_interleave(hq // hkv, dim=1)) / 8**0.5
    causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    if num_levels > 1:
        _close(measured, key_importance(probs, hkv))
    return stats.bytes_sent


def _worker(rank: int, ws: int) -> None:
    # a level's rows attended member by member as they land (the default), and the level at once
    for t, hq, hkv, partitions in ((53, 6, 2, "member"), (38, 9, 3, "level"), (41, 4, 4, "member")):
        most = CSALevels.even(t, ws).num_levels
        for num_levels in range(1, most + 1):
            dense = _case(rank, None, t, ws, num_levels, 0.0, hq, hkv, partitions)
            for drop in (0.3, 0.6):
                sparse = _case(rank, None, t, ws, num_levels, drop, hq, hkv, partitions)
                if num_levels > 1:
                    assert sparse <= dense, (num_levels, drop, sparse, dense)
        # the formula as printed: farther levels keep more (at 0.6, level 3 keeps 80 %, level 4 all)
        printed = _case(rank, None, t, ws, most, 0.6, hq, hkv, partitions, rule="printed")
        assert printed <= dense


@pytest.mark.parametrize("ws", [2, 3, 4, 5])
def test_csa_all_to_all_equals_dense_and_the_reference(ws: int) -> None:
    run_group(_worker, ws)


def _subgroup_worker(rank: int, ws: int) -> None:
    group = RankGroup((3, 0, 2))  # three of four ranks, in proximity order, not rank order
    if rank in group.ranks:
        _case(group.ranks.index(rank), group, 47, 3, 3, 0.4, 4, 2)
    dist.barrier()


def test_csa_all_to_all_runs_on_a_rank_group_of_some_ranks() -> None:
    run_group(_subgroup_worker, 4)


@pytest.mark.parametrize("members", [2, 3, 4, 5, 8])
def test_every_row_travels_at_most_once_and_only_where_causality_needs_it(members: int) -> None:
    levels = CSALevels.even(100, members, drop=0.2)
    for src in range(members):
        for dst in range(members):
            if src == dst:
                continue
            seen: dict[tuple[str, int], int] = {}
            for rows in forward_rows(levels, src, dst, 6, 2, dense=False).values():
                for r in rows:
                    assert r.start == seen.get((r.kind, r.head), 0) and r.end > r.start
                    seen[(r.kind, r.head)] = r.end
            if src == members - 1:  # the last segment's keys are in every other query's future
                assert not any(kind in ("k", "v") for kind, _ in seen)
            if src == 0:  # the first segment's queries have no earlier keys
                assert not any(kind == "q" for kind, _ in seen)
