"""CSA's attended share of causal pairs (`spindle_costmodel.csa.pair_fraction`) against the tensor reference's
count on even segments (`spindle_attention.csa.dropped_pairs`, which rounds kept tokens per segment)."""

import pytest
import torch

from spindle_attention.csa import CSALevels, dropped_pairs, kept_tokens
from spindle_costmodel.csa import alltoall_bytes, pair_fraction


@pytest.mark.parametrize(("members", "levels"), [(2, 2), (4, 3), (4, 2), (8, 4), (8, 3), (6, 4)])
@pytest.mark.parametrize(("drop", "rule"), [(0.0, "doubling"), (0.125, "doubling"), (0.25, "doubling"),
                                            (0.5, "doubling"), (0.625, "printed"), (0.25, "printed")])  # fmt: skip
def test_pair_fraction_matches_the_reference_mask(members: int, levels: int, drop: float, rule: str) -> None:
    t = 64 * members  # segments of 64: every kept count is whole
    csa = CSALevels.even(t, members, levels, drop, rule)
    importance = torch.rand(1, t, generator=torch.Generator().manual_seed(members))
    attended, dense = dropped_pairs(csa, kept_tokens(csa, importance, 1))
    # the reference counts each own segment's diagonal (T(T+1)/2 pairs); the model counts halves of squares
    diagonal = t
    want = (attended - diagonal / 2) / (dense - diagonal / 2)
    assert pair_fraction(members, levels, drop, rule) == pytest.approx(want, rel=2e-2)


def test_nothing_dropped_or_one_level_keeps_every_pair_and_bad_settings_are_refused() -> None:
    assert pair_fraction(8, 4, 0.0) == 1.0 and pair_fraction(8, 1, 0.5) == 1.0
    assert pair_fraction(8, 4, 0.2) < pair_fraction(8, 2, 0.2) < 1.0  # more levels drop more of the far pairs
    with pytest.raises(ValueError, match="takes 1 to 3 levels"):
        pair_fraction(4, 4, 0.1)
    with pytest.raises(ValueError, match="drop in"):
        pair_fraction(4, 2, 1.0)


@pytest.mark.parametrize(("members", "levels"), [(2, 2), (4, 3), (4, 2), (8, 4), (6, 4), (5, 3)])
@pytest.mark.parametrize(("drop", "rule"), [(0.0, "doubling"), (0.125, "doubling"), (0.25, "doubling"),
                                            (0.625, "printed")])  # fmt: skip
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(9, 3), (32, 2), (8, 8)])
def test_alltoall_bytes_are_what_csa_all_to_all_sends(
    members: int, levels: int, drop: float, rule: str, q_heads: int, kv_heads: int
) -> None:
    from spindle_attention.distributed.csa_all_to_all import back_heads, forward_rows

    t, d, elem = 64 * members, 16, 4  # segments of 64: every kept count is whole
    csa = CSALevels.even(t, members, levels, drop, rule)
    sent = 0
    for src in range(members):
        for dst in range(members):
            if dst == src:
                continue
            for rows in forward_rows(csa, src, dst, q_heads, kv_heads, dense=False).values():
                sent += sum((r.end - r.start) * (8 if r.kind == "pos" else d * elem) for r in rows)
            for level in range(2, levels + 1):
                heads = back_heads(csa, level, src, dst, q_heads, kv_heads)
                sent += len(heads) * csa.kept_count(level, src) * (4 + d * elem)
    assert alltoall_bytes(t, members, levels, drop, q_heads, kv_heads, d, elem, rule) == pytest.approx(sent, rel=1e-9)


def test_plain_alltoall_bytes_and_what_csa_saves() -> None:
    # SmolLM2's attention (9 / 3 heads of 64, fp32) on examples/doc.txt's 1,115 tokens over 4 members, 30 layers:
    # what `spindle verify --layout all-to-all [--csa-drop 0]` measured (182.3 MB plain, 151.9 MB with CSA)
    layers = 30
    assert alltoall_bytes(1115, 4, 1, 0.0, 9, 3, 64, 4) * layers / 1e6 == pytest.approx(182.3, abs=0.05)
    assert alltoall_bytes(1115, 4, 3, 0.0, 9, 3, 64, 4) * layers / 1e6 == pytest.approx(151.9, abs=0.05)
    assert alltoall_bytes(4096, 8, 4, 0.1, 32, 8, 128, 2) < alltoall_bytes(4096, 8, 4, 0.0, 32, 8, 128, 2)
