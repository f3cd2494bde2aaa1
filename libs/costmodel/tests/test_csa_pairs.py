"""CSA's attended share of causal pairs (`spindle_costmodel.csa.pair_fraction`) against the tensor reference's
count on even segments (`spindle_attention.csa.dropped_pairs`, which rounds kept tokens per segment)."""

import pytest
import torch

from spindle_attention.csa import CSALevels, dropped_pairs, kept_tokens
from spindle_costmodel.csa import pair_fraction


@pytest.mark.parametrize(("members", "levels"), [(2, 2), (4, 3), (4, 2), (8, 4), (8, 3), (6, 4)])
@pytest.mark.parametrize("drop", [0.0, 0.125, 0.25, 0.5])
def test_pair_fraction_matches_the_reference_mask(members: int, levels: int, drop: float) -> None:
    t = 64 * members  # segments of 64: every kept count is whole
    csa = CSALevels.even(t, members, levels, drop)
    importance = torch.rand(1, t, generator=torch.Generator().manual_seed(members))
    attended, dense = dropped_pairs(csa, kept_tokens(csa, importance, 1))
    # the reference counts each own segment's diagonal (T(T+1)/2 pairs); the model counts halves of squares
    diagonal = t
    assert pair_fraction(members, levels, drop) == pytest.approx((attended - diagonal / 2) / (dense - diagonal / 2),
                                                                 rel=2e-2)  # fmt: skip


def test_nothing_dropped_or_one_level_keeps_every_pair_and_bad_settings_are_refused() -> None:
    assert pair_fraction(8, 4, 0.0) == 1.0 and pair_fraction(8, 1, 0.5) == 1.0
    assert pair_fraction(8, 4, 0.2) < pair_fraction(8, 2, 0.2) < 1.0  # more levels drop more of the far pairs
    with pytest.raises(ValueError, match="takes 1 to 3 levels"):
        pair_fraction(4, 4, 0.1)
    with pytest.raises(ValueError, match="drop in"):
        pair_fraction(4, 2, 1.0)
