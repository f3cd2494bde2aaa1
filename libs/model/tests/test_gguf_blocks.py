"""Decode matmuls from the GGUF file's quantized blocks (`gguf_blocks.py`) on the real SmolLM2 file: the index
reader agrees with gguf's own reader, and every weight that takes blocks gives the float32 products bit for bit."""

from pathlib import Path

import pytest
import torch
from gguf import GGUFReader

from spindle_attention import cpu
from spindle_model import LlamaModel, attach_gguf_blocks, load_state_dict
from spindle_model.gguf_blocks import read_gguf_index
from spindle_model.sources import ModelSource


def test_index_matches_ggufs_reader(smollm2_gguf: Path, gguf_reader: GGUFReader) -> None:
    index = read_gguf_index(smollm2_gguf)
    assert len(index) == len(gguf_reader.tensors)
    for t in gguf_reader.tensors:
        entry = index[t.name]
        assert entry.offset == t.data_offset, t.name
        assert (entry.cols, entry.rows) == (int(t.shape[0]), int(t.n_elements // t.shape[0])), t.name
        assert entry.kind == (t.tensor_type.name if t.tensor_type.name in ("Q4_0", "Q4_1", "Q8_0") else "other")
    with pytest.raises(ValueError, match="GGUF"):
        read_gguf_index(Path(__file__))


@pytest.mark.skipif(not cpu.available(), reason="CPU kernels unavailable")
def test_every_weight_takes_blocks_and_gives_the_float32_products(smollm2_source: ModelSource) -> None:
    model = LlamaModel(smollm2_source.config)
    model.load_weights(load_state_dict(smollm2_source.path))
    g = torch.Generator().manual_seed(0)
    checks = []
    for layer in (model.layers[0], model.layers[17], model.layers[-1]):
        for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            x = torch.randn(5, linear.weight.shape[1], generator=g)
            checks.append((linear, x, linear(x)))  # float32 packed kernel
    hidden = torch.randn(3, model.config.hidden_size, generator=g)
    logits = model.compute_logits(hidden)
    assert attach_gguf_blocks(model, smollm2_source.gguf) == 4 * len(model.layers) + 1  # + the tied LM head
    for linear, x, y in checks:
        assert isinstance(linear.small._packed, cpu.GGUFPackedWeight)
        assert torch.equal(linear(x), y)
    assert torch.equal(model.compute_logits(hidden), logits)
    bf16 = LlamaModel(smollm2_source.config, dtype=torch.bfloat16, layer_range=(0, 1))
    assert attach_gguf_blocks(bf16, smollm2_source.gguf) == 0  # only float32 models take blocks
