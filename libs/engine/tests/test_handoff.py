"""KV hand-off between two engines (the prefill/decode split) gives the single-engine result."""

import pytest
import torch

from spindle_engine import Engine, EngineConfig, SamplingParams
from spindle_model.testing import tiny_llama


def _engine(model, **kw) -> Engine:
    return Engine(EngineConfig(model="tiny", **{"block_size": 16, "kv_cache_tokens": 2048, **kw}), model=model)


def _drain(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def _split_run(prefill: Engine, decode: Engine, prompts: dict[str, list[int]], params: SamplingParams):
    for rid, ids in prompts.items():
        prefill.add_request(rid, ids, params, prefill_only=True)
    first: dict[str, int] = {}
    while prefill.has_unfinished():
        for o in prefill.step():
            assert o.kv_ready and not o.finished
            first[o.request_id] = o.new_token_ids[0]
    for rid, ids in prompts.items():
        kv = prefill.export_kv(rid)
        assert kv.shape == decode.kv_shape(len(ids))
        assert decode.reserve(rid, len(ids))
        decode.add_prefilled(rid, ids, first[rid], kv.clone(), params)
        assert prefill.release(rid)
    prefill.allocator.check_invariants()
    assert prefill.allocator.num_used == 0
    rest = _drain(decode)
    decode.allocator.check_invariants()
    assert decode.allocator.num_used == 0
    return {rid: [first[rid], *rest[rid]] for rid in prompts}


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(0)[1]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(  # the penalties count the first token, sampled on the prefill side
            max_tokens=10,
            temperature=0.9,
            min_p=0.05,
            seed=7,
            presence_penalty=1.5,
            frequency_penalty=0.5,
            repetition_penalty=1.4,
            logit_bias=((5, 3.0),),
            min_tokens=4,
            logprobs=3,
        ),
        SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0, logprobs=0),
    ],
)
def test_handoff_matches_single_engine(tiny, params):
    g = torch.Generator().manual_seed(5)
    prompts = {f"r{i}": torch.randint(3, 301, (n,), generator=g).tolist() for i, n in enumerate((1, 17, 59, 130))}
    single = _engine(tiny)
    for rid, ids in prompts.items():
        single.add_request(rid, ids, params)
    expected = _drain(single)
    got = _split_run(_engine(tiny, max_num_batched_tokens=48), _engine(tiny, block_size=8), prompts, params)
    assert got == expected


def test_reserve_refuses_when_full_and_abort_frees_everything(tiny):
    decode = _engine(tiny, kv_cache_tokens=256, max_model_len=200)
    assert decode.reserve("a", 150)
    assert not decode.reserve("b", 150)  # 10 + 10 blocks > 16
    with pytest.raises(ValueError, match="already in use"):
        decode.reserve("a", 10)
    with pytest.raises(ValueError, match="does not match"):
        decode.add_prefilled("a", [5] * 150, 1, torch.zeros(decode.kv_shape(149)), SamplingParams())
    assert decode.blocks_held() == {"a": 10}
    assert decode.abort("a")
    assert decode.allocator.num_used == 0

    prefill = _engine(tiny)
    prefill.add_request("p", [3] * 40, SamplingParams(max_tokens=4), prefill_only=True)
    while prefill.has_unfinished():
        prefill.step()
    assert prefill.blocks_held() == {"p": 3}
    assert prefill.abort("p")
    assert not prefill.abort("p")
    assert prefill.allocator.num_used == 0


def test_n_choices_decode_from_one_prompt_kv_and_equal_single_choice_requests(tiny):
    """n = 3: the prefill computes the prompt once; the decode engine copies its KV into each choice's blocks and
    each choice samples its own first token (choice i seeded by choice_seed). Each choice equals the single engine
    run as one request with that seed, every block is freed, and an abort ends every choice."""
    from spindle_engine.sampling_params import choice_seed

    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, 301, (37,), generator=g).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True, presence_penalty=0.5, n=3)
    prefill, decode = _engine(tiny), _engine(tiny, kv_cache_tokens=512)
    prefill.add_request("r", prompt, params, prefill_only=True)
    (out,) = prefill.step()
    assert out.kv_ready
    kv = prefill.export_kv("r")
    prefill.release("r")
    assert decode.reserve("r", len(prompt), choices=3)
    assert decode.allocator.blocks_by_owner() == {"r": 3, "r#1": 3, "r#2": 3}
    decode.add_prefilled("r", prompt, out.new_token_ids[0], kv, params)
    got: dict[int, list[int]] = {}
    while decode.has_unfinished():
        for o in decode.step():
            assert o.request_id == "r"
            got.setdefault(o.choice, []).extend(o.new_token_ids)
    assert decode.allocator.num_used == 0
    single = _engine(tiny)
    for i in range(3):
        single.add_request(f"c{i}", prompt, SamplingParams(**{**_kw(params), "n": 1, "seed": choice_seed(11, i)}))
    ref = _drain(single)
    assert got == {i: ref[f"c{i}"] for i in range(3)}
    assert len({tuple(v) for v in got.values()}) > 1  # the choices differ

    assert decode.reserve("a", len(prompt), choices=2)
    decode.add_prefilled("a", prompt, out.new_token_ids[0], kv, SamplingParams(max_tokens=8, n=2))
    decode.step()
    assert decode.abort("a") and decode.allocator.num_used == 0 and not decode.has_unfinished()
    assert not decode.reserve("b", 300, choices=3)  # 3 x 20 blocks do not fit in 32
    with pytest.raises(ValueError, match="n > 1"):
        decode.add_request("x", prompt, params)


def test_n_choices_decode_in_the_engine_that_prefilled_them(tiny):
    """A colocated instance: `decode_held` forks an n = 3 request's choices from the KV it computed, in the same
    engine; each choice equals the single engine run as one request with its seed. With no room for the choices'
    copies the request is dropped and its blocks freed."""
    from spindle_engine.sampling_params import choice_seed

    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 301, (41,), generator=g).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True, n=3)
    engine = _engine(tiny, max_num_batched_tokens=16)  # the prompt takes three steps
    engine.add_request("r", prompt, params, prefill_only=True)
    got: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.kv_ready:
                assert engine.decode_held("r") and "r" not in engine.held
            else:
                got.setdefault(o.choice, []).extend(o.new_token_ids)
    assert engine.allocator.num_used == 0
    single = _engine(tiny)
    for i in range(3):
        single.add_request(f"c{i}", prompt, SamplingParams(**{**_kw(params), "n": 1, "seed": choice_seed(3, i)}))
    assert got == {i: v for i, v in enumerate(_drain(single).values())}

    small = _engine(tiny, kv_cache_tokens=160, max_model_len=160)  # the prompt (123 tokens) fits once, not 3 times
    small.add_request("r", prompt * 3, params, prefill_only=True)
    while not small.held:
        small.step()
    assert not small.decode_held("r") and small.allocator.num_used == 0 and not small.has_unfinished()


def _kw(params: SamplingParams) -> dict:
    import dataclasses

    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


@pytest.mark.parametrize("chunk", [7, 4096])
def test_prompt_logprobs_are_log_softmax_of_the_whole_prompts_logits(tiny, chunk):
    """Computed chunk by chunk where the prompt is prefilled (chunks of 7 tokens: a boundary between a position and
    the token it predicts), reported with the first output; equal to one forward pass over the prompt."""
    from spindle_model import CausalAttention

    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 301, (40,), generator=g).tolist()
    engine = _engine(tiny, max_num_batched_tokens=chunk, long_prefill_token_threshold=chunk)
    engine.add_request("p", prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3), prefill_only=True)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (out,) = outs
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) - 1 and [lp.token_id for lp in lps] == prompt[1:]
    with torch.inference_mode():
        hidden = tiny(torch.arange(len(prompt)), CausalAttention(), input_ids=torch.tensor(prompt))
        want = torch.log_softmax(tiny.compute_logits(hidden), -1)[:-1]  # [n - 1, V]
    got = torch.tensor([lp.logprob for lp in lps])
    torch.testing.assert_close(got, want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], rtol=0, atol=1e-4)
    assert [lp.top_ids for lp in lps] == [tuple(r.tolist()) for r in torch.topk(want, 3).indices]
