"""Preemption out of the engine (to the kvstore) and resumption give the uninterrupted result."""

import pytest
import torch

from spindle_engine import Engine, EngineConfig, SamplingParams
from spindle_model.testing import tiny_llama

PARAMS = [
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
]


def _engine(model, **kw) -> Engine:
    return Engine(EngineConfig(model="tiny", **{"block_size": 16, "kv_cache_tokens": 2048, **kw}), model=model)


def _collect(engine: Engine, out: dict[str, list[int]], steps: int | None = None) -> None:
    n = 0
    while engine.has_unfinished() and (steps is None or n < steps):
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        n += 1


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(0)[1]


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return {f"r{i}": torch.randint(3, 301, (n,), generator=g).tolist() for i, n in enumerate((1, 16, 45))}


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("keep_blocks", [False, True])
def test_preempt_and_resume_match_an_uninterrupted_run(tiny, prompts, params, keep_blocks):
    single = _engine(tiny)
    for rid, ids in prompts.items():
        single.add_request(rid, ids, params)
    expected: dict[str, list[int]] = {}
    _collect(single, expected)

    eng = _engine(tiny)
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, params)
    got: dict[str, list[int]] = {}
    _collect(eng, got, steps=5)
    before = eng.allocator.num_used
    out = eng.preempt_out("r1", keep_blocks=keep_blocks)
    assert out.token_ids == prompts["r1"] + got["r1"]
    assert out.num_prompt_tokens == len(prompts["r1"])
    assert out.kv.shape == eng.kv_shape(out.num_kv_tokens)
    assert "r1" not in eng.requests
    if keep_blocks:
        assert eng.blocks_held()["r1"] == -(-out.num_kv_tokens // 16)
        assert eng.release("r1")
    assert "r1" not in eng.blocks_held()
    assert eng.allocator.num_used < before
    eng.allocator.check_invariants()

    _collect(eng, got, steps=3)  # the others go on without it
    assert eng.reserve("r1", out.num_kv_tokens)
    eng.resume("r1", out.token_ids, out.num_prompt_tokens, out.kv.clone(), out.params)
    _collect(eng, got)
    assert got == expected
    eng.allocator.check_invariants()
    assert eng.allocator.num_used == 0


@pytest.mark.parametrize("params", PARAMS)
def test_resume_on_another_engine_and_readmit(tiny, prompts, params):
    """The KV is position-exact: another engine (other block size) resumes it; readmit undoes a kept preempt."""
    single = _engine(tiny)
    single.add_request("r2", prompts["r2"], params)
    expected: dict[str, list[int]] = {}
    _collect(single, expected)

    a = _engine(tiny)
    a.add_request("r2", prompts["r2"], params)
    got: dict[str, list[int]] = {}
    _collect(a, got, steps=3)
    a.preempt_out("r2", keep_blocks=True)
    a.readmit("r2")
    _collect(a, got, steps=3)
    out = a.preempt_out("r2")
    assert a.allocator.num_used == 0

    b = _engine(tiny, block_size=8)
    assert b.reserve("r2", out.num_kv_tokens)
    b.resume("r2", out.token_ids, out.num_prompt_tokens, out.kv, out.params)
    _collect(b, got)
    assert got == expected
    assert b.allocator.num_used == 0


def test_bad_calls_raise_value_error_and_change_nothing(tiny):
    eng = _engine(tiny, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match="not decoding"):
        eng.preempt_out("nope")
    eng.add_request("long", [5] * 40, params)
    eng.step()  # one 16-token chunk of 40: still prefilling
    with pytest.raises(ValueError, match="not decoding"):
        eng.preempt_out("long")
    eng.add_request("p", [7] * 10, params, prefill_only=True)
    with pytest.raises(ValueError, match="not decoding"):
        eng.preempt_out("p")
    with pytest.raises(ValueError, match="not preempted"):
        eng.readmit("long")
    assert set(eng.requests) == {"long", "p"}

    while "long" in eng.requests:  # finished requests are unknown
        eng.step()
    with pytest.raises(ValueError, match="not decoding"):
        eng.preempt_out("long")
    assert eng.release("p")

    eng.add_request("d", [9] * 20, params)
    for _ in range(4):
        eng.step()
    out = eng.preempt_out("d")
    with pytest.raises(ValueError, match="no reservation"):
        eng.resume("d", out.token_ids, out.num_prompt_tokens, out.kv, params)
    assert eng.reserve("d", out.num_kv_tokens)
    with pytest.raises(ValueError, match="does not match"):
        eng.resume("d", [*out.token_ids, 1], out.num_prompt_tokens, out.kv, params)
    with pytest.raises(ValueError, match="prompt tokens"):
        eng.resume("d", out.token_ids, len(out.token_ids), out.kv, params)
    with pytest.raises(ValueError, match="integers"):
        eng.resume("d", [*out.token_ids[:-1], 10**9], out.num_prompt_tokens, out.kv, params)
    assert "d" in eng.reserved  # a refused resume keeps the reservation
    eng.resume("d", out.token_ids, out.num_prompt_tokens, out.kv, params)
    while eng.has_unfinished():
        eng.step()
    eng.allocator.check_invariants()
    assert eng.allocator.num_used == 0
