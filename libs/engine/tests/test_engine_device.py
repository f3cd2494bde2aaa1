"""EngineConfig.device / attention_backend: validation, pass-through and the unchanged CPU default."""

import pytest
import torch

from spindle_engine import LLM, Engine, EngineConfig, SamplingParams
from spindle_engine.generate import main as generate_main
from spindle_model import CausalAttention, LlamaModel
from spindle_model.testing import tiny_llama

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "", "meta"])
def test_malformed_device_is_rejected(device):
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(device=device)


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_clear_error(device):
    with pytest.raises(ValueError, match="CUDA is not available"):
        EngineConfig(device=device)


@no_cuda
def test_llm_and_cli_pass_the_device_through(capsys):
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM(model="no-such-model", device="cuda")  # the config is validated before the model is looked up
    assert generate_main(["--prompt", "hi", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_attention_backend_validation(monkeypatch):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")
    assert EngineConfig().resolved_attention_backend == "torch"  # auto on CPU
    assert EngineConfig(attention_backend="torch").resolved_attention_backend == "torch"
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        EngineConfig(attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig(attention_backend="triton").resolved_attention_backend == "triton"


def test_cpu_default_keeps_everything_on_cpu():
    config = EngineConfig()
    assert config.device == "cpu" and config.torch_device == torch.device("cpu")
    _, model = tiny_llama(0, num_layers=2)
    engine = Engine(EngineConfig(model="tiny", block_size=4, kv_cache_tokens=512), model=model)
    assert engine.device.type == "cpu" and engine.attention_backend == "torch"
    assert engine.cache.k.device.type == "cpu" and model.device.type == "cpu"
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert len(tokens) == 3


def test_model_on_another_device_is_rejected():
    meta = LlamaModel(tiny_llama(0, num_layers=1)[1].config, device="meta")
    assert meta.device.type == "meta" and meta.rotary.table is None
    with pytest.raises(ValueError, match="is on meta"):
        Engine(EngineConfig(model="tiny", block_size=4, kv_cache_tokens=512), model=meta)


def test_rotary_factors_move_host_positions_to_the_model_device():
    # SP/PP plans hand a rank host positions; its model may sit on a GPU (meta stands in for one here)
    meta = LlamaModel(tiny_llama(0, num_layers=1)[1].config, device="meta")
    factors = meta.rotary.factors(torch.arange(5))  # [T, 1, D/2]
    assert factors.device.type == "meta" and factors.shape == (5, 1, meta.config.head_dim // 2)


def test_model_built_on_a_device_matches_the_default():
    hf, model = tiny_llama(0, num_layers=2)
    other = LlamaModel(model.config, device="cpu")
    other.load_weights(hf.state_dict())
    ids, pos = torch.tensor([3, 4, 5, 6]), torch.arange(4)
    with torch.inference_mode():
        a = model.compute_logits(model(pos, CausalAttention(), input_ids=ids))
        b = other.compute_logits(other(pos, CausalAttention(), input_ids=ids))
    assert torch.equal(a, b)
    # the computed rotary factors (what non-CPU devices use) agree with the CPU table
    rot = model.rotary
    p = torch.arange(0, 500, 7)
    torch.testing.assert_close(rot._factors(p).unsqueeze(1), rot.factors(p), rtol=0, atol=0)
