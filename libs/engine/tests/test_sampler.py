import pytest
import torch

from spindle_engine import SamplingParams
from spindle_engine.sampler import draw, sample


def _logits(n: int = 4, vocab: int = 50) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = _logits()
    g = torch.Generator().manual_seed(0)
    greedy = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4, g)
    assert greedy == logits.argmax(-1).tolist()
    topk1 = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 4, [None] * 4, g)
    assert topk1 == greedy
    tiny_p = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 4, [None] * 4, g)
    assert tiny_p == greedy


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = _logits(3)
    p = SamplingParams(temperature=1.0, seed=7)

    def draw(batch_rows: list[int]) -> int:
        gens = [torch.Generator().manual_seed(7) if i == 0 else None for i in range(len(batch_rows))]
        params = [p] + [SamplingParams(temperature=1.0)] * (len(batch_rows) - 1)
        return sample(logits[batch_rows], params, gens, torch.Generator().manual_seed(123))[0]

    assert draw([0]) == draw([0, 1, 2]) == draw([0, 2])


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0, -10.0]])
    g = torch.Generator().manual_seed(0)
    seen = {sample(logits, [SamplingParams(temperature=5.0, top_k=2)], [None], g)[0] for _ in range(200)}
    assert seen == {0, 1}
    probs = torch.softmax(logits[0], -1)  # top-2 mass ~0.95
    p = float(probs[0] + probs[1]) - 0.01
    seen = {sample(logits, [SamplingParams(temperature=1.0, top_p=p)], [None], g)[0] for _ in range(300)}
    assert seen == {0, 1}


def test_draws_follow_the_distribution_and_never_pick_filtered_tokens():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])  # zeros first, between and last, as filters leave them
    g = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(n)]), minlength=6).double() / n
    assert counts[[0, 2, 5]].sum() == 0
    assert float((counts - probs.double()).abs().max()) < 0.015  # ~4.5 sigma at n = 20000
    one = torch.zeros(49152)
    one[49151] = 1.0
    assert draw(one, g) == 49151


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_bad_params_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
