"""Tensor parallelism over a `RankGroup` (point-to-point on the default group, no `new_group`)."""

import pytest
import torch

from spindle_model import CausalAttention
from spindle_model.testing import rank_group_all_reduce_worker, run_gloo, tiny_llama, tiny_tp_logits_worker


@pytest.mark.parametrize("world", [2, 3])
def test_rank_group_all_reduce_is_the_sum_and_bitwise_equal_everywhere(world, tmp_path):
    results = run_gloo(rank_group_all_reduce_worker, world, tmp_path, [5, 7])
    expected = sum(r["input"] for r in results)
    for r in results:
        assert torch.equal(r["output"], results[0]["output"])
        torch.testing.assert_close(r["output"], expected)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_tiny_tp_logits_over_a_rank_group_match_one_process(world, tmp_path):
    ids = torch.randint(0, 301, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    _, model = tiny_llama()
    with torch.inference_mode():
        ref = model.compute_logits(model(torch.arange(len(ids)), CausalAttention(), input_ids=torch.tensor(ids)))
    results = run_gloo(tiny_tp_logits_worker, world, tmp_path, ids)
    for r in results:
        assert torch.equal(r["logits"], results[0]["logits"])  # every rank samples the same tokens
    torch.testing.assert_close(results[0]["logits"], ref, rtol=1e-4, atol=1e-4)
