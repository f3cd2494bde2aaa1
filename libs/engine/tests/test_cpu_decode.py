"""Decode-only steps through `CPUDecodeRunner` (the layer stack in one native call) against the torch path.

Each scenario runs twice on the same tiny model (odd sizes: hidden 72, head dim 8, GQA 9:3, FFN 100), once with
`fused_cpu_decode=False` and once with it on: the greedy tokens must be identical and every step's logits
within 1e-5, while batches shrink and grow, prompts cross block boundaries, one-token prefill chunks ride in
decode-only steps and batches above the kernel's 32 rows fall back to the torch path.
"""

import pytest
import torch

from spindle_attention import cpu
from spindle_engine import Engine, EngineConfig
from spindle_engine.cpu_decode import CPUDecodeRunner, unsupported_reason
from spindle_engine.testing import Wave, random_prompts, record_logits, run_waves
from spindle_model import LlamaModel
from spindle_model.testing import tiny_llama

pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels unavailable (no compiler or AVX-512)")

MAX_LOGIT_DIFF = 1e-5


@pytest.fixture(scope="module")
def tiny():
    _, model = tiny_llama(0, num_layers=2)
    with torch.no_grad():  # sharper weights, so greedy picks vary
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


def _scenario(engine: Engine, waves: list[Wave], join_every: int) -> tuple[dict, list, list]:
    """Run `waves` (see `run_waves`). Returns every request's tokens, every step's logits and the batch size of
    every step the fused runner served."""
    fused_batches: list[int] = []
    fused = engine.runner.cpu_decode
    if fused is not None:
        fused_run = fused.run

        def fused_recording(ids, *args):
            fused_batches.append(len(ids))
            return fused_run(ids, *args)

        fused.run = fused_recording
    logits = record_logits(engine)
    return run_waves(engine, waves, join_every), logits, fused_batches


def _compare(model, waves, join_every: int, **config) -> list[int]:
    opts = {"model": "tiny", "block_size": 4, "kv_cache_tokens": 2048, "max_num_seqs": 40, **config}
    eager = Engine(EngineConfig(**opts, fused_cpu_decode=False), model=model)
    assert eager.runner.cpu_decode is None
    ref_tokens, ref_logits, _ = _scenario(eager, waves, join_every)
    fused = Engine(EngineConfig(**opts), model=model)
    assert isinstance(fused.runner.cpu_decode, CPUDecodeRunner)
    tokens, logits, batches = _scenario(fused, waves, join_every)
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    for i, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
        assert a.shape == b.shape, f"step {i}"
        assert a.numel() == 0 or float((a - b).abs().max()) <= MAX_LOGIT_DIFF, f"step {i}"
    return batches


def test_shrinking_and_joining_batches_match_the_torch_path(tiny):
    first = list(zip(random_prompts([7, 3, 12, 5, 9], seed=1), [9, 4, 14, 6, 11], strict=True))
    second = list(zip(random_prompts([6, 2, 10], seed=2), [8, 12, 5], strict=True))
    batches = _compare(tiny, [first, second], join_every=6)
    assert {1, 3, 5} <= set(batches), batches


def test_batches_above_the_kernel_rows_run_the_torch_path(tiny):
    # 36 sequences decode together: those steps (36 > 32 rows) run eagerly, the tail (<= 32) fused
    prompts = random_prompts([3 + i % 5 for i in range(36)], seed=3)
    waves = [list(zip(prompts, [2 + i % 9 for i in range(36)], strict=True))]
    batches = _compare(tiny, waves, join_every=1)
    assert batches and max(batches) <= cpu.MAX_ROWS and 36 not in batches


def test_one_token_prefill_chunks(tiny):
    # budget 2: "r1"'s prompt is prefilled one token a step next to "r0"'s decode: decode-only steps whose
    # second row samples nothing
    waves = [[(random_prompts([3], seed=4)[0], 10)], [(random_prompts([5], seed=5)[0], 4)]]
    batches = _compare(tiny, waves, join_every=3, max_num_batched_tokens=2)
    assert 2 in batches


def test_only_whole_float32_cpu_models_qualify(tiny):
    engine = Engine(EngineConfig(model="tiny", kv_cache_tokens=1024), model=tiny)
    assert unsupported_reason(engine.model, engine.cache) is None
    hf, _ = tiny_llama(0, num_layers=1)
    bf16 = LlamaModel(tiny.config.__class__.from_hf(hf.config.to_dict()), dtype=torch.bfloat16)
    bf16.load_weights(hf.state_dict())
    engine = Engine(EngineConfig(model="tiny", dtype="bfloat16", kv_cache_tokens=1024), model=bf16)
    assert engine.runner.cpu_decode is None
    assert "float32" in unsupported_reason(engine.model, engine.cache)
    with pytest.raises(ValueError, match="cannot serve"):
        CPUDecodeRunner(engine.model, engine.cache)
