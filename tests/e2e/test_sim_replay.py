"""Real vs simulated replay (issue 4, "Real executor"): one small trace through the real stack with `single` and
through the simulator with a profile measured here. Only loose sanity is asserted; the accuracy (target: within
30 % at P50) is what bench/bench_sim_replay.py reports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_sim_replay


@pytest.mark.slow
def test_simulated_latency_is_near_the_real_stack(tmp_path) -> None:
    args = bench_sim_replay.parse_args(
        [
            *("--num-requests", "8", "--rate", "2.0", "--profile-repeats", "1", "--no-transfer"),
            *("--log-dir", str(tmp_path / "logs"), "--out", str(tmp_path / "out.json")),
        ]
    )
    doc = bench_sim_replay.run(args)
    print(bench_sim_replay.format_table(doc["comparison"]))
    assert doc["completed"] == {"measured": 8, "simulated": 8, "total": 8}
    assert doc["measured"]["length_mismatches"] == []
    for metric in ("ttft", "e2e"):
        p50 = doc["comparison"][metric]["p50"]
        ratio = p50["simulated_s"] / p50["measured_s"]
        print(f"{metric} P50: simulated / measured = {ratio:.2f}")
        assert 1 / 3 <= ratio <= 3, f"simulated {metric} P50 is {ratio:.2f}x the measured one"
