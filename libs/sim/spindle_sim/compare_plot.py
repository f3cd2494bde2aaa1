"""The PNG of `spindle sim compare`: one panel per metric, a group of bars per strategy (drawn from the JSON).

Panels, each where some strategy has a value: TTFT and TPOT (P50 and P99), goodput, max sustainable load, and the
wall time of plan() (mean and P99). A panel whose values span more than LOG_RANGE gets a log axis.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .metrics import describe_slo
from .plot import LOG_RANGE, _pyplot

# (JSON key, statistics drawn (None: a number), title, unit)
PANELS: tuple[tuple[str, tuple[str, ...] | None, str, str], ...] = (
    ("ttft_s", ("p50", "p99"), "TTFT", "s"),
    ("tpot_s", ("p50", "p99"), "TPOT", "s/token"),
    ("goodput_rps", None, "goodput", "req/s"),
    ("max_load_rps", None, "max sustainable load", "req/s"),
    ("plan_us", ("mean", "p99"), "plan() wall time per request", "µs"),
)
COLORS = ("#4C72B0", "#DD8452")
STAT_NAMES = {"p50": "P50", "p99": "P99", "mean": "mean"}


def _values(strategies: dict[str, dict[str, Any]], key: str, stats: tuple[str, ...] | None) -> list[list[float]]:
    """Per statistic, a value per strategy (NaN where null)."""
    rows = []
    for stat in stats or (None,):
        row = []
        for d in strategies.values():
            v = d[key] if stat is None or d[key] is None else d[key][stat]
            row.append(math.nan if v is None else float(v))
        rows.append(row)
    return rows


def _label(v: float) -> str:
    return "" if v != v else f"{v:.3g}"


def _goodput_title(slo: dict[str, float | None] | None) -> str:
    limits = describe_slo(slo)
    return f"goodput ({limits})" if limits else "goodput under the SLO"


def _max_load_title(rule: dict[str, Any] | None) -> str:
    if rule is None:
        return "max sustainable load"
    if rule.get("attainment") is not None:
        return f"max sustainable load (SLO att. >= {100 * rule['attainment']:g} %)"
    metric = rule["metric"].replace("_", " ").upper()
    slo = f"{rule['slo_s']:g} s" if rule["slo_s"] is not None else f"{rule['slo_scale']:g}x light load"
    return f"max sustainable load ({metric} <= {slo})"


def plot_compare(
    doc: dict[str, Any],
    path: str | Path,
    title: str = "",
    shapes: dict[str, str] | None = None,
    lower_bounds: frozenset[str] = frozenset(),
) -> Path:
    """Write the comparison `doc` (compare.compare_doc's JSON) as a PNG to `path`; `shapes` optionally labels each
    strategy with how its GPUs were shaped; `lower_bounds`: strategies whose max load is only a lower bound (never
    violated up to the highest rate probed), drawn hatched and labelled '>='. Returns the path."""
    strategies, w = doc["strategies"], doc["workload"]
    if not strategies:
        raise ValueError("nothing to plot: no strategy ran")
    panels = []
    for key, stats, label, unit in PANELS:
        rows = _values(strategies, key, stats)
        if any(v == v for row in rows for v in row):
            panels.append((key, stats, label, unit, rows))
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    width = max(4.5, 1.55 * len(strategies) + 1.2)  # room for each strategy's two-line label
    ncols = len(panels) if len(panels) <= 2 else 3 if len(panels) == 3 and width <= 6 else 2
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, 4.4 * nrows), squeeze=False)
    names = [f"{spec}\n{shapes[spec]}" if shapes and spec in shapes else spec for spec in strategies]
    xs = list(range(len(strategies)))
    for ax, (key, stats, label, unit, rows) in zip(axes.flat, panels, strict=False):
        bar_w = 0.8 / len(rows)
        for i, row in enumerate(rows):
            pos = [x + (i - (len(rows) - 1) / 2) * bar_w for x in xs]
            bars = ax.bar(pos, [0 if v != v else v for v in row], bar_w, color=COLORS[i % len(COLORS)],
                          label=None if stats is None else STAT_NAMES[stats[i]])  # fmt: skip
            labels = [_label(v) for v in row]
            if key == "max_load_rps":
                for bar, spec in zip(bars, strategies, strict=True):
                    bar.set_hatch("//" if spec in lower_bounds else "")
                labels = [f">= {t}" if spec in lower_bounds else t for t, spec in zip(labels, strategies, strict=True)]
            ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
        positive = [v for row in rows for v in row if v == v and v > 0]
        if positive and max(positive) / min(positive) > LOG_RANGE:
            ax.set_yscale("log")
            ax.set_ylim(top=max(positive) * 3)
            ax.yaxis.set_major_formatter(plain)
        else:
            ax.set_ylim(0, max(positive, default=1.0) * 1.18)
        titles = {"max_load_rps": _max_load_title(w["max_load"]), "goodput_rps": _goodput_title(w["slo"])}
        ax.set_title(titles.get(key, label))
        ax.set_ylabel(unit)
        ax.set_xticks(xs, names, fontsize=8)
        ax.grid(True, axis="y", alpha=0.35)
        if stats is not None:
            ax.legend(fontsize=8, frameon=False)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
