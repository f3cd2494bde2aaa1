"""Exactness of the engine on the real SmolLM2 weights against Hugging Face transformers."""

import pytest
import torch

from spindle_attention import cpu
from spindle_engine import Engine, EngineConfig, SamplingParams
from spindle_model import CausalAttention

NEW_TOKENS = 12

SENTENCES = [
    "The river ran past the old mill, where the miller's daughter counted sacks of flour.",
    "In 1887 the railway reached the valley, and with it came merchants, surveyors and a printing press.",
    "Every spring the orchards bloomed white, and the bees from seventeen hives worked from dawn to dusk.",
    "The council met on Thursdays in the upstairs room of the inn to argue about bridges and taxes.",
    "Children walked two miles to the schoolhouse, carrying slates, bread and sometimes a lantern.",
]


def _long_text(n_sentences: int) -> str:
    return " ".join(f"({i}) {SENTENCES[i % len(SENTENCES)]}" for i in range(n_sentences))


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    tok = smollm2_tokenizer
    chat = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a color."}],
        [{"role": "user", "content": "Summarise this story:\n" + _long_text(40)}],
    ]
    plain = ["The capital of France is", "def fibonacci(n):", "Once upon a time", _long_text(45), _long_text(130)]
    out = [tok.apply_chat_template(m, add_generation_prompt=True) for m in chat] + [tok.encode(p) for p in plain]
    lengths = sorted(len(p) for p in out)
    assert lengths[0] < 20 and any(800 <= n <= 1300 for n in lengths) and lengths[-1] >= 2800, lengths
    return out


def _generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished():
        for o in engine.step():
            out[int(o.request_id)] += o.new_token_ids
    assert engine.allocator.num_used == 0
    return out


def _logit_prompts(prompts: list[list[int]]) -> list[int]:
    """Indices of the prompts whose last positions' logits are compared with transformers: shortest and longest."""
    return [0, max(range(len(prompts)), key=lambda i: len(prompts[i]))]


@pytest.fixture(scope="module")
def hf_runs(smollm2_hf, prompts) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
    """Plain greedy decoding with transformers' own KV cache (generate() would suppress EOS under min_new_tokens),
    and, from the same prompt passes, the last min(64, n) positions' logits of the `_logit_prompts` (full-vocab
    logits of every position would be 600 MB at 3k tokens)."""
    outs, logits = [], {}
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            keep = min(64, len(p)) if i in _logit_prompts(prompts) else 1
            out = smollm2_hf(torch.tensor([p]), use_cache=True, logits_to_keep=keep)
            if keep > 1:
                logits[i] = out.logits[0].clone()
            tokens = [int(out.logits[0, -1].argmax())]
            while len(tokens) < NEW_TOKENS:
                out = smollm2_hf(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
                tokens.append(int(out.logits[0, -1].argmax()))
            outs.append(tokens)
    return outs, logits


@pytest.fixture(scope="module")
def hf_greedy(hf_runs) -> list[list[int]]:
    return hf_runs[0]


@pytest.mark.slow
def test_prompt_logits_match_transformers(smollm2_model, hf_runs, prompts):
    for i in _logit_prompts(prompts):
        p = prompts[i]
        ids = torch.tensor(p)
        ref = hf_runs[1][i]
        keep = len(ref)
        with torch.inference_mode():
            hidden = smollm2_model(torch.arange(len(p)), CausalAttention(), input_ids=ids)
            ours = smollm2_model.compute_logits(hidden[-keep:])
        err = (ours - ref).abs().max().item()
        scale = ref.abs().max().item()
        print(f"\n[{len(p)} tokens] max |logit diff| vs transformers: {err:.2e} (logit scale {scale:.1f})")
        assert err <= 1e-4 * scale


@pytest.mark.slow
def test_greedy_continuations_match_transformers(smollm2_model, prompts, hf_greedy):
    engine = Engine(EngineConfig(kv_cache_tokens=32768), model=smollm2_model)
    assert engine.runner.cpu_decode is not None or not cpu.available()  # decode steps: the fused CPU kernel
    assert _generate(engine, prompts) == hf_greedy


@pytest.mark.slow
@pytest.mark.parametrize("budget", [256])  # the long prompts in many chunks, the short ones beside them
def test_chunk_size_and_batching_do_not_change_outputs(smollm2_model, prompts, hf_greedy, budget):
    engine = Engine(EngineConfig(kv_cache_tokens=32768, max_num_batched_tokens=budget), model=smollm2_model)
    assert _generate(engine, prompts) == hf_greedy
