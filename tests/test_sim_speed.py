"""bench/sim_speed.py's small case: every strategy simulates the cell twice and the JSON says how long each took
(the timings themselves are the benchmark's to report, not this test's to judge)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sim_speed_runs_every_strategy_on_a_small_cell(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    cmd = [sys.executable, str(ROOT / "bench" / "sim_speed.py"), "--requests", "120", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["cell"]["requests"] == 120
    ran = {s: r for s, r in doc["strategies"].items() if "skipped" not in r}
    assert {"medha", "loongserve", "chunked", "spindle", "tetris"} <= set(ran)
    for spec, row in ran.items():
        assert row["requests"] == [30, 120] and len(row["wall_s"]) == 2 and row["growth"] > 0, spec
        assert row["finished"] == 120, spec
    assert "growth" in done.stdout
