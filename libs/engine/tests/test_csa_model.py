"""CSA through a whole model on one process (`spindle_attention.csa.CSAPrompt`): with nothing dropped the prompt's
logits are the plain causal forward's; with a drop ratio, the first and last layers stay dense, every other layer
attends fewer query-key pairs, and the logits move (an approximation: measured by bench/quality_csa.py)."""

import torch

from spindle_attention.csa import CSALevels, CSAPrompt
from spindle_model.llama import CausalAttention
from spindle_model.testing import tiny_llama


@torch.inference_mode()
def test_a_prompt_through_csa_equals_causal_attention_with_nothing_dropped_and_drops_only_middle_layers() -> None:
    _, model = tiny_llama(3, num_layers=4)
    ids = torch.randint(3, 301, (203,), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(ids.numel())
    want = model.compute_logits(model(pos, CausalAttention(), input_ids=ids))
    off = CSAPrompt(CSALevels.even(203, 4), (0, 4), block=64)
    got = model.compute_logits(model(pos, off, input_ids=ids))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert off.attended == off.dense_pairs

    sparse = CSAPrompt(CSALevels.even(203, 4, drop=0.5), (0, 4), block=64)
    moved = model.compute_logits(model(pos, sparse, input_ids=ids))
    assert sparse.attended[0] == sparse.dense_pairs[0] and sparse.attended[3] == sparse.dense_pairs[3]
    assert sparse.attended[1] < sparse.dense_pairs[1] and sparse.attended[2] < sparse.dense_pairs[2]
    assert (moved - want).abs().max() > 1e-3
