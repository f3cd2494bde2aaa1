"""Directed steps (`Engine.step_directed`): what an elastic instance runs when the cluster scheduler names each
iteration (LoongServe). Whatever the batching, prompt splits and interleaving, tokens equal the engine's own
scheduling, greedy and seeded; errors leave the engine untouched; every block comes back."""

import pytest
import torch

from spindle_engine import Engine, EngineConfig, SamplingParams
from spindle_model.testing import tiny_llama

GREEDY = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(0)


def _engine(model, **kw) -> Engine:
    return Engine(EngineConfig(model="tiny", **{"block_size": 16, "kv_cache_tokens": 4096, **kw}), model=model)


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(5)
    return {f"r{i}": torch.randint(3, 301, (n,), generator=g).tolist() for i, n in enumerate((37, 130, 5, 77))}


def _reference(model, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
    engine = _engine(model)
    out = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_directed_iterations_give_the_engines_tokens(tiny, params: SamplingParams) -> None:
    _, model = tiny
    prompts = _prompts()
    want = _reference(model, prompts, params)
    engine = _engine(model)
    for rid, ids in prompts.items():
        engine.add_directed(rid, ids, params)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    done: set[str] = set()

    def step(prefill: dict[str, int], decode: list[str]) -> None:
        for o in engine.step_directed(prefill, decode):
            assert o.request_id not in done
            got[o.request_id] += o.new_token_ids
            if o.finished:
                done.add(o.request_id)

    step({"r0": 37, "r1": 60}, [])  # r1's prompt in two parts, batched with r0's whole prompt
    step({"r1": 70}, ["r0"])  # a prefill part and a decode in one step
    step({"r2": 5}, ["r0", "r1"])
    assert not engine.has_unfinished() and engine.num_running == 0  # the engine's own loop never runs them
    while len(done) < 3:  # r0-r2 decode to their end; r3 has not started
        step({}, [r for r in ("r0", "r1", "r2") if r not in done])
    step({"r3": 77}, [])
    while "r3" not in done:
        step({}, ["r3"])
    assert got == want
    engine.allocator.check_invariants()
    assert engine.allocator.num_used == 0 and not engine.directed


def test_bad_directed_steps_are_refused_and_change_nothing(tiny) -> None:
    _, model = tiny
    engine = _engine(model, kv_cache_tokens=64, max_model_len=64)  # 4 blocks
    engine.add_directed("a", list(range(3, 40)), GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_directed("a", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="n = 1"):
        engine.add_directed("b", [5, 6], SamplingParams(n=2, max_tokens=3))
    with pytest.raises(ValueError, match="prompt tokens"):
        engine.step_directed({"a": 38}, [])  # more than its prompt
    with pytest.raises(ValueError, match="not a decoding"):
        engine.step_directed({}, ["a"])  # its prompt is not in yet
    engine.add_directed("big", list(range(3, 60)), GREEDY)
    with pytest.raises(ValueError, match="no KV room"):
        engine.step_directed({"a": 37, "big": 57}, [])  # 3 + 4 blocks > 4
    assert engine.allocator.num_used == 0
    (out,) = engine.step_directed({"a": 37}, [])
    assert len(out.new_token_ids) == 1 and engine.allocator.num_used == 3
    assert engine.abort("a") and engine.abort("big") and engine.allocator.num_used == 0 and not engine.directed
