import pytest
import torch

from spindle_engine import SamplingParams
from spindle_engine.sampler import draw, process_logits
from spindle_engine.sampler import sample as sample_seqs
from spindle_engine.sequence import Sequence


def _logits(n: int = 4, vocab: int = 50) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3


def _seq(params: SamplingParams, prompt: list[int] | None = None, outputs: list[int] = ()) -> Sequence:
    prompt = prompt or [1, 2, 3]
    return Sequence("r", [*prompt, *outputs], params, num_prompt_tokens=len(prompt))


def sample(logits, params, gens, default):
    """The old call shape: params and generators per row (a seeded row gets a Sequence with that seed)."""
    return sample_seqs(logits, [_seq(p) for p in params], default).tokens


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
        params = [p] + [SamplingParams(temperature=1.0)] * (len(batch_rows) - 1)
        return sample(logits[batch_rows], params, None, torch.Generator().manual_seed(123))[0]

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
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": ((5, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_params_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


# ---- logit processors and logprobs, each against the formula computed directly on the logits ----

V = 50
EOS = 7


def _row() -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(1)) * 3


def _processed(params: SamplingParams, prompt: list[int], outputs: list[int]) -> torch.Tensor:
    return process_logits(_row(), _seq(params, prompt, outputs), eos_token_ids=[EOS])


def test_frequency_and_presence_penalties_subtract_counts_of_the_outputs_only():
    prompt, outputs = [4, 4, 9], [3, 3, 3, 5, 9]
    got = _processed(SamplingParams(frequency_penalty=0.5, presence_penalty=1.25), prompt, outputs)
    want = _row()
    for t in set(outputs):
        want[t] -= 0.5 * outputs.count(t) + 1.25
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got[4] == _row()[4]  # in the prompt only: untouched


def test_repetition_penalty_covers_prompt_and_outputs_and_divides_positive_logits():
    prompt, outputs = [4, 11, 11], [3, 20]
    got = _processed(SamplingParams(repetition_penalty=1.7), prompt, outputs)
    want = _row()
    for t in {4, 11, 3, 20}:
        want[t] = want[t] / 1.7 if want[t] > 0 else want[t] * 1.7
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_logit_bias_adds_and_minus_100_bans_the_argmax():
    row = _row()
    top = int(row.argmax())
    got = _processed(SamplingParams(logit_bias=((top, -100.0), (3, 2.5))), [1], [])
    assert got[top] == pytest.approx(float(row[top]) - 100.0)
    assert got[3] == pytest.approx(float(row[3]) + 2.5)
    seq = _seq(SamplingParams(temperature=0, logit_bias=((top, -100.0),)), [1])
    assert sample_seqs(row[None], [seq], torch.Generator()).tokens[0] != top
    forced = _seq(SamplingParams(temperature=1.0, seed=3, logit_bias=((13, 100.0),)), [1])
    assert sample_seqs(row[None], [forced], torch.Generator()).tokens == [13]


def test_min_tokens_bans_eos_and_stop_ids_until_enough_outputs():
    row = _row()
    row[EOS] = row[21] = 50.0  # both would win
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(21,))
    for n_out, banned in ((0, True), (2, True), (3, False)):
        seq = _seq(p, [1], [5] * n_out)
        got = process_logits(row, seq, eos_token_ids=[EOS])
        assert (got[EOS] == float("-inf")) == banned and (got[21] == float("-inf")) == banned
        token = sample_seqs(row[None], [seq], torch.Generator(), eos_token_ids=[EOS]).tokens[0]
        assert (token not in (EOS, 21)) == banned
    ignore = process_logits(row, _seq(SamplingParams(min_tokens=3, ignore_eos=True), [1]), eos_token_ids=[EOS])
    assert ignore[EOS] == 50.0  # ignore_eos: EOS is no stop token, so min_tokens leaves it alone


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    seqs = [_seq(SamplingParams(temperature=1.0, min_p=0.5))]
    seen = {sample_seqs(logits, seqs, g).tokens[0] for _ in range(300)}
    assert seen == {0, 1}  # p(2) / p(0) = e^-3 < 0.5


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_log_softmax_of_the_processed_logits_over_temperature(temperature):
    row = _row()
    p = SamplingParams(temperature=temperature, seed=5, logprobs=5, presence_penalty=0.8, logit_bias=((2, 1.5),))
    seq = _seq(p, [1], [2, 8])
    sampled = sample_seqs(row[None], [seq], torch.Generator())
    lp = sampled.logprobs[0]
    scaled = process_logits(row, seq) / (temperature or 1.0)
    want = torch.log_softmax(scaled, -1)
    assert lp.token_id == sampled.tokens[0]
    assert lp.logprob == pytest.approx(float(want[lp.token_id]), abs=1e-6)
    top = torch.topk(want, 5)
    assert lp.top_ids == tuple(top.indices.tolist())
    torch.testing.assert_close(torch.tensor(lp.top_logprobs), top.values, rtol=0, atol=1e-6)
    if temperature == 0:
        assert lp.token_id == lp.top_ids[0]


def test_logprobs_zero_gives_the_sampled_token_only_and_none_gives_nothing():
    row = _row()[None]
    one = sample_seqs(row, [_seq(SamplingParams(temperature=0, logprobs=0))], torch.Generator()).logprobs[0]
    assert one.top_ids == () and one.logprob == pytest.approx(float(torch.log_softmax(row[0], -1).max()), abs=1e-6)
    assert sample_seqs(row, [_seq(SamplingParams(temperature=0))], torch.Generator()).logprobs == [None]


def test_penalty_state_follows_the_sequence_as_it_grows():
    p = SamplingParams(temperature=0, frequency_penalty=1.0)
    seq = _seq(p, [1], [])
    first = process_logits(_row(), seq)
    seq.token_ids += [5, 5]
    again = process_logits(_row(), seq)
    assert again[5] == pytest.approx(float(first[5]) - 2.0)
    fresh = process_logits(_row(), _seq(p, [1], [5, 5]))  # rebuilt from the tokens, as after a hand-off
    torch.testing.assert_close(again, fresh)
