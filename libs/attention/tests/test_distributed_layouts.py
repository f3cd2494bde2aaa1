"""Sharding layouts: exact cover for any token count, documented balance, shard/unshard round trip."""

import pytest
import torch

from spindle_attention.distributed import LAYOUTS, shard, shard_indices, shard_positions, unshard


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_cover_every_token_once_and_balance(layout):
    for sp in range(1, 9):
        for n in [*range(0, 3 * sp + 2), 277, 1001]:
            idx = shard_indices(n, sp, layout)
            assert len(idx) == sp
            allidx = torch.cat(idx)
            assert torch.equal(torch.sort(allidx).values, torch.arange(n))
            sizes = [i.numel() for i in idx]
            assert max(sizes) - min(sizes) <= 1, (layout, n, sp, sizes)
            for i in idx:
                assert i.dtype == torch.int64 and (i.numel() < 2 or bool((i[1:] > i[:-1]).all()))


def test_layout_shapes():
    assert [i.tolist() for i in shard_indices(10, 2, "stripe")] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert [i.tolist() for i in shard_indices(8, 2, "zigzag")] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [i.tolist() for i in shard_indices(5, 2, "contiguous")] == [[0, 1, 2], [3, 4]]
    assert [i.tolist() for i in shard_indices(2, 4, "contiguous")] == [[0], [1], [], []]
    assert shard_positions(8, 2, "zigzag", 1, offset=100).tolist() == [102, 103, 104, 105]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_unshard_round_trip(layout):
    x = torch.randn(277, 3, 4)
    for sp in (1, 2, 3, 4, 300):
        assert torch.equal(unshard([shard(x, sp, layout, r) for r in range(sp)], layout), x)


def test_bad_layout_arguments():
    with pytest.raises(ValueError):
        shard_indices(10, 2, "diagonal")
    with pytest.raises(ValueError):
        shard_indices(10, 0, "stripe")
    with pytest.raises(ValueError):
        unshard([torch.zeros(4), torch.zeros(2)], "contiguous")  # 6 tokens split 3/3, not 4/2
