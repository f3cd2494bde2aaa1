"""`spindle sim`: a run from published figures or from a profile, summary JSON with the issue's keys."""

import json

from spindle_policy.calibration import load_paper_calibration
from spindle_sim.commands import main


def _check(path) -> dict:
    d = json.loads(path.read_text())
    assert {"strategy", "workload", "rate", "completed", "ttft_s", "tbt_s", "e2e_s", "throughput_tok_s"} <= set(d)
    for key in ("ttft_s", "tbt_s", "e2e_s"):
        assert {"mean", "p50", "p90", "p99"} <= set(d[key])
    return d


def test_sim_from_calibration_and_from_profile(tmp_path, capsys):
    out = tmp_path / "sim.json"
    args = ["--workload", "tetris-short", "--rate", "2", "--instances", "4", "--decode-instances", "2"]
    assert main([*args, "--num-requests", "40", "--seed", "3", "--json", str(out)]) == 0
    d = _check(out)
    printed = capsys.readouterr().out
    assert d["completed"] == 40 and d["strategy"] == "single" and "40/40 completed" in printed
    assert "plan() per request: mean " in printed and "(40 calls)" in printed
    assert 0 < d["plan_us"]["mean"] <= d["plan_us"]["max"] and d["plan_us"]["p99"] <= d["plan_us"]["max"]

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"model": json.loads(load_paper_calibration().to_json())}))
    out2 = tmp_path / "sim2.json"
    assert main([*args, "--num-requests", "40", "--seed", "3", "--profile", str(profile), "--json", str(out2)]) == 0
    d2 = _check(out2)
    assert set(d.pop("plan_us")) == set(d2.pop("plan_us")) == {"mean", "p99", "max"}  # wall times: they vary
    assert d2 == d  # the same model from a file: the same deterministic run


def test_sim_bad_input_is_a_clear_error(capsys):
    assert main(["--workload", "nope", "--num-requests", "5"]) == 2
    assert "nope" in capsys.readouterr().err


def test_a_colocated_strategy_gets_the_given_gpus_as_colocated_instances(tmp_path, capsys):
    """Instance counts for a prefill/decode split, and a strategy of colocated instances (`chunked`, `loongserve`):
    the same GPUs run it as colocated instances instead of refusing every request."""
    for strategy in ("chunked", "loongserve"):
        out = tmp_path / f"{strategy}.json"
        args = ["--strategy", strategy, "--workload", "tetris-short", "--rate", "1", "--instances", "2"]
        assert main([*args, "--decode-instances", "2", "--num-requests", "20", "--json", str(out)]) == 0
        assert _check(out)["completed"] == 20
        assert "4 colocated x TP1 instances (the given 4 GPUs as colocated instances" in capsys.readouterr().out
