"""CSPS §3.2.6, objective-oriented configuring: the CSA drop ratio for a request from *measured* quality.

The paper fits a regression of accuracy loss on (length, levels, per-layer/head drop ratios) and enumerates. We
search the points `bench/quality_csa.py` measured on the served model (shipped in `data/quality.json`; any file of
that form can replace it): for an SP size G, the points of the smallest measured SP size >= G (more members, more
far levels, more dropped pairs at the same p: the conservative stand-in); a G above every measured size, or levels
never measured, get no drops.

The candidates are (levels, p) pairs of the measured level counts (or the one the strategy fixes):
- Accuracy budget A (`accuracy_loss`): a ratio p is allowed when it and every smaller measured ratio (same levels)
  lost at most A (observed passkey accuracy below dense) and, for A = 0, none lost measurably (McNemar p > 0.05
  against dense on the same prompts). So `accuracy_loss=0` never drops more than the measurement supports. With
  the budget alone: the allowed pair with the lowest predicted TTFT (objective 1 of §3.2.6).
- TTFT objective T (`ttft_s`), with or without a budget: the allowed pair dropping least whose predicted TTFT meets
  T (dense when dense meets it); when none does, the allowed pair with the lowest predicted TTFT (objective 2).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHIPPED = Path(__file__).parent / "data" / "quality.json"
SIGNIFICANCE = 0.05


@dataclass(frozen=True)
class QualityPoint:
    sp: int
    levels: int | None  # None: every level
    drop: float
    loss: float  # dense accuracy - CSA accuracy, on the same prompts
    mcnemar_p: float


@dataclass(frozen=True)
class QualityTable:
    points: tuple[QualityPoint, ...]
    source: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QualityTable:
        dense = float(data["dense"]["accuracy"])
        levels = data.get("levels")
        pts = tuple(
            QualityPoint(int(p["sp"]), levels, float(p["drop"]), dense - float(p["accuracy"]), float(p["mcnemar_p"]))
            for p in data["points"]
        )
        return cls(pts, str(data.get("source", "")))

    @classmethod
    def load(cls, path: Path = SHIPPED) -> QualityTable:
        docs = json.loads(path.read_text())
        docs = docs if isinstance(docs, list) else [docs]
        # only the importance the SP members measure alone ("own") is what the services run
        tables = [cls.from_dict(d) for d in docs if d.get("importance", "own") == "own"]
        return cls(tuple(p for t in tables for p in t.points), str(path))

    def allowed(self, sp: int, levels: int | None, accuracy_loss: float | None) -> list[float]:
        """The drop ratios (ascending, 0 first) a request on `sp` members may use within the budget (None: any
        measured ratio)."""
        sizes = sorted({p.sp for p in self.points if p.levels == levels and p.sp >= sp})
        if not sizes:
            return [0.0]
        points = sorted((p for p in self.points if p.levels == levels and p.sp == sizes[0]), key=lambda p: p.drop)
        out = [0.0]
        for p in points:
            if p.drop == 0.0:
                continue
            if accuracy_loss is not None:
                lost = p.loss > accuracy_loss or (accuracy_loss == 0.0 and p.mcnemar_p <= SIGNIFICANCE)
                if lost:
                    break  # every larger ratio is out too
            out.append(p.drop)
        return out

    def level_options(self) -> list[int | None]:
        """The level counts measured (None: every level)."""
        return sorted({p.levels for p in self.points}, key=lambda x: (x is None, x or 0))


Predict = Callable[[int | None, float], float]  # (levels, drop) -> predicted TTFT seconds


def choose(
    table: QualityTable,
    sp: int,
    accuracy_loss: float | None,
    ttft_s: float | None,
    predict: Predict,
    levels: int | str | None = "any",
) -> tuple[int | None, float]:
    """(levels, drop ratio) for one request, searched over the measured points (`levels`: fixed, or "any" of the
    measured level counts; see the module docstring). Without any objective: (levels, 0), dense."""
    options = table.level_options() if levels == "any" else [levels]
    if accuracy_loss is None and ttft_s is None:
        return (options[-1] if options else None), 0.0
    candidates = [(lv, p) for lv in options for p in table.allowed(sp, lv, accuracy_loss)] or [(None, 0.0)]
    times = {c: predict(*c) for c in candidates}
    if ttft_s is None:  # the budget alone: the fastest allowed
        return min(candidates, key=lambda c: (times[c], c[1]))
    meeting = [c for c in candidates if times[c] <= ttft_s]
    if meeting:  # the least dropping that meets the objective
        return min(meeting, key=lambda c: (c[1], times[c]))
    return min(candidates, key=lambda c: (times[c], c[1]))
