"""Sweeps, goodput and normalised latencies, the max-sustainable-load search, plots and `spindle sim sweep`."""

import json
import math

import pytest

from spindle_policy.calibration import load_paper_calibration
from spindle_policy.core import SchedulerConfig
from spindle_sim import SimConfig
from spindle_sim.cli import split_specs
from spindle_sim.commands import main
from spindle_sim.executor import simulate
from spindle_sim.loadsearch import (
    find_light_load,
    max_sustainable_load,
    search_max_attainment,
    search_max_load,
)
from spindle_sim.metrics import RequestRecord, Slo, summarize
from spindle_sim.plot import plot_sweep, sweep_title
from spindle_sim.sweep import format_table, metric_value, run_point, sweep
from spindle_sim.workloads import make_workload

SMALL = ["--workload", "tetris-short", "--instances", "4", "--decode-instances", "2", "--num-requests", "60"]


@pytest.fixture(scope="module")
def latency():
    return load_paper_calibration()


def _config(prefill: int = 4, decode: int = 2) -> SimConfig:
    return SimConfig(num_prefill=prefill, num_decode=decode, scheduler=SchedulerConfig(max_num_requests=1000))


def _rec(
    rid: str,
    arrived: float,
    prompt: int,
    times: list[float],
    state: str = "finished",
    service_class: str = "interactive",
) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        arrived_at=arrived,
        num_prefill_tokens=prompt,
        num_decode_tokens=max(len(times), 1),
        service_class=service_class,
        state=state,
        finished_at=times[-1] if state == "finished" else None,
        token_times=list(times),
    )


def test_sweep_rows_are_deterministic_and_replay_the_same_requests(latency):
    rates = [4.0, 1.0]
    rows = sweep(["single"], rates, "tetris-short", latency, _config(), num_requests=60, seed=1, slo=Slo(5.0))
    assert [(r.strategy, r.rate) for r in rows] == [("single", 1.0), ("single", 4.0)]
    for row in rows:
        s = row.summary
        assert s.completed == s.num_requests == 60 and s.rate == row.rate and s.workload == "tetris-short"
        assert 0 <= s.slo_attainment <= 1 and s.goodput_req_s is not None
    low, high = (r.summary for r in rows)
    # the same requests at both rates: the same input tokens, more queueing at the higher rate
    assert low.input_throughput_tok_s * low.duration_s == pytest.approx(high.input_throughput_tok_s * high.duration_s)
    assert metric_value(high, "ttft", "p50") >= metric_value(low, "ttft", "p50")
    again = sweep(["single"], rates, "tetris-short", latency, _config(), num_requests=60, seed=1, slo=Slo(5.0))
    assert [r.summary for r in again] == [r.summary for r in rows]
    table = format_table(rows)
    assert "ttft p50" in table and "60/60" in table
    with pytest.raises(ValueError):
        sweep(["single"], [0.0], "tetris-short", latency, _config())
    with pytest.raises(ValueError):
        metric_value(low, "ttft", "p42")


def test_goodput_under_an_slo():
    recs = [
        _rec("a", 0.0, 100, [1.0, 1.1, 1.2, 1.3]),  # TTFT 1, TPOT 0.1
        _rec("b", 1.0, 100, [4.0, 4.1]),  # TTFT 3, TPOT 0.1
        _rec("c", 2.0, 100, [3.0, 3.5, 4.0]),  # TTFT 1, TPOT 0.5
        _rec("d", 3.0, 100, [5.0]),  # TTFT 2, a single token: no TPOT
        _rec("e", 4.0, 100, [], state="rejected"),
    ]
    duration = 4.0 - 0.0  # per second of offered load: the first to the last arrival
    both = summarize(recs, slo=Slo(ttft_s=2.0, tpot_s=0.2))
    assert both.goodput_req_s == pytest.approx(2 / duration)  # a and d
    assert both.goodput_tok_s == pytest.approx((4 + 1) / duration)
    assert both.slo_attainment == pytest.approx(2 / 5)  # the rejected request counts as a miss
    ttft_only = summarize(recs, slo=Slo(ttft_s=2.0))
    assert ttft_only.goodput_req_s == pytest.approx(3 / duration)  # a, c, d
    no_limit = summarize(recs, slo=Slo())
    assert no_limit.goodput_req_s == pytest.approx(4 / duration) and no_limit.slo_attainment == pytest.approx(4 / 5)
    none = summarize(recs)
    assert none.goodput_req_s is None and none.slo is None
    data = json.loads(both.to_json())
    assert data["slo"] == {"ttft_s": 2.0, "tpot_s": 0.2, "ttft_per_ktok_s": 0.0}
    assert data["goodput_req_s"] == pytest.approx(0.5)
    assert json.loads(none.to_json())["goodput_tok_s"] is None
    with pytest.raises(ValueError):
        Slo(ttft_s=0.0)


def test_a_length_scaled_ttft_slo_gives_longer_prompts_longer():
    recs = [_rec("short", 0.0, 1_000, [1.5, 1.6]), _rec("long", 0.0, 40_000, [2.5, 2.6])]  # TTFT 1.5 and 2.5 s
    slo = Slo(ttft_s=1.0, ttft_per_ktok_s=0.05)  # 1.05 s for 1K tokens, 3 s for 40K
    assert slo.ttft_limit(40_000) == pytest.approx(3.0)
    assert [slo.met_by(r) for r in recs] == [False, True]
    assert summarize(recs, slo=slo).slo_attainment == pytest.approx(0.5)
    for bad in ({"ttft_s": 1.0, "ttft_per_ktok_s": -1.0}, {"tpot_s": 0.1, "ttft_per_ktok_s": 0.05}):
        with pytest.raises(ValueError):
            Slo(**bad)


def test_loongserve_normalised_latencies():
    recs = [_rec("a", 0.0, 100, [2.0, 2.5, 3.0, 3.5]), _rec("b", 1.0, 50, [2.0])]
    s = summarize(recs)
    # input: TTFT / prompt tokens; output: (E2E - TTFT) / output tokens; per-token: E2E / (prompt + output)
    assert s.normalized_input_latency_s.mean == pytest.approx((2.0 / 100 + 1.0 / 50) / 2)
    assert s.normalized_output_latency_s.mean == pytest.approx((1.5 / 4 + 0.0) / 2)
    assert s.normalized_latency_s.mean == pytest.approx((3.5 / 104 + 1.0 / 51) / 2)
    empty = json.loads(summarize([]).to_json())
    assert empty["normalized_input_latency_s"]["mean"] is None


def test_max_load_search_on_a_monotone_toy():
    calls: list[float] = []

    def evaluate(rate: float) -> float:
        calls.append(rate)
        return 1.0 + rate**2

    result = search_max_load(evaluate, "toy", start_rate=1.0, rel_tol=0.02)
    assert len(calls) == len(set(calls))  # each rate evaluated once
    # light load: halve while the value falls by > 5 %: 1 -> 0.5 -> 0.25 -> 0.125 (1.0625 -> 1.0156, flat)
    assert result.light_rate == 0.125 and result.light_value == pytest.approx(1 + 0.125**2)
    assert result.slo_s == pytest.approx(25 * result.light_value)
    assert result.saturated and 1 + result.rate**2 <= result.slo_s < 1 + result.next_rate**2
    assert result.next_rate - result.rate <= 0.02 * result.rate
    assert result.rate == pytest.approx(math.sqrt(result.slo_s - 1), rel=0.03)
    assert [p.rate for p in result.points] == sorted(calls)
    assert all(p.ok == (p.value <= result.slo_s) for p in result.points)

    given = search_max_load(evaluate, light_rate=0.5, slo_s=10.0)
    assert given.light_rate == 0.5 and given.slo_s == 10.0 and given.rate <= 3.0 < given.next_rate
    never = search_max_load(lambda r: 1.0, max_rate=64.0)
    assert never.rate == 64.0 and never.next_rate is None and not never.saturated
    broken = search_max_load(lambda r: math.inf, light_rate=1.0, slo_s=1.0)
    assert broken.rate is None
    assert find_light_load(lambda r: 3.0, 2.0) == (1.0, 3.0)


def test_max_sustainable_load_in_the_simulator(latency):
    config = _config(prefill=1, decode=1)
    m = max_sustainable_load("single", "tetris-short", latency, config, num_requests=60, seed=0, max_rate=64.0)
    assert m.metric == "ttft_p50" and m.saturated
    by_rate = {p.rate: p for p in m.points}
    assert by_rate[m.rate].value <= m.slo_s < by_rate[m.next_rate].value
    assert m.light_rate < m.rate < m.next_rate
    again = max_sustainable_load("single", "tetris-short", latency, config, num_requests=60, seed=0, max_rate=64.0)
    assert again == m


def test_plot_writes_a_png(latency, tmp_path):
    rows = sweep(["single"], [0.5, 2, 8], "tetris-short", latency, _config(), num_requests=60)
    out = plot_sweep(rows, tmp_path / "sweep.png", sweep_title("tetris-short", _config(), 60))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert sweep_title("w", _config(), 60) == "w: 4 prefill + 2 decode instances, 60 requests"
    with pytest.raises(ValueError):
        plot_sweep([], tmp_path / "empty.png")


def test_strategy_spec_lists():
    assert split_specs(["single,request-sp", "fixed-sp:sp=8,x=1", "fixed-sp:sp=16"]) == [
        "single",
        "request-sp",
        "fixed-sp:sp=8,x=1",
        "fixed-sp:sp=16",
    ]
    with pytest.raises(ValueError):
        split_specs(["single", "single"])


def test_sweep_cli_end_to_end(tmp_path, capsys):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    args = ["sweep", "--strategies", "single", *SMALL, "--rates", "1,4", "--slo-ttft", "5", "--slo-tpot", "0.05"]
    assert main([*args, "--max-load", "--max-rate", "64", "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "ttft p50" in printed and "single" in printed and "TTFT P50 SLO" in printed
    d = json.loads(out.read_text())  # strict JSON: json.loads would accept NaN, so check the text too
    assert "NaN" not in out.read_text() and "Infinity" not in out.read_text()
    assert [(r["strategy"], r["rate"]) for r in d["rows"]] == [("single", 1.0), ("single", 4.0)]
    assert d["slo"] == {"ttft_s": 5.0, "tpot_s": 0.05, "ttft_per_ktok_s": 0.0} and d["cluster"]["num_prefill"] == 4
    assert all(r["completed"] == 60 and r["goodput_req_s"] is not None for r in d["rows"])
    assert all(set(r["plan_us"]) == {"mean", "p99", "max"} and r["plan_us"]["mean"] > 0 for r in d["rows"])
    (load,) = d["max_load"]
    assert load["strategy"] == "single" and load["points"] and load["metric"] == "ttft_p50"
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_errors_and_help(capsys):
    assert main(["sweep", "--strategies", "nope", *SMALL, "--rates", "1"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["sweep", "--strategies", "single", *SMALL, "--rates", "1,x"]) == 2
    assert main(["--strategy", "single", "--sp", "8", *SMALL]) == 2  # single has no sp option
    assert "sp" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sweep", "--strategies", "single", *SMALL])  # neither --rates nor --max-load
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    assert "fixed-sp:sp=16 fixed-sp:sp=8 request-sp" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "spindle sim sweep" in capsys.readouterr().out


def test_strategy_option_flags_and_colocated(tmp_path):
    out = tmp_path / "chunked.json"
    args = ["--workload", "tetris-short", "--num-requests", "30", "--rate", "1", "--json", str(out)]
    assert main(["--strategy", "chunked", "--chunk-size", "1024", "--colocated", "4", *args]) == 0
    d = json.loads(out.read_text())
    assert d["completed"] == 30 and d["strategy"].startswith("chunked")
    assert main(["--strategy", "fixed-sp:sp=2", "--instances", "4", "--decode-instances", "2", *args]) == 0
    assert json.loads(out.read_text())["strategy"].startswith("fixed-sp")


def test_single_run_prints_goodput(tmp_path, capsys):
    out = tmp_path / "one.json"
    assert main([*SMALL, "--rate", "2", "--slo-ttft", "5", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["strategy"] == "single" and d["slo"]["ttft_s"] == 5.0 and 0 < d["slo_attainment"] <= 1
    assert "goodput" in capsys.readouterr().out


def test_batch_requests_have_no_slo_and_a_job_completion_time():
    interactive = [
        _rec("a", 0.0, 100, [1.0, 1.1, 1.2, 1.3]),  # meets TTFT 2 / TPOT 0.2
        _rec("b", 1.0, 100, [4.0, 4.1]),  # TTFT 3: misses
        _rec("e", 2.0, 100, [], state="rejected"),  # misses
    ]
    batch = [
        _rec("x", 2.0, 5000, [30.0, 30.5, 31.0], service_class="batch"),  # TTFT 28: no SLO to miss
        _rec("y", 2.0, 5000, [40.0, 42.0], service_class="batch"),
    ]
    slo = Slo(ttft_s=2.0, tpot_s=0.2)
    alone = summarize(interactive, slo=slo)
    assert alone.num_batch == 0 and alone.batch_jct_s is None
    assert alone.interactive_ttft_s == alone.ttft_s and alone.interactive_tpot_s == alone.tpot_s
    s = summarize(interactive + batch, slo=slo)
    assert s.num_batch == 2 and s.batch_jct_s == pytest.approx(42.0 - 2.0)  # first batch arrival -> last finish
    # goodput and attainment: interactive requests only (over their arrival window, 0 -> 2), as without batch
    assert s.slo_attainment == pytest.approx(1 / 3) == alone.slo_attainment
    assert s.goodput_req_s == pytest.approx(1 / 2) == alone.goodput_req_s
    # latency stats cover every completed request; interactive_* only the interactive ones
    assert s.ttft_s.count == 4 and s.ttft_s.p99 > 20 and s.interactive_ttft_s == alone.ttft_s
    assert s.interactive_tpot_s.count == 2 and s.tpot_s.count == 4
    assert s.duration_s == pytest.approx(42.0) and s.completed == 4
    unfinished = summarize([*interactive, batch[0], _rec("z", 2.0, 5000, [], "failed", "batch")], slo=slo)
    assert unfinished.batch_jct_s == math.inf
    d = json.loads(unfinished.to_json())
    assert d["batch_jct_s"] is None and d["num_batch"] == 2 and set(d["interactive_ttft_s"]) >= {"p50", "p99"}
    only_batch = summarize(batch, slo=slo)
    assert math.isnan(only_batch.slo_attainment) and only_batch.goodput_req_s == 0.0


def test_the_simulator_passes_the_service_class_to_the_scheduler(latency):
    trace = make_workload("mixed-batch:0.25", 40, 2.0, 0)  # 10 batch requests at once
    # at most 2 batch requests in flight: the core refuses the rest of the job (it reads RequestSpec.service_class)
    config = SimConfig(num_prefill=2, num_decode=1, scheduler=SchedulerConfig(max_num_requests=40, batch_share=0.05))
    records = simulate(trace, "single", latency, config).records
    assert [r.service_class for r in records] == [r.service_class for r in trace]
    refused = [r for r in records if r.state == "rejected"]
    assert refused and all(r.service_class == "batch" and "batch requests in flight" in r.reason for r in refused)
    roomy = simulate(trace, "single", latency, _config(prefill=2, decode=1)).summary("mixed-batch:0.25", 2.0)
    assert roomy.completed == 40 and roomy.num_batch == 10 and 0 < roomy.batch_jct_s < math.inf


def test_max_load_by_slo_attainment_on_a_toy():
    calls: list[float] = []

    def attained(rate: float) -> float:
        calls.append(rate)
        return 1.0 - rate / 100  # 0.9 at rate 10

    m = search_max_attainment(attained, 0.9, "toy", Slo(1.0), start_rate=1.0, rel_tol=0.02)
    assert len(calls) == len(set(calls)) and m.metric == "slo_attainment" and m.attainment == 0.9
    assert m.saturated and m.rate <= 10 < m.next_rate and m.next_rate - m.rate <= 0.02 * m.rate
    assert (m.light_rate, m.light_value, m.slo) == (1.0, 0.99, Slo(1.0)) and math.isnan(m.slo_s)
    assert all(p.ok == (p.value >= 0.9) for p in m.points)
    high = search_max_attainment(attained, 0.9, start_rate=64.0)  # the start violates: halve until a rate holds
    rates = [p.rate for p in high.points]  # 64, 32, 16 violate, 8 holds, then bisection between 8 and 16
    assert rates[0] == 8.0 and {16.0, 32.0, 64.0} <= set(rates) and 8.0 <= high.rate <= 10 < high.next_rate
    never = search_max_attainment(lambda r: 0.5, 0.9, start_rate=1.0)
    assert never.rate is None and never.next_rate == 1 / 256 and len(never.points) == 9
    dropped = search_max_attainment(lambda r: 1.0 if r < 3 else -math.inf, 0.9, start_rate=1.0)  # -inf: rejected
    assert dropped.rate < 3 <= dropped.next_rate and dropped.next_rate - dropped.rate <= 0.05 * dropped.rate
    always = search_max_attainment(lambda r: 1.0, 1.0, max_rate=8.0)
    assert always.rate == 8.0 and not always.saturated
    for bad in (0.0, 1.5, math.nan):
        with pytest.raises(ValueError, match="attainment"):
            search_max_attainment(attained, bad)


def test_max_load_by_slo_attainment_in_the_simulator(latency):
    config = _config(prefill=1, decode=1)
    kw = {"num_requests": 40, "seed": 0, "max_rate": 8.0, "attainment": 0.9, "slo": Slo(ttft_s=5.0)}
    m = max_sustainable_load("single", "tetris-short", latency, config, start_rate=0.0625, **kw)
    assert m.metric == "slo_attainment" and m.saturated and m.light_rate == 0.0625
    by_rate = {p.rate: p for p in m.points}
    assert by_rate[m.rate].value >= 0.9 > by_rate[m.next_rate].value and by_rate[m.rate].ok
    assert m == max_sustainable_load("single", "tetris-short", latency, config, start_rate=0.0625, **kw)
    # a looser rule holds at higher rates
    loose = max_sustainable_load(
        "single", "tetris-short", latency, config, start_rate=0.0625, **kw | {"attainment": 0.5}
    )
    assert loose.rate > m.rate
    # a rejected request is a miss: 2 in flight at most and an SLO nothing completed misses, so a rate's
    # attainment is the share of requests admitted, and the search ends where more than 10 % are refused
    tight = SimConfig(num_prefill=1, num_decode=1, scheduler=SchedulerConfig(max_num_requests=2))
    dropped = max_sustainable_load(
        "single", "tetris-short", latency, tight, start_rate=0.0625, **kw | {"slo": Slo(1e6)}
    )
    assert dropped.saturated and dropped.rate is not None
    for p in dropped.points:
        trace = make_workload("tetris-short", 40, p.rate, 0)
        summary = run_point(trace, "single", latency, tight, "tetris-short", p.rate, Slo(1e6))
        assert p.value == summary.completed / 40 and p.ok == (p.value >= 0.9)
    assert any(not p.ok for p in dropped.points) and min(p.value for p in dropped.points) > 0
    for slo in (None, Slo()):
        with pytest.raises(ValueError, match="TTFT and/or TPOT"):
            max_sustainable_load("single", "tetris-short", latency, config, **kw | {"slo": slo})


def test_a_minimum_window_keeps_a_short_traces_burst_from_passing_for_sustained_load(latency):
    config = _config(prefill=1, decode=1)
    kw = {"num_requests": 40, "seed": 0, "max_rate": 8.0, "attainment": 0.5, "slo": Slo(ttft_s=5.0)}
    burst = max_sustainable_load("single", "tetris-short", latency, config, start_rate=0.0625, **kw)
    windowed = max_sustainable_load(
        "single", "tetris-short", latency, config, start_rate=0.0625, **kw | {"min_window_s": 200.0}
    )
    assert windowed.rate is not None and burst.rate is not None and windowed.rate < burst.rate
    with pytest.raises(ValueError, match="min_window_s"):
        max_sustainable_load("single", "tetris-short", latency, config, **kw | {"min_window_s": -1.0})


def test_max_load_attainment_flags(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    args = ["sweep", "--strategies", "single", *SMALL, "--max-load", "--max-rate", "8", "--start-rate", "0.25"]
    assert main([*args, "--max-load-attainment", "0.9", "--slo-ttft", "10", "--json", str(out)]) == 0
    assert "SLO attainment >= 90 % (TTFT <= 10 s)" in capsys.readouterr().out
    (load,) = json.loads(out.read_text())["max_load"]
    assert load["metric"] == "slo_attainment" and load["attainment"] == 0.9 and load["slo"]["ttft_s"] == 10.0
    assert load["slo_s"] is None and load["rate"] > 0
    for extra, says in [
        ([], "give --slo-ttft and/or --slo-tpot"),
        (["--slo-ttft", "5", "--max-load-attainment", "1.5"], "must be in (0, 1]"),
        (["--slo-ttft", "5", "--light-rate", "1"], "--light-rate belong"),
    ]:
        assert main([*args, "--max-load-attainment", "0.9", *extra]) == 2
        assert says in capsys.readouterr().err
    no_max_load = ["sweep", "--strategies", "single", *SMALL, "--rates", "1", "--slo-ttft", "5"]
    assert main([*no_max_load, "--max-load-attainment", "0.9"]) == 2
    assert "give --max-load too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    assert "--max-load-attainment A" in capsys.readouterr().out


def test_a_strategy_that_fails_its_light_load_has_no_max_load():
    # a strategy that rejects requests even under light load: its metric is inf there, so "25x its light load"
    # would be an infinite SLO that it never violates; it gets no max load instead
    m = search_max_load(lambda rate: math.inf, "rejects", light_rate=1.0)
    assert m.rate is None and m.next_rate == 1.0 and not m.points[0].ok
    m = search_max_load(lambda rate: math.nan, "rejects")
    assert m.rate is None
