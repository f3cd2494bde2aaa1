"""The public trace formats users record traffic in (Mooncake / AIPerf JSONL, BurstGPT CSV), the shipped examples,
`replay` (a trace at another rate or length) and `spindle sim --trace`."""

import json
import math
from pathlib import Path

import pytest

from spindle_sim.commands import main
from spindle_sim.compare import compare_main
from spindle_sim.traces import (
    TraceRequest,
    read_burstgpt,
    read_mooncake,
    read_trace,
    replay,
    write_csv,
    write_jsonl,
    write_mooncake,
)
from spindle_sim.workloads import make_workload

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "traces"


def test_mooncake_lines_read_as_requests_in_seconds(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 9, "output_length": 1},
        {"timestamp": 2500.5, "input_length": 1024, "output_length": 7, "hash_ids": [1, 2, 3], "extra": "ignored"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert (
        read_mooncake(path)
        == read_trace(path)
        == [
            TraceRequest(0.0, 600, 20, hash_ids=(1, 2)),
            TraceRequest(1.5, 9, 1),
            TraceRequest(2.5005, 1024, 7, hash_ids=(1, 2, 3)),
        ]
    )


def test_mooncake_round_trip(tmp_path):
    reqs = [TraceRequest(t, p, d, hash_ids=tuple(range(p // 512 + 1))) for t, p, d in
            [(0.0, 100, 5), (0.25, 2000, 40), (1.125, 513, 1)]]  # fmt: skip
    path = tmp_path / "t.jsonl"
    write_mooncake(path, reqs)
    assert read_trace(path) == reqs


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"input_length": 5, "output_length": 2}', "no 'timestamp'"),
        ('{"session_id": "a", "delay": 5, "input_length": 5, "output_length": 2}', "multi-turn session"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 2}', "token counts must be >= 1"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": ["x"]}', "hash_ids"),
        ('{"timestamp": -3, "input_length": 5, "output_length": 2}', "arrived_at"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_a_bad_mooncake_line_names_its_line(tmp_path, line, says):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"t\.jsonl:2: .*{says}"):
        read_mooncake(path)


def test_burstgpt_csv_skips_failed_requests(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5.0,ChatGPT,472,18,490,Conversation log\n"
        "6.5,GPT-4,1000,0,1000,Conversation log\n"
        "7.25,GPT-4,31,127,158,API log\n"
    )
    assert read_burstgpt(path) == read_trace(path) == [TraceRequest(5.0, 472, 18), TraceRequest(7.25, 31, 127)]
    path.write_text("Timestamp,Model,Request tokens\n1,ChatGPT,3\n")
    with pytest.raises(ValueError, match="Response tokens"):
        read_trace(path)


def test_read_trace_tells_the_formats_apart(tmp_path):
    reqs = make_workload("mixed-chat", 20, 3.0, 1)
    write_csv(tmp_path / "own.csv", reqs)
    write_jsonl(tmp_path / "own.jsonl", reqs)
    assert read_trace(tmp_path / "own.csv") == read_trace(tmp_path / "own.jsonl") == reqs
    (tmp_path / "own.txt").write_text("0.0 5 5\n")
    with pytest.raises(ValueError, match=r"must be \.jsonl"):
        read_trace(tmp_path / "own.txt")


def test_the_shipped_examples_read():
    moon = read_trace(EXAMPLES / "mooncake_example.jsonl")
    burst = read_trace(EXAMPLES / "burstgpt_example.csv")
    assert len(moon) == 64 and len(burst) == 62  # two failed requests skipped
    assert all(r.hash_ids[:2] == (0, 1) for r in moon)  # the shared system prompt
    assert all(len(r.hash_ids) == math.ceil(r.num_prefill_tokens / 512) for r in moon)


def test_replay_takes_n_requests_at_a_rate():
    trace = [TraceRequest(10.0, 5, 1), TraceRequest(12.0, 6, 2), TraceRequest(16.0, 7, 3)]
    assert [r.arrived_at for r in replay(trace, 3)] == [0.0, 2.0, 6.0]  # recorded, from 0
    # repeated after itself one mean gap (3 s) after its last request
    assert [(r.arrived_at, r.num_prefill_tokens) for r in replay(trace, 5)] == [
        (0.0, 5), (2.0, 6), (6.0, 7), (9.0, 5), (11.0, 6)]  # fmt: skip
    fast = replay(trace, 3, rate=2.0)  # the mean gap becomes 0.5 s: times x 1/6
    assert [r.arrived_at for r in fast] == pytest.approx([0.0, 1 / 3, 1.0])
    assert {r.arrived_at for r in replay(trace, 3, rate=math.inf)} == {0.0}
    with pytest.raises(ValueError):
        replay([], 3)
    with pytest.raises(ValueError):
        replay(trace, 3, rate=0.0)


def test_a_trace_file_is_a_workload(tmp_path):
    path = EXAMPLES / "mooncake_example.jsonl"
    reqs = make_workload(f"trace:{path}", 100, 4.0, seed=0)
    assert len(reqs) == 100 and (len(reqs) - 1) / reqs[-1].arrived_at == pytest.approx(4.0)
    assert make_workload(f"trace:{path}", 64, None, seed=0) == replay(read_trace(path), 64)
    with pytest.raises(ValueError, match="needs an arrival rate"):
        make_workload("mixed-chat", 10, None, seed=0)
    with pytest.raises(ValueError, match="cannot read the trace"):
        make_workload(f"trace:{tmp_path / 'missing.jsonl'}", 10, 1.0, seed=0)


def test_spindle_sim_replays_a_trace_file(tmp_path, capsys):
    out = tmp_path / "run.json"
    trace = EXAMPLES / "burstgpt_example.csv"
    assert main(["--trace", str(trace), "--num-requests", "62", "--strategy", "single", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "at the recorded rate: 62/62 completed" in printed
    assert json.loads(out.read_text())["completed"] == 62
    assert main(["--trace", str(tmp_path / "nope.csv")]) == 2
    assert "cannot read the trace" in capsys.readouterr().err


def test_sim_compare_replays_a_trace_file(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    trace = EXAMPLES / "mooncake_example.jsonl"
    argv = ["--trace", str(trace), "--num-requests", "64", "--strategies", "single", "chunked", "--json", str(out)]
    assert compare_main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["workload"]["name"] == f"trace:{trace}" and doc["workload"]["rate"] is None
    assert {s: d["completed"] for s, d in doc["strategies"].items()} == {"single": 64, "chunked": 64}
