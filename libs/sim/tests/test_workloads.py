"""Workload generators and trace files.

Tolerances: with a fixed seed the tests are deterministic; the tolerances bound fit error plus sampling error of
a 20,000-request draw. Sample mean of a lognormal with CV <= 0.6 has a standard error < 0.5 %, so 3 % on Tetris
means is > 6 SE. A sample median's SE is ~1.25 sigma/sqrt(n) in log space (< 1 % here), the p90 ~1.6 %, the p99
~2.5 % for sigma ~ 0.94 (CSPS NeedleBench): 5 % for medians/p90, 8 % for p99.
"""

import json
import math
import re

import numpy as np
import pytest

from spindle_policy.calibration import PAPER_FIGURES
from spindle_sim.traces import filler_prompt, read_csv, read_jsonl, write_csv, write_jsonl
from spindle_sim.workloads import (
    WORKLOADS,
    Arrival,
    ScaledBeta,
    TraceRequest,
    lognormal_with_tail,
    make_workload,
    mixed_diurnal,
)

N = 20_000


def _arrays(reqs: list[TraceRequest]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = np.array([r.arrived_at for r in reqs])
    p = np.array([r.num_prefill_tokens for r in reqs])
    d = np.array([r.num_decode_tokens for r in reqs])
    return t, p, d


def _close(x: float, target: float, tol: float) -> None:
    assert abs(x - target) <= tol * target, f"{x} not within {tol:.0%} of {target}"


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_is_deterministic_and_valid(name: str) -> None:
    a = make_workload(name, 500, 2.0, seed=7)
    assert a == make_workload(name, 500, 2.0, seed=7)
    assert a != make_workload(name, 500, 2.0, seed=8)
    t, p, d = _arrays(a)
    assert np.all(np.diff(t) >= 0) and t[0] > 0
    assert p.min() >= 1 and d.min() >= 1


def test_lengths_do_not_depend_on_arrival_process() -> None:
    a = make_workload("tetris-short", 200, 1.0, seed=3)
    b = make_workload("tetris-short", 200, 5.0, seed=3, arrival="gamma", cv=3.0)
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in a] == [
        (r.num_prefill_tokens, r.num_decode_tokens) for r in b
    ]


@pytest.mark.parametrize("kind,cv", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 4.0)])
def test_interarrival_mean_and_cv(kind: str, cv: float) -> None:
    rate = 2.5
    gaps = np.diff(np.concatenate([[0.0], Arrival(kind, rate, cv).times(N, np.random.default_rng(0))]))
    _close(gaps.mean(), 1 / rate, 0.03 * cv)  # SE of the mean is cv/sqrt(N) relative: 0.7 % * cv
    _close(gaps.std() / gaps.mean(), cv, 0.1)


def test_infinite_rate_puts_all_at_zero() -> None:
    assert {r.arrived_at for r in make_workload("constant:10:5", 20, math.inf, 0)} == {0.0}


@pytest.mark.parametrize(
    "name,mean,lo,hi",
    [
        ("tetris-short", 23_600, 4000, 95_000),
        ("tetris-medium", 32_800, 8000, 142_000),
        ("tetris-long", 50_100, 16_000, 190_000),
    ],
)
def test_tetris_total_length_matches_paper(name: str, mean: int, lo: int, hi: int) -> None:
    _, p, d = _arrays(make_workload(name, N, 1.0, 0))
    total = p + d
    _close(total.mean(), mean, 0.03)
    assert total.min() >= lo and total.max() <= hi


@pytest.mark.parametrize(
    "name,lo,hi",
    [("loongserve-sharegpt", 4, 2300), ("loongserve-l-eval", 2700, 210_500), ("loongserve-lv-eval", 15_100, 497_300)],
)
def test_loongserve_ranges(name: str, lo: int, hi: int) -> None:
    _, p, _ = _arrays(make_workload(name, N, 1.0, 0))
    assert p.min() >= lo and p.max() <= hi
    _close(float(np.median(p)), math.sqrt(lo * hi), 0.05)


def test_loongserve_mixed_and_zipf() -> None:
    _, p, _ = _arrays(make_workload("loongserve-mixed", N, 1.0, 0))
    assert 0.3 < np.mean(p <= 2300) < 0.37  # a third is ShareGPT (plus a few short L-Eval)
    means = [_arrays(make_workload(f"loongserve-zipf-{a}", N, 1.0, 0))[1].mean() for a in ("1.0", "1.2", "1.4")]
    assert means[0] > means[1] > means[2]
    assert max(_arrays(make_workload("loongserve-zipf:1.1", N, 1.0, 0))[1]) <= 200_000


@pytest.mark.parametrize(
    "name,p50,p99,d50,d99",
    [("csps-needlebench", 113_000, 995_000, 348, 572), ("csps-bookcorpus", 97_000, 406_000, 375, 631)],
)
def test_csps_quantiles_match_paper(name: str, p50: int, p99: int, d50: int, d99: int) -> None:
    _, p, d = _arrays(make_workload(name, N, 1.0, 0))
    _close(float(np.median(p)), p50, 0.05)
    _close(float(np.quantile(p, 0.99)), p99, 0.08)
    _close(float(np.median(d)), d50, 0.05)
    _close(float(np.quantile(d, 0.99)), d99, 0.08)


def test_medha_long_and_mix() -> None:
    _, p, d = _arrays(make_workload("medha-long", N, 1.0, 0))
    assert p.min() >= 128_000 and p.max() <= 1_000_000
    _close(float(np.median(p)), 393_000, 0.05)
    _close(float(np.quantile(p, 0.9)), 839_000, 0.05)
    _close(float(np.median(d)), 518, 0.05)
    _close(float(np.quantile(d, 0.9)), 808, 0.05)
    _, p, d = _arrays(make_workload("medha-mix", N, 1.0, 0))
    assert 0.045 < np.mean(p >= 128_000) < 0.055
    short = p < 128_000
    assert np.all(p[short] + d[short] <= 8192)
    _, p, _ = _arrays(make_workload("medha-mix:0.2", N, 1.0, 0))
    assert 0.19 < np.mean(p >= 128_000) < 0.21


def test_seesaw_arxiv_matches_vidur_trace_stats() -> None:
    figs = json.loads(PAPER_FIGURES.read_text())
    ref = figs["seesaw_workloads"]["arxiv_summarization_lengths_from_vidur_trace"]
    _, p, d = _arrays(make_workload("seesaw-arxiv", N, 1.0, 0))
    _close(p.mean(), ref["prefill_mean"], 0.03)
    _close(float(np.median(p)), ref["prefill_p50"], 0.05)
    _close(float(np.quantile(p, 0.99)), ref["prefill_p99"], 0.05)  # the Beta fit lands ~+3 % (documented)
    assert p.max() <= 4096
    _close(d.mean(), ref["decode_mean"], 0.05)  # heavy tail: the mean's SE is ~1.5 %
    _close(float(np.median(d)), ref["decode_p50"], 0.05)
    _close(float(np.quantile(d, 0.99)), ref["decode_p99"], 0.08)


@pytest.mark.parametrize(
    "mean,p50,p99,tail_lo,hi",
    [(291, 167, 3000, 2000, 3000), (100, 167, 3273, 2048, 4096), (291, 167, 1000, 2048, 4096)],
)
def test_bad_tail_fit(mean: float, p50: float, p99: float, tail_lo: int, hi: int) -> None:
    with pytest.raises(ValueError):
        lognormal_with_tail(mean, p50, p99, tail_lo, hi)


def test_bad_beta_fit() -> None:
    with pytest.raises(ValueError):
        ScaledBeta.from_mean_median(2730, 2588, 4096)  # mean > median: right-skewed, not this family
    with pytest.raises(ValueError):
        ScaledBeta.from_mean_median(5000, 5100, 4096)


def test_constant() -> None:
    _, p, d = _arrays(make_workload("constant:3000:7", 50, 1.0, 0))
    assert set(p) == {3000} and set(d) == {7}


@pytest.mark.parametrize("name", ["nope", "constant:1", "constant:0:5", "loongserve-zipf:x", "medha-mix:1.5"])
def test_unknown_or_bad_workload(name: str) -> None:
    with pytest.raises(ValueError):
        make_workload(name, 10, 1.0, 0)


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_bad_rate(rate: float) -> None:
    with pytest.raises(ValueError):
        make_workload("tetris-short", 10, rate, 0)


def test_bad_arrival_args() -> None:
    with pytest.raises(ValueError):
        make_workload("tetris-short", 10, 1.0, 0, arrival="uniform")
    with pytest.raises(ValueError):
        make_workload("tetris-short", 10, 1.0, 0, arrival="gamma", cv=0.0)
    with pytest.raises(ValueError):
        make_workload("tetris-short", -1, 1.0, 0)


def test_csv_round_trip(tmp_path) -> None:
    reqs = make_workload("medha-mix", 300, 1.3, 5, arrival="gamma", cv=2.0)
    path = tmp_path / "trace.csv"
    write_csv(path, reqs)
    assert path.read_text().splitlines()[0] == "arrived_at,num_prefill_tokens,num_decode_tokens,service_class"
    assert read_csv(path) == reqs


def test_jsonl_round_trip_and_vllm_fields(tmp_path) -> None:
    reqs = make_workload("loongserve-sharegpt", 100, 4.0, 1)
    path = tmp_path / "trace.jsonl"
    write_jsonl(path, reqs)
    assert read_jsonl(path) == reqs
    first = json.loads(path.read_text().splitlines()[0])
    assert first["prompt"] == filler_prompt(reqs[0].num_prefill_tokens)
    assert first["output_tokens"] == reqs[0].num_decode_tokens


def test_jsonl_plain_vllm_file(tmp_path) -> None:
    path = tmp_path / "plain.jsonl"
    path.write_text('{"prompt": "a b c", "output_tokens": 4}\n\n{"prompt": "d", "output_tokens": 2}\n')
    with pytest.raises(ValueError):
        read_jsonl(path)
    got = read_jsonl(path, count_tokens=lambda s: len(s.split()))
    assert got == [TraceRequest(0.0, 3, 4), TraceRequest(0.0, 1, 2)]
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError):
        read_jsonl(path, count_tokens=len)


def test_bad_csv(tmp_path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("arrived_at,num_prefill_tokens\n0.0,3\n")
    with pytest.raises(ValueError):
        read_csv(path)
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,0,3\n")
    with pytest.raises(ValueError):
        read_csv(path)


def _long_share(reqs: list[TraceRequest]) -> float:
    return float(np.mean([r.num_prefill_tokens >= 16_000 for r in reqs]))


def test_mixed_chat_share_and_parts() -> None:
    reqs = make_workload("mixed-chat", N, 1.0, 0)
    _, p, d = _arrays(reqs)
    assert {r.service_class for r in reqs} == {"interactive"}
    long = p >= 16_000  # the chat body is capped at 8K: a clean gap
    assert not np.any((p > 8192) & ~long)
    _close(float(long.mean()), 0.02, 0.15)  # SE of a 2 % share over 20K draws: 5 % of it
    assert p[long].min() >= 16_000 and p[long].max() <= 256_000
    _close(float(np.median(p[long])), 64_000, 0.15)  # ~400 draws: the geometric midpoint of 16K-256K
    assert np.all(p[~long] + d[~long] <= 8192)
    _close(_long_share(make_workload("mixed-chat:0.2", N, 1.0, 0)), 0.2, 0.05)
    assert _long_share(make_workload("mixed-chat:0", 2000, 1.0, 0)) == 0.0


def test_mixed_diurnal_drifts_up_over_the_trace() -> None:
    reqs = make_workload("mixed-diurnal", N, 1.0, 0)
    assert reqs == make_workload("mixed-diurnal", N, 1.0, 0) and reqs != make_workload("mixed-diurnal", N, 1.0, 1)
    fifth = N // 5
    first, last = _long_share(reqs[:fifth]), _long_share(reqs[-fifth:])
    # the raised cosine averages 0.016 over its first fifth and 0.194 over its last (SE ~0.002 and ~0.006)
    assert 0.008 < first < 0.025 and 0.175 < last < 0.215
    _close(_long_share(reqs), (0.01 + 0.20) / 2, 0.1)  # symmetric about the middle: the mean share
    down = make_workload("mixed-diurnal:0.3:0.0", N, 1.0, 0)  # HI < LO drifts down
    assert _long_share(down[:fifth]) > 0.25 and _long_share(down[-fifth:]) < 0.02
    shares = mixed_diurnal(0.01, 0.2).shares(5)
    assert shares[0] == pytest.approx(0.01) and shares[-1] == pytest.approx(0.2)
    assert shares[2] == pytest.approx(0.105) and np.all(np.diff(shares) > 0)
    assert mixed_diurnal().shares(1).tolist() == [0.01]


def test_mixed_batch_job() -> None:
    n = 2000
    reqs = make_workload("mixed-batch", n, 2.0, 3)
    assert len(reqs) == n and reqs == make_workload("mixed-batch", n, 2.0, 3)
    t, p, d = _arrays(reqs)
    assert np.all(np.diff(t) >= 0)
    batch = np.array([r.service_class == "batch" for r in reqs])
    assert batch.sum() == 200 and {r.service_class for r in reqs} == {"interactive", "batch"}
    online = [r for r in reqs if r.service_class == "interactive"]
    # all submitted at the midpoint of the online arrival span
    assert set(t[batch]) == {(online[0].arrived_at + online[-1].arrived_at) / 2}
    assert p[batch].min() >= 8000 and p[batch].max() <= 64_000 and d[batch].min() >= 1 and d[batch].max() <= 2048
    _close(float(np.median(p[batch])), math.sqrt(8000 * 64_000), 0.15)
    _close(float(np.median(d[batch])), 256, 0.15)
    # the online requests are mixed-chat's trace of the same seed
    assert online == make_workload("mixed-chat", n - 200, 2.0, 3)
    assert sum(r.service_class == "batch" for r in make_workload("mixed-batch:0.25", 40, 2.0, 0)) == 10
    assert {r.service_class for r in make_workload("mixed-batch:0", 40, 2.0, 0)} == {"interactive"}
    assert {r.arrived_at for r in make_workload("mixed-batch", 50, math.inf, 0)} == {0.0}  # everything at t=0
    all_batch = make_workload("mixed-batch:1", 10, 2.0, 0)
    assert {(r.arrived_at, r.service_class) for r in all_batch} == {(0.0, "batch")}
    bursty = make_workload("mixed-batch", 500, 2.0, 3, arrival="gamma", cv=4.0)
    assert sum(r.service_class == "batch" for r in bursty) == 50 and all(r.arrived_at >= 0 for r in bursty)


@pytest.mark.parametrize(
    "name,says",
    [
        ("mixed-chat:1.5", "not in [0, 1]"),
        ("mixed-chat:x", "'x' is not a number"),
        ("mixed-diurnal:0.1", "expected 2 share(s)"),
        ("mixed-diurnal:0.1:2", "share 2 is not in [0, 1]"),
        ("mixed-batch:-0.1", "not in [0, 1]"),
        ("mixed-batch:0.1:0.2", "expected 1 share(s)"),
    ],
)
def test_bad_mixed_workload_arguments(name: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        make_workload(name, 10, 1.0, 0)
    assert name in str(e.value)


def test_service_class_is_checked_and_round_trips(tmp_path) -> None:
    with pytest.raises(ValueError, match="service_class"):
        TraceRequest(0.0, 10, 5, "bulk")
    reqs = make_workload("mixed-batch:0.25", 40, 2.0, 0)
    csv_path, jsonl_path = tmp_path / "trace.csv", tmp_path / "trace.jsonl"
    write_csv(csv_path, reqs)
    write_jsonl(jsonl_path, reqs)
    assert read_csv(csv_path) == reqs and read_jsonl(jsonl_path) == reqs
    assert sum(json.loads(line)["service_class"] == "batch" for line in jsonl_path.read_text().splitlines()) == 10
    # older files, without the column or key, read as interactive
    csv_path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,10,3\n")
    jsonl_path.write_text('{"prompt": "a", "output_tokens": 3, "num_prefill_tokens": 10, "arrived_at": 0.5}\n')
    assert read_csv(csv_path) == read_jsonl(jsonl_path) == [TraceRequest(0.5, 10, 3, "interactive")]
    jsonl_path.write_text('{"prompt": "a", "output_tokens": 3, "num_prefill_tokens": 10, "service_class": "x"}\n')
    with pytest.raises(ValueError, match="service_class"):
        read_jsonl(jsonl_path)
