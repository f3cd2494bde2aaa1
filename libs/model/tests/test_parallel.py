"""Tensor parallelism and pipeline stages over a real 2-process gloo group give the single-process logits."""

import pytest
import torch

from spindle_model import CausalAttention, LlamaModel, load_state_dict
from spindle_model.testing import parallel_logits_worker, run_gloo


@pytest.fixture(scope="module")
def reference(smollm2_source):
    ids = torch.randint(0, smollm2_source.config.vocab_size, (203,), generator=torch.Generator().manual_seed(0))
    model = LlamaModel(smollm2_source.config)
    model.load_weights(load_state_dict(smollm2_source.path))
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.arange(203), CausalAttention(), input_ids=ids))
    return ids.tolist(), logits


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tp", "tp-rank-group", "pp"])
def test_two_process_logits_match_single_process(mode, smollm2_source, reference, tmp_path):
    ids, ref = reference
    results = run_gloo(parallel_logits_worker, 2, tmp_path, mode, str(smollm2_source.path), ids)
    out = results[1 if mode == "pp" else 0]["logits"]
    err = (out - ref).abs().max().item()
    print(f"\n[{mode}=2] max |logit diff| vs single process: {err:.2e} (logit scale {ref.abs().max().item():.1f})")
    assert err <= 1e-4 * ref.abs().max().item()
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
