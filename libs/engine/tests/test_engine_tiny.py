"""Engine behaviour on a tiny random-weight Llama: paging, chunking, batching, preemption, abort."""

import pytest
import torch

from spindle_engine import Engine, EngineConfig, SamplingParams
from spindle_model.testing import tiny_llama

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _engine(model, **kw) -> Engine:
    opts = {"block_size": 16, "kv_cache_tokens": 4096, **kw}
    return Engine(EngineConfig(model="tiny", **opts), model=model)


def _run(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    finished = set()
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id not in finished, "output after the terminal state"
            out[o.request_id] += o.new_token_ids
            if o.finished:
                finished.add(o.request_id)
    assert finished == set(prompts)
    engine.allocator.check_invariants()
    assert engine.allocator.num_used == 0, "blocks leaked"
    return out


def _prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 300) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return {f"r{i}": torch.randint(3, 301, (n_,), generator=g).tolist() for i, n_ in enumerate(lens)}


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(0)


def test_greedy_matches_transformers_generate(tiny):
    hf, model = tiny
    prompt = _prompts(1, seed=3)["r0"]
    ours = _run(_engine(model, max_num_batched_tokens=64), {"a": prompt})["a"]
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert ours == ref


def test_batch_chunking_and_paging_do_not_change_outputs(tiny):
    _, model = tiny
    prompts = _prompts(8, seed=1)
    alone = {rid: _run(_engine(model), {rid: ids})[rid] for rid, ids in prompts.items()}
    for budget in (64, 256, 8192):
        batched = _run(_engine(model, max_num_batched_tokens=budget), prompts)
        assert batched == alone, f"budget {budget}"
    capped = _run(_engine(model, long_prefill_token_threshold=37, block_size=5), prompts)
    assert capped == alone
    shared = _run(_engine(model, max_num_batched_tokens=512, shared_prefill_chunk=29, block_size=7), prompts)
    assert shared == alone


def test_a_shared_chunk_caps_a_long_prompt_only_while_others_share_the_engine(tiny):
    """`shared_prefill_chunk`: alone, a prompt takes the whole budget; beside a decode or a waiting prompt, at
    most the shared chunk, and the rest of the budget goes to the newer prompt."""
    _, model = tiny
    engine = _engine(model, max_num_batched_tokens=256, shared_prefill_chunk=40)
    engine.add_request("long", list(range(3, 203)), GREEDY)  # 200 tokens, alone
    engine.step()
    assert engine.requests["long"].num_computed_tokens == 200
    engine.add_request("long2", [3 + i % 290 for i in range(300)], GREEDY)  # 300 tokens, beside a decode
    engine.add_request("short", list(range(5, 35)), GREEDY)  # 30 tokens
    engine.step()
    computed = {rid: seq.num_computed_tokens for rid, seq in engine.requests.items()}
    assert computed == {"long": 201, "long2": 40, "short": 30}
    with pytest.raises(ValueError, match="shared_prefill_chunk"):
        _engine(model, shared_prefill_chunk=-1)


def test_preemption_under_a_small_cache_keeps_outputs(tiny):
    _, model = tiny
    prompts = _prompts(6, seed=2, lo=200, hi=300)
    alone = {rid: _run(_engine(model), {rid: ids})[rid] for rid, ids in prompts.items()}
    eng = _engine(model, kv_cache_tokens=512, max_model_len=512, block_size=16)
    assert _run(eng, prompts) == alone
    assert eng.scheduler.num_preemptions > 0


def test_seeded_sampling_is_batch_independent(tiny):
    _, model = tiny
    prompts = _prompts(4, seed=4)
    p = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=11, ignore_eos=True)
    alone = _run(_engine(model), {"r0": prompts["r0"]}, p)["r0"]
    batched = _run(_engine(model, max_num_batched_tokens=100), prompts, p)["r0"]
    assert alone == batched


def test_stop_tokens_max_tokens_and_context_limit(tiny):
    _, model = tiny
    prompt = _prompts(1, seed=5)["r0"]
    free = _run(_engine(model), {"a": prompt})["a"]
    stop_at = free[4]
    eng = _engine(model)
    eng.add_request("s", prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,)))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [t for o in outs for t in o.new_token_ids] == free[: free.index(stop_at) + 1]
    assert outs[-1].finish_reason == "stop"
    eng = _engine(model, max_model_len=len(prompt) + 3)
    eng.add_request("c", prompt, GREEDY)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert len(outs) == 3 and outs[-1].finish_reason == "length"


def test_abort_frees_blocks_and_others_continue(tiny):
    _, model = tiny
    prompts = _prompts(3, seed=6)
    alone = _run(_engine(model), {"r1": prompts["r1"]})["r1"]
    eng = _engine(model, max_num_batched_tokens=64)
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, GREEDY)
    eng.step()
    assert eng.abort("r0") and not eng.abort("r0") and not eng.abort("nope")
    got: list[int] = []
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id != "r0"
            if o.request_id == "r1":
                got += o.new_token_ids
    assert got == alone
    assert eng.allocator.num_used == 0
    eng.allocator.check_invariants()


def test_bad_requests_raise_and_leave_engine_untouched(tiny):
    _, model = tiny
    eng = _engine(model, max_model_len=64)
    for ids, match in [
        ([], "empty"),
        (list(range(3, 68)), "context"),
        ([5, 999], r"\[0, 301\)"),
        ([5, -1], r"\[0, 301\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            eng.add_request("x", ids, GREEDY)
    assert not eng.has_unfinished() and eng.allocator.num_used == 0
    eng.add_request("ok", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("ok", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="cannot hold"):
        _engine(model, kv_cache_tokens=100, max_model_len=512)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        _engine(model, max_model_len=513)
    with pytest.raises(ValueError, match="configured for bfloat16"):
        _engine(model, dtype="bfloat16")


def test_prompt_filling_the_context_still_gets_one_token(tiny):
    _, model = tiny
    eng = _engine(model, max_model_len=64)
    out = _run(eng, {"full": list(range(3, 67))})
    assert len(out["full"]) == 1
