"""Load curves the way Tetris (Fig. 8) and LoongServe draw them: latency vs request rate, one line per strategy.

Four panels: P50 TTFT, P99 TTFT, P50 TBT, P99 TBT. matplotlib (Agg backend) is imported only here, lazily.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from .sweep import SweepRow

PANELS = (
    ("ttft_s", "p50", "P50 TTFT"),
    ("ttft_s", "p99", "P99 TTFT"),
    ("tbt_s", "p50", "P50 TBT"),
    ("tbt_s", "p99", "P99 TBT"),
)
MARKERS = "osD^v<>ph*"
LOG_RANGE = 20.0  # a panel whose largest/smallest value exceeds this gets a log y axis


def _minor_label(v: float) -> str:
    mantissa = round(v / 10 ** math.floor(math.log10(v)), 6)
    return f"{v:g}" if mantissa in (2.0, 5.0) else ""


def _pyplot():  # -> the matplotlib.pyplot module
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(
    rows: Sequence[SweepRow], path: str | Path, title: str = "", slo: dict[str, float] | None = None
) -> Path:
    """Write a 2x2 PNG of ``rows`` to ``path``. ``slo`` optionally maps a panel key ("ttft_s.p50") to a
    horizontal SLO line. Returns the path."""
    if not rows:
        raise ValueError("nothing to plot: no sweep rows")
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, NullFormatter

    strategies = list(dict.fromkeys(r.strategy for r in rows))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for ax, (key, pct, label) in zip(axes.flat, PANELS, strict=True):
        values = []
        for i, spec in enumerate(strategies):
            pts = sorted((r.rate, getattr(getattr(r.summary, key), pct)) for r in rows if r.strategy == spec)
            xs = [x for x, y in pts if y == y]
            ys = [y for _, y in pts if y == y]
            values += ys
            ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], markersize=5, linewidth=1.6, label=spec)
        line = (slo or {}).get(f"{key}.{pct}")
        if line is not None:
            ax.axhline(line, color="grey", linestyle="--", linewidth=1, label="SLO")
        positive = [v for v in values if v > 0]
        if positive and max(positive) / min(positive) > LOG_RANGE:
            ax.set_yscale("log")
        else:  # linear from 0, plain tick labels (no "1e-15 + 2e-2" offsets on flat curves)
            ax.set_ylim(bottom=0, top=max(values, default=1.0) * 1.12 or 1.0)
            ax.ticklabel_format(axis="y", style="plain", useOffset=False)
        ax.set_title(label)
        ax.set_ylabel(f"{label} (s)")
        ax.grid(True, which="major", alpha=0.4)
        ax.grid(True, which="minor", alpha=0.12)
    rates = sorted({r.rate for r in rows})
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax in axes.flat:
        if ax.get_yscale() == "log":  # plain numbers; under 2 decades also label the 2x and 5x minor ticks
            lo, hi = ax.get_ylim()
            few = math.log10(hi / lo) < 2
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _, few=few: _minor_label(v) if few else ""))
        if len(rates) > 2 and rates[-1] / rates[0] > LOG_RANGE:  # rates doubling: log x, ticks at the rates
            ax.set_xscale("log")
            ax.set_xticks(rates if len(rates) <= 12 else rates[:: -(-len(rates) // 12)])
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(NullFormatter())
    for ax in axes[1]:
        ax.set_xlabel("request rate (req/s)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="upper center", ncol=min(len(labels), 5), frameon=False, bbox_to_anchor=(0.5, 0.965)
    )
    if title:
        fig.suptitle(title, fontsize=13, y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def sweep_title(workload: str, config: object, num_requests: int) -> str:
    """'<workload>: P prefill + D decode (+ C colocated) instances, K requests' from a SimConfig."""
    parts = [f"{getattr(config, 'num_prefill', 0)} prefill", f"{getattr(config, 'num_decode', 0)} decode"]
    colocated = getattr(config, "num_colocated", 0)
    if colocated:
        parts.append(f"{colocated} colocated")
    tp = getattr(config, "decode_tp", 1)
    tp_text = f", decode TP {tp}" if tp and tp > 1 else ""
    return f"{workload}: {' + '.join(parts)} instances{tp_text}, {num_requests} requests"
