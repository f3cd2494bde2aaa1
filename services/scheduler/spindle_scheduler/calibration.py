"""Latency models calibrated on published figures.

`PAPER_FIGURES` is a copy of the project's `shared/reference/paper_figures.json` (numbers from the five papers,
with their sources), packaged so the simulator can model the papers' clusters on any machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .latency import BatchPrefillModel, LatencyModel, PrefillLatencyModel, TransferModel

PAPER_FIGURES = Path(__file__).parent / "data" / "paper_figures.json"

# calibration name -> entry in paper_figures.json holding a whole-prompt prefill table
CALIBRATIONS = {"tetris-a100-llama3-8b": "tetris_table1_prefill_latency_s"}

# Tetris Table 1's hardware: 200 Gbps InfiniBand across nodes. The per-message latency is not published.
TETRIS_IB_BYTES_PER_S = 200e9 / 8


def prefill_table_samples(table: dict[str, Any]) -> list[tuple[int, float, float, float]]:
    """(sp, C=0, L, seconds) samples from a {"prompt_tokens": [...], "sp": {"1": [seconds or null]}} table.

    Each entry is a whole prompt prefilled at once (batch 1, no history); null means out of memory.
    """
    try:
        lengths = [int(n) for n in table["prompt_tokens"]]
        per_sp = table["sp"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"prefill table lacks prompt_tokens/sp: {e}") from e
    samples = []
    for sp, secs in per_sp.items():
        if len(secs) != len(lengths):
            raise ValueError(f"sp={sp}: {len(secs)} latencies for {len(lengths)} prompt lengths")
        samples += [(int(sp), 0.0, float(n), float(s)) for n, s in zip(lengths, secs, strict=True) if s is not None]
    return samples


def load_paper_calibration(path: str | Path = PAPER_FIGURES, key: str = "tetris-a100-llama3-8b") -> LatencyModel:
    """Prefill models (Tetris Eq. 1 and LoongServe Eq. 7, DoP = SP size) fitted to a published table.

    The table has no decode-step figures, so the bundle's decode model is left out.
    """
    if key not in CALIBRATIONS:
        raise ValueError(f"unknown calibration {key!r}; known: {sorted(CALIBRATIONS)}")
    try:
        figures = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read paper figures from {path}: {e}") from e
    entry = CALIBRATIONS[key]
    if entry not in figures:
        raise ValueError(f"{path} has no {entry!r} entry")
    samples = prefill_table_samples(figures[entry])
    prefill = PrefillLatencyModel.fit(samples)
    batch = BatchPrefillModel.fit((sp, [length], secs) for sp, _, length, secs in samples)
    return LatencyModel(
        prefill=prefill,
        batch_prefill=batch,
        transfer=TransferModel(latency_s=0.0, bandwidth_bytes_per_s=TETRIS_IB_BYTES_PER_S),
        source=f"{key}: {figures[entry].get('source', entry)}",
    )
