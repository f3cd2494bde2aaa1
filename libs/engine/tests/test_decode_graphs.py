"""Decode steps through `DecodeGraphRunner`'s static buffers (emulated on CPU) against the eager path.

SPINDLE_DECODE_GRAPHS_EMULATE=1 makes the engine run decode-only steps through the static buffers, padding,
bucket choice and output slicing that CUDA graphs replay on a GPU, with the forward run eagerly. Every step
must give the same greedy tokens and logits within 1e-5 as the plain eager engine, while batches need padding
(3 -> 4, 5 -> 8), sequences finish mid-run and new requests join.
"""

import pytest
import torch

from spindle_engine import Engine, EngineConfig
from spindle_engine.cuda_graphs import EMULATE_ENV, decode_buckets
from spindle_engine.testing import Wave, random_prompts, record_logits, run_waves
from spindle_model.testing import tiny_llama

MAX_LOGIT_DIFF = 1e-5


@pytest.fixture(scope="module")
def tiny():
    _, model = tiny_llama(0, num_layers=2)
    with torch.no_grad():  # sharper weights (before any forward packs them), so greedy picks vary
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


def _scenario(engine: Engine, waves: list[Wave], join_every: int) -> tuple[dict, list]:
    """Run `waves` (see `run_waves`); record every step's logits and the batches through the static buffers."""
    graphs = engine.runner.decode_graphs
    if graphs is not None:  # the batch sizes that went through the static buffers
        graphs.batch_sizes = []
        graphs.partial_steps = 0
        graph_run = graphs.run

        def graph_recording(ids, *args):
            graphs.batch_sizes.append(len(ids))
            return graph_run(ids, *args)

        graphs.run = graph_recording
    run = engine.runner.run

    def counting(chunks):
        before = graphs.steps if graphs is not None else 0
        out, rows = run(chunks)
        if graphs is not None and graphs.steps > before and len(rows) < len(chunks):
            graphs.partial_steps += 1  # through the buffers, with a row that samples nothing
        return out, rows

    engine.runner.run = counting
    logits = record_logits(engine)
    return run_waves(engine, waves, join_every), logits


def _compare(llama, monkeypatch, waves, join_every: int, **config) -> Engine:
    # both engines run the torch layer loop (the fused CPU decode is compared with it in test_cpu_decode.py)
    opts = {"model": "tiny", "block_size": 4, "kv_cache_tokens": 1024, "max_num_seqs": 16, "fused_cpu_decode": False}
    opts |= config
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    eager = Engine(EngineConfig(**opts), model=llama)
    assert eager.runner.decode_graphs is None
    ref_tokens, ref_logits = _scenario(eager, waves, join_every)
    monkeypatch.setenv(EMULATE_ENV, "1")
    graphed = Engine(EngineConfig(**opts), model=llama)
    assert graphed.runner.decode_graphs is not None and graphed.runner.decode_graphs.mode == "emulate"
    tokens, logits = _scenario(graphed, waves, join_every)
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    for i, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
        assert a.shape == b.shape, f"step {i}"
        assert a.numel() == 0 or float((a - b).abs().max()) <= MAX_LOGIT_DIFF, f"step {i}"
    return graphed


def test_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(256)[-3:] == [240, 248, 256]
    with pytest.raises(ValueError):
        decode_buckets(0)


def test_padding_shrinking_and_joining_match_eager(tiny, monkeypatch):
    # 5 requests (bucket 8), finishing at different steps (5 -> 4 -> 3 -> ...), then 3 more join (block tables
    # of new sequences, the batch grows again); prompts cross block boundaries as they decode.
    first = list(zip(random_prompts([7, 3, 12, 5, 9], seed=1), [9, 4, 14, 6, 11], strict=True))
    second = list(zip(random_prompts([6, 2, 10], seed=2), [8, 12, 5], strict=True))
    engine = _compare(tiny, monkeypatch, [first, second], join_every=6)
    graphs = engine.runner.decode_graphs
    assert {3, 5} <= set(graphs.batch_sizes), graphs.batch_sizes
    assert {4, 8} <= set(graphs.bucket_steps), graphs.bucket_steps
    assert engine.cache.k.shape[1] == engine.allocator.num_blocks + 1  # the scratch block is never allocated
    assert graphs.scratch_block == engine.allocator.num_blocks
    assert graphs.capture_s == {}  # nothing is captured in emulation


def test_steps_beyond_largest_bucket_run_eager(tiny, monkeypatch):
    # cuda_graph_max_batch=2: the decode steps of 3 rows run eagerly, those of 2 and 1 through the buffers
    waves = [list(zip(random_prompts([5, 4, 7], seed=3), [4, 7, 10], strict=True))]
    engine = _compare(tiny, monkeypatch, waves, join_every=1, cuda_graph_max_batch=2)
    graphs = engine.runner.decode_graphs
    assert graphs.buckets == [1, 2] and 3 not in graphs.batch_sizes and {1, 2} <= set(graphs.batch_sizes)


def test_one_token_prefill_chunks(tiny, monkeypatch):
    # budget 2: while "r0" decodes, "r1"'s prompt is prefilled one token a step next to it; such a step holds
    # only 1-token chunks, so it goes through the buffers, with a row that samples nothing
    waves = [[(random_prompts([3], seed=4)[0], 10)], [(random_prompts([5], seed=5)[0], 4)]]
    engine = _compare(tiny, monkeypatch, waves, join_every=3, max_num_batched_tokens=2)
    assert engine.runner.decode_graphs.partial_steps > 0


def test_config_switch(tiny, monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "1")
    off = Engine(EngineConfig(model="tiny", kv_cache_tokens=1024, cuda_graphs=False), model=tiny)
    assert off.runner.decode_graphs is None
    assert off.cache.k.shape[1] == off.allocator.num_blocks
    monkeypatch.delenv(EMULATE_ENV)
    cpu = Engine(EngineConfig(model="tiny", kv_cache_tokens=1024), model=tiny)  # on CPU without emulation: eager
    assert cpu.runner.decode_graphs is None
    with pytest.raises(ValueError):
        EngineConfig(cuda_graph_max_batch=0)


def test_smollm2_matches_eager(smollm2_model, smollm2_tokenizer, monkeypatch):
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    prompts = [smollm2_tokenizer.encode(t) for t in texts]
    waves = [list(zip(prompts, [6, 4, 8], strict=True))]
    _compare(smollm2_model, monkeypatch, waves, join_every=1, model="smollm2", max_model_len=256)
