"""`spindle sim compare`: strategies side by side on one trace and cluster, its JSON schema, shapes, skips and PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spindle_policy.strategy import available_strategies, parse_strategy_spec
from spindle_sim.commands import main

SMALL = ["--workload", "tetris-short", "--num-requests", "40", "--seed", "1"]
GIVEN = ["--instances", "4", "--decode-instances", "2"]
KEYS = {"completed", "rejected", "ttft_s", "tpot_s", "e2e_s", "interactive_ttft_s", "interactive_tpot_s"}
KEYS |= {"throughput_tok_s"}
KEYS |= {"goodput_rps", "slo_attainment", "batch_jct_s", "max_load_rps", "plan_us", "prediction_error", "config"}
STATS = {"mean", "p50", "p90", "p99"}


def _compare(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "compare.json"
    assert main(["compare", *argv, "--json", str(out)]) == 0
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    return json.loads(text)


def test_json_schema_same_keys_for_every_strategy_nulls_where_not_asked(tmp_path: Path) -> None:
    strategies = ["single,request-sp", "fixed-sp:sp=2"]
    d = _compare(tmp_path, "--strategies", *strategies, *GIVEN, *SMALL, "--rate", "2")
    assert set(d) == {"workload", "cluster", "strategies"}
    assert list(d["strategies"]) == ["single", "request-sp", "fixed-sp:sp=2"]
    for spec, s in d["strategies"].items():
        assert set(s) == KEYS, spec
        assert s["completed"] == 40 and s["rejected"] == 0 and s["throughput_tok_s"] > 0
        assert all(set(s[k]) == STATS and s[k]["p50"] <= s[k]["p99"] for k in ("ttft_s", "tpot_s", "e2e_s"))
        assert s["goodput_rps"] is None and s["max_load_rps"] is None  # no SLO, no --max-load
        assert s["slo_attainment"] is None and s["batch_jct_s"] is None  # no SLO, no batch job
        assert s["interactive_ttft_s"] == s["ttft_s"] and s["interactive_tpot_s"] == s["tpot_s"]  # all interactive
        assert set(s["plan_us"]) == {"mean", "p99", "max"} and 0 < s["plan_us"]["mean"] <= s["plan_us"]["max"]
    w = d["workload"]
    assert (w["name"], w["num_requests"], w["rate"], w["seed"], w["slo"], w["max_load"]) == (
        "tetris-short", 40, 2.0, 1, None, None
    )  # fmt: skip
    assert set(d["cluster"]["by_strategy"]) == set(d["strategies"]) and d["cluster"]["skipped"] == {}

    d = _compare(tmp_path, "--strategies", "single", *GIVEN, *SMALL, "--rate", "2", "--slo-ttft", "5")
    assert d["strategies"]["single"]["goodput_rps"] > 0 and d["workload"]["slo"] == {
        "ttft_s": 5.0,
        "tpot_s": None,
        "ttft_per_ktok_s": 0.0,
    }


def test_default_is_every_strategy_each_shaped_as_it_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _compare(tmp_path, *GIVEN, *SMALL, "--rate", "2")
    printed = capsys.readouterr().out
    # seesaw re-shards groups priced by the cost model: a cluster given as instance counts has none
    assert sorted(parse_strategy_spec(s)[0] for s in d["strategies"]) == sorted({*available_strategies()} - {"seesaw"})
    assert "named cluster" in d["cluster"]["skipped"]["seesaw"]
    assert all(s["completed"] == 40 for s in d["strategies"].values())
    # fixed-sp's default sp=8 does not fit 4 prefill instances: it runs with the largest SP size that does
    assert "fixed-sp:sp=4" in d["strategies"] and "the default sp=8 needs 8 prefill instances" in printed
    by = d["cluster"]["by_strategy"]
    assert (by["chunked"]["num_colocated"], by["chunked"]["num_prefill"]) == (6, 0)  # the same 6 GPUs, colocated
    assert (by["single"]["num_prefill"], by["single"]["num_decode"]) == (4, 2)  # as given
    assert "6 colocated, TP1" in printed and "4 prefill + 2 decode, TP1" in printed  # the table says how


def test_named_cluster_and_the_default_calibration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    named = ["--model", "llama3-70b", "--hardware", "h100-sxm", "--nodes", "2"]
    d = _compare(tmp_path, *named, "--strategies", "single,chunked,fixed-sp", *SMALL, "--rate", "1")
    c = d["cluster"]
    assert (c["model"], c["hardware"], c["gpus"]) == ("llama3-70b", "h100-sxm", 16)
    assert c["by_strategy"]["chunked"]["num_colocated"] * c["by_strategy"]["chunked"]["colocated_tp"] == 16
    assert c["by_strategy"]["single"]["num_prefill"] == 2 and "fixed-sp:sp=2" in d["strategies"]
    assert "2 prefill x TP4 + 2 decode x TP4 instances" in capsys.readouterr().out
    # charged the cost model, planned with forms fitted to it: every strategy's prediction error is reported
    for spec, st in d["strategies"].items():
        assert 0 <= st["prediction_error"]["all"]["mean_abs"] < 0.5 and st["prediction_error"]["all"]["n"] > 0, spec
    noisy = _compare(tmp_path, *named, "--strategies", "single", *SMALL, "--rate", "1", "--noise", "0.3")
    assert (noisy["strategies"]["single"]["prediction_error"]["all"]["mean_abs"]
            > d["strategies"]["single"]["prediction_error"]["all"]["mean_abs"])  # fmt: skip
    assert "pred. err" in capsys.readouterr().out

    d = _compare(tmp_path, "--strategies", "single", "--num-requests", "30", "--rate", "4")  # calibration, 32 + 8
    assert d["strategies"]["single"]["prediction_error"] is None  # priced by the very forms it plans with
    c = d["cluster"]
    assert (c["model"], c["num_prefill"], c["num_decode"]) == (None, 32, 8)
    assert d["strategies"]["single"]["completed"] == 30


def test_max_load_on_a_small_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--strategies", "single,request-sp", *GIVEN, *SMALL, "--max-load", "--max-rate", "32"]
    d = _compare(tmp_path, *argv)
    printed = capsys.readouterr().out
    assert "max sustainable load" in printed
    rule = d["workload"]["max_load"]
    # one SLO for the cell: 25x the best strategy's light load, told to every strategy; two minutes a probe
    assert rule | {"slo_s": None} == {
        "metric": "ttft_p50", "slo_scale": 25.0, "slo_s": None, "attainment": None, "window_s": 120.0,
        "slo_from": rule["slo_from"],
    }  # fmt: skip
    assert rule["slo_from"] in d["strategies"] and rule["slo_s"] > 0
    assert f"SLO for every strategy: ttft_p50 <= {rule['slo_s']:.4g} s" in printed
    assert printed.count(f"TTFT P50 SLO {rule['slo_s']:.3g} s") == 2  # each strategy's search used it
    for s in d["strategies"].values():
        assert set(s) == KEYS and 0 < s["max_load_rps"] <= 32
        assert s["completed"] is None and s["ttft_s"] is None and s["plan_us"] is None  # no --rate: no run
        assert s["slo_attainment"] is None and s["batch_jct_s"] is None and s["interactive_ttft_s"] is None


def test_jobs_run_the_strategies_in_forked_processes_with_the_same_results(tmp_path: Path) -> None:
    argv = ["--strategies", "single,request-sp", "chunked", *GIVEN, *SMALL, "--rate", "2", "--max-load",
            "--max-rate", "16", "--max-load-window", "4"]  # fmt: skip
    alone = _compare(tmp_path, *argv)
    forked = _compare(tmp_path, *argv, "--jobs", "3")
    for doc in (alone, forked):
        for s in doc["strategies"].values():
            s.pop("plan_us")  # wall time of plan(), the one number that may differ
    assert forked == alone and all(s["max_load_rps"] for s in alone["strategies"].values())
    assert main(["compare", *argv, "--jobs", "0"]) == 2


def test_a_batch_job_and_the_attainment_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mixed = ["--workload", "mixed-batch:0.25", "--num-requests", "40", "--seed", "1"]
    argv = ["--strategies", "single,chunked", *GIVEN, *mixed, "--rate", "2", "--slo-ttft", "5", "--slo-tpot", "0.1"]
    png = tmp_path / "compare.png"
    rule = ["--max-load", "--max-load-attainment", "0.5", "--start-rate", "0.5", "--max-rate", "16",
            "--max-load-window", "4"]  # fmt: skip
    d = _compare(tmp_path, *argv, *rule, "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "batch JCT s" in table and "SLO att." in table and "SLO attainment >= 50 %" in table
    assert d["workload"]["max_load"] == {
        "metric": "slo_attainment",
        "slo_scale": None,
        "slo_s": None,
        "attainment": 0.5,
        "window_s": 4.0,
    }
    for spec, s in d["strategies"].items():
        assert set(s) == KEYS and s["completed"] == 40, spec
        assert s["batch_jct_s"] > 0 and 0 <= s["slo_attainment"] <= 1 and s["max_load_rps"] > 0
        assert set(s["interactive_ttft_s"]) == STATS and set(s["interactive_tpot_s"]) == STATS
        assert s["interactive_ttft_s"] != s["ttft_s"]  # the 10 batch requests' long prompts are in ttft_s only
    # no batch job and no SLO: neither column
    _compare(tmp_path, "--strategies", "single", *GIVEN, *SMALL, "--rate", "2")
    head = capsys.readouterr().out.splitlines()[1]
    assert "batch JCT" not in head and "SLO att." not in head and "goodput" in head
    no_slo = ["compare", "--strategies", "single", *GIVEN, *SMALL, "--max-load", "--max-load-attainment", "0.9"]
    assert main(no_slo) == 2
    assert "give --slo-ttft and/or --slo-tpot" in capsys.readouterr().err


def test_the_png_is_written(tmp_path: Path) -> None:
    png = tmp_path / "compare.png"
    argv = ["--strategies", "single,chunked", *GIVEN, *SMALL, "--rate", "2", "--slo-ttft", "5"]
    _compare(tmp_path, *argv, "--max-load", "--max-rate", "16", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_a_strategy_that_cannot_run_is_skipped_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--strategies", "single", "fixed-sp:sp=16", "chunked:chunk_size=0", *GIVEN, *SMALL, "--rate", "2"]
    d = _compare(tmp_path, *argv)
    assert list(d["strategies"]) == ["single"]
    skipped = d["cluster"]["skipped"]
    assert "fewer than sp=16 live prefill instances" in skipped["fixed-sp:sp=16"]
    assert "chunk_size must be >= 1" in skipped["chunked:chunk_size=0"]
    assert "skipped" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("strategies", "says"),
    [
        (["nope"], "unknown strategy 'nope'"),
        (["single:foo=1"], "has no option foo"),
        (["fixed-sp:sp"], "is not key=value"),
        (["single", "single"], "listed twice"),
        (["fixed-sp:sp=32"], "no strategy could run"),  # every one skipped
    ],
)
def test_a_bad_spec_is_a_clear_error(strategies: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--strategies", *strategies, *GIVEN, *SMALL, "--rate", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spindle sim compare: ") and says in err and "Traceback" not in err


def test_help_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["compare", *SMALL])  # neither --rate nor --max-load
    assert e.value.code == 2 and "give --rate, --max-load or both" in capsys.readouterr().err
    assert main(["compare", "--strategies", "single", *GIVEN, *SMALL, "--rate", "0"]) == 2
    assert "--rate must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert "examples:\n  spindle sim compare --workload " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "spindle sim compare" in capsys.readouterr().out.replace("\n", " ")


def test_seeds_give_means_ranges_and_only_the_wins_they_carry(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--strategies", "single", "chunked", *GIVEN, "--workload", "tetris-short", "--num-requests", "40"]
    d = _compare(tmp_path, *argv, "--rate", "2", "--slo-ttft", "5", "--seeds", "1,2,3")
    printed = capsys.readouterr().out
    assert d["workload"]["seeds"] == [1, 2, 3] and d["workload"]["seed"] is None
    one = {seed: _compare(tmp_path, *argv, "--rate", "2", "--slo-ttft", "5", "--seed", str(seed)) for seed in (1, 2, 3)}
    for spec, s in d["strategies"].items():
        goodputs = [one[seed]["strategies"][spec]["goodput_rps"] for seed in (1, 2, 3)]
        assert s["goodput_rps"] == pytest.approx(sum(goodputs) / 3)
        assert s["spread"]["goodput_rps"] == [min(goodputs), max(goodputs)]
        assert s["per_seed"]["2"]["goodput_rps"] == goodputs[1]
        p50s = [one[seed]["strategies"][spec]["ttft_s"]["p50"] for seed in (1, 2, 3)]
        assert s["ttft_s"]["p50"] == pytest.approx(sum(p50s) / 3)
        assert s["spread"]["ttft_s.p50"] == [min(p50s), max(p50s)]
    for metric, v in d["verdicts"].items():
        lo, hi = d["strategies"][v["best"]]["spread"][metric]
        others = [d["strategies"][s]["spread"][metric] for s in d["strategies"] if s != v["best"]]
        overlap = any(a <= hi and b >= lo for a, b in others)
        assert v["result"] == ("tie" if overlap else "wins")
    assert "a win only where the seeds' ranges do not overlap" in printed
    _compare(tmp_path, *argv, "--rate", "2")
    assert "one seed: no strategy is called the winner" in capsys.readouterr().out
    assert main(["compare", *argv, "--rate", "2", "--seeds", "1,1"]) == 2
    assert "distinct seeds" in capsys.readouterr().err


def test_a_strategy_is_not_tied_with_its_own_paper_variant() -> None:
    from spindle_sim.seeds import verdicts

    def row(lo: float, hi: float) -> dict:
        return {"goodput_rps": (lo + hi) / 2, "spread": {"goodput_rps": [lo, hi]}}

    rows = {"tetris:max_sp=8": row(4.0, 4.2), "tetris@paper": row(4.1, 4.3), "spindle": row(2.6, 3.1)}
    v = verdicts(rows, 3)["goodput_rps"]
    assert v == {"best": "tetris@paper", "result": "wins", "tied_with": []}
    rows["spindle"] = row(3.0, 4.05)  # overlaps the tuned tetris only: the best one's range is what counts
    assert verdicts(rows, 3)["goodput_rps"]["result"] == "wins"
    rows["spindle"] = row(3.0, 4.15)
    assert verdicts(rows, 3)["goodput_rps"] == {"best": "tetris@paper", "result": "tie", "tied_with": ["spindle"]}


def test_tune_searches_every_strategy_alike_and_keeps_the_paper_variant(tmp_path: Path, capsys) -> None:
    named = ["--model", "llama3-8b", "--hardware", "a100-80g", "--nodes", "1", "--workload", "tetris-short"]
    cell = [*named, "--num-requests", "40", "--rate", "2", "--strategies", "single", "chunked"]
    d = _compare(tmp_path, *cell, "--slo-ttft", "2", "--tune", "--tune-budget", "3", "--seeds", "1,2")
    printed = capsys.readouterr().out
    specs = list(d["strategies"])
    assert len(specs) == 4 and "single@paper" in specs and "chunked@paper" in specs
    for spec, s in d["strategies"].items():
        if spec.endswith("@paper"):
            assert s["config"]["tuned"] is None
            continue
        tuned = s["config"]["tuned"]
        assert tuned["seed"] == 99 and tuned["runs"] == 3, spec  # the same budget for every strategy
        assert s["config"]["spec"] == spec and "tuned on seed 99 (3 runs)" in printed
        for knob, value in tuned["chosen"].items():
            assert knob in ("prefill_share", "decode_tp") or f"{knob}={value}" in spec, (spec, knob)
    forked = _compare(
        tmp_path, *cell, "--slo-ttft", "2", "--tune", "--tune-budget", "3", "--seeds", "1,2", "--jobs", "2"
    )
    for doc in (d, forked):
        for s in doc["strategies"].values():
            s.pop("plan_us")
    assert forked == d  # the search's runs in forked processes choose the same configurations
    # the evaluation never uses the tuning seed, and the search needs a load point and an SLO
    assert main(["compare", *cell, "--slo-ttft", "2", "--tune", "--tune-seed", "1", "--seeds", "1,2"]) == 2
    assert "tuning seed 1 is also evaluated" in capsys.readouterr().err
    assert main(["compare", *cell, "--tune"]) == 2
    assert "maximises goodput" in capsys.readouterr().err


def test_every_strategy_tunes_knobs_it_has() -> None:
    from spindle_policy.strategy import strategy_class, strategy_options
    from spindle_sim.tuning import SHAPE_KNOBS, candidates

    # every strategy but Spindle's own runs beside its tuned configuration as its paper configured it
    assert [n for n in available_strategies() if not strategy_class(n).from_paper] == ["spindle"]
    for name in available_strategies():
        space = strategy_class(name).tuning
        assert space, f"{name} has no tuning knobs"
        for knob, values in space.items():
            assert knob in SHAPE_KNOBS or knob in strategy_options(name), (name, knob)
            assert values and len(set(values)) == len(values), (name, knob)
        drawn = candidates(dict(space), 5, seed=3)
        assert drawn[0] == {} and len(drawn) <= 5 and drawn == candidates(dict(space), 5, seed=3)
