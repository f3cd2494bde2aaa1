"""The model against Hugging Face transformers on tiny random-weight Llamas (shapes that do not divide)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spindle_model import CausalAttention, LlamaModel, ModelConfig


def _tiny(tie: bool, rope_scaling: dict | None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    hc = LlamaConfig(
        vocab_size=301,
        hidden_size=72,
        intermediate_size=100,
        num_hidden_layers=3,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=128,
        rope_theta=5e4,
        tie_word_embeddings=tie,
        rope_scaling=rope_scaling,
        rms_norm_eps=1e-6,
    )
    return LlamaForCausalLM(hc).eval()


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"rope_type": "linear", "factor": 2.0},
    ],
)
def test_logits_match_transformers(tie, scaling):
    hf = _tiny(tie, scaling)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    assert cfg.tie_word_embeddings == tie
    model = LlamaModel(cfg)
    model.load_weights(hf.state_dict())
    ids = torch.randint(0, 301, (157,), generator=torch.Generator().manual_seed(1))  # past the 128 table
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        out = model.compute_logits(model(torch.arange(157), CausalAttention(), input_ids=ids))
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_pipeline_stages_compose():
    hf = _tiny(True, None)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    full, first, last = LlamaModel(cfg), LlamaModel(cfg, layer_range=(0, 2)), LlamaModel(cfg, layer_range=(2, 3))
    for m in (full, first, last):
        m.load_weights(hf.state_dict())
    assert first.lm_head is None and first.norm is None and last.embed_tokens is None
    ids = torch.randint(0, 301, (40,))
    pos = torch.arange(40)
    with torch.no_grad():
        ref = full.compute_logits(full(pos, CausalAttention(), input_ids=ids))
        h = first(pos, CausalAttention(), input_ids=ids)
        out = last.compute_logits(last(pos, CausalAttention(), hidden=h))
    torch.testing.assert_close(out, ref)


def test_bad_construction_raises():
    cfg = ModelConfig.from_hf(_tiny(True, None).config.to_dict())
    with pytest.raises(ValueError, match="layer_range"):
        LlamaModel(cfg, layer_range=(2, 2))
    with pytest.raises(ValueError, match="missing"):
        LlamaModel(cfg).load_weights({})
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig.from_hf({**_tiny(True, None).config.to_dict(), "rope_scaling": {"rope_type": "yarn"}})
