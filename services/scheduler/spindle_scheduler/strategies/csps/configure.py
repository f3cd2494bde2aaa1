"""CSPS §3.2.6, objective-oriented configuring: the CSA drop ratio for a request from *measured* quality.

The paper fits a regression of accuracy loss on (length, levels, per-layer/head drop ratios) and enumerates. We
search the points `bench/quality_csa.py` measured on the served model (shipped in `data/quality.json`; any file of
that form can replace it): for an SP size G, the points of the smallest measured SP size >= G (more members, more
far levels, more dropped pairs at the same p: the conservative stand-in); a G above every measured size, or levels
never measured, get no drops.

- Accuracy budget A (`accuracy_loss`): the largest measured p such that it and every smaller measured p lost at
  most A (observed passkey accuracy below dense) and, for A = 0, none lost measurably (McNemar p > 0.05 against
  dense on the same prompts). So `accuracy_loss=0` never drops more than the measurement supports.
- TTFT objective T (`ttft_s`), with or without a budget: the smallest allowed p whose predicted TTFT meets T (0 when
  dense meets it); when none does, the allowed p with the lowest predicted TTFT.
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


def choose_drop(
    table: QualityTable,
    sp: int,
    levels: int | None,
    accuracy_loss: float | None,
    ttft_s: float | None = None,
    predict_ttft: Callable[[float], float] | None = None,
) -> float:
    """The drop ratio for one request (see the module docstring)."""
    allowed = table.allowed(sp, levels, accuracy_loss)
    if ttft_s is None:
        return allowed[-1] if accuracy_loss is not None else 0.0
    assert predict_ttft is not None, "a TTFT objective needs a TTFT prediction"
    times = [(predict_ttft(p), p) for p in allowed]
    meeting = [p for t, p in times if t <= ttft_s]
    return meeting[0] if meeting else min(times)[1]
