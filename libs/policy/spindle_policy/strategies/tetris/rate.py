"""Tetris's load-aware improvement rate (§5.1, §7.1): an offline table of the best rate per arrival rate, and
at run time the arrival rate over a sliding window picks the table's row with the closest arrival rate.

Tables are JSON: {"workload": ..., "source": ..., "rows": [{"arrival_rate": r, "improvement_rate": x, ...}]}
(`spindle tune tetris` writes them). `default_table(name)` reads the shipped ones, tuned for the paper's
workloads on its cluster (Table 1's latencies, 32 prefill instances in 4 nodes).
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHIPPED = Path(__file__).parent / "data" / "improvement_rates.json"
DEFAULT_TABLE = "tetris-medium"


@dataclass(frozen=True)
class RateTable:
    rows: tuple[tuple[float, float], ...]  # (arrival rate in req/s, improvement rate), ascending arrival rates
    workload: str = ""

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("an improvement-rate table needs at least one row")
        rates = [r for r, _ in self.rows]
        if rates != sorted(rates) or len(set(rates)) != len(rates) or rates[0] < 0:
            raise ValueError(f"arrival rates must be distinct, ascending and >= 0, got {rates}")
        if any(not 0 <= x < 1 for _, x in self.rows):
            raise ValueError("improvement rates must be in [0, 1)")

    def lookup(self, arrival_rate: float) -> float:
        """The improvement rate of the row whose arrival rate is closest (the lower one on a tie)."""
        rates = [r for r, _ in self.rows]
        i = bisect_left(rates, arrival_rate)
        if i == len(rates) or (i > 0 and arrival_rate - rates[i - 1] <= rates[i] - arrival_rate):
            i -= 1
        return self.rows[i][1]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RateTable:
        try:
            rows = sorted((float(r["arrival_rate"]), float(r["improvement_rate"])) for r in data["rows"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an improvement-rate table: {e}") from e
        return cls(tuple(rows), str(data.get("workload", "")))


def load_table(name_or_path: str) -> RateTable:
    """A shipped table by workload name (tetris-short, tetris-medium, tetris-long) or a JSON file."""
    shipped = json.loads(SHIPPED.read_text())
    if name_or_path in shipped:
        return RateTable.from_dict(shipped[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"tetris: no improvement-rate table {name_or_path!r} (shipped: {', '.join(shipped)})")
    try:
        return RateTable.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"tetris: {path} is not JSON: {e}") from e


class ArrivalWindow:
    """Arrivals over the last `window_s` seconds, as a rate."""

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.times: deque[float] = deque()
        self.first: float | None = None

    def add(self, now: float) -> None:
        self.times.append(now)
        self.first = now if self.first is None else self.first
        while self.times and self.times[0] <= now - self.window_s:
            self.times.popleft()

    def rate(self, now: float) -> float:
        """Requests per second over the window; while less than a window has passed since the first arrival, the
        arrivals' intervals over that time."""
        if self.first is None:
            return 0.0
        count = sum(1 for t in self.times if t > now - self.window_s)
        elapsed = now - self.first
        if elapsed < self.window_s:
            return (count - 1) / elapsed if count > 1 and elapsed > 0 else 0.0
        return count / self.window_s

    def warming_up(self, now: float) -> bool:
        return self.first is None or now - self.first < self.window_s
