"""Decode CUDA graphs on a GPU: captured on first use while another thread of the process copies to the GPU, as a
decode service's KV receiver does, or all at start, they still give the eager engine's tokens. Needs CUDA (skipped
elsewhere)."""

import threading

import pytest
import torch

from spindle_engine import Engine, EngineConfig, SamplingParams
from spindle_model import LlamaModel
from spindle_model.testing import tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _generate(cuda_graphs: bool, copier: bool, at_start: bool = False) -> tuple[dict[str, list[int]], dict[int, int]]:
    hf, cpu_model = tiny_llama(0, num_layers=2, vocab_size=101, max_positions=256)
    model = LlamaModel(cpu_model.config, device="cuda")
    model.load_weights(hf.state_dict())
    config = EngineConfig(model="tiny", block_size=4, kv_cache_tokens=1024, max_num_seqs=16, max_model_len=64,
                          device="cuda", attention_backend="triton", cuda_graphs=cuda_graphs,
                          cuda_graphs_at_start=at_start)  # fmt: skip
    engine = Engine(config, model=model)
    if at_start:  # every bucket before the first step
        assert set(engine.runner.decode_graphs.graphs) == set(engine.runner.decode_graphs.buckets)
    stop, errors = threading.Event(), []

    def copy_to_gpu() -> None:  # host -> GPU copies and allocations the whole time, like a KV receiver
        try:
            while not stop.is_set():
                torch.randn(4096).to("cuda").sum().item()
        except Exception as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=copy_to_gpu, daemon=True)
    if copier:
        thread.start()
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    try:
        for wave in (1, 3, 11):  # new batch buckets (1, 4, 16) are captured while the copier runs
            for i in range(wave):
                rid = f"{wave}-{i}"
                engine.add_request(rid, torch.randint(3, 101, (5 + 3 * i,), generator=g).tolist(), params)
                tokens[rid] = []
            while engine.has_unfinished():
                for out in engine.step():
                    tokens[out.request_id] += out.new_token_ids
    finally:
        stop.set()
        if copier:
            thread.join(timeout=30)
    assert not errors, errors
    graphs = engine.runner.decode_graphs
    return tokens, dict(graphs.bucket_steps) if graphs is not None else {}


def test_graphs_captured_beside_a_copying_thread_match_eager():
    eager, _ = _generate(cuda_graphs=False, copier=False)
    graphed, buckets = _generate(cuda_graphs=True, copier=True)
    assert graphed == eager
    assert {1, 4, 16} <= set(buckets), buckets


def test_graphs_captured_at_start_match_eager():
    eager, _ = _generate(cuda_graphs=False, copier=False)
    graphed, buckets = _generate(cuda_graphs=True, copier=True, at_start=True)
    assert graphed == eager
    assert {1, 4, 16} <= set(buckets), buckets
