"""Real vs simulated (`bench/sim_vs_real.py`): one small trace through the real stack with `single` and through
the simulator with the stored profile of this machine (`bench/results/sim_vs_real_profile.json`; measuring one is
`services/launcher/tests/test_profile.py`'s). Asserted: every request ends in both, the lengths agree and the JSON
has what the benchmark reports; how close the simulated latencies are is a timing, which the benchmark measures
and reports, not a test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import sim_vs_real


@pytest.mark.slow
def test_a_trace_replays_on_the_real_stack_and_in_the_simulator(tmp_path) -> None:
    out = tmp_path / "out.json"
    argv = ["--strategies", "single", "--requests", "4", "--rate", "4.0", "--prompt-lens", "32,128",
            "--output-lens", "4,12", "--log-dir", str(tmp_path / "logs"), "--json", str(out)]  # fmt: skip
    assert sim_vs_real.main(argv) == 0
    doc = json.loads(out.read_text())
    result = doc["strategies"]["single"]
    assert result["length_mismatches"] == []
    for side in ("real", "sim", "error"):
        assert set(result[side]) == set(sim_vs_real.KEYS), side
    assert result["real"]["ttft_p50"] > 0 and result["sim"]["ttft_p50"] > 0
    assert {"prefill", "decode"} <= result["instances_kv_blocks"].keys()
