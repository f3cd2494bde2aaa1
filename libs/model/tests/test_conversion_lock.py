"""One GGUF conversion per machine: real processes resolving the same model at once on an empty cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Each child imports spindle_model (torch: the slow part), says READY, then waits for the GO file, so that every
# resolve_model call starts within milliseconds of the others.
CHILD = """
import logging, os, sys, time
logging.basicConfig(level=logging.INFO, format="%(process)d %(message)s", stream=sys.stderr)
from spindle_model.sources import resolve_model
print("READY", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
print("PATH", resolve_model("smollm2", progress=False).path, flush=True)
"""


def _start(cache: Path, go: Path, n: int) -> list[subprocess.Popen]:
    env = {**os.environ, "SPINDLE_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for _ in range(n)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "READY\n"
    return procs


def _temporaries(cache: Path) -> list[Path]:
    return sorted((cache / "models").glob(".*.tmp-*"))


@pytest.mark.slow
def test_processes_starting_together_convert_once(tmp_path: Path) -> None:
    cache, go = tmp_path / "cache", tmp_path / "go"
    procs = _start(cache, go, 4)
    start = time.perf_counter()
    go.touch()
    results = [p.communicate(timeout=300) for p in procs]
    seconds = time.perf_counter() - start
    assert [p.returncode for p in procs] == [0] * 4, [err for _, err in results]
    paths = {out.split("PATH ", 1)[1].strip() for out, _ in results}
    logs = "".join(err for _, err in results)
    print(f"\n[spindle_model] 4 processes resolved smollm2 on an empty cache in {seconds:.1f} s")
    assert len(paths) == 1
    assert logs.count("(first use of this file)") == 1, logs
    # The others waited on the lock (or, had they come later, found the conversion done).
    assert logs.count("waiting for another process converting") + logs.count("converted by another process") >= 3
    assert [p.name for p in (cache / "models").iterdir()] == [Path(paths.pop()).name]
    assert _temporaries(cache) == []


@pytest.mark.slow
def test_a_killed_conversion_blocks_nobody(tmp_path: Path) -> None:
    cache, go = tmp_path / "cache", tmp_path / "go"
    (victim,) = _start(cache, go, 1)
    go.touch()
    deadline = time.monotonic() + 120
    while not _temporaries(cache):  # converting: its temporary directory exists, it holds the lock
        assert victim.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    assert _temporaries(cache)  # what the killed conversion left behind

    (survivor,) = _start(cache, go, 1)
    out, err = survivor.communicate(timeout=300)
    assert survivor.returncode == 0, err
    assert "waiting for another process" not in err and "(first use of this file)" in err
    assert _temporaries(cache) == []  # removed under the lock, however young
    assert (Path(out.split("PATH ", 1)[1].strip()) / "model.safetensors").is_file()
