"""Helpers for tests that compare two engine paths step by step (CUDA-graph buffers, the fused CPU decode)."""

from __future__ import annotations

import torch

from .engine import Engine
from .sampling_params import SamplingParams

Wave = list[tuple[list[int], int]]  # (prompt ids, max_tokens) of requests added together


def random_prompts(lens: list[int], seed: int, low: int = 3, high: int = 301) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (n,), generator=g).tolist() for n in lens]


def record_logits(engine: Engine) -> list[torch.Tensor]:
    """From now on, a copy of every step's logits (graph-path logits are a buffer the next step rewrites)."""
    logits: list[torch.Tensor] = []
    run = engine.runner.run

    def recording(chunks):
        out, rows = run(chunks)
        logits.append(out.clone())
        return out, rows

    engine.runner.run = recording
    return logits


def run_waves(engine: Engine, waves: list[Wave], join_every: int) -> dict[str, list[int]]:
    """Add one wave of greedy requests every `join_every` steps and step until all finish; returns each request's
    tokens and checks that every block was given back."""
    tokens: dict[str, list[int]] = {}
    step = 0
    pending = list(waves)
    while pending or engine.has_unfinished():
        if pending and step % join_every == 0:
            for prompt, max_tokens in pending.pop(0):
                rid = f"r{len(tokens)}"
                engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                tokens[rid] = []
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
        step += 1
    engine.allocator.check_invariants()
    assert engine.allocator.num_used == 0
    return tokens
