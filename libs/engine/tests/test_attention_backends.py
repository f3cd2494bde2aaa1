"""EngineConfig.attention_backend through spindle_attention's backend registry, and the engine on each backend.

Names are accepted or refused at construction with the registry's reasons; `auto` on CPU keeps the engine's
"torch" path. On the real SmolLM2 weights, the `reference` and `cpu` backends give the `torch` backend's greedy
tokens, and so does the flash-attn context, run on CPU against a FAKE `flash_attn` module
(libs/attention/tests/fake_flash_attn.py: flash-attn cannot install or run without a GPU, so a stand-in that
keeps its documented semantics, computed with Spindle's reference, is injected into `sys.modules`). The fake
needs a "CUDA" machine: the tests monkeypatch `torch.cuda` and the adapter's device check, never the product.
"""

import importlib.util
import itertools
import logging
import sys
from pathlib import Path

import pytest
import torch

from spindle_attention import cpu
from spindle_attention.backends import backend_names, registry
from spindle_attention.backends.flash import FlashAttnBackend
from spindle_engine import Engine, EngineConfig, SamplingParams
from spindle_engine import config as engine_config
from spindle_engine.config import ATTENTION_BACKENDS
from spindle_engine.cuda_graphs import graph_mode
from spindle_engine.flash_attention import unsupported_reason
from spindle_engine.model_runner import ModelRunner
from spindle_model import LlamaModel, load_state_dict
from spindle_model.testing import tiny_llama

FAKE_FLASH = Path(__file__).resolve().parents[2] / "attention" / "tests" / "fake_flash_attn.py"
NEW_TOKENS = 6
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "In 1887 the railway reached the valley, and with it came merchants, surveyors and a printing press. " * 12,
    "Every spring the orchards bloomed white, and the bees worked from dawn to dusk.",
]


def _fake_flash_attn():
    """A new FAKE `flash_attn` module (see the module doc), loaded from the attention tests by path."""
    spec = importlib.util.spec_from_file_location("spindle_tests_fake_flash_attn", FAKE_FLASH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fake_flash_attn()


@pytest.fixture(autouse=True)
def fresh_skip_logs(monkeypatch):
    monkeypatch.setattr(registry, "_skips_logged", set())
    monkeypatch.setattr(engine_config, "_dtype_skips_logged", set())


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda answering as a machine with one sm80 GPU would (nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))


@pytest.fixture
def fake_flash(monkeypatch, fake_cuda):
    module = _fake_flash_attn()
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return module


# --- names and resolution -------------------------------------------------------------------------------------


def test_names_are_the_registry_s_plus_auto_and_torch():
    assert set(ATTENTION_BACKENDS) == {"auto", "torch", *backend_names()}
    with pytest.raises(ValueError, match=r"attention_backend must be one of \('auto', 'torch', 'reference'"):
        EngineConfig(attention_backend="flash")


def test_cpu_resolution_keeps_the_torch_path():
    assert EngineConfig().resolved_attention_backend == "torch"  # auto
    assert EngineConfig(attention_backend="torch").resolved_attention_backend == "torch"
    assert EngineConfig(attention_backend="reference").resolved_attention_backend == "reference"
    if cpu.available():
        assert EngineConfig(attention_backend="cpu").resolved_attention_backend == "torch"
    else:
        with pytest.raises(ValueError, match="native CPU kernels are off here"):
            EngineConfig(attention_backend="cpu")


def test_auto_on_cpu_without_native_kernels_is_still_torch(monkeypatch, caplog):
    monkeypatch.setattr(cpu, "available", lambda: False)
    with caplog.at_level(logging.INFO, logger="spindle.attention"):
        assert EngineConfig().resolved_attention_backend == "torch"
        with pytest.raises(ValueError, match="attention backend 'cpu' cannot run on cpu"):
            EngineConfig(attention_backend="cpu")
    (line,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]  # once, not per config
    assert line.startswith("attention backend 'cpu' skipped on cpu: Spindle's native CPU kernels are off here")


def test_backends_that_cannot_run_are_refused_with_the_reason(fake_cuda, monkeypatch):
    with pytest.raises(ValueError, match="flash-attn runs on CUDA devices only"):
        EngineConfig(attention_backend="flash-attn", dtype="bfloat16", block_size=256)
    with pytest.raises(ValueError, match="native CPU kernels run on CPU tensors only"):
        EngineConfig(device="cuda", attention_backend="cpu")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` fails as when not installed
    with pytest.raises(ValueError, match=r"flash_attn package is not installed \(pip install 'spindle-attention\[gpu"):
        EngineConfig(device="cuda", attention_backend="flash-attn", dtype="bfloat16", block_size=256)


def test_flash_attn_block_size_and_dtype_are_checked(fake_flash):
    with pytest.raises(ValueError, match=r"multiple of 256, and this cache has block_size=16"):
        EngineConfig(device="cuda", attention_backend="flash-attn", dtype="bfloat16", block_size=16)
    with pytest.raises(ValueError, match=r"runs float16 or bfloat16, not torch\.float32"):
        EngineConfig(device="cuda", attention_backend="flash-attn", block_size=256)
    config = EngineConfig(device="cuda:0", attention_backend="flash-attn", dtype="float16", block_size=512)
    assert config.resolved_attention_backend == "flash-attn"


def test_auto_on_cuda_prefers_flash_where_it_can_run(fake_flash, monkeypatch, caplog):
    monkeypatch.setattr(registry.get_backend("triton"), "unavailable", classmethod(lambda cls, d, b: None))
    with caplog.at_level(logging.INFO):
        assert EngineConfig(device="cuda", dtype="bfloat16", block_size=256).resolved_attention_backend == "flash-attn"
        assert EngineConfig(device="cuda", dtype="bfloat16").resolved_attention_backend == "triton"
        assert EngineConfig(device="cuda", block_size=256).resolved_attention_backend == "triton"  # float32
        EngineConfig(device="cuda", block_size=256)
    lines = [r.getMessage() for r in caplog.records if "'flash-attn' skipped" in r.getMessage()]
    assert len(lines) == 2, lines  # once for the block size, once for float32: each logged once
    assert "block_size=16" in lines[0] and "float32" in lines[1] and "using 'triton'" in lines[1]


def test_flash_model_limits_and_no_graphs():
    assert unsupported_reason(64, torch.bfloat16, 256) is None
    assert "multiple of 8" in unsupported_reason(100, torch.bfloat16, 256)
    assert "float16 and bfloat16" in unsupported_reason(64, torch.float32, 256)
    assert "multiple of 256" in unsupported_reason(64, torch.float16, 128)
    _, model = tiny_llama(0, num_layers=1)
    cuda = torch.device("cuda")
    assert graph_mode(True, cuda, "triton", model) == "cuda"
    assert graph_mode(True, cuda, "flash-attn", model) is None
    assert graph_mode(True, cuda, "reference", model) is None
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ModelRunner(model, None, attention_backend="cpu")  # a registry name, not an engine context


# --- engines on SmolLM2 -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def texts(smollm2_tokenizer) -> list[list[int]]:
    prompts = [smollm2_tokenizer.encode(t) for t in TEXTS]
    assert max(len(p) for p in prompts) > 256  # a sequence over more than one 256-token block
    return prompts


def _greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Two waves: the second joins while the first decodes (mixed steps); long prompts come in several chunks."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out: list[list[int]] = [[] for _ in prompts]
    half = len(prompts) // 2
    for i in range(half):
        engine.add_request(str(i), prompts[i], params)
    steps = 0
    while engine.has_unfinished() or steps < 3:
        if steps == 2:
            for i in range(half, len(prompts)):
                engine.add_request(str(i), prompts[i], params)
        for o in engine.step():
            out[int(o.request_id)] += o.new_token_ids
        steps += 1
    assert engine.allocator.num_used == 0
    return out


def _config(backend: str, **options) -> EngineConfig:
    return EngineConfig(
        kv_cache_tokens=4096, max_model_len=1024, max_num_batched_tokens=96, attention_backend=backend, **options
    )


@pytest.fixture(scope="module")
def torch_tokens(smollm2_model, texts) -> list[list[int]]:
    return _greedy(Engine(_config("torch"), model=smollm2_model), texts)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_cpu_backends_give_the_torch_backend_s_tokens(backend, smollm2_model, texts, torch_tokens):
    if backend == "cpu" and not cpu.available():
        pytest.skip("Spindle's native CPU kernels are off here")
    engine = Engine(_config(backend), model=smollm2_model)
    assert engine.attention_backend == ("reference" if backend == "reference" else "torch")
    assert (engine.runner.cpu_decode is None) == (backend == "reference")  # the fused native decode is "torch"'s
    assert _greedy(engine, texts) == torch_tokens
    assert all(len(t) == NEW_TOKENS for t in torch_tokens) and len({tuple(t) for t in torch_tokens}) > 1


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2) -> LlamaModel:
    model = LlamaModel(smollm2.config, dtype=torch.bfloat16)
    model.load_weights(load_state_dict(smollm2.path, dtype=torch.bfloat16))
    return model


def test_flash_context_gives_the_torch_backend_s_tokens(fake_flash, monkeypatch, smollm2_bf16, texts):
    checks = FlashAttnBackend.unavailable.__func__

    def as_if_cuda(cls, device, block_size):  # the fake runs on CPU tensors: the adapter's checks run as for CUDA
        return checks(cls, torch.device("cuda"), block_size)

    monkeypatch.setattr(FlashAttnBackend, "unavailable", classmethod(as_if_cuda))
    options = {"dtype": "bfloat16", "block_size": 256}
    expected = _greedy(Engine(_config("torch", **options), model=smollm2_bf16), texts)
    engine = Engine(_config("flash-attn", **options), model=smollm2_bf16)
    assert engine.attention_backend == "flash-attn" and engine.runner.decode_graphs is None
    assert _greedy(engine, texts) == expected
    kinds = {(name, info.get("paged")) for name, info in fake_flash.calls}
    assert kinds == {("kvcache", None), ("varlen", False), ("varlen", True)}  # decode, fresh and continued chunks
    names = [name for name, _ in fake_flash.calls]
    assert ("kvcache", "varlen") in itertools.pairwise(names)  # a step of decodes and chunks together
    layers = len(smollm2_bf16.layers)
    assert all(info["causal"] for _, info in fake_flash.calls) and len(fake_flash.calls) % layers == 0
