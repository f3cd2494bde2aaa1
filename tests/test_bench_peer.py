"""bench/bench_peer.py's pure parts, without a server: per-process CPU accounting, ratios, case seeds."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import proc_cpu
from bench_peer import CASES, case_seed, ratio


def test_cpu_seconds_per_process_of_a_tree() -> None:
    """A child that burns CPU for ~0.6 s shows up under its module name; a sleeping one does not."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(5)"
    busy = subprocess.Popen([sys.executable, "-c", burn])
    idle = subprocess.Popen([sys.executable, "-m", "http.server", "--help"], stdout=subprocess.DEVNULL)
    try:
        import os

        before = proc_cpu.snapshot(os.getpid())
        assert busy.pid in before
        time.sleep(1.2)
        after = proc_cpu.snapshot(os.getpid())
        spent = proc_cpu.cpu_delta(before, after)
        assert spent["python"] == pytest.approx(0.6, abs=0.35)  # `python -c` keeps its comm
        assert spent.get("http.server", 0.0) < 0.3
        assert list(spent.values()) == sorted(spent.values(), reverse=True)
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()


def test_ratio_is_spindle_better_or_equal_at_one() -> None:
    assert ratio(300.0, 150.0, "lower") == 2.0  # latencies: vLLM ms / Spindle ms
    assert ratio(50.0, 100.0, "higher") == 2.0  # throughput: Spindle / vLLM
    assert ratio(None, 1.0, "lower") is None and ratio(1.0, 0.0, "lower") is None


def test_every_case_has_its_own_prompts() -> None:
    seeds = {name: case_seed(case, 0) for name, case in CASES.items()}
    assert len(set(seeds.values())) == len(seeds) and 0 not in seeds.values()  # 0: the warm-up's
    assert all(math.isinf(c.request_rate) or c.request_rate > 0 for c in CASES.values())
