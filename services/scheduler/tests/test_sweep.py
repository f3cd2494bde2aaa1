"""Sweeps, goodput and normalised latencies, the max-sustainable-load search, plots and `spindle sim sweep`."""

import json
import math

import pytest

from spindle_scheduler.calibration import load_paper_calibration
from spindle_scheduler.core import SchedulerConfig
from spindle_scheduler.sim import SimConfig
from spindle_scheduler.sim.cli import main, split_specs
from spindle_scheduler.sim.loadsearch import find_light_load, max_sustainable_load, search_max_load
from spindle_scheduler.sim.metrics import RequestRecord, Slo, summarize
from spindle_scheduler.sim.plot import plot_sweep, sweep_title
from spindle_scheduler.sim.sweep import format_table, metric_value, sweep

SMALL = ["--workload", "tetris-short", "--instances", "4", "--decode-instances", "2", "--num-requests", "60"]


@pytest.fixture(scope="module")
def latency():
    return load_paper_calibration()


def _config(prefill: int = 4, decode: int = 2) -> SimConfig:
    return SimConfig(num_prefill=prefill, num_decode=decode, scheduler=SchedulerConfig(max_num_requests=1000))


def _rec(rid: str, arrived: float, prompt: int, times: list[float], state: str = "finished") -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        arrived_at=arrived,
        num_prefill_tokens=prompt,
        num_decode_tokens=max(len(times), 1),
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
    duration = 5.0 - 0.0
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
    assert data["slo"] == {"ttft_s": 2.0, "tpot_s": 0.2} and data["goodput_req_s"] == pytest.approx(0.4)
    assert json.loads(none.to_json())["goodput_tok_s"] is None
    with pytest.raises(ValueError):
        Slo(ttft_s=0.0)


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
    assert d["slo"] == {"ttft_s": 5.0, "tpot_s": 0.05} and d["cluster"]["num_prefill"] == 4
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
